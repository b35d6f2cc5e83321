"""The adapter formats edgetrain reads and writes (kept apart so the CLI can list them without torch)."""

FORMATS = ("edgetrain", "peft", "mlx-lm", "gguf")
