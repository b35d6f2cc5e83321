"""edgetrain.profiler.step_breakdown: one step with every operator and tile timed, split into the products as
they ran in the step, the other operators, the packed base's tiles and the rest; each part against the floor."""
from __future__ import annotations

import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.models import quantized, tile_kernel
from edgetrain.profiler.compute_floor import measure_compute_floor
from edgetrain.profiler.step_breakdown import (breakdown_line, dispatch_seconds_per_call, measure_step_breakdown,
                                               times_operators_on)


def test_products_and_other_operators_are_told_apart_and_the_rest_is_what_the_step_took_beyond_them():
    weight, x = torch.randn(256, 256), torch.randn(64, 256)

    def step():
        y = x @ weight
        for _ in range(20):
            y = torch.tanh(y)
        return torch.mm(y, weight)

    record = measure_step_breakdown(step, step_seconds=10.0, floor_seconds=0.5)
    assert record["operator_calls"] == 22 and record["tile_calls"] == 0
    assert record["products_in_step_seconds"] > 0 and record["other_operators_seconds"] > 0
    assert record["tile_dequantising_seconds"] == 0
    parts = record["products_in_step_seconds"] + record["other_operators_seconds"]
    assert abs(record["between_operators_seconds"] - (10.0 - parts)) < 1e-9
    assert record["products_in_step_floor_ratio"] == record["products_in_step_seconds"] / 0.5
    assert 0 < record["dispatch_seconds_per_call"] < 1e-3


def _packed_learner(tmp_path, dequantize: bool):
    from gguf_testkit import Q, hf_model, write_gguf

    path = tmp_path / "m.gguf"
    if not path.exists():
        write_gguf(path, hf_model("qwen2"), Q.Q4_1)
    model = edgetrain.load_model(path, quantized=not dequantize)
    edgetrain.add_lora(model, rank=2)
    learner = edgetrain.Learner(model, method="mesp", probe=False)
    tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    return lambda: learner.step(Batch(tokens, tokens, 0))


def test_a_packed_base_s_tiles_are_their_own_part_and_a_dense_base_has_none(tmp_path):
    fills = tile_kernel.KernelRows.fill, quantized.PackedMatrix._dequantize_packed
    packed_step, dense_step = _packed_learner(tmp_path, False), _packed_learner(tmp_path, True)
    packed_step()
    floor = measure_compute_floor(packed_step, 1.0, repeats=1)
    packed = measure_step_breakdown(packed_step, 1.0, floor["floor_seconds"])
    dense = measure_step_breakdown(dense_step, 1.0, floor["floor_seconds"])
    assert packed["tile_calls"] > 0 and packed["tile_dequantising_seconds"] > 0
    assert dense["tile_calls"] == 0 and dense["tile_dequantising_seconds"] == 0
    # Every product of the step is timed (the same calls the floor counted).
    assert packed["operator_calls"] > floor["matmul_calls"] > 0
    # The timers are taken off again.
    assert (tile_kernel.KernelRows.fill, quantized.PackedMatrix._dequantize_packed) == fills


def test_the_report_line_adds_the_parts_up_to_s_floor():
    record = {"method": "mesp", "floor_ratio": 2.1, "products_in_step_floor_ratio": 1.24,
              "other_operators_floor_ratio": 0.5, "tile_dequantising_floor_ratio": 0.16,
              "between_operators_floor_ratio": 0.2}
    line = breakdown_line(record)
    assert line.startswith("mesp: s/floor 2.10 = products in the step 1.24 + other torch operators 0.50 + "
                           "dequantising tiles 0.16 + Python and dispatch 0.20")
    assert breakdown_line({"method": "bp", "floor_ratio": None}) is None


def test_the_dispatch_share_is_what_an_operator_that_does_nothing_costs():
    assert 0 < dispatch_seconds_per_call(repeats=51) < 1e-3


def test_the_breakdown_is_taken_where_a_call_times_its_work():
    """A GPU call returns once its kernel is queued: no breakdown there (a CPU one is)."""
    assert times_operators_on(torch.device("cpu")) and times_operators_on("cpu")
    assert not times_operators_on(torch.device("cuda", 0)) and not times_operators_on("mps")
