"""Files: crash-safe writes (atomic) and reading the files a user hands edgetrain without trusting them (user)."""
