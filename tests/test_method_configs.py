"""One options dataclass per method (edgetrain/methods/configs.py), shared by torch and MLX: the same
options, defaults and refusals on both frameworks."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from edgetrain.methods import METHODS
from edgetrain.methods.configs import METHOD_CONFIGS, MeSPConfig, method_config
from edgetrain.registry import EdgetrainError

BAD_OPTIONS = [
    ("mesp", {"vocab_chunk": 0}, "vocab_chunk must be a positive integer"),
    ("mesp", {"rollback": "yes"}, "rollback must be True or False"),
    ("mesp", {"bogus": 1}, "unknown option.*bogus.*known: fused_update, rollback"),
    ("mezo", {"epsilon": float("inf")}, "epsilon must be a finite positive number"),
    ("mezo", {"epsilon": "1e-3"}, "epsilon must be a finite positive number"),
    ("mezo", {"seed": 1.5}, "seed must be an integer"),
]


@pytest.mark.parametrize("method, options, message", BAD_OPTIONS)
def test_bad_options_are_refused_by_name_on_torch(method, options, message, tiny_lora):
    with pytest.raises(EdgetrainError, match=message):
        METHODS.get(method)(tiny_lora(), **options)


@pytest.mark.parametrize("method, options, message", BAD_OPTIONS)
def test_mlx_refuses_the_same_options_with_the_same_words(method, options, message, tiny_lora):
    pytest.importorskip("mlx.core", reason="mlx is not installed")
    from edgetrain.backends.mlx.loading import load_mlx_model
    from edgetrain.backends.mlx.lora import add_lora
    from edgetrain.backends.mlx.methods import MLX_METHODS

    model = load_mlx_model("tiny", seed=0)
    add_lora(model, rank=2)
    with pytest.raises(EdgetrainError) as on_mlx:
        MLX_METHODS.get(method)(model, **options)
    with pytest.raises(EdgetrainError) as on_torch:
        METHODS.get(method)(tiny_lora(), **options)
    assert str(on_mlx.value) == str(on_torch.value)


def test_every_option_of_a_config_is_taken_by_both_frameworks(tiny_lora):
    pytest.importorskip("mlx.core", reason="mlx is not installed")
    from edgetrain.backends.mlx.loading import load_mlx_model
    from edgetrain.backends.mlx.lora import add_lora
    from edgetrain.backends.mlx.methods import MLX_METHODS

    model = load_mlx_model("tiny", seed=0)
    add_lora(model, rank=2)
    for method, config_class in METHOD_CONFIGS.items():
        options = {f.name: f.default for f in dataclasses.fields(config_class)}
        METHODS.get(method)(tiny_lora(), **options)
        MLX_METHODS.get(method)(model, **options)
    rolling = MLX_METHODS.get("mesp")(model, fused_update=True)
    assert rolling.partial_updates and not MLX_METHODS.get("mesp")(model, fused_update=True,
                                                                     rollback=False).partial_updates


def test_torch_mesp_takes_vocab_chunk_and_reads_the_head_that_many_rows_at_a_time(tiny_lora, text_batches,
                                                                                  monkeypatch):
    import edgetrain.methods.mesp.method as mesp_method

    model, batch = tiny_lora(rank=4), text_batches(1, seq_len=32, batch_size=2)[0]
    _, reference = METHODS.get("mesp")(model).gradients(batch)
    widths = []
    original = mesp_method.chunked_lm_loss
    monkeypatch.setattr(mesp_method, "chunked_lm_loss",
                        lambda *args, **options: widths.append(args[-1]) or original(*args, **options))
    _, grads = METHODS.get("mesp")(model, vocab_chunk=37).gradients(batch)
    assert widths == [37]
    for name, g in reference.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7)


def test_a_config_checks_its_values_once_and_keeps_its_defaults():
    assert method_config("mesp", {}) == MeSPConfig()
    assert method_config("mesp", {"vocab_chunk": None}).vocab_chunk is None
    assert method_config("mezo", {"epsilon": 2}).epsilon == 2.0


def test_torch_mezo_refuses_an_epsilon_its_parameters_dtype_cannot_hold(tiny_lora):
    # found by the hostile-values fuzz: torch.add(alpha=3.4028234663852889e38) overflowed inside torch
    with pytest.raises(EdgetrainError, match="epsilon .* beyond what .* torch.float32 holds"):
        METHODS.get("mezo")(tiny_lora(), epsilon=3.402823466385289e38)
    with pytest.raises(EdgetrainError, match="torch.float16 holds"):
        METHODS.get("mezo")(tiny_lora().half(), epsilon=1e5)
