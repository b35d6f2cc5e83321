"""The memory a step adds, estimated from a decoder's shape (edgetrain/training/step_estimates.py), and the budget
guard's ranking of methods by it (edgetrain/training/budget_report.py)."""
from __future__ import annotations

import pytest
import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.models.decoder_presets import qwen25_config
from edgetrain.models.llama import LlamaModel
from edgetrain.training.budget_report import StepFigure, lower_memory_methods, rank_methods
from edgetrain.training.step_estimates import estimate_step_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = ("bp", "mebp", "mesp", "mezo")


def _qwen_on_meta() -> LlamaModel:
    """Qwen2.5-0.5B's shape with LoRA r8, on the meta device: the estimates read shapes only."""
    with torch.device("meta"):
        model = LlamaModel(qwen25_config("qwen2.5-0.5b"))
        edgetrain.add_lora(model, rank=8)
    return model


def test_estimates_rank_mesp_below_mebp_below_bp_on_decoder_presets(tiny_lora, text_batches):
    tokens = torch.zeros(1, 512, dtype=torch.long)
    for model, batch in ((tiny_lora(rank=8), text_batches(1, seq_len=256)[0]), (_qwen_on_meta(), Batch(tokens, tokens))):
        estimates = {method: estimate_step_bytes(model, batch, method) for method in METHODS}
        assert estimates["mesp"] < estimates["mebp"] < estimates["bp"], estimates
    # On Qwen2.5-0.5B's 152k vocabulary the logits dominate everything but mesp (which never holds them).
    assert estimates["mesp"] * 5 < estimates["mezo"] < estimates["mebp"]


MEASURE = """
import json, sys, torch, edgetrain
sys.path.insert(0, "tests")
from testkit import random_lora_b, text_token_batches
from edgetrain.probes import TensorAccountant
from edgetrain.training.step_estimates import estimate_step_bytes
torch.set_num_threads(1)
batch = text_token_batches(1, seq_len=256)[0]
figures = {}
LEAN = {"attention_chunk": 16, "mlp_chunk": 32, "loss_chunk": 32, "vocab_chunk": 64}
FRESH = {"reuse_buffers": False}
for label, method, options in (("bp", "bp", {}), ("mebp", "mebp", {}), ("mesp", "mesp", FRESH), ("mezo", "mezo", {}),
                               ("mesp, lean chunks", "mesp", {**LEAN, **FRESH}), ("mesp, reused buffers", "mesp", {})):
    torch.manual_seed(0)
    model = edgetrain.load_model("tiny")
    edgetrain.add_lora(model, rank=8)
    random_lora_b(model, 1, 0.02)
    learner = edgetrain.Learner(model, method=method, probe=TensorAccountant(model), method_options=options)
    figures[label] = (estimate_step_bytes(model, batch, method, options), learner.step(batch).peak_bytes)
print(json.dumps(figures))
"""


def test_estimates_are_within_15_percent_of_tensor_accounting_on_the_tiny_preset():
    """Measured in a fresh process: in the full suite's long-lived process, bp's first step read 30.6 MB by
    tensor accounting where a fresh process (and this test on its own) reads 22 (cause not yet found; the
    estimates are what this test checks)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", MEASURE], cwd=Path(__file__).parent.parent, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    # The estimates count fresh allocations. mesp's reused step buffers (methods/mesp/step_buffers.py) hold
    # buffers whole while smaller tensors use them: +8% of the step on SmolLM2 and Qwen2.5-0.5B, where the
    # estimate stays within 10% (docs/benchmarks.md), but about +30% on tiny, whose stored inputs are small.
    estimate, pooled = figures.pop("mesp, reused buffers")
    assert figures["mesp"][1] < pooled <= 1.4 * estimate, (estimate, pooled)
    for method, (estimate, measured) in figures.items():
        assert abs(estimate - measured) <= 0.15 * measured, (method, estimate, measured)
    # mesp's chunk options are the step's: smaller chunks, a smaller estimate, as measured.
    assert figures["mesp, lean chunks"][0] < figures["mesp"][0] and figures["mesp, lean chunks"][1] < figures["mesp"][1]


def test_a_bad_chunk_option_is_the_methods_error(tiny_lora, text_batches):
    with pytest.raises(edgetrain.EdgetrainError, match="mlp_chunk"):
        estimate_step_bytes(tiny_lora(), text_batches(1)[0], "mesp", {"mlp_chunk": 0})


def test_no_estimate_for_other_methods_or_models(tiny_lora, text_batches):
    batch = text_batches(1)[0]
    assert estimate_step_bytes(tiny_lora(), batch, "fgd") is None
    classifier = edgetrain.load_model("mlp-digits")
    assert estimate_step_bytes(classifier, Batch(torch.randn(2, 64), torch.tensor([0, 1])), "bp") is None


def test_ranking_puts_a_slices_lower_bound_where_its_estimate_says():
    # bp was refused on a slice (over 5 MiB measured), so its whole step is at least that, and estimated at 40.
    tried = [StepFigure("bp", 5 * 2**20, measured=True, slice_tokens=64, batch_tokens=512)]
    estimates = {"bp": 40 * 2**20, "mebp": 12 * 2**20, "mesp": 3 * 2**20, "mezo": 8 * 2**20}
    ranked = rank_methods(tried, estimates)
    assert [figure.method for figure in ranked] == ["mesp", "mezo", "mebp", "bp"]
    assert ranked[-1].ranked_entry() == "bp over 5.0 MiB (measured on a slice, ~40.0 MiB estimated)"
    assert lower_memory_methods(tried, ranked, ("mebp", "mesp", "mezo"), estimates) == ["mesp", "mezo", "mebp"]
    # A measured method ranks by its measurement; only methods ranked below every tried one are suggested.
    tried = [StepFigure("mebp", 9 * 2**20, measured=True)]
    ranked = rank_methods(tried, {**estimates, "mebp": 12 * 2**20})
    assert [figure.method for figure in ranked] == ["mesp", "mezo", "mebp", "bp"]
    assert lower_memory_methods(tried, ranked, ("mebp", "mesp", "mezo"), estimates) == ["mesp", "mezo"]
    # Without estimates (a classifier), the usual order of lower-memory methods.
    assert lower_memory_methods(tried, rank_methods(tried, {}), ("mebp", "mesp", "mezo"), estimates) == ["mesp", "mezo"]
