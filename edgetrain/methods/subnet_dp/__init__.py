"""Subnetwork data parallelism (Singh et al. 2025), the parts that run in one process: each of N
workers trains a fixed structured subnetwork of a ResNet (neuron or block masking), every parameter
owned by exactly P <= N workers. The multi-process run (torchrun, masked all-reduce) is
edgetrain.recipes.subnet_dp.

  layout.py      what the masks need to know about the ResNet; each parameter's role (trunk, branch, hidden)
  plan.py        SubnetPlan: who owns what; validation of the invariant sum_i m_i = P
  assign.py      assign_masks: the seeded plan (neuron channels round-robin, block owners under a memory cap)
  from_masks.py  a plan from explicit parameter masks, checked against the masking's structure
  subnetwork.py  a worker's physically smaller subnetwork; the masked full-model forward (reference)
  method.py      `subnet_dp` in METHODS: the N workers simulated in one process
  alignment.py   the gradient-alignment diagnostic of §5
"""
from edgetrain.methods.subnet_dp import method  # noqa: F401  (registers subnet_dp)
from edgetrain.methods.subnet_dp.assign import DEFAULT_LOAD_SLACK, assign_masks
from edgetrain.methods.subnet_dp.from_masks import plan_from_parameter_masks
from edgetrain.methods.subnet_dp.layout import MASKINGS, MaskError, ResNetLayout, parameter_role
from edgetrain.methods.subnet_dp.plan import SubnetPlan, masked_and_replicated, owner_counts, validate_plan

__all__ = ["DEFAULT_LOAD_SLACK", "MASKINGS", "MaskError", "ResNetLayout", "SubnetPlan", "assign_masks",
           "masked_and_replicated", "owner_counts", "parameter_role", "plan_from_parameter_masks", "validate_plan"]
