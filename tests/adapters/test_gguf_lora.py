"""llama.cpp's LoRA GGUF: edgetrain writes what llama.cpp's loader checks (metadata, names, shapes, Q/K row
order of llama models), reads it back exactly, refuses damaged or unfitting adapters by name with the
model untouched; merged exports (Hugging Face directory, GGUF) equal the model with its adapter.
llama.cpp itself loads them in tests/adapters/test_llama_cpp.py (slow)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import edgetrain
from edgetrain.adapters.convert import AdapterBase, convert_adapter, detect_format, load_adapter, read_adapter
from edgetrain.adapters.gguf_lora import read_gguf_lora, write_gguf_lora
from edgetrain.cli import main
from edgetrain.export.merged import MergeError, save_merged_gguf, save_merged_hf
from edgetrain.models.gguf.loader import permute_rope_rows
from edgetrain.models.lora import AdapterError, lora_state_dict
from testkit import random_lora_b

gguf = pytest.importorskip("gguf")
from gguf_testkit import VOCAB, hf_model, write_gguf  # noqa: E402

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    """A tiny llama-architecture GGUF (Q and K rows permuted as llama.cpp's converter stores them)."""
    return write_gguf(tmp_path_factory.mktemp("base") / "llama.gguf", hf_model("llama"))


def _with_adapter(base, rank=4, alpha=6.0, targets=TARGETS, seed=1):
    model = edgetrain.load_model(base)
    edgetrain.add_lora(model, rank=rank, alpha=alpha, targets=targets)
    random_lora_b(model, seed, 0.2)
    return model


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).double()


def _tokens():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))  # in every vocabulary here


# Merged weights against the adapter applied beside them, fp32 logits: measured 1.8e-6 .. 1.9e-6 (the sums
# are rounded in another order), so 1e-5; an F16 file rounds every weight to 11 bits (measured 2.4e-3), so 1e-2.
def _relative(got, expected):
    return float((got - expected).abs().max() / expected.abs().max())


def test_written_as_llama_cpp_reads_it(llama_gguf, tmp_path):
    model = _with_adapter(llama_gguf, targets=("q", "k", "down"))
    path = write_gguf_lora(model.lora_config, lora_state_dict(model), tmp_path / "a.gguf", model.config)
    reader = gguf.GGUFReader(str(path))  # the gguf package's reader, not edgetrain's
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert (fields["general.type"], fields["adapter.type"], fields["general.architecture"]) == ("adapter", "lora", "llama")
    assert fields["adapter.lora.alpha"] == pytest.approx(6.0)
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {f"blk.{i}.{m}.weight.lora_{h}" for i in range(2) for m in ("attn_q", "attn_k", "ffn_down")
                            for h in "ab"}
    own = lora_state_dict(model)
    config = model.config
    for block in range(2):
        for module, path_name, heads in (("attn_q", "self_attn.q_proj", config.num_attention_heads),
                                         ("attn_k", "self_attn.k_proj", config.num_key_value_heads),
                                         ("ffn_down", "mlp.down_proj", None)):
            a, b = tensors[f"blk.{block}.{module}.weight.lora_a"], tensors[f"blk.{block}.{module}.weight.lora_b"]
            # llama.cpp's checks: A's ne[0] = the base's ne[0] (in), B's ne[1] = the base's ne[1] (out), A ne[1] = B ne[0]
            expected_b = own[f"blocks.{block}.{path_name}.lora_B"]
            assert list(a.shape) == [config.hidden_size if module != "ffn_down" else config.intermediate_size, 4]
            assert list(b.shape) == [4, expected_b.shape[0]]
            assert np.array_equal(np.asarray(a.data), own[f"blocks.{block}.{path_name}.lora_A"].numpy())
            if heads is not None:
                expected_b = permute_rope_rows(expected_b, heads)
            assert np.array_equal(np.asarray(b.data), expected_b.numpy())


def test_the_file_adds_the_same_update_to_llama_cpps_permuted_weights(llama_gguf, tmp_path):
    """llama.cpp computes (W_file + scale B_file A_file) x with W_file the permuted base rows. Undoing the
    permutation of that sum must give edgetrain's W + scale B A: the adapter's rows go with the base's."""
    model = _with_adapter(llama_gguf, targets=("q", "k"))
    path = write_gguf_lora(model.lora_config, lora_state_dict(model), tmp_path / "a.gguf", model.config)
    from edgetrain.models.gguf.loader import unpermute_rope_rows

    base = {t.name: t for t in gguf.GGUFReader(str(llama_gguf)).tensors}
    lora = {t.name: np.asarray(t.data, dtype=np.float64) for t in gguf.GGUFReader(str(path)).tensors}
    scale = model.lora_config.scale
    for module, proj, heads in (("attn_q", "q_proj", 4), ("attn_k", "k_proj", 2)):
        name = f"blk.1.{module}.weight"
        file_sum = np.asarray(base[name].data, dtype=np.float64) + scale * lora[name + ".lora_b"] @ lora[name + ".lora_a"]
        layer = model.blocks[1].self_attn.get_submodule(proj)
        expected = layer.base.weight.double() + layer.delta_weight().double()
        assert torch.allclose(unpermute_rope_rows(torch.from_numpy(file_sum), heads), expected, atol=1e-6)


@pytest.mark.parametrize("base_name", ["llama", "tiny"])
def test_round_trip_is_exact_and_loads_with_the_same_logits(llama_gguf, tmp_path, base_name):
    base = llama_gguf if base_name == "llama" else "tiny"  # tiny is qwen2: no row permutation
    model = _with_adapter(base)
    saved = edgetrain.save_lora(model, tmp_path / "a.safetensors")
    path = convert_adapter(saved, tmp_path / "a.gguf", "gguf", base_config=model.config)
    assert detect_format(path) == "gguf"
    config, tensors = read_adapter(path, AdapterBase(config=model.config))
    assert (config.rank, config.alpha, config.targets) == (4, 6.0, TARGETS)
    expected = lora_state_dict(model)
    assert tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in expected)
    loaded = edgetrain.load_model(base, adapter=path)
    assert torch.equal(_logits(loaded, _tokens()), _logits(model, _tokens()))
    back = convert_adapter(path, tmp_path / "back", "peft", base_config=model.config)  # GGUF -> PEFT, exact
    assert all(torch.equal(read_adapter(back)[1][k], expected[k]) for k in expected)


def test_the_cli_writes_gguf_and_generate_reads_it(llama_gguf, tmp_path, capsys):
    model = _with_adapter(llama_gguf)
    saved = edgetrain.save_lora(model, tmp_path / "a.safetensors")
    out = tmp_path / "a.gguf"
    assert main(["export-adapter", "--adapter", str(saved), "--format", "gguf", "-o", str(out), "--quiet"]) != 0
    assert "writing a GGUF adapter needs the base model (--model" in capsys.readouterr().err
    assert not out.exists()
    assert main(["export-adapter", "--model", str(llama_gguf), "--adapter", str(saved), "--format", "gguf",
                 "-o", str(out), "--quiet"]) == 0
    capsys.readouterr()
    texts = []
    for adapter in (saved, out):
        assert main(["generate", "--model", str(llama_gguf), "--prompt", "The lazy", "--max-tokens", "8",
                     "--adapter", str(adapter), "--quiet"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]


# ---------------------------------------------------------------------------------------------------
# Damaged and unfitting adapters: named errors, the model as it was


def _write_raw(path, tensors, arch="llama", general_type="adapter", adapter_type="lora", alpha=8.0):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", general_type)
    writer.add_string("adapter.type", adapter_type)
    if alpha is not None:
        writer.add_float32("adapter.lora.alpha", alpha)
    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _pairs(config, rank=2, modules=("attn_v",), blocks=None, value=0.1):
    out = {}
    for block in (range(config.num_hidden_layers) if blocks is None else blocks):
        for module in modules:
            width_out = config.num_key_value_heads * config.head_dim if module == "attn_v" else config.hidden_size
            out[f"blk.{block}.{module}.weight.lora_a"] = np.full((rank, config.hidden_size), value)
            out[f"blk.{block}.{module}.weight.lora_b"] = np.full((width_out, rank), value)
    return out


def test_a_hand_made_adapter_reads_with_llama_cpps_meaning(llama_gguf, tmp_path):
    config = edgetrain.load_model(llama_gguf).config
    path = _write_raw(tmp_path / "a.gguf", _pairs(config), alpha=0.0)  # alpha 0: llama.cpp applies scale 1
    lora, tensors = read_gguf_lora(path, config)
    assert (lora.rank, lora.alpha, lora.targets) == (2, 2.0, ("v",))
    assert torch.equal(tensors["blocks.0.self_attn.v_proj.lora_A"], torch.full((2, 64), 0.1))


def _hostile_cases(config):
    good = _pairs(config)
    return {
        "not an adapter": (dict(general_type="model"), good, "not a LoRA adapter GGUF"),
        "another adapter type": (dict(adapter_type="control_vector"), good, "not a LoRA adapter GGUF"),
        "another architecture": (dict(arch="qwen2"), good, "for a 'qwen2' model, the base model is 'llama'"),
        "negative alpha": (dict(alpha=-1.0), good, "adapter.lora.alpha"),
        "NaN alpha": (dict(alpha=float("nan")), good, "adapter.lora.alpha"),
        "a base weight": ({}, {**good, "blk.0.attn_q.weight": np.zeros((64, 64))}, "not a LoRA weight"),
        "a norm adapter": ({}, {**good, "blk.0.attn_norm.weight.lora_a": np.zeros((2, 64))}, "not a LoRA weight"),
        "an embedding adapter": ({}, {**good, "token_embd.weight.lora_a": np.zeros((2, 64)),
                                      "token_embd.weight.lora_b": np.zeros((300, 2))}, "not a LoRA weight"),
        "lora_a alone": ({}, {k: v for k, v in good.items() if k != "blk.1.attn_v.weight.lora_b"}, "without lora_b"),
        "a layer subset": ({}, _pairs(config, blocks=[0]), "adapted in blocks \\[0\\]"),
        "mixed ranks": ({}, {**good, **{k: v for k, v in _pairs(config, rank=3, blocks=[1]).items()}}, "ranks \\[2, 3\\]"),
        "B untransposed": ({}, {**good, "blk.0.attn_v.weight.lora_b": np.zeros((2, 32))}, "lora_b has shape"),
        "wrong width": ({}, {**good, "blk.0.attn_v.weight.lora_a": np.zeros((2, 48))}, "has shape"),
        "NaN values": ({}, {**good, "blk.1.attn_v.weight.lora_a": np.full((2, 64), np.nan)}, "NaN or infinite"),
        "no tensors": ({}, {}, "no LoRA tensors"),
    }


@pytest.mark.parametrize("case", list(_hostile_cases(edgetrain.models.LlamaConfig(
    vocab_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2))))
def test_damaged_adapters_are_named_errors_and_the_model_is_untouched(llama_gguf, tmp_path, case):
    model = _with_adapter(llama_gguf, rank=2, alpha=8.0, targets=("v",))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options, tensors, message = _hostile_cases(model.config)[case]
    path = _write_raw(tmp_path / "bad.gguf", tensors, **options)
    with pytest.raises(AdapterError, match=message):
        load_adapter(model, path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_truncated_file_and_an_adapter_of_another_rank_are_refused(llama_gguf, tmp_path):
    model = _with_adapter(llama_gguf, rank=4, alpha=6.0)
    path = write_gguf_lora(model.lora_config, lora_state_dict(model), tmp_path / "a.gguf", model.config)
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:-100])
    with pytest.raises(AdapterError, match="cut.gguf"):
        load_adapter(edgetrain.load_model(llama_gguf), tmp_path / "cut.gguf")
    other = _with_adapter(llama_gguf, rank=2, alpha=6.0)
    before = lora_state_dict(other)
    before = {k: v.clone() for k, v in before.items()}
    with pytest.raises(AdapterError, match="rank 4 \\(the model's: 2\\)"):
        load_adapter(other, path)
    assert all(torch.equal(before[k], v) for k, v in lora_state_dict(other).items())
    with pytest.raises(AdapterError, match="the adapter's LoRA config differs"):
        read_adapter(path, AdapterBase(config=model.config)) and load_adapter(other, path)


def test_a_failed_write_keeps_the_old_file(llama_gguf, tmp_path):
    model = _with_adapter(llama_gguf)
    path = write_gguf_lora(model.lora_config, lora_state_dict(model), tmp_path / "a.gguf", model.config)
    old = path.read_bytes()
    bad = dict(lora_state_dict(model), **{"blocks.0.not_a_module.lora_A": torch.zeros(1)})
    with pytest.raises(AdapterError, match="not a decoder block's LoRA tensor"):
        write_gguf_lora(model.lora_config, bad, path, model.config)
    assert path.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["a.gguf"]


# ---------------------------------------------------------------------------------------------------
# Merged exports


def test_merged_gguf_loads_with_the_adapted_models_logits(llama_gguf, tmp_path):
    model = _with_adapter(llama_gguf)
    expected = _logits(model, _tokens())
    for dtype, tolerance in (("f32", 1e-5), ("f16", 1e-2)):
        path = save_merged_gguf(model, llama_gguf, tmp_path / f"merged-{dtype}.gguf", dtype)
        merged = edgetrain.load_model(path)
        assert _relative(_logits(merged, _tokens()), expected) < tolerance, dtype
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
        assert types["blk.0.attn_q.weight"] == dtype.upper() and types["blk.0.attn_norm.weight"] == "F32"
        assert model_tokenizer_ids(merged) == model_tokenizer_ids(model)
    with pytest.raises(MergeError, match="supported: f32, f16"):
        save_merged_gguf(model, llama_gguf, tmp_path / "q.gguf", "q4_0")
    with pytest.raises(MergeError, match="not loaded from this GGUF"):
        save_merged_gguf(_with_adapter("tiny"), llama_gguf, tmp_path / "x.gguf")


def model_tokenizer_ids(model):
    from edgetrain.data.tokenizer import model_tokenizer

    return model_tokenizer(model).encode("The lazy dog, naïve café 日本語")


def test_merged_hf_checkpoint_loads_in_transformers_and_edgetrain(llama_gguf, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _with_adapter(llama_gguf)
    adapter_state = {k: v.clone() for k, v in model.state_dict().items()}
    expected = _logits(model, _tokens())
    directory = save_merged_hf(model, tmp_path / "merged")
    assert all(torch.equal(adapter_state[k], v) for k, v in model.state_dict().items())  # the model is not merged
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        assert _relative(reference(_tokens()).logits.double(), expected) < 1e-5
    assert _relative(_logits(edgetrain.load_model(directory), _tokens()), expected) < 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    text = "The lazy dog, naïve café 日本語"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == model_tokenizer_ids(model)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["eos_token_id"] == VOCAB[0].index("<|im_end|>")
    assert tokenizer.chat_template == model.tokenizer.chat_template


def test_export_merge_cli(llama_gguf, tmp_path, capsys):
    model = _with_adapter(llama_gguf)
    saved = edgetrain.save_lora(model, tmp_path / "a.safetensors")
    expected = _logits(model, _tokens())
    assert main(["export", "--merge", "--model", str(llama_gguf), "--adapter", str(saved),
                 "--out", str(tmp_path / "m.gguf"), "--merge-dtype", "f32", "--quiet"]) == 0
    assert main(["export", "--merge", "--model", str(llama_gguf), "--adapter", str(saved),
                 "--out", str(tmp_path / "m-hf"), "--quiet"]) == 0
    for path in (tmp_path / "m.gguf", tmp_path / "m-hf"):
        assert _relative(_logits(edgetrain.load_model(path), _tokens()), expected) < 1e-5
    capsys.readouterr()
    assert main(["export", "--merge", "--model", str(llama_gguf), "--out", str(tmp_path / "n.gguf"), "--quiet"]) != 0
    assert "--merge needs --adapter" in capsys.readouterr().err
    assert main(["export", "--merge", "--model", "tiny", "--adapter", str(saved), "--out", str(tmp_path / "n.gguf"),
                 "--quiet"]) != 0
    assert "--model tiny is not a GGUF model" in capsys.readouterr().err
    assert not (tmp_path / "n.gguf").exists()


def test_mlx_loads_a_gguf_adapter_with_torchs_logits(llama_gguf, tmp_path):
    mx = pytest.importorskip("mlx.core")
    model = _with_adapter(llama_gguf)
    path = write_gguf_lora(model.lora_config, lora_state_dict(model), tmp_path / "a.gguf", model.config)
    ours = edgetrain.load_model(llama_gguf, backend="mlx", adapter=path)
    got = torch.from_numpy(np.array(ours(mx.array(_tokens().numpy())))).double()
    assert _relative(got, _logits(model, _tokens())) < 1e-5
