"""The torch-cuda backend where a CUDA GPU exists (skipped elsewhere, saying so): the methods' gradients on
the GPU equal the CPU's, mezo's estimate is the directional derivative along the z it draws on the GPU, a
learner trains there with the CUDA allocator's figures, its budget guard refuses a step that cannot fit,
and a checkpoint written on the GPU resumes on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch

import edgetrain
from edgetrain.cli import main as cli_main
from edgetrain.methods import METHODS
from edgetrain.methods.mezo import Directions
from edgetrain.training.learner import MemoryBudgetError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch-cuda backend)")


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    num = sum(float((got[k].double().cpu() - want[k].double().cpu()).norm() ** 2) for k in want) ** 0.5
    den = sum(float(want[k].double().cpu().norm() ** 2) for k in want) ** 0.5
    return num / den


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-8), (torch.float32, 1e-4)])
@pytest.mark.parametrize("method", ["bp", "mebp", "mesp"])
def test_gradients_on_the_gpu_equal_the_cpus(method, dtype, tolerance, tiny_lora, text_batches):
    """fp64 measured 7.0e-10 for all three on an H200 (the kernels' own summation orders), fp32 within 1e-4."""
    batch = text_batches(1, seq_len=64, batch_size=2)[0]
    cpu_model = tiny_lora(rank=4).to(dtype)
    gpu_model = copy.deepcopy(cpu_model).cuda()
    cpu_loss, cpu_grads = METHODS.get(method)(cpu_model).gradients(batch)
    gpu_loss, gpu_grads = METHODS.get(method)(gpu_model).gradients(batch.to("cuda"))
    assert all(g.device.type == "cuda" for g in gpu_grads.values())
    assert abs(float(gpu_loss) - float(cpu_loss)) <= tolerance * abs(float(cpu_loss))
    assert _relative_error(gpu_grads, cpu_grads) <= tolerance


@pytest.mark.parametrize("quantize_bits", [None, 4])
def test_mesps_compiled_blocks_on_the_gpu_give_the_cpus_gradients_step_after_step(quantize_bits, tiny_lora,
                                                                                 text_batches):
    """compile_blocks on CUDA: the block programs compiled in mode "reduce-overhead" (CUDA graphs), against
    eager mesp on the CPU; three steps, so the graphs are replayed, not only recorded. Written before a GPU was
    lent (edgetrain/methods/mesp/compiled.py); tools/gpu_check.sh runs it."""
    cpu_model = tiny_lora(quantize_bits=quantize_bits)
    gpu_model = copy.deepcopy(cpu_model).cuda()
    batches = text_batches(3, seq_len=64, batch_size=2)
    for batch in batches:
        cpu_loss, cpu_grads = METHODS.get("mesp")(cpu_model).gradients(batch)
        gpu_loss, gpu_grads = METHODS.get("mesp")(gpu_model, compile_blocks=True).gradients(batch.to("cuda"))
        assert abs(float(gpu_loss) - float(cpu_loss)) <= 1e-4 * abs(float(cpu_loss))
        assert _relative_error(gpu_grads, cpu_grads) <= 1e-4


def test_mezos_estimate_on_the_gpu_is_the_derivative_along_its_gpu_drawn_z(tiny_lora, text_batches):
    batch = text_batches(1, seq_len=32, batch_size=2)[0].to("cuda")
    model = tiny_lora(rank=4).double().cuda()
    mezo = METHODS.get("mezo")(model, epsilon=1e-5)
    seed = mezo._step_seed()
    _, estimate = mezo.gradients(batch)
    _, exact = METHODS.get("bp")(model).gradients(batch)
    z = Directions(mezo.params, seed)
    directional = sum(float((exact[name] * z(name)).sum()) for name in exact)
    for name in exact:
        torch.testing.assert_close(estimate[name], directional * z(name), rtol=1e-5, atol=1e-8)


def test_a_learner_trains_on_the_gpu_and_its_checkpoint_resumes_on_the_cpu(tiny_lora, text_batches, tmp_path):
    batches = text_batches(8, seq_len=64, batch_size=2)
    model = tiny_lora(rank=8, random_b=False)
    learner = edgetrain.Learner(model, method="mesp", backend="torch-cuda", optimizer="adamw", lr=3e-3)
    before = learner.evaluate(batches[:2])["loss"]
    stats = [learner.step(batches[i % len(batches)]) for i in range(24)]
    after = learner.evaluate(batches[:2])["loss"]
    assert all(s.probe == "cuda" and s.peak_bytes is not None and s.peak_bytes > 0 for s in stats)
    assert after < before - 0.1, (before, after)
    learner.save(tmp_path / "gpu.ckpt")

    on_cpu = edgetrain.Learner(tiny_lora(rank=8, random_b=False), method="mesp", backend="torch-cpu",
                               optimizer="adamw", lr=3e-3).load(tmp_path / "gpu.ckpt")
    assert on_cpu.steps_done == 24
    assert abs(on_cpu.evaluate(batches[:2])["loss"] - after) < 1e-4
    # Both continue the same way: the optimizer state travelled too.
    gpu_next = learner.step(batches[0]).loss
    cpu_next = on_cpu.step(batches[0]).loss
    assert abs(gpu_next - cpu_next) < 1e-4


def test_the_budget_guard_on_the_gpu_refuses_a_step_that_cannot_fit_and_changes_nothing(tiny_lora, text_batches):
    model = tiny_lora(rank=4)
    learner = edgetrain.Learner(model, method="bp", backend="torch-cuda", memory_budget=learner_budget(model))
    before = {k: v.detach().clone() for k, v in learner.params.items()}
    with pytest.raises(MemoryBudgetError, match="cuda"):
        learner.step(text_batches(1, seq_len=256, batch_size=4)[0])
    assert learner.steps_done == 0
    assert all(torch.equal(before[k], v) for k, v in learner.params.items())


def learner_budget(model: torch.nn.Module) -> int:
    """The weights and 64 KiB: no bp step of a 4 x 256 batch fits."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + 64 * 1024


def test_profile_runs_on_the_gpu(tmp_path, capsys):
    code = cli_main(["profile", "--backend", "torch-cuda", "--methods", "bp,mebp,mesp", "--seq", "128",
                     "--steps", "1", "--json", str(tmp_path / "p.jsonl")])
    assert code == 0
    out = capsys.readouterr().out
    assert "mesp" in out and "cuda" in out


@pytest.mark.parametrize("method", ["bp", "mebp", "mesp"])
def test_a_4_bit_base_on_the_gpu_gives_the_cpus_gradients(method, text_batches):
    """Quantised frozen weights (edgetrain.models.quantized) dequantised on the GPU, layer by layer."""
    torch.manual_seed(0)
    cpu_model = edgetrain.load_model("tiny", quantize_bits=4)
    edgetrain.add_lora(cpu_model, rank=4)
    with torch.no_grad():
        for name, param in cpu_model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    gpu_model = copy.deepcopy(cpu_model).cuda()
    assert all(b.device.type == "cuda" for name, b in gpu_model.named_buffers() if name.endswith("codes"))
    batch = text_batches(1, seq_len=64, batch_size=2)[0]
    _, cpu_grads = METHODS.get(method)(cpu_model).gradients(batch)
    _, gpu_grads = METHODS.get(method)(gpu_model).gradients(batch.to("cuda"))
    assert _relative_error(gpu_grads, cpu_grads) <= 1e-4


def test_the_gpu_dequantises_a_4_bit_base_in_large_tiles_with_the_cpus_product(monkeypatch, text_batches):
    """On a GPU the tiles are ACCELERATOR_TILE_ELEMENTS and a quantised head is read DEFAULT_VOCAB_CHUNK
    rows at a time (fewer kernel launches); the product and mesp's gradients are the CPU's."""
    from edgetrain.methods.mesp.loss import DEFAULT_VOCAB_CHUNK
    from edgetrain.models import quantized
    from edgetrain.models.quantized import PackedMatrix, QuantizedLinear

    layer = QuantizedLinear.from_dense(torch.randn(8192, 1024, generator=torch.Generator().manual_seed(0)), 4)
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(1))
    gpu_layer = copy.deepcopy(layer).cuda()
    assert [stop - start for start, stop, _ in gpu_layer.scratch_tiles()] == [4096, 4096]
    torch.testing.assert_close(gpu_layer(x.cuda()).cpu(), layer(x), rtol=1e-4, atol=1e-4)

    import dataclasses

    from edgetrain.models.decoder_presets import tiny_config
    from edgetrain.models.llama import LlamaModel
    from edgetrain.models.quantize import quantize_base

    torch.manual_seed(0)
    model = LlamaModel(dataclasses.replace(tiny_config(), vocab_size=8192))
    model.init_weights()
    quantize_base(model, 4)
    edgetrain.add_lora(model, rank=4)
    batch = text_batches(1, seq_len=32, batch_size=2)[0]
    _, cpu_grads = METHODS.get("mesp")(model).gradients(batch)
    head_tiles = []
    original = PackedMatrix.dequantize_rows
    monkeypatch.setattr(PackedMatrix, "dequantize_rows", lambda self, start, stop, *a, **k: (
        head_tiles.append(stop - start) if self.rows == 8192 else None) or original(self, start, stop, *a, **k))
    _, gpu_grads = METHODS.get("mesp")(model.cuda()).gradients(batch.to("cuda"))
    assert max(head_tiles) == DEFAULT_VOCAB_CHUNK
    assert _relative_error(gpu_grads, cpu_grads) <= 1e-4
    assert quantized.tile_elements("cuda") == quantized.ACCELERATOR_TILE_ELEMENTS
