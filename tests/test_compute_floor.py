"""edgetrain.profiler.compute_floor: every matrix product of a step is recorded with its shape (autograd's,
hand-written backward's, a packed base's tiles alike), its FLOPs counted 2 x M x K x N, and the floor timed."""
from __future__ import annotations

import torch

from edgetrain.profiler.compute_floor import ProductRecorder, floor_seconds, measure_compute_floor, product_flops


def test_a_linear_layers_forward_and_backward_are_three_products():
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with ProductRecorder() as recorder:
        layer(x).sum().backward()
    # forward x W^T (addmm with the bias), backward grad W^T... : [4,8]x[8,16] and [8,4]x[4,16]
    assert sum(recorder.counts.values()) == 3
    assert product_flops(recorder.counts) == 3 * 2 * 4 * 16 * 8
    shapes = sorted((m, k, n) for (_, _, _, m, k, n) in recorder.counts)
    assert shapes == sorted([(4, 16, 8), (4, 8, 16), (8, 4, 16)])


def test_batched_products_count_their_batch():
    with ProductRecorder() as recorder:
        torch.bmm(torch.randn(3, 5, 7), torch.randn(3, 7, 2))
        torch.baddbmm(torch.zeros(3, 5, 2), torch.randn(3, 5, 7), torch.randn(3, 7, 2))
    assert product_flops(recorder.counts) == 2 * (2 * 3 * 5 * 7 * 2)


def test_the_floor_is_the_products_alone_and_the_ratio_is_against_it():
    weight = torch.randn(256, 256)
    calls = []

    def step():
        calls.append(1)
        return torch.randn(64, 256) @ weight

    record = measure_compute_floor(step, step_seconds=1.0, repeats=3)
    assert calls == [1] and record["matmul_calls"] == 1 and record["matmul_flops"] == 2 * 64 * 256 * 256
    assert 0 < record["floor_seconds"] < 1.0 and record["floor_ratio"] == 1.0 / record["floor_seconds"]
    assert floor_seconds(ProductRecorder().counts) == 0.0  # no products: no floor (and no ratio)
    assert measure_compute_floor(lambda: torch.ones(3).sum(), 1.0)["floor_ratio"] is None


def test_mesp_on_a_packed_base_counts_its_dequantised_tiles(tmp_path):
    import edgetrain
    from edgetrain.data.batch import Batch
    from gguf_testkit import Q, hf_model, write_gguf

    model = edgetrain.load_model(write_gguf(tmp_path / "m.gguf", hf_model("qwen2"), Q.Q4_1))
    edgetrain.add_lora(model, rank=2)
    learner = edgetrain.Learner(model, method="mesp", probe=False)
    tokens = torch.randint(0, model.config.vocab_size, (2, 8))
    record = measure_compute_floor(lambda: learner.step(Batch(tokens, tokens, 0)), 1.0, repeats=1)
    hidden = model.config.hidden_size
    # at least the forward's q projection of every block: 16 tokens x hidden x hidden
    assert record["matmul_flops"] >= len(model.blocks) * 2 * 16 * hidden * hidden


def test_products_written_into_buffers_count_too():
    a, b = torch.randn(4, 6), torch.randn(6, 3)
    out = torch.empty(4, 3)
    with ProductRecorder() as recorder:
        torch.mm(a, b, out=out)
        out.addmm_(a, b)
        torch.addmm(out, a, b, out=torch.empty(4, 3))
    assert sum(recorder.counts.values()) == 3 and product_flops(recorder.counts) == 3 * 2 * 4 * 6 * 3
