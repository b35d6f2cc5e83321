"""Subnetwork data parallelism (Singh et al. 2025) across processes: each of N ranks trains its own
structured subnetwork of a ResNet, and gradients are averaged over exactly each parameter's P owners.
The masks, the subnetwork and the one-process simulation are edgetrain.methods.subnet_dp.

  averaging.py   masked gradient averaging over torch.distributed (process group per owner set)
  config.py      SubnetDPConfig; lr schedule (cosine / multi-step), SGD+Nesterov, FLOP-matched steps
  trainer.py     one training loop for every run: a rank's subnetwork, the DDP baseline, the one-process
                 simulation, the stochastic-depth baseline
  evaluation.py  unified model, branches x P/N, own subnetwork, ensemble
  run.py         torchrun entry point: torchrun --nproc_per_node N -m edgetrain.recipes.subnet_dp.run

Modules are imported on their own; nothing is imported here.
"""
