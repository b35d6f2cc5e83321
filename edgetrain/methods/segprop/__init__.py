"""SegProp (Segmented Propagation, Gelbard et al., TMLR) with SnapCheck, and the layer-wise baseline.
The whole schedule over a stream (`run_schedule`) is a recipe: edgetrain.recipes.segprop_schedule.

  plan.py       prefix depth p, global-head size r, segmentation of the body into stages
  views.py      the units a schedule cuts (block view; ResNet's paper split of the last block)
  adapters.py   training-only adapters (1x1 strided conv + BN + ReLU, linear, identity)
  snapcheck.py  cache of detached frozen-prefix outputs with a byte budget and memory-mapped spill
  trainer.py    the stage-by-stage trainer (a TrainingMethod; methods `segprop` and `lw`), built from:
    schedule.py      stage budgets, the plateau tracker, the segment's and global head's lr multipliers
    stage_parts.py   what each stage trains (segment, bridge, global head), adapters, the active path
    prefix_cache.py  the committed prefix's output, computed or served from SnapCheck
    eval_pins.py     committed modules stay in eval() through later model.train() calls
    evaluation.py    a stage's training path on evaluation data (the paper's "Test (aux)")
    head_last.py     head_grads_last: a step's backward split so the global head's gradients come last
    waiting_spill.py spill_waiting: weights of segments whose stage has not begun, mapped from a file
  flops.py      FLOPs per sample of e2e vs each stage (the paper's Table 5 method)
"""
from edgetrain.methods.segprop import method  # noqa: F401  (registers segprop and lw)
from edgetrain.methods.segprop.adapters import ConvAdapter, LinearAdapter, make_adapter
from edgetrain.methods.segprop.eval_pins import is_pinned, pin_eval, unpin_eval
from edgetrain.methods.segprop.plan import Stage, StagePlan, even_split, plan_lw, plan_segprop
from edgetrain.methods.segprop.snapcheck import SnapCheck
from edgetrain.methods.segprop.trainer import StagedTrainer
from edgetrain.methods.segprop.views import UnitView, unit_view

__all__ = ["ConvAdapter", "LinearAdapter", "SnapCheck", "Stage", "StagePlan",
           "StagedTrainer", "UnitView", "even_split", "is_pinned", "make_adapter", "pin_eval", "plan_lw",
           "plan_segprop", "unit_view", "unpin_eval"]
