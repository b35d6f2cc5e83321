"""Today's architectures from files the reference tools made (tests/fixtures/arch, remade by
tools/make_arch_fixtures.py): a checkpoint directory transformers saved and the GGUF llama.cpp's own
converter made of it, with transformers' and llama.cpp's logits on fixed tokens.

Every architecture: checkpoint and GGUF give transformers' logits (1e-5), the GGUF follows llama.cpp's, MLX
gives the same, merges round-trip, MeSP's (and mebp's) gradients equal autograd's, and MeZO's estimate is the
derivative along its direction.

Llama 3.x: its RoPE scaling reaches the GGUF only as `rope_freqs.weight`; the loader recovers the scaling
from the factors and writes it back into a merged checkpoint or GGUF. Qwen3: head norms over q and k, a head
size of its own, an untied head."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods import METHODS
from edgetrain.models.gguf.reader import GGUFError
from gguf_blocks_testkit import assert_follows_llama_cpp
from testkit import random_lora_b

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "arch"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
STORED = np.load(FIXTURES / "logits.npz")
TOKENS = [int(t) for t in STORED["tokens"]]
RELATIVE = 1e-5


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([TOKENS]))[0].double().numpy()


def _relative(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def test_llama3_checkpoint_and_gguf_give_transformers_logits():
    expected = STORED["llama3.transformers"]
    checkpoint = edgetrain.load_model(FIXTURES / "llama3")
    from_gguf = edgetrain.load_model(FIXTURES / "llama3.gguf")
    # transformers 5 keeps rope_theta among the rope parameters; the GGUF has it as metadata of its own.
    assert from_gguf.config.rope_scaling == {k: v for k, v in checkpoint.config.rope_scaling.items()
                                             if k != "rope_theta"}
    assert from_gguf.config.rope_scaling["rope_type"] == "llama3"
    assert _relative(_logits(checkpoint), expected) <= RELATIVE
    assert _relative(_logits(from_gguf), expected) <= RELATIVE
    # The scaling matters at these positions: the same weights without it are far off.
    import dataclasses

    from edgetrain.models.llama import LlamaModel

    unscaled = LlamaModel(dataclasses.replace(checkpoint.config, rope_scaling=None))
    unscaled.load_state_dict(checkpoint.state_dict())
    assert _relative(_logits(unscaled.eval()), expected) > 100 * RELATIVE


ARCHITECTURES = sorted(MANIFEST["models"])


def test_every_architecture_edgetrain_builds_has_a_fixture():
    from edgetrain.models.decoders import architecture_names

    built = {edgetrain.load_model(FIXTURES / MANIFEST["models"][name]["gguf"]).config.model_type
             for name in ARCHITECTURES}
    assert set(architecture_names()) - {"llama", "qwen2"} <= built  # llama/qwen2: tests/models/test_gguf.py


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_checkpoint_and_gguf_give_transformers_logits(name):
    expected = STORED[f"{name}.transformers"]
    checkpoint = edgetrain.load_model(FIXTURES / MANIFEST["models"][name]["checkpoint"])
    from_gguf = edgetrain.load_model(FIXTURES / MANIFEST["models"][name]["gguf"])
    assert checkpoint.config.model_type == from_gguf.config.model_type
    assert _relative(_logits(checkpoint), expected) <= RELATIVE
    assert _relative(_logits(from_gguf), expected) <= RELATIVE


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_gguf_follows_llama_cpps_logits(name):
    if f"{name}.llama_cpp" not in STORED:
        pytest.skip("the fixtures were made without llama-cpp-python")
    assert_follows_llama_cpp(_logits(edgetrain.load_model(FIXTURES / MANIFEST["models"][name]["gguf"])),
                             STORED[f"{name}.llama_cpp"], name)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_gguf_and_checkpoint_on_mlx_give_transformers_logits(name):
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")

    ids = mx.array(np.array([TOKENS], dtype=np.int32))
    for source in ("gguf", "checkpoint"):
        model = edgetrain.load_model(FIXTURES / MANIFEST["models"][name][source], backend="mlx")
        assert _relative(np.array(model(ids))[0], STORED[f"{name}.transformers"]) <= RELATIVE, source


def test_merging_writes_the_scaling_back(tmp_path):
    from edgetrain.export.merged import save_merged_gguf, save_merged_hf

    model = edgetrain.load_model(FIXTURES / "llama3.gguf")
    save_merged_gguf(model, FIXTURES / "llama3.gguf", tmp_path / "merged.gguf", dtype="f32")
    save_merged_hf(model, tmp_path / "merged")
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["rope_scaling"] == model.config.rope_scaling
    for path in (tmp_path / "merged.gguf", tmp_path / "merged"):
        assert _relative(_logits(edgetrain.load_model(path)), STORED["llama3.transformers"]) <= RELATIVE


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_merged_exports_give_the_same_logits(tmp_path, name):
    from edgetrain.export.merged import save_merged_gguf, save_merged_hf

    source = FIXTURES / MANIFEST["models"][name]["gguf"]
    model = edgetrain.load_model(source)
    save_merged_gguf(model, source, tmp_path / "merged.gguf", dtype="f32")
    save_merged_hf(model, tmp_path / "merged")
    for path in (tmp_path / "merged.gguf", tmp_path / "merged"):
        assert _relative(_logits(edgetrain.load_model(path)), STORED[f"{name}.transformers"]) <= RELATIVE, path
    reference = transformers_model(tmp_path / "merged")
    with torch.no_grad():
        theirs = reference(torch.tensor([TOKENS])).logits[0].double().numpy()
    assert _relative(theirs, STORED[f"{name}.transformers"]) <= RELATIVE


def transformers_model(directory: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("method", ["mebp", "mesp"])
def test_mesp_gradients_equal_autograd(method, name):
    model = edgetrain.load_model(FIXTURES / MANIFEST["models"][name]["gguf"])
    torch.manual_seed(0)
    edgetrain.add_lora(model, rank=4)
    random_lora_b(model, seed=1, scale=0.02)
    ids = torch.tensor([TOKENS[:81], TOKENS[15:96]])
    batch = Batch(ids[:, :-1].clone(), ids[:, 1:].clone(), 0)
    loss, grads = METHODS.get(method)(model).gradients(batch)
    reference_loss, reference = METHODS.get("bp")(model).gradients(batch)
    assert abs(float(loss) - float(reference_loss)) <= 1e-5 * abs(float(reference_loss))
    num = sum(float((grads[k] - reference[k]).norm() ** 2) for k in reference) ** 0.5
    den = sum(float(reference[k].norm() ** 2) for k in reference) ** 0.5
    assert num <= 1e-5 * den, (method, num / den)


def test_factors_no_llama3_scaling_makes_are_refused_by_name(tmp_path):
    """A `rope_freqs.weight` whose factors are not Llama 3's (here one factor changed) is refused, naming the
    tensor, rather than approximated."""
    from edgetrain.models.gguf.reader import read_gguf

    source = FIXTURES / "llama3.gguf"
    info = read_gguf(source).tensors["rope_freqs.weight"]
    raw = bytearray(source.read_bytes())
    raw[info.offset + 4:info.offset + 8] = np.array([5.0], dtype="<f4").tobytes()  # the second factor
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(bytes(raw))
    with pytest.raises(GGUFError, match="'rope_freqs.weight' holds frequency factors .* that no Llama 3 RoPE"):
        edgetrain.load_model(damaged)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_mezo_estimates_the_derivative_along_its_direction(name):
    """MeZO through each architecture (float64): its (L(theta + eps z) - L(theta - eps z)) / 2 eps is
    autograd's gradient projected on the same z."""
    from edgetrain.methods.mezo import Directions

    model = edgetrain.load_model(FIXTURES / MANIFEST["models"][name]["checkpoint"]).double()
    torch.manual_seed(0)
    edgetrain.add_lora(model, rank=4)
    random_lora_b(model, seed=1, scale=0.02)
    model.double()
    ids = torch.tensor([TOKENS[:41], TOKENS[50:91]])
    batch = Batch(ids[:, :-1].clone(), ids[:, 1:].clone(), 0)
    _, exact = METHODS.get("bp")(model).gradients(batch)
    # The default step (the paper's 1e-3) is a secant within 1e-3; a small one is the derivative itself.
    for epsilon, tolerance in ((None, 1e-3), (1e-6, 1e-7)):
        method = METHODS.get("mezo")(model, **({} if epsilon is None else {"epsilon": epsilon}))
        _, projected = method.projected_gradient(batch, 11)
        directions = Directions(method.params, 11)
        directional = sum(float((exact[name] * directions(name)).sum()) for name in method.params)
        assert abs(directional) > 1e-3
        assert projected == pytest.approx(directional, rel=tolerance), epsilon
