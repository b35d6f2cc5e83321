"""`mesp` against autograd (`bp`): same loss, same LoRA gradients, same training trajectory."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods import METHODS
from edgetrain.methods.mesp.block import BlockWeights, block_backward, block_forward, rope_tables
from edgetrain.models.llama import LlamaConfig, LlamaModel
from testkit import move_norms_off_one

# Chunk sizes that divide nothing in these tests, so every ragged last chunk is exercised.
RAGGED = dict(attention_chunk=5, mlp_chunk=13, loss_chunk=7)


def randomise_lora_b(model: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """A fresh LoRA B is zero, which makes every A gradient zero: useless for parity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


def random_decoder(seed: int, **overrides) -> LlamaModel:
    torch.manual_seed(seed)
    config = LlamaConfig(**{**dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, head_dim=8), **overrides})
    model = LlamaModel(config)
    model.init_weights(std=0.1, seed=seed)
    with torch.no_grad():  # non-zero biases and norm weights, so their paths are really tested
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn(param.shape) * 0.1)
    return model


def with_lora(model: nn.Module, seed: int = 1, **lora) -> nn.Module:
    torch.manual_seed(seed)
    edgetrain.add_lora(model, **{"rank": 4, **lora})
    return randomise_lora_b(model, seed + 1)


def random_batch(vocab: int, batch: int = 2, seq_len: int = 11, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    targets = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    targets[0, :3] = -100  # a masked prompt
    targets[-1, -1] = -100
    return Batch(inputs, targets)


def max_relative_errors(reference: dict[str, torch.Tensor], estimate: dict[str, torch.Tensor]) -> dict[str, float]:
    assert estimate.keys() == reference.keys()
    return {name: float((estimate[name].double() - ref.double()).abs().max() / ref.double().abs().max())
            for name, ref in reference.items()}


def assert_matches_bp(model: nn.Module, batch: Batch, grad_tol: float = 1e-5, **options) -> None:
    ref_loss, ref_grads = METHODS.get("bp")(model).gradients(batch)
    loss, grads = METHODS.get("mesp")(model, **options).gradients(batch)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert all(g.abs().max() > 0 for g in ref_grads.values())  # every gradient is non-trivial
    errors = max_relative_errors(ref_grads, grads)
    assert max(errors.values()) <= grad_tol, {k: v for k, v in errors.items() if v > grad_tol}


# -- one block, float64 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qk-norm"])
@pytest.mark.parametrize("store", [False, True])
def test_block_forward_and_backward_match_autograd_on_the_module_in_float64(store, qk_norm):
    model = with_lora(random_decoder(2, attention_bias=True, mlp_bias=True, qk_norm=qk_norm),
                      targets=("q", "k", "o", "up", "down"))
    model.double()
    block = model.blocks[1]
    torch.manual_seed(0)
    x = torch.randn(2, 11, 48, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 11, 48, dtype=torch.float64)
    reference = block(x)
    reference.backward(grad_out)
    weights = BlockWeights.from_block(block)
    rope = rope_tables(model.config, 11, x.device, x.dtype)
    with torch.no_grad():
        out = block_forward(weights, x.detach(), rope, attention_chunk=4, mlp_chunk=6)
        grad_x, grads = block_backward(weights, x.detach(), grad_out, rope, attention_chunk=4, mlp_chunk=6,
                                       store_lora_projection=store)
    # The model's RMSNorm and mesp's both normalise in float64 for a float64 model (edgetrain.training.precision).
    expected = {"output": reference.detach(), "input grad": x.grad}
    expected.update({name: p.grad for name, p in block.named_parameters() if p.requires_grad})
    assert set(grads) == set(expected) - {"output", "input grad"} == set(weights.lora_parameter_names())
    errors = max_relative_errors(expected, {"output": out, "input grad": grad_x, **grads})
    assert max(errors.values()) <= 1e-12, errors


def test_float64_gradients_equal_float64_autograd():
    """A float64 model is a float64 computation in both: norms, softmax and loss included (they used to
    run in fp32 in the model, so that mesp in fp64 and autograd in "fp64" differed by fp32 rounding)."""
    model = with_lora(random_decoder(3, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)).double()
    batch = random_batch(97)
    ref_loss, ref_grads = METHODS.get("bp")(model).gradients(batch)
    loss, grads = METHODS.get("mesp")(model, **RAGGED).gradients(batch)
    assert loss.dtype == ref_loss.dtype == torch.float64
    assert abs(float(loss - ref_loss)) <= 1e-12 * abs(float(ref_loss))
    assert all(g.dtype == torch.float64 for g in grads.values())
    errors = max_relative_errors(ref_grads, grads)
    assert max(errors.values()) <= 1e-10, errors


# -- gradient parity ------------------------------------------------------------------------------------

def test_tiny_preset_gradients_match_bp_with_default_and_ragged_chunks(tiny_lora, text_batches):
    model = tiny_lora(rank=4)
    batch = text_batches(1, seq_len=32, batch_size=2)[0]
    assert_matches_bp(model, batch)
    assert_matches_bp(model, batch, **RAGGED)


def test_gqa_bias_tied_decoder_matches_bp():
    model = with_lora(random_decoder(3, attention_bias=True, tie_word_embeddings=True))
    assert model.head.lm_head.weight is model.embed.embed_tokens.weight
    assert_matches_bp(model, random_batch(97), **RAGGED)


def test_untied_decoder_without_attention_bias_but_with_mlp_bias_matches_bp():
    model = with_lora(random_decoder(4, attention_bias=False, tie_word_embeddings=False, mlp_bias=True,
                                     num_attention_heads=4, num_key_value_heads=4, head_dim=12))
    assert_matches_bp(model, random_batch(97, seq_len=9), **RAGGED)


def qwen3_decoder(seed: int, std: float = 0.2) -> LlamaModel:
    """Qwen3's RMSNorm over each head's q and k (before RoPE), with its own head size, no bias, untied."""
    from edgetrain.models.qwen3 import Qwen3Config

    torch.manual_seed(seed)
    model = LlamaModel(Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    model.init_weights(std=std, seed=seed)
    move_norms_off_one(model)
    return model


def test_qwen3_head_norms_match_bp():
    model = qwen3_decoder(8, std=0.1)
    assert model.blocks[0].self_attn.q_norm.weight.shape == (16,)
    assert_matches_bp(with_lora(model), random_batch(97), **RAGGED)
    assert_matches_bp(model, random_batch(97, seed=1))


def gemma3_decoder(seed: int, soft_cap: float | None = 3.0) -> LlamaModel:
    """Every Gemma 3 feature at once: sandwich norms, GeGLU, scaled embeddings, head norms, sliding layers with
    a window (4) shorter than the sequence and their own RoPE base, an attention scale of its own, a soft-cap."""
    from edgetrain.models.gemma3 import Gemma3Config

    torch.manual_seed(seed)
    config = Gemma3Config(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                          query_pre_attn_scalar=20, final_logit_softcapping=soft_cap,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = LlamaModel(config)
    model.init_weights(std=0.2, seed=seed)
    move_norms_off_one(model)
    return model


@pytest.mark.parametrize("soft_cap", [3.0, None])
def test_gemma3_features_match_bp(soft_cap):
    model = with_lora(gemma3_decoder(9, soft_cap))
    batch = random_batch(97, seq_len=11)
    assert_matches_bp(model, batch, **RAGGED)
    assert_matches_bp(model, batch)
    ref_loss, ref = METHODS.get("bp")(model.double()).gradients(batch)
    loss, grads = METHODS.get("mesp")(model, **RAGGED).gradients(batch)
    assert abs(float(loss - ref_loss)) <= 1e-12 * abs(float(ref_loss))
    assert max(max_relative_errors(ref, grads).values()) <= 1e-10


def test_gemma3_window_and_soft_cap_change_the_model():
    """The two features the fixtures cannot show (llama.cpp's Gemma 3 has no soft-cap; the fixture's window
    spans most of its sequence) change the logits: the parity above is not of two programs ignoring them."""
    import dataclasses

    model = gemma3_decoder(9)
    ids = random_batch(97, seq_len=11).inputs
    for change in (dict(final_logit_softcapping=None), dict(sliding_window=64)):
        other = LlamaModel(dataclasses.replace(model.config, **change))
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert float((other(ids) - model(ids)).abs().max()) > 1e-3, change


@pytest.mark.parametrize("targets", [("q", "v"), ("k", "o", "down"), ("gate",)])
def test_lora_target_subsets_match_bp(targets):
    model = with_lora(random_decoder(5, attention_bias=True), targets=targets)
    assert_matches_bp(model, random_batch(97), **RAGGED)


def test_storing_the_lora_projection_gives_the_same_gradients():
    model = with_lora(random_decoder(6, attention_bias=True))
    batch = random_batch(97)
    recomputed = METHODS.get("mesp")(model, **RAGGED).gradients(batch)[1]
    stored = METHODS.get("mesp")(model, store_lora_projection=True, **RAGGED).gradients(batch)[1]
    assert max(max_relative_errors(recomputed, stored).values()) <= 1e-6
    assert_matches_bp(model, batch, store_lora_projection=True)


def test_bf16_gradients_are_as_close_to_fp32_as_autograd_in_bf16():
    model = with_lora(random_decoder(7, attention_bias=True, num_hidden_layers=3))
    batch = random_batch(97, seq_len=16)
    _, exact = METHODS.get("bp")(model).gradients(batch)
    model.to(torch.bfloat16)
    bp_loss, bp_grads = METHODS.get("bp")(model).gradients(batch)
    loss, grads = METHODS.get("mesp")(model, **RAGGED).gradients(batch)
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    assert abs(loss.item() - bp_loss.item()) <= 1e-2 * abs(bp_loss.item())
    bp_error = max(max_relative_errors(exact, bp_grads).values())
    mesp_error = max(max_relative_errors(exact, grads).values())
    assert mesp_error <= max(2 * bp_error, 2e-2), (mesp_error, bp_error)


def test_gradients_leave_the_weights_and_grads_untouched(tiny_lora, text_batches):
    model = tiny_lora(rank=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    METHODS.get("mesp")(model).gradients(text_batches(1, seq_len=16)[0])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


# -- training trajectories (paper Fig. 2 / App. D) -----------------------------------------------------------

def sgd_losses(tiny_lora, text_batches, method: str, steps: int, **options) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = tiny_lora(rank=4, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1)
    trainer = METHODS.get(method)(model, **options)
    losses = [trainer.step(batch, optimizer).item() for batch in text_batches(steps, seq_len=32)]
    return losses, edgetrain.models.lora.lora_state_dict(model)


def test_sgd_loss_trajectory_matches_bp_step_for_step_fused_or_not(tiny_lora, text_batches):
    steps = 50
    bp_losses, bp_weights = sgd_losses(tiny_lora, text_batches, "bp", steps)
    mesp_losses, mesp_weights = sgd_losses(tiny_lora, text_batches, "mesp", steps)
    fused_losses, fused_weights = sgd_losses(tiny_lora, text_batches, "mesp", steps, fused_update=True)
    assert bp_losses[-1] < bp_losses[0] - 0.5  # it really trains
    # fp32 rounding differences (MeSP sums in another order) compound over 50 steps: 1.04e-6 relative at
    # step 37 on one x86 machine, 0 at step 0. 1e-5 is the per-step gradient bound used above; a wrong
    # gradient term moves the trajectory by orders of magnitude more.
    for step, (ref, mine) in enumerate(zip(bp_losses, mesp_losses)):
        assert abs(mine - ref) <= 1e-5 * abs(ref), (step, ref, mine)
    # Per-block SGD updates apply the very same arithmetic as one update of everything.
    assert fused_losses == mesp_losses
    assert all(torch.equal(fused_weights[k], mesp_weights[k]) for k in mesp_weights)
    assert max(max_relative_errors(bp_weights, mesp_weights).values()) <= 1e-4


def test_fused_adam_update_equals_the_unfused_one(tiny_lora, text_batches):
    results = []
    for fused in (False, True):
        model = tiny_lora(rank=2, seed=0)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        trainer = METHODS.get("mesp")(model, fused_update=fused)
        losses = [trainer.step(batch, optimizer).item() for batch in text_batches(4, seq_len=16)]
        steps = {int(state["step"]) for state in optimizer.state.values()}
        results.append((losses, edgetrain.models.lora.lora_state_dict(model), steps))
    (losses, weights, steps), (fused_losses, fused_weights, fused_steps) = results
    assert steps == fused_steps == {4}
    assert fused_losses == losses
    assert max(max_relative_errors(weights, fused_weights).values()) <= 1e-6


def test_learner_runs_mesp_with_options(tiny_lora, text_batches):
    model = tiny_lora(rank=2)
    learner = edgetrain.Learner(model, method="mesp", optimizer="adamw", lr=1e-3, probe=False,
                                method_options={"fused_update": True, "loss_chunk": 16})
    stats = learner.step(text_batches(1, seq_len=16)[0])
    assert stats.loss > 0


# -- refusals -------------------------------------------------------------------------------------------------

def test_refuses_models_that_are_not_llama_style_decoders():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(edgetrain.EdgetrainError, match="LlamaModel-style"):
        METHODS.get("mesp")(model)


def test_refuses_trainable_parameters_other_than_lora_and_suggests_mebp(tiny_lora):
    model = tiny_lora(rank=2)
    model.blocks[1].input_layernorm.weight.requires_grad_(True)
    with pytest.raises(edgetrain.EdgetrainError, match=r"LoRA fine-tuning.*blocks\.1\.input_layernorm.*'mebp'"):
        METHODS.get("mesp")(model)


@pytest.mark.parametrize("options,message", [
    ({"attention_chunk": 0}, "attention_chunk"), ({"loss_chunk": 2.5}, "loss_chunk"),
    ({"mlp_chunk": True}, "mlp_chunk"), ({"fused_update": "yes"}, "fused_update"),
    ({"store_lora_projection": 1}, "store_lora_projection")])
def test_validates_its_options(tiny_lora, options, message):
    with pytest.raises(edgetrain.EdgetrainError, match=message):
        METHODS.get("mesp")(tiny_lora(rank=2), **options)


def test_unknown_options_are_refused(tiny_lora):
    with pytest.raises(edgetrain.EdgetrainError, match="unknown option.*chunk"):
        METHODS.get("mesp")(tiny_lora(rank=2), chunk=3)


def test_refuses_merged_adapters_and_lora_dropout(tiny_lora, text_batches):
    batch = text_batches(1, seq_len=8)[0]
    model = tiny_lora(rank=2)
    edgetrain.merge_lora(model)
    with pytest.raises(edgetrain.EdgetrainError, match="unmerge"):
        METHODS.get("mesp")(model).gradients(batch)
    model = tiny_lora(rank=2, dropout=0.1)
    with pytest.raises(edgetrain.EdgetrainError, match="dropout"):
        METHODS.get("mesp")(model).gradients(batch)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_checkpoint_saved_by_transformers_matches_bp(tmp_path, model_type):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if model_type == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
    elif model_type == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = with_lora(edgetrain.load_model(tmp_path))
    assert_matches_bp(model, random_batch(97, batch=3, seq_len=13))


@pytest.mark.parametrize("rollback", [True, False])
def test_fused_step_with_a_late_non_finite_gradient(tiny_lora, text_batches, monkeypatch, rollback):
    """Block 0's gradients come last; when they are NaN the other blocks were already updated. With
    rollback (the default) the learner restores the last good step; without, the step still raises."""
    import edgetrain.methods.mesp.compiled as mesp_programs  # where a step takes its block programs from
    from edgetrain.methods.base import TrainingError

    model = tiny_lora()
    learner = edgetrain.Learner(model, method="mesp", optimizer="adamw", lr=1e-2, probe=False,
                                method_options={"fused_update": True, "rollback": rollback})
    batches = text_batches(2)
    learner.step(batches[0])
    good = {name: p.detach().clone() for name, p in learner.params.items()}
    real_backward, calls = mesp_programs.block_backward, []

    def poisoned(*args, **kwargs):
        grad, grads = real_backward(*args, **kwargs)
        calls.append(1)
        if len(calls) == len(model.blocks):
            grads = {name: g * float("nan") for name, g in grads.items()}
        return grad, grads

    monkeypatch.setattr(mesp_programs, "block_backward", poisoned)
    with pytest.raises(TrainingError, match="non-finite gradient"):
        learner.step(batches[1])
    changed = {name for name, p in learner.params.items() if not torch.equal(p, good[name])}
    if rollback:
        assert not changed
    else:
        assert changed and all(not name.startswith("blocks.0.") for name in changed)
