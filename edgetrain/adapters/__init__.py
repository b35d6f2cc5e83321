"""LoRA adapters in the formats other runtimes read: PEFT (transformers) here; mlx-lm in
edgetrain.backends.mlx.adapters; edgetrain's own single file in edgetrain.models.lora."""
