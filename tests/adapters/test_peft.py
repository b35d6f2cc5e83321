"""PEFT adapters: one edgetrain writes loads in PEFT onto the transformers model with the same logits; one
PEFT trained imports into edgetrain with the same logits; round trips are exact; anything that is not
plain LoRA on decoder projections, or that does not fit the model, is refused by name with the model
left as it was."""
from __future__ import annotations

import json

import pytest
import torch

import edgetrain
from edgetrain.adapters.peft import load_peft_adapter, save_peft_adapter
from edgetrain.models.lora import AdapterError, lora_layers, lora_state_dict
from testkit import random_lora_b

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A small llama in the Hugging Face layout (transformers wrote it)."""
    directory = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def _hf(base_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def test_an_edgetrain_adapter_loads_in_peft_with_the_same_logits(base_dir, tmp_path):
    model = edgetrain.load_model(base_dir)
    edgetrain.add_lora(model, rank=4, alpha=12.0, targets=("q", "v", "down"))
    random_lora_b(model, 1, 0.2)
    out = save_peft_adapter(model, tmp_path / "adapter", base_model=str(base_dir))
    written = json.loads((out / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["target_modules"]) == (4, 12.0, ["down_proj", "q_proj",
                                                                                         "v_proj"])
    with torch.no_grad():
        ours = model.eval()(TOKENS)
        theirs = peft.PeftModel.from_pretrained(_hf(base_dir), str(out)).eval()(TOKENS).logits
        base = _hf(base_dir)(TOKENS).logits
    assert _relative(ours, theirs) <= 1e-4 and _relative(base, theirs) > 1e-3  # the adapter matters


def test_a_peft_adapter_imports_with_the_same_logits_and_round_trips_exactly(base_dir, tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "gate_proj"],
                             task_type="CAUSAL_LM")
    trained = peft.get_peft_model(_hf(base_dir), config)
    with torch.no_grad():  # as if trained: PEFT starts every B at zero
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    trained.save_pretrained(tmp_path / "from-peft")
    model = load_peft_adapter(edgetrain.load_model(base_dir), tmp_path / "from-peft")
    assert model.lora_config.targets == ("q", "k", "gate") and model.lora_config.scale == 2.0
    with torch.no_grad():
        assert _relative(model.eval()(TOKENS), trained.eval()(TOKENS).logits) <= 1e-4
    again = load_peft_adapter(edgetrain.load_model(base_dir), save_peft_adapter(model, tmp_path / "again"))
    assert all(torch.equal(a, b) for a, b in zip(lora_state_dict(model).values(), lora_state_dict(again).values()))


def _adapter(base_dir, tmp_path, name="adapter", **lora):
    model = edgetrain.load_model(base_dir)
    edgetrain.add_lora(model, **{"rank": 4, "targets": ("q", "v"), **lora})
    random_lora_b(model, 1, 0.2)
    return save_peft_adapter(model, tmp_path / name)


def _edit_config(directory, **changes):
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_tensors(directory, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "adapter_model.safetensors"))


HOSTILE = {
    "rslora": (lambda d: _edit_config(d, use_rslora=True), "use_rslora = True is not supported"),
    "dora": (lambda d: _edit_config(d, use_dora=True), "use_dora = True is not supported"),
    "bias": (lambda d: _edit_config(d, bias="all"), "bias = 'all' is not supported"),
    "modules-to-save": (lambda d: _edit_config(d, modules_to_save=["lm_head"]), "modules_to_save"),
    "rank-pattern": (lambda d: _edit_config(d, rank_pattern={"q_proj": 8}), "rank_pattern"),
    "lm-head-target": (lambda d: _edit_config(d, target_modules=["q_proj", "lm_head"]), "lm_head"),
    "targets-as-string": (lambda d: _edit_config(d, target_modules="q_proj"), "target_modules must be a list"),
    "not-lora": (lambda d: _edit_config(d, peft_type="IA3"), "only LORA adapters load"),
    "nan-alpha": (lambda d: _edit_config(d, lora_alpha=float("nan")), "JSON has no NaN"),
    "negative-alpha": (lambda d: _edit_config(d, lora_alpha=-2), "alpha must be a finite number > 0"),
    "zero-rank": (lambda d: _edit_config(d, r=0), "rank must be an integer"),
    "rank-mismatch": (lambda d: _edit_config(d, r=8), "has shape"),
    "missing-tensor": (lambda d: _edit_tensors(d, lambda t: t.pop(next(iter(sorted(t))))), "missing adapter tensor"),
    "extra-tensor": (lambda d: _edit_tensors(d, lambda t: t.update(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)})), "not a LoRA weight of a decoder layer"),
    "base-weight": (lambda d: _edit_tensors(d, lambda t: t.update(
        {"base_model.model.model.layers.0.self_attn.q_proj.base.weight": torch.zeros(32, 32)})), "lora_A/B"),
    "nan-weight": (lambda d: _edit_tensors(d, lambda t: next(iter(t.values())).fill_(float("nan"))), "NaN"),
    "damaged-json": (lambda d: (d / "adapter_config.json").write_text('{"r": '), "adapter_config.json"),
    "damaged-weights": (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x00" * 10), "cannot read"),
    "no-weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_adapter_is_refused_and_the_model_is_untouched(base_dir, tmp_path, case):
    damage, message = HOSTILE[case]
    directory = _adapter(base_dir, tmp_path)
    damage(directory)
    model = edgetrain.load_model(base_dir)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(AdapterError, match=message):
        load_peft_adapter(model, directory)
    assert not lora_layers(model) and model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())


def test_a_model_with_other_adapters_refuses_a_different_config(base_dir, tmp_path):
    directory = _adapter(base_dir, tmp_path, alpha=8.0)
    model = edgetrain.load_model(base_dir)
    edgetrain.add_lora(model, rank=4, alpha=16.0, targets=("q", "v"))
    kept = {name: t.clone() for name, t in lora_state_dict(model).items()}
    with pytest.raises(AdapterError, match="alpha 8.0 .the model's: 16.0"):
        load_peft_adapter(model, directory)
    assert all(torch.equal(lora_state_dict(model)[name], t) for name, t in kept.items())


def test_save_refuses_a_model_without_an_adapter(base_dir, tmp_path):
    with pytest.raises(AdapterError, match="no LoRA adapter"):
        save_peft_adapter(edgetrain.load_model(base_dir), tmp_path / "x")


def test_generate_and_eval_take_a_peft_adapter_directory(base_dir, tmp_path, capsys):
    from edgetrain.cli import main

    directory = _adapter(base_dir, tmp_path)
    text = tmp_path / "held_out.txt"
    text.write_text("".join(chr(32 + i % 60) for i in range(2000)))
    flags = ["--model", str(base_dir), "--quiet"]
    assert main(["eval", *flags, "--data", str(text), "--seq", "16", "--batch", "2", "--max-batches", "2"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(["eval", *flags, "--adapter", str(directory), "--data", str(text), "--seq", "16", "--batch", "2",
                 "--max-batches", "2"]) == 0
    tuned = json.loads(capsys.readouterr().out)
    assert tuned["loss"] != base["loss"] and tuned["tokens"] == base["tokens"]


def test_an_adapter_trained_on_mlx_loads_in_peft_with_mlxs_logits(base_dir, tmp_path):
    """MLX -> PEFT: an adapter the MLX backend trained (mlx-lm layout, transposed) converts to a PEFT
    directory that transformers + PEFT runs with the MLX model's logits."""
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    from edgetrain.adapters.convert import convert_adapter
    from edgetrain.backends.mlx.adapters import save_mlx_lm_adapters
    from edgetrain.backends.mlx.lora import add_lora, set_parameters, trainable_parameters

    model = add_lora(edgetrain.load_model(base_dir, backend="mlx"), rank=4, alpha=8.0)
    set_parameters(model, {name: mx.random.normal(p.shape, key=mx.random.key(i)) * 0.1
                           for i, (name, p) in enumerate(trainable_parameters(model).items())})
    save_mlx_lm_adapters(model, tmp_path / "mlx")
    out = convert_adapter(tmp_path / "mlx", tmp_path / "peft", "peft")
    ours = torch.from_numpy(np.array(model(mx.array(TOKENS.numpy()))))
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(_hf(base_dir), str(out)).eval()(TOKENS).logits
        base = _hf(base_dir)(TOKENS).logits
    assert _relative(ours, theirs) <= 1e-4 and _relative(base, theirs) > 1e-3
