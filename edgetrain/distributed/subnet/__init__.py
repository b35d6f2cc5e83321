"""Subnetwork data parallelism (Singh et al. 2025): each of N workers trains a fixed structured
subnetwork of a ResNet (neuron or block masking), every parameter owned by exactly P <= N workers,
gradients averaged over exactly the owners.

  masks.py       ownership plans: assign_masks, validation, parameter masks
  subnetwork.py  a worker's physically smaller subnetwork; the masked full-model forward (reference)
  averaging.py   masked gradient averaging over torch.distributed (process group per owner set)
  trainer.py     the training loop (SGD+Nesterov, cosine / multi-step, FLOP-matched epochs)
  alignment.py   the gradient-alignment diagnostic of §5
  method.py      `subnet_dp` in METHODS: the N workers simulated in one process
  run.py         torchrun entry point: torchrun --nproc_per_node N -m edgetrain.distributed.subnet.run

Modules are imported on their own; nothing is imported here.
"""
