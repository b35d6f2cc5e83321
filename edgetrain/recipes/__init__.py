"""Recipes: programs that drive methods and learners over several stages or processes.

  segprop_schedule.py  run_schedule: SegProp's (and lw's) whole staged schedule over a stream, with
                       evaluation per stage and exact resume; bp and mebp as one stage
  ddp_segprop.py       SegProp under torchrun: DDP over the active path of each stage
  scpl_pipeline.py     SCPL's pipeline: one process per component, activations passed point to point
  subnet_dp/           subnetwork data parallelism across torchrun ranks (masked averaging, the loops,
                       evaluation, the entry point)

The multi-process recipes are imported on their own (they pull in torch.distributed); the mechanisms
they run on -- starting torchrun, its failure records, point-to-point transport -- are edgetrain.distributed.
Methods (edgetrain.methods) import neither.
"""
from edgetrain.recipes.segprop_schedule import ScheduleResult, StageReport, run_schedule

__all__ = ["ScheduleResult", "StageReport", "run_schedule"]
