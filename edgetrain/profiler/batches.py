"""The fixed batch every profile measures, the same for torch and MLX methods."""
from __future__ import annotations


def build_batch(model, config):
    """A fixed batch of the shape asked for: real English text for language models, random inputs
    of the model's own input shape (and random labels) for classifiers."""
    import torch

    from edgetrain.data.batch import Batch

    if getattr(model, "task", None) == "lm":
        from pydoc_data.topics import topics

        from edgetrain.data.tokenizer import model_tokenizer

        needed = config.batch * (config.seq + 1)
        # The model's own tokenizer: a checkpoint is profiled on the tokens it would train on.
        text = "".join(topics[k] for k in sorted(topics))
        tokens = model_tokenizer(model).encode(text[:needed * 16])  # enough text for `needed` tokens
        ids = torch.tensor((tokens * (needed // max(len(tokens), 1) + 1))[:needed], dtype=torch.long)
        ids = ids.remainder(model.config.vocab_size).view(config.batch, config.seq + 1)
        return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), 0)
    from edgetrain.models.zoo import example_input

    generator = torch.Generator().manual_seed(config.seed)
    inputs = example_input(model, config.batch, config.seq, generator=generator)
    labels = torch.randint(0, model.config.num_classes, (config.batch,), generator=generator)
    return Batch(inputs, labels, 0)
