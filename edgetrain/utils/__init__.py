"""How edgetrain speaks and reads sizes: logging (logs), progress bars (progress), memory sizes (memory_sizes)."""
