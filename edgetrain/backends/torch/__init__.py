"""The torch backends: torch-cpu and torch-cuda (a server GPU or a Jetson's), and what only torch needs.

    engine.py         TorchEngine: the Learner's tensor work for torch models
    cpu.py, cuda.py   the backends they register
    optimizers.py     torch's optimizers by name
    finite_steps.py   all-or-nothing optimizer steps (a non-finite update changes nothing)
    learner_state.py  what a torch Learner checkpoint holds besides the learner's own state

The torch models (edgetrain.models) and methods (edgetrain.methods) are the reference implementations
that every other framework's port is checked against; backends/mlx holds MLX's ports.
"""
from edgetrain.backends.torch import cpu, cuda  # noqa: F401  (registers torch-cpu, torch-cuda)
