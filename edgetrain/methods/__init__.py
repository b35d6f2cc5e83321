"""Training methods, found by name in METHODS. Importing a method module registers it."""
from edgetrain.methods import bp, mezo  # noqa: F401
from edgetrain.methods import mesp  # noqa: F401
from edgetrain.methods import asyncfgd, fgd  # noqa: F401
from edgetrain.methods import scpl  # noqa: F401
from edgetrain.methods import segprop  # noqa: F401
from edgetrain.methods import subnet_dp  # noqa: F401  (registers subnet_dp)
from edgetrain.methods.base import METHODS, TrainingMethod, trainable_parameters

__all__ = ["METHODS", "TrainingMethod", "trainable_parameters"]
