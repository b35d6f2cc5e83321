"""Recipes: programs that drive learners over several stages or processes.

  segprop_schedule.py  run_schedule: SegProp's (and lw's) whole staged schedule over a stream, with
                       evaluation per stage and exact resume; bp and mebp as one stage
"""
from edgetrain.recipes.segprop_schedule import ScheduleResult, StageReport, run_schedule

__all__ = ["ScheduleResult", "StageReport", "run_schedule"]
