"""mesp's reused step buffers (edgetrain/methods/mesp/step_buffers.py): the same numbers bit for bit, buffers
handed out again only when nothing reads them, a peak near the plain step's, and each path forceable."""
from __future__ import annotations

import pytest
import torch

import edgetrain
from edgetrain.methods import METHODS
from edgetrain.methods.mesp import step_buffers
from edgetrain.methods.mesp.block import BlockWeights, block_forward, rope_tables
from edgetrain.probes import TensorAccountant
from tests.methods.test_mesp_parity import RAGGED, random_batch, random_decoder, with_lora


@pytest.fixture
def every_temporary_pooled(monkeypatch):
    """The test models' temporaries are a few KiB, below the size a step pools: pool them all, so that
    every reuse (and every wrongful one) happens here."""
    monkeypatch.setattr(step_buffers, "MIN_POOLED_BYTES", 0)


def _gradients(model, batch, **options):
    loss, grads = METHODS.get("mesp")(model, **options).gradients(batch)
    return loss, grads


def _assert_bit_equal(model, batch, **options):
    plain_loss, plain = _gradients(model, batch, reuse_buffers=False, **options)
    pooled_loss, pooled = _gradients(model, batch, **options)
    assert torch.equal(plain_loss, pooled_loss)
    assert plain.keys() == pooled.keys()
    different = [name for name in plain if not torch.equal(plain[name], pooled[name])]
    assert not different, different
    assert all(g.abs().max() > 0 for g in plain.values())


@pytest.mark.parametrize("chunks", [{}, RAGGED], ids=["default chunks", "ragged chunks"])
def test_pooled_gradients_equal_the_plain_ones_bit_for_bit(every_temporary_pooled, chunks):
    # GQA, q/k/v biases, an MLP bias and every projection adapted: every pooled site runs.
    model = with_lora(random_decoder(3, attention_bias=True, mlp_bias=True, num_hidden_layers=3),
                      targets=("q", "k", "v", "o", "gate", "up", "down"))
    _assert_bit_equal(model, random_batch(97, batch=3, seq_len=23), **chunks)


def test_pooled_gradients_equal_the_plain_ones_on_a_packed_base(every_temporary_pooled, tiny_lora, text_batches):
    model = tiny_lora(quantize_bits=4)
    _assert_bit_equal(model, text_batches(1, seq_len=48, batch_size=2)[0], mlp_chunk=40, attention_chunk=16)


def test_pooled_training_steps_follow_the_plain_ones(tiny_lora, text_batches, every_temporary_pooled):
    batches = text_batches(3, seq_len=32, batch_size=2)
    weights = []
    for reuse in (False, True):
        learner = edgetrain.Learner(tiny_lora(seed=4), method="mesp", optimizer="adamw", lr=1e-2,
                                    method_options={"reuse_buffers": reuse, "fused_update": True}, probe=False)
        losses = [learner.step(batch).loss for batch in batches]
        weights.append((losses, {k: p.detach().clone() for k, p in learner.params.items()}))
    (plain_losses, plain), (pooled_losses, pooled) = weights
    assert plain_losses == pooled_losses
    assert all(torch.equal(plain[k], pooled[k]) for k in plain)


def test_a_buffer_is_handed_out_again_only_once_nothing_reads_it():
    buffers = step_buffers.StepBuffers(min_bytes=0)
    first = buffers.empty((4, 8), torch.float32, torch.device("cpu"))
    view = first[1:].t()  # a view keeps the memory taken after its base is gone
    del first
    second = buffers.empty((4, 8), torch.float32, torch.device("cpu"))
    assert buffers.allocated == 2 and buffers.reused == 0
    del view
    third = buffers.empty((32,), torch.float32, torch.device("cpu"))
    assert buffers.reused == 1 and buffers.allocated == 2
    smaller = buffers.empty((3, 5), torch.float32, torch.device("cpu"))  # the smallest free buffer that holds it
    assert smaller.shape == (3, 5) and smaller.is_contiguous() and buffers.allocated == 3
    del second, third, smaller
    assert buffers.empty((3, 5), torch.float32, torch.device("cpu")).shape == (3, 5) and buffers.allocated == 3
    # Another dtype never shares a buffer.
    buffers.empty((4, 8), torch.float64, torch.device("cpu"))
    assert buffers.allocated == 4


def test_small_requests_and_released_buffers_are_left_to_the_allocator():
    buffers = step_buffers.StepBuffers(min_bytes=1024)
    buffers.empty((8,), torch.float32, torch.device("cpu"))
    assert buffers.allocated == 0 and buffers.held_bytes() == 0
    kept = buffers.empty((512,), torch.float32, torch.device("cpu"))
    buffers.empty((512,), torch.float32, torch.device("cpu"))
    assert buffers.held_bytes() == 2 * 2048
    buffers.release_free()
    assert buffers.held_bytes() == 2048 and kept.numel() == 512


def test_free_buffers_are_kept_only_as_far_as_the_room_the_step_made():
    """release_free(within_room=True) keeps the largest free buffers whose bytes fit in the room made so far
    (make_room: the stored block inputs the backward let go of); a plain release_free keeps none."""
    cpu = torch.device("cpu")
    buffers = step_buffers.StepBuffers(min_bytes=0)
    held = [buffers.empty((numel,), torch.float32, cpu) for numel in (256, 512, 1024)]
    taken = buffers.empty((2048,), torch.float32, cpu)
    del held  # free now
    buffers.release_free(within_room=True)
    assert buffers.held_bytes() == 2048 * 4  # no room yet: only the taken one stays
    held = [buffers.empty((numel,), torch.float32, cpu) for numel in (256, 512, 1024)]
    del held
    buffers.make_room(1024 * 4 + 256 * 4 + 100)
    buffers.release_free(within_room=True)
    # Largest first: 1024 fits, 512 no longer does, 256 does.
    assert sorted(size for held in buffers._buffers.values() for size, _, _ in held) == [256, 1024, 2048]
    buffers.release_free()
    assert buffers.held_bytes() == 2048 * 4 and taken.numel() == 2048


def test_the_freed_block_inputs_let_the_next_blocks_reuse_the_mlp_buffers(monkeypatch):
    """Within the room the freed block inputs made, the MLP's free buffers are kept for the next block: fewer
    fresh buffers (each a fresh mapping, its pages faulted in) and the same gradients; the peak is bounded by
    test_the_pooled_step_peak_stays_near_the_plain_one."""
    import edgetrain.methods.mesp.block as block

    model = with_lora(random_decoder(7, num_hidden_layers=8, hidden_size=192, intermediate_size=512,
                                     vocab_size=3000, num_attention_heads=6, num_key_value_heads=2, head_dim=32))
    batch = random_batch(3000, batch=2, seq_len=96)
    pools = []
    made = step_buffers.StepBuffers.__init__
    monkeypatch.setattr(step_buffers.StepBuffers, "__init__",
                        lambda self, *a, **k: made(self, *a, **k) or pools.append(self))
    kept_loss, kept = _gradients(model, batch)
    with_room = pools[-1].allocated
    monkeypatch.setattr(block, "release_free", lambda within_room=False: step_buffers.release_free(False))
    released_loss, released = _gradients(model, batch)
    assert with_room < pools[-1].allocated, (with_room, pools[-1].allocated)
    assert torch.equal(kept_loss, released_loss) and all(torch.equal(kept[k], released[k]) for k in kept)


def test_pooled_like_a_tensor_keeps_its_memory_order(every_temporary_pooled):
    sequence_major = torch.empty(2, 5, 3, 4).transpose(1, 2)  # [B, H, T, hd] laid out as [B, T, H, hd]
    with step_buffers.step_buffers():
        like = step_buffers.empty_like(sequence_major)
        assert like.shape == sequence_major.shape and like.stride() == sequence_major.stride()
        assert step_buffers.empty_like(torch.empty(3, 4)).is_contiguous()
    assert step_buffers.empty_like(sequence_major) is None and step_buffers.empty((3,), torch.float32, "cpu") is None


def test_outside_a_step_and_off_the_cpu_the_plain_allocator_runs(monkeypatch, tiny_lora, text_batches):
    assert step_buffers.active() is None
    assert step_buffers.available(torch.device("cpu"))
    assert not step_buffers.available(torch.device("cuda"))
    monkeypatch.setattr(step_buffers, "_storage_use_count", None)  # a torch without the use count
    assert not step_buffers.available(torch.device("cpu"))
    with step_buffers.step_buffers() as buffers:
        assert buffers is None and step_buffers.active() is None


@pytest.mark.parametrize("reuse", [True, False])
def test_the_option_forces_each_path(monkeypatch, tiny_lora, text_batches, reuse):
    seen = []
    real = step_buffers.step_buffers

    def spy(enabled=True):
        seen.append(enabled)
        return real(enabled)

    monkeypatch.setattr(step_buffers, "step_buffers", spy)
    METHODS.get("mesp")(tiny_lora(), reuse_buffers=reuse).gradients(text_batches(1, seq_len=16, batch_size=2)[0])
    assert seen == [reuse]


def test_a_stored_block_output_is_not_a_step_buffer(every_temporary_pooled):
    model = with_lora(random_decoder(5))
    weights = BlockWeights.from_block(model.blocks[0])
    x = torch.randn(2, 7, 48)
    rope = rope_tables(model.config, 7, x.device, x.dtype)
    with step_buffers.step_buffers() as buffers:
        output = block_forward(weights, x, rope, attention_chunk=4, mlp_chunk=5)
        held = {entry[1].data_ptr() for entries in buffers._buffers.values() for entry in entries}
        assert buffers.reused > 0
    assert output.data_ptr() not in held


@pytest.mark.parametrize("shape", [dict(head_dim=32), dict(head_dim=64, qk_norm=True)],
                         ids=["llama", "qwen3 (queries twice the hidden size, head norms)"])
def test_the_pooled_step_peak_stays_near_the_plain_one(monkeypatch, shape):
    """Tensor accounting counts the pool's buffers, free ones included. A step's phases (forward, loss,
    backward) each start with no free buffers, so what one phase left free does not sit through the next
    one's peak (here the loss: a vocabulary of 3,000 makes its tile the largest tensor); within a block's
    backward the MLP's buffers go before the attention's backward, and a miss drops the free buffers too
    small for it. Qwen3's shapes (queries wider than the hidden size) held 1.26x the plain peak before."""
    model = with_lora(random_decoder(7, num_hidden_layers=8, hidden_size=192, intermediate_size=512,
                                     vocab_size=3000, num_attention_heads=6, num_key_value_heads=2, **shape))
    batch = random_batch(3000, batch=2, seq_len=96)
    pools = []
    made = step_buffers.StepBuffers.__init__

    def record(self, *args, **kwargs):
        made(self, *args, **kwargs)
        pools.append(self)

    monkeypatch.setattr(step_buffers.StepBuffers, "__init__", record)
    peaks = {}
    for reuse in (False, True):
        method = METHODS.get("mesp")(model, reuse_buffers=reuse)
        method.gradients(batch)
        with TensorAccountant(model) as accountant:
            accountant.reset_peak()
            method.gradients(batch)
            peaks[reuse] = accountant.report().peak_above_baseline_bytes
    assert pools[-1].reused > 2 * pools[-1].allocated > 0  # the default pooling threshold pooled this model
    assert peaks[True] <= 1.06 * peaks[False], peaks
