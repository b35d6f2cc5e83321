"""AsyncFGD: forward gradients with the network cut into K modules that work at the same time."""
from edgetrain.methods.asyncfgd.method import AsyncFGD
from edgetrain.methods.asyncfgd.schedule import ReferenceScheduler
from edgetrain.methods.asyncfgd.stages import split_units
from edgetrain.methods.asyncfgd.workers import CudaStreamWorkers, ThreadWorkers

__all__ = ["AsyncFGD", "CudaStreamWorkers", "ReferenceScheduler", "ThreadWorkers", "split_units"]
