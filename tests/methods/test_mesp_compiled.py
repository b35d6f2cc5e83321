"""mesp's compiled block programs (edgetrain/methods/mesp/compiled.py): the option picks the path, a compile
that fails falls back to eager once, and (slow lane: the compile takes about a minute on 2 cores) the compiled
step's gradients equal eager's and bp's within 1e-5."""
from __future__ import annotations

import logging

import pytest
import torch

import edgetrain
from edgetrain.methods import METHODS
from edgetrain.methods.mesp import compiled
from edgetrain.methods.mesp.block import block_backward, block_forward
from edgetrain.registry import EdgetrainError
from tests.methods.test_mesp_parity import max_relative_errors, random_batch, random_decoder, with_lora


def _model():
    return with_lora(random_decoder(11, num_hidden_layers=2), targets=("q", "k", "v", "o", "gate", "up", "down"))


def test_the_option_picks_the_programs(monkeypatch, tiny_lora, text_batches):
    calls = []

    def counting(function):
        def run(*args, **kwargs):
            calls.append(function.__name__)
            return function(*args, **kwargs)
        return run

    monkeypatch.setattr(compiled, "compiled_programs",
                        lambda mode: calls.append(mode) or (counting(block_forward), counting(block_backward)))
    batch = text_batches(1, seq_len=16, batch_size=2)[0]
    model = tiny_lora()
    plain_loss, plain = METHODS.get("mesp")(model).gradients(batch)
    assert calls == []
    loss, grads = METHODS.get("mesp")(model, compile_blocks=True).gradients(batch)
    blocks = len(model.blocks)
    assert calls[0] == "default" and calls.count("block_forward") == blocks and calls.count("block_backward") == blocks
    # The programs here are the eager functions: only grad_out's buffer differs (not overwritten when compiled).
    assert torch.equal(loss, plain_loss) and all(torch.equal(grads[k], plain[k]) for k in plain)
    assert compiled.block_programs(torch.device("meta"), True) == (block_forward, block_backward)


def test_a_program_that_cannot_be_compiled_runs_eagerly_from_then_on(caplog):
    class BackendCompilerFailed(Exception):  # the name torch._dynamo gives a backend's failure
        pass

    attempts = []

    def failing(*args, **kwargs):
        attempts.append(1)
        raise BackendCompilerFailed("inductor: no working C++ compiler found")

    program = compiled._Program(failing, lambda x: x + 1)
    with caplog.at_level(logging.WARNING, logger="edgetrain.methods.mesp.compiled"):
        assert program(1) == 2 and program(2) == 3
    assert attempts == [1]
    assert "could not be compiled here (BackendCompilerFailed: inductor: no working C++ compiler found)" in caplog.text
    # A failure of the model itself is not the compiler's: it is raised.
    broken = compiled._Program(lambda x: 1 / x, lambda x: x)
    with pytest.raises(ZeroDivisionError):
        broken(0)


def test_mlx_refuses_the_option_by_name():
    pytest.importorskip("mlx.core")
    model = edgetrain.load_model("tiny", backend="mlx")
    edgetrain.add_lora(model, rank=4)
    with pytest.raises(EdgetrainError, match="compile_blocks compiles torch's block programs"):
        edgetrain.Learner(model, method="mesp", backend="mlx", method_options={"compile_blocks": True})


@pytest.mark.slow
def test_compiled_gradients_match_eager_and_bp():
    model = _model()
    batch = random_batch(97, batch=2, seq_len=16)
    eager_loss, eager = METHODS.get("mesp")(model).gradients(batch)
    loss, grads = METHODS.get("mesp")(model, compile_blocks=True).gradients(batch)
    assert abs(float(loss) - float(eager_loss)) <= 1e-6 * abs(float(eager_loss))
    assert max(max_relative_errors(eager, grads).values()) <= 1e-5
    _, reference = METHODS.get("bp")(model).gradients(batch)
    assert max(max_relative_errors(reference, grads).values()) <= 1e-5
    # A second step replays the same programs (no new compile) and trains as eager does.
    learners = [edgetrain.Learner(_model(), method="mesp", optimizer="adamw", lr=1e-2, probe=False,
                                  method_options={"compile_blocks": flag}) for flag in (False, True)]
    losses = [[learner.step(batch).loss for _ in range(3)] for learner in learners]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


@pytest.mark.slow
def test_compiled_gradients_on_a_packed_base_match_eager(tiny_lora, text_batches):
    model = tiny_lora(quantize_bits=4)
    batch = text_batches(1, seq_len=32, batch_size=2)[0]
    eager_loss, eager = METHODS.get("mesp")(model).gradients(batch)
    loss, grads = METHODS.get("mesp")(model, compile_blocks=True).gradients(batch)
    assert abs(float(loss) - float(eager_loss)) <= 1e-6 * abs(float(eager_loss))
    assert max(max_relative_errors(eager, grads).values()) <= 1e-5
