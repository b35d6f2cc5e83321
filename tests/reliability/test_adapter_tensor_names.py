"""Issue 40: an adapter file with unexpected tensor names.

The mlx-lm conversion of an edgetrain adapter holding a tensor named plain `lora_A` ended in `ValueError: not
enough values to unpack`. Converting or loading any adapter names the first tensor it cannot place: here one
tensor of a good adapter is renamed (bare `lora_A`, an empty name, extra dots, an unknown module, a block
beyond the model, a negative or zero-padded index, another script's digits, unicode, a trailing newline,
very long names) in each source format (edgetrain's file, a PEFT directory, a llama.cpp GGUF LoRA, an mlx-lm
directory where MLX runs), then converted to every format and loaded into a torch model (and an MLX one where
MLX runs). Each is an AdapterError naming the tensor; never a ValueError, KeyError or IndexError, and the
model is left as it was.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import edgetrain
from edgetrain.adapters.convert import FORMATS, convert_adapter, load_adapter
from edgetrain.models.lora import AdapterError, LoraConfig, adapter_tensor_place, lora_layers, lora_state_dict
from edgetrain.models.lora import write_lora_file
from adapter_state import snapshot, unchanged
from fault_tally import attempt, refused

FAULT = "adapters"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


HAS_MLX = _installed("mlx.core")
HAS_GGUF = _installed("gguf")


def _decoder(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return edgetrain.load_model("tiny")


def _good_tensors() -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    model = edgetrain.add_lora(_decoder(), rank=2, alpha=4.0, targets=("q", "v"))
    with torch.no_grad():
        for param in lora_state_dict(model).values():
            param.copy_(torch.randn_like(param) * 0.05)
    return model.lora_config, {k: v.detach().clone() for k, v in lora_state_dict(model).items()}


FIRST = "blocks.0.self_attn.q_proj.lora_A"

# name: how to turn a tensor's name (in whatever format it is stored) into a hostile one
HOSTILE = {
    "bare-lora_A": lambda name: "lora_A",
    "empty": lambda name: "",
    "extra-dots": lambda name: name.replace("q_proj.", "q_proj.extra.").replace("attn_q.", "attn_q.extra."),
    "double-dot": lambda name: name.replace(".", "..", 1),
    "trailing-dot": lambda name: name + ".",
    "unknown-module": lambda name: name.replace("q_proj", "zz_proj").replace("attn_q", "attn_zz"),
    "block-beyond-the-model": lambda name: name.replace(".0.", ".999.", 1),
    "negative-block": lambda name: name.replace(".0.", ".-1.", 1),
    "zero-padded-block": lambda name: name.replace(".0.", ".00.", 1),
    "another-scripts-digit": lambda name: name.replace(".0.", ".\u0660.", 1),  # ARABIC-INDIC DIGIT ZERO
    "superscript-digit": lambda name: name.replace(".0.", ".\u00b2.", 1),
    "unicode": lambda name: "ブロック" + name[name.index("."):],
    "trailing-newline": lambda name: name + "\n",
    "huge-block-number": lambda name: name.replace(".0.", "." + "9" * 5000 + ".", 1),
    "very-long": lambda name: "x" * 20_000,
}


def _shown(name: str) -> str:
    """What of the hostile name the error must show (a very long one is cut)."""
    return repr(name)[1:-1][:60]


def _write_edgetrain(path: Path, config: LoraConfig, tensors: dict[str, torch.Tensor], hostile) -> str:
    bad = hostile(FIRST)
    renamed = {(bad if name == FIRST else name): t for name, t in tensors.items()}
    write_lora_file(config, renamed, path)
    return bad


def _write_peft(path: Path, config: LoraConfig, tensors: dict[str, torch.Tensor], hostile, monkeypatch) -> str:
    from edgetrain.adapters import peft

    real = peft.peft_key
    bad = hostile(real(FIRST))
    monkeypatch.setattr(peft, "peft_key", lambda name: bad if name == FIRST else real(name))
    peft.write_peft_adapter(config, tensors, path)
    monkeypatch.setattr(peft, "peft_key", real)
    return bad


def _write_gguf(path: Path, config: LoraConfig, tensors: dict[str, torch.Tensor], hostile, monkeypatch) -> str:
    from edgetrain.adapters import gguf_lora

    real = gguf_lora.gguf_lora_name
    bad = hostile(real(FIRST, _decoder().config)[0])

    def renamed(name, base):
        gguf_name, heads = real(name, base)
        return (bad, heads) if name == FIRST else (gguf_name, heads)

    monkeypatch.setattr(gguf_lora, "gguf_lora_name", renamed)
    try:
        gguf_lora.write_gguf_lora(config, tensors, path, _decoder().config)
    except Exception as exc:  # the gguf package may refuse to write such a name at all
        pytest.skip(f"the gguf package will not write a tensor named {bad[:40]!r}: {exc!r}")
    finally:
        monkeypatch.setattr(gguf_lora, "gguf_lora_name", real)
    return bad


def _write_mlx_lm(path: Path, config: LoraConfig, tensors: dict[str, torch.Tensor], hostile, monkeypatch) -> str:
    from edgetrain.backends.mlx import adapters

    real = adapters.mlx_lm_key
    bad = hostile(real(0, "self_attn.q_proj", "lora_a"))
    monkeypatch.setattr(adapters, "mlx_lm_key",
                        lambda block, path_, part: bad if (block, path_, part) == (0, "self_attn.q_proj", "lora_a")
                        else real(block, path_, part))
    good = path.parent / "good.safetensors"
    write_lora_file(config, tensors, good)
    adapters.torch_adapter_to_mlx_lm(good, path)
    monkeypatch.setattr(adapters, "mlx_lm_key", real)
    return bad


SOURCES = {"edgetrain": (".safetensors", None), "peft": ("", None),
           "gguf": (".gguf", None if HAS_GGUF else "the gguf package is not installed"),
           "mlx-lm": ("", None if HAS_MLX else "mlx is not installed")}


def _hostile_adapter(tmp_path: Path, source: str, case: str, monkeypatch) -> tuple[Path, str]:
    suffix, missing = SOURCES[source]
    if missing:
        pytest.skip(missing)
    config, tensors = _good_tensors()
    path = tmp_path / f"hostile{suffix}"
    if source == "edgetrain":
        return path, _write_edgetrain(path, config, tensors, HOSTILE[case])
    writer = {"peft": _write_peft, "gguf": _write_gguf, "mlx-lm": _write_mlx_lm}[source]
    return path, writer(path, config, tensors, HOSTILE[case], monkeypatch)


def _names_it(error: Exception, bad: str) -> bool:
    """The error names the tensor: as the file names it, or (a block the model lacks, found where the
    tensors are already under edgetrain's names) as edgetrain does."""
    return _shown(bad) in str(error) or (".999." in bad and "blocks.999.self_attn.q_proj" in str(error))


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_converting_an_adapter_names_the_tensor_it_cannot_place(source, case, tmp_path, monkeypatch):
    path, bad = _hostile_adapter(tmp_path, source, case, monkeypatch)
    base = _decoder().config
    for target in FORMATS:
        out = tmp_path / f"out-{target}" / ("adapter.gguf" if target == "gguf" else "adapter.safetensors"
                                            if target == "edgetrain" else "adapter")
        error = refused(FAULT, lambda: convert_adapter(path, out, target, base_config=base))
        assert isinstance(error, AdapterError) and _names_it(error, bad), f"{source} -> {target}: {error}"
        assert not out.exists(), f"{source} -> {target}: something was written"


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("has_adapters", [False, True])
def test_loading_an_adapter_names_the_tensor_it_cannot_place_and_changes_nothing(source, case, has_adapters,
                                                                                   tmp_path, monkeypatch):
    path, bad = _hostile_adapter(tmp_path, source, case, monkeypatch)
    model = _decoder(seed=3)
    if has_adapters:
        edgetrain.add_lora(model, rank=2, alpha=4.0, targets=("q", "v"))
    before = snapshot(model)
    error = refused(FAULT, lambda: load_adapter(model, path))
    assert _names_it(error, bad), error
    assert unchanged(model, before)
    if source == "edgetrain":
        error = refused(FAULT, lambda: edgetrain.load_lora(model, path))
        assert _names_it(error, bad) and unchanged(model, before), error


@pytest.mark.skipif(not HAS_MLX, reason="mlx is not installed")
@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_loading_into_an_mlx_model_names_the_tensor_it_cannot_place(source, case, tmp_path, monkeypatch):
    from edgetrain.adapters.convert import load_adapter_into_mlx

    path, bad = _hostile_adapter(tmp_path, source, case, monkeypatch)
    model = edgetrain.load_model("tiny", backend="mlx")
    error = refused(FAULT, lambda: load_adapter_into_mlx(model, path))
    assert _names_it(error, bad), error


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_name_parser_names_every_hostile_name(case):
    bad = HOSTILE[case](FIRST)
    if case == "block-beyond-the-model":  # well formed: only a model can say it has no block 999
        assert attempt(FAULT, lambda: adapter_tensor_place(bad, "f"), sound=lambda place: place[0] == 999)
        return
    error = refused(FAULT, lambda: adapter_tensor_place(bad, "f"))
    assert _names_it(error, bad), error


def test_good_adapters_still_convert_through_every_format_exactly(tmp_path):
    """The name checks refuse nothing edgetrain writes: a round trip through each format gives the tensors
    back exactly (mlx-lm and GGUF only where their packages are)."""
    config, tensors = _good_tensors()
    start = write_lora_file(config, tensors, tmp_path / "start.safetensors")
    base = _decoder().config
    for target in FORMATS:
        if (target == "mlx-lm" and not HAS_MLX) or (target == "gguf" and not HAS_GGUF):
            continue
        middle = tmp_path / target / ("adapter.gguf" if target == "gguf" else "adapter")
        convert_adapter(start, middle, target, base_config=base)
        back = tmp_path / f"back-{target}.safetensors"

        def round_trip():
            convert_adapter(middle, back, "edgetrain", base_config=base)
            from edgetrain.models.lora import read_lora_file
            return read_lora_file(back)

        attempt(FAULT, round_trip, sound=lambda result: result[0] == config and result[1].keys() == tensors.keys()
                and all(torch.equal(result[1][k], tensors[k]) for k in tensors))
