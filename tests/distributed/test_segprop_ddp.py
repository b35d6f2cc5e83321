"""SegProp / layer-wise under torchrun: two gloo processes on localhost, each on half of every global
batch, end with the weights of one process trained on the whole batches.

SGD, because it is linear in the gradient: the two runs differ only in float summation order (~1e-7),
whereas Adam divides by the root of the second moment and turns rounding noise in coordinates whose
gradient is ~0 (directions GroupNorm cancels) into steps of size lr.
"""
from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed as dist

from edgetrain.data import make_stream
from edgetrain.distributed.launch import run_torchrun
from edgetrain.recipes import run_schedule
from edgetrain.models.resnet import ResNetConfig, build_resnet
from edgetrain.registry import EdgetrainError

RESNET = {"in_channels": 1, "width": 8, "norm": "group", "blocks_per_stage": [1, 1, 1], "num_classes": 10}
DATA = {"image": True, "shuffle": False}
GLOBAL_BATCH, STEPS, LR = 16, 4, 0.2
OPTIONS = {"segments": 2, "head_blocks": 1, "snapcheck": True}


def localhost_unavailable() -> str | None:
    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available in this torch build"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
    except OSError as exc:
        return f"cannot bind a TCP port on localhost for the gloo rendezvous ({exc})"
    return None


def single_process(method: str) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    model = build_resnet(ResNetConfig(**RESNET))
    run_schedule(model, make_stream("digits", batch_size=GLOBAL_BATCH, **DATA), method, steps_per_stage=STEPS,
                 optimizer="sgd", lr=LR, **OPTIONS)
    return model.state_dict()


@pytest.mark.parametrize("method", ["segprop", pytest.param("lw", marks=pytest.mark.slow)])
def test_two_gloo_ranks_match_one_process_on_the_global_batch(tmp_path, method):
    reason = localhost_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "ddp.safetensors"
    argv = ["--method", method, "--resnet", json.dumps(RESNET), "--data", "digits", "--data-options", json.dumps(DATA),
            "--batch-size", str(GLOBAL_BATCH), "--steps-per-stage", str(STEPS), "--optimizer", "sgd", "--lr", str(LR),
            "--method-options", json.dumps(OPTIONS), "--backend", "gloo", "--out", str(out)]
    try:
        run = run_torchrun(2, "edgetrain.recipes.ddp_segprop", argv, timeout=400, cwd=tmp_path)
    except EdgetrainError as exc:
        pytest.fail(str(exc))
    if run.returncode != 0:
        text = run.stdout + run.stderr
        if any(s in text for s in ("Address already in use", "Connection refused", "Cannot assign requested address")) \
                and not out.exists():
            pytest.skip(f"gloo could not connect two processes on localhost:\n{text[-1500:]}")
        pytest.fail(f"torchrun failed ({run.returncode}):\n{text[-4000:]}")
    from safetensors.torch import load_file

    distributed = load_file(out)
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["world_size"] == 2 and report["steps"] == STEPS * (2 if method == "segprop" else 3)
    single = single_process(method)
    assert set(distributed) == set(single)   # no adapter left in either
    worst = max(float((distributed[k].float() - single[k].float()).abs().max()) for k in single)
    assert worst < 1e-5, f"largest weight difference {worst}"
    moved = max(float((single[k].float() - build_resnet(ResNetConfig(**RESNET)).state_dict()[k].float()).abs().max())
                for k in single if single[k].is_floating_point())
    assert moved > 1e-2   # the runs really trained
