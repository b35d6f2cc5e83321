"""`segprop` and `lw`: plans and the paper's splits, which parameters train in each stage, frozen
BatchNorm statistics and eval() pins, the final model without adapters, SnapCheck against
recomputation (memory budget, spill to disk, invalidation), exact resume across a stage boundary,
LoRA/ViT/llama models, FLOPs accounting."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.data import digits_stream
from edgetrain.data.batch import Batch
from edgetrain.methods.segprop import (ConvAdapter, LinearAdapter, SnapCheck, even_split, is_pinned,
                                       make_adapter, plan_lw, plan_segprop, unit_view)
from edgetrain.methods.segprop.flops import schedule_flops
from edgetrain.methods.segprop.plan import balanced_split
from edgetrain.methods.segprop.schedule import cosine_multiplier
from edgetrain.models.resnet import ResNetConfig, build_resnet
from edgetrain.models.vit import ViTConfig, build_vit
from edgetrain.models.zoo import run_blocks
from edgetrain.recipes import run_schedule
from edgetrain.registry import EdgetrainError


# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")


def digits_resnet(norm: str = "batch", width: int = 8, blocks=(1, 1, 1), seed: int = 0) -> nn.Module:
    """A small ResNet for 1x8x8 digits: cifar stem, 8 -> 8 -> 4 -> 2 pixels."""
    return build_resnet(ResNetConfig(num_classes=10, in_channels=1, stem="cifar", norm=norm, width=width,
                                     blocks_per_stage=blocks, seed=seed))


def digits_batches(count: int, batch_size: int = 16) -> list[Batch]:
    stream = digits_stream("train", batch_size=batch_size, image=True, shuffle=False, epochs=None)
    return [stream.batch(i) for i in range(count)]


def names_of(model: nn.Module, modules: list[nn.Module]) -> set[str]:
    ids = {id(p) for m in modules for p in m.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in ids}


# -- plans ---------------------------------------------------------------------------------------------

def test_splits_follow_the_paper():
    assert even_split(76, 3) == [26, 25, 25]            # LLaMA-70B, appendix D.2
    vit = plan_segprop(12, head_blocks=3, segments=2)    # ViT-B/16, appendix F
    assert vit.split == (5, 4) and [(s.start, s.end) for s in vit.stages] == [(0, 5), (5, 9)]
    assert vit.stages[0].trains_embed and vit.stages[0].bridge and not vit.stages[1].bridge
    one_per_stage = plan_segprop(8, head_blocks=2, prefix=3)   # Algorithm 1: p, then one block per stage
    assert one_per_stage.split == (3, 1, 1, 1)
    assert plan_segprop(8, head_blocks=2, split=[0, 6]).stages[1].frozen_depth == 0   # embedding-only prefix
    lw = plan_lw(8, head_blocks=2, segments=2)
    assert lw.split == (3, 5) and lw.stages[-1].trains_head and lw.stages[-1].start == 8
    assert not any(s.trains_head for s in lw.stages[:-1])
    assert balanced_split([5, 1, 1, 1], 0, 2) == [1, 3] and balanced_split([1, 1, 1, 1], 0, 2) == [2, 2]
    assert balanced_split([4, 2, 1], 9, 2) == [0, 3]      # a heavy embedding trains alone
    assert balanced_split([3, 3, 1, 1], 0, 2) == [1, 3]
    assert balanced_split([3, 3, 1, 1], 0, 2, extras=[0, 0, 4, 0]) == [2, 2]   # a backward transient counts
    for bad in (dict(segments=7), dict(split=[2, 2]), dict(prefix=1, segments=2), dict(head_blocks=8)):
        with pytest.raises(EdgetrainError):
            plan_segprop(8, **{"head_blocks": 2, **bad})


def test_resnet18_paper_split_and_adapters():
    """Appendix B.2: stem + layer1 | layer2 | layer3 | layer4[0] + layer4[1].(conv1, bn1, ReLU); the global
    head owns layer4[1].conv2 + bn2 and the classifier; adapters are 1x1 convs of stride 8 / 4 / 2 to 7x7
    with 1024 channels split into (I, P)."""
    model = edgetrain.load_model("resnet18-imagenet")
    method = edgetrain.methods.METHODS.get("segprop")(model, view="resnet-paper", head_blocks=1, segments=4)
    view = method.view
    units = [[view.names[i] for i in range(s.start, s.end)] for s in method.stages]
    assert units == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"], ["blocks.4", "blocks.5"],
                     ["blocks.6", "blocks.7.front"]]
    assert view.names[method.plan.head_start:] == ["blocks.7.back"]
    assert names_of(model, [view.units[-1]]) == {"blocks.7.conv2.weight", "blocks.7.norm2.weight",
                                                 "blocks.7.norm2.bias"}
    strides = {}
    for key, adapter in method.adapters.items():
        assert isinstance(adapter, ConvAdapter) and adapter.out_channels == (512, 512)
        assert adapter.conv.kernel_size == (1, 1) and isinstance(adapter.pool, nn.Identity)
        strides[int(key)] = adapter.conv.stride[0]
    assert strides == {0: 8, 1: 4, 2: 2}       # 56 -> 7, 28 -> 7, 14 -> 7; stage 3 is the real seg4
    x = torch.rand(2, 3, 64, 64)
    model.eval()
    assert torch.equal(view.forward(x), model(x))
    method.finish()


def test_memory_balanced_segments_on_resnet18():
    """ResNet-18's stem and layer1 keep most activations: balance="memory" gives the stem a stage of
    its own instead of equal block counts (2/1/1/1)."""
    model = edgetrain.load_model("resnet18-imagenet")
    segprop = edgetrain.methods.METHODS.get("segprop")
    equal = segprop(model, head_blocks=3, segments=4)
    assert equal.plan.split == (2, 1, 1, 1)
    equal.finish()
    balanced = segprop(model, head_blocks=3, segments=4, balance="memory")
    costs = balanced.unit_costs
    saved = [c[0] for c in costs]
    assert saved[0] > saved[1] == saved[2] > saved[3] > saved[4] > saved[5]   # stem, layer1, layer2 ...
    assert balanced.plan.split == (0, 1, 1, 3)
    balanced.finish()


# -- which parameters train ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["segprop", "lw"])
def test_gradients_reach_exactly_the_active_segment_its_adapter_and_the_head(name):
    model = digits_resnet(blocks=(2, 1, 1))
    learner = edgetrain.Learner(model, method=name, optimizer="adamw", lr=1e-3, probe=False,
                                method_options={"head_blocks": 1, "segments": 3})
    method, view = learner.method, learner.method.view
    batch = digits_batches(1)[0]
    learner.step(batch)  # applies stage 0 and fills optimizer state
    for stage in method.stages:
        while method.stage_index < stage.index:
            method.advance_stage()
        loss = method.forward_loss(batch)
        loss.backward()
        expected = [*view.units[stage.start:stage.end], *view.units[stage.tail_start:]]
        expected += [view.embed] if stage.trains_embed else []
        expected += [view.head] if stage.trains_head else []
        expected += [method.bridge(stage)] if method.bridge(stage) is not None else []
        want = names_of(model, expected)
        got = {n for n, p in model.named_parameters() if p.grad is not None}
        assert got == want, f"stage {stage.index}"
        assert {n for n, p in model.named_parameters() if p.requires_grad} == want
        if name == "segprop":
            assert names_of(model, [view.head, *view.units[method.plan.head_start:]]) <= got
        model.zero_grad(set_to_none=True)
        # Optimizer state only for what trains now (finished segments' state is freed).
        state_names = {n for n, p in model.named_parameters() if p in learner.optimizer.state}
        assert state_names <= want


def test_committed_segments_keep_their_batchnorm_statistics_and_stay_in_eval():
    model = digits_resnet(blocks=(2, 1, 1))
    learner = edgetrain.Learner(model, method="segprop", optimizer="adamw", lr=1e-2, probe=False,
                                method_options={"head_blocks": 1, "segments": 2, "steps_per_stage": 3})
    method, view = learner.method, learner.method.view
    batches = digits_batches(8)
    for batch in batches[:3]:
        learner.step(batch)
    assert method.stage_index == 1
    committed = [view.embed, *view.units[:method.stage.start]]
    before = {n: b.clone() for m in committed for n, b in m.named_buffers()}
    assert any("running_mean" in n for n in before)
    for batch in batches[3:]:
        learner.step(batch)
        learner.evaluate([batches[0]])   # calls model.eval() then model.train()
        model.train()
        for module in committed:
            assert all(not m.training for m in module.modules()) and is_pinned(module)
        assert all(m.training for u in view.units[method.stage.start:] for m in u.modules())
    after = {n: b for m in committed for n, b in m.named_buffers()}
    assert all(torch.equal(before[n], after[n]) for n in before)
    active_mean = view.units[method.stage.start].norm1.running_mean
    assert not torch.equal(active_mean, torch.zeros_like(active_mean))


def test_finished_model_has_no_adapters_and_runs_the_assembled_blocks():
    model = digits_resnet()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    result = run_schedule(model, digits_stream("train", batch_size=16, image=True, shuffle=False),
                          "segprop", steps_per_stage=3, lr=1e-2, view="resnet-paper", head_blocks=1, segments=3)
    assert len(result.stages) == 3 and result.steps == 9
    assert not hasattr(model, "stage_adapters")
    assert not any("adapter" in n for n, _ in model.state_dict().items())
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    model.train()
    assert all(m.training for m in model.modules()) and not any(is_pinned(m) for m in model.modules())
    model.eval()
    x = torch.rand(5, 1, 8, 8)
    assert torch.equal(model(x), run_blocks(model, x))
    assert torch.equal(model(x), unit_view(model, "resnet-paper").forward(x))
    # Nothing else keeps the adapters alive: the optimizer and the learner's parameter list drop them.
    learner, own = result.learner, {id(p) for p in model.parameters()}
    assert {id(p) for g in learner.optimizer.param_groups for p in g["params"]} <= own
    assert {id(p) for p in learner.optimizer.state} <= own
    assert not any(n.startswith("stage_adapters") for n in learner.params)


def test_learner_finish_drops_the_adapters_from_its_parameters_and_checkpoints(tmp_path):
    """The Learner path (no run_schedule): learner.finish() ends the method and forgets what the model
    no longer holds, so a checkpoint written afterwards has no adapter tensors."""
    from edgetrain.training.checkpoint import load_safetensors_checked

    model = digits_resnet()
    learner = edgetrain.Learner(model, method="segprop", optimizer="adamw", lr=1e-3, probe=False,
                                method_options={"view": "resnet-paper", "head_blocks": 1, "segments": 3,
                                                "steps_per_stage": 2})
    for batch in digits_batches(6):
        learner.step(batch)
    assert any(n.startswith("stage_adapters") for n in learner.params)
    assert learner.finish() is model and not hasattr(model, "stage_adapters")
    assert not any(n.startswith("stage_adapters") for n in learner.params)
    assert {id(p) for p in learner.params.values()} <= {id(p) for p in model.parameters()}
    tensors, _ = load_safetensors_checked(learner.save(tmp_path / "after-finish.safetensors"))
    assert not any("stage_adapters" in name for name in tensors)
    plain = edgetrain.Learner(digits_resnet(), method="bp", probe=False)  # no method finish: params kept
    before = dict(plain.params)
    plain.finish()
    assert plain.params == before


def test_unknown_method_options_are_named():
    with pytest.raises(EdgetrainError, match="unknown method option.*segmnts"):
        edgetrain.Learner(digits_resnet(), method="segprop", probe=False, method_options={"segmnts": 3})


@pytest.mark.parametrize("name", ["segprop", "lw"])
def test_only_the_active_path_is_handed_to_the_distributed_wrapper(name):
    """What DistributedDataParallel would wrap (the wrap_active hook) holds exactly the stage's
    trainable parameters: the active segment, its adapter or auxiliary classifier, the head."""
    model = digits_resnet(blocks=(2, 1, 1))
    learner = edgetrain.Learner(model, method=name, optimizer="sgd", lr=1e-2, probe=False,
                                method_options={"head_blocks": 1, "segments": 3, "steps_per_stage": 1})
    wrapped = []
    learner.method.wrap_active = lambda path: wrapped.append(path) or path
    for batch in digits_batches(learner.method.num_stages):
        learner.step(batch)
    assert len(wrapped) == learner.method.num_stages
    for stage, path in zip(learner.method.stages, wrapped):
        got = {id(p) for p in path.parameters()}
        expected = learner.method._body_modules(stage) + learner.method._head_modules(stage)
        assert got == {id(p) for m in expected for p in m.parameters()}, f"stage {stage.index}"
        committed = [learner.method.view.embed, *learner.method.view.units[:stage.start]] if stage.index else []
        assert not got & {id(p) for m in committed for p in m.parameters()}


# -- SnapCheck -------------------------------------------------------------------------------------------

def test_snapcheck_returns_what_was_stored_and_keeps_its_budgets(tmp_path):
    generator = torch.Generator().manual_seed(0)
    states = {i: torch.randn(4, 8, 8, 8, generator=generator) for i in range(6)}   # 8 KiB each
    pair = (torch.randn(2, 3, generator=generator).to(torch.bfloat16), torch.randn(5, generator=generator))
    cache = SnapCheck(budget_bytes=2 * 8192, spill_dir=tmp_path, disk_budget_bytes=3 * 8192)
    for i, state in states.items():
        cache.put(3, i, state, fingerprint=("x", i), stamp=7)
        assert cache.memory_bytes <= 2 * 8192 and cache.disk_bytes <= 3 * 8192
    stats = cache.stats()
    assert stats["spills"] == 4 and stats["evictions"] == 1 and stats["entries"] == 5
    assert cache.get(3, 0, ("x", 0), 7) is None                  # evicted (oldest on disk): a miss
    for i in range(1, 6):
        got = cache.get(3, i, ("x", i), 7)
        assert got.dtype == states[i].dtype and torch.equal(got, states[i])   # bit-identical, memory or disk
    assert cache.stats()["disk_reads"] >= 1
    cache.put(1, "pair", pair)
    got = cache.get(1, "pair")
    assert isinstance(got, tuple) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, pair))
    # Guards: another batch under the same id, a changed prefix, an entry its consumer wrote into.
    assert cache.get(3, 5, ("y", 5), 7) is None and cache.get(3, 5, ("x", 5), 7) is None
    assert cache.get(3, 4, ("x", 4), 8) is None and len([k for k in cache._entries if k[0] == 3]) == 0
    cache.put(2, 0, torch.ones(3))
    cache.get(2, 0).add_(1)
    assert cache.get(2, 0) is None
    cache.close()
    assert not list(tmp_path.iterdir())
    nothing = SnapCheck(budget_bytes=0, spill_dir=None)
    nothing.put(0, 0, torch.ones(4))
    assert len(nothing) == 0 and nothing.stats()["evictions"] == 1


@pytest.mark.parametrize("method", ["segprop", "lw"])
@pytest.mark.parametrize("budget", ["1GiB", 0])
def test_snapcheck_training_is_bit_identical_to_recomputing_the_prefix(method, budget):
    """A fixed-order stream over 3 epochs per stage: with SnapCheck (in memory, or everything spilled to
    disk with budget 0) the weights are exactly those of recomputing the frozen prefix every step."""
    weights, stats = [], []
    for snapcheck in (False, True):
        model = digits_resnet(blocks=(2, 1, 1))
        stream = digits_stream("train", batch_size=256, image=True, shuffle=False, epochs=None)
        result = run_schedule(model, stream, method, epochs_per_stage=3, lr=1e-2, head_blocks=1, segments=3,
                              snapcheck=snapcheck, snapcheck_budget=budget)
        weights.append(model.state_dict())
        stats.append(result.snapcheck)
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    per_epoch = digits_stream("train", batch_size=256, image=True).batches_per_epoch
    later_stages = 2 if method == "segprop" else 3
    # Every later stage: each batch is missed once (built from the previous depth), then hit twice.
    assert stats[1]["hits"] == later_stages * 2 * per_epoch
    assert stats[1]["puts"] == later_stages * per_epoch
    if budget == 0:
        assert stats[1]["spills"] == stats[1]["puts"] and stats[1]["memory_bytes"] == 0


def test_snapcheck_recomputes_after_the_frozen_prefix_changes():
    """An in-place write to a committed weight (a checkpoint load, a manual edit) bumps its version
    counter: the cached activations of that depth are stale and the prefix runs again."""
    model = digits_resnet(blocks=(2, 1, 1))
    learner = edgetrain.Learner(model, method="segprop", optimizer="sgd", lr=1e-2, probe=False,
                                method_options={"head_blocks": 1, "segments": 2, "steps_per_stage": 1,
                                                "snapcheck": True})
    method, batch = learner.method, digits_batches(1)[0]
    learner.step(batch)
    assert method.stage_index == 1
    first = method.frozen_state(batch)
    assert torch.equal(method.frozen_state(batch), first) and method.snapcheck.stats()["hits"] == 1
    with torch.no_grad():
        model.embed.conv.weight.mul_(0.5)
    again = method.frozen_state(batch)
    assert method.snapcheck.stats()["stale"] == 1 and not torch.equal(again, first)
    with torch.no_grad():
        assert torch.equal(again, method.view.run(method.view.embed(batch.inputs), 0, method.stage.start))
    method.finish()


def test_snapcheck_is_off_when_the_prefix_shares_a_trainable_parameter_with_the_head(caplog):
    model = edgetrain.load_model("tiny")   # tied embeddings, everything trainable
    method = edgetrain.methods.METHODS.get("segprop")(model, head_blocks=1, segments=2, snapcheck=True)
    assert method.snapcheck is None and "tied" in caplog.text
    method.finish()


# -- schedule, checkpoints ------------------------------------------------------------------------------

def test_a_schedule_with_no_room_for_a_cosine_ends_at_the_floor_like_every_other():
    # warm-up as long as the stage: past the end the rate is the floor, as with a shorter warm-up (this
    # branch once returned the peak rate; found by the mutation triage).
    assert cosine_multiplier(3, 3, 3, 0.1) == 0.1 == pytest.approx(cosine_multiplier(3, 3, 1, 0.1))
    assert cosine_multiplier(2, 3, 3, 0.1) == 1.0  # the last warm-up step is still the ramp's top
    for warmup in (1, 3):
        learner = edgetrain.Learner(digits_resnet(), method="segprop", optimizer="sgd", lr=0.1, probe=False,
                                    method_options={"head_blocks": 1, "segments": 2, "steps_per_stage": 3,
                                                    "lr_schedule": "cosine", "warmup_steps": warmup,
                                                    "min_lr_ratio": 0.1})
        for batch in digits_batches(12):
            learner.step(batch)
        assert learner.method.finished
        assert learner.method.lr_multipliers() == pytest.approx((0.1, 0.1)), warmup


def test_stage_advancement_lr_schedule_and_plateau():
    assert cosine_multiplier(0, 10, 2, 0.0) == 0.5 and cosine_multiplier(1, 10, 2, 0.0) == 1.0
    assert cosine_multiplier(2, 10, 2, 0.1) == 1.0 and cosine_multiplier(10, 10, 2, 0.1) == pytest.approx(0.1)
    model = digits_resnet()
    learner = edgetrain.Learner(model, method="segprop", optimizer="sgd", lr=0.1, probe=False,
                                method_options={"segments": 2, "steps_per_stage": [2, 3], "lr_schedule": "cosine",
                                                "warmup_steps": 1, "min_lr_ratio": 0.1, "head_lr_scale": 0.5})
    method = learner.method
    assert method.total_budget == 5
    seen = []
    for batch in digits_batches(6):
        seen.append((method.stage_index, *method.lr_multipliers()))
        learner.step(batch)
    assert [s[0] for s in seen] == [0, 0, 1, 1, 1, 1] and method.finished
    assert seen[2][1] == 1.0 and seen[2][2] == pytest.approx(0.5 * cosine_multiplier(2, 5, 1, 0.1))
    assert learner.optimizer.param_groups[0]["lr"] == 0.1     # the base rate is restored after each step
    plateau = edgetrain.Learner(digits_resnet(), method="segprop", optimizer="sgd", lr=0.0, probe=False,
                                method_options={"segments": 2, "plateau_window": 2, "plateau_patience": 1})
    for batch in digits_batches(1) * 4:
        plateau.step(batch)   # lr 0, one batch: the loss cannot improve, the second window ends the stage
    assert plateau.method.stage_index == 1


@pytest.mark.parametrize("method", ["segprop", "lw"])
def test_resume_across_a_stage_boundary_is_exact(tmp_path, method):
    options = {"head_blocks": 1, "segments": 2, "steps_per_stage": 4, "snapcheck": True, "snapcheck_period": 50}
    batches = digits_batches(10)

    def learner():
        return edgetrain.Learner(digits_resnet(blocks=(2, 1, 1)), method=method, optimizer="adamw", lr=1e-2,
                                 probe=False, method_options=options)

    straight = learner()
    for batch in batches:
        straight.step(batch)
    first = learner()
    for batch in batches[:5]:
        first.step(batch)
    assert first.method.stage_index == 1
    first.save(tmp_path / "ckpt.safetensors")
    second = learner().load(tmp_path / "ckpt.safetensors")
    assert second.method.stage_index == 1 and second.method.stage_step == 1
    for batch in batches[5:]:
        second.step(batch)
    assert second.method.stage_index == straight.method.stage_index
    a, b = straight.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other_split = {**options, "segments": None, "split": [1, 2]}
    with pytest.raises(EdgetrainError, match="different plan"):   # same parameters, other stages
        edgetrain.Learner(digits_resnet(blocks=(2, 1, 1)), method=method, optimizer="adamw", lr=1e-2, probe=False,
                          method_options=other_split).load(tmp_path / "ckpt.safetensors")


class Interrupted(Exception):
    pass


def test_run_schedule_resumes_after_an_interruption_exactly(tmp_path):
    """A run killed mid-stage (here: the stream raises at batch 8) and started again with the same
    checkpoint directory ends with the weights of an uninterrupted run."""
    options = dict(steps_per_stage=4, lr=1e-2, head_blocks=1, segments=3, checkpoint_every=3)

    def stream(fail_at: int | None = None):
        base = digits_stream("train", batch_size=16, image=True, shuffle=True, seed=3, epochs=None)
        if fail_at is not None:
            original = base.batch

            def batch(index: int) -> Batch:
                if index == fail_at:
                    raise Interrupted
                return original(index)
            base.batch = batch
        return base

    straight = digits_resnet(blocks=(2, 1, 1))
    run_schedule(straight, stream(), "segprop", **options)
    with pytest.raises(Interrupted):
        run_schedule(digits_resnet(blocks=(2, 1, 1)), stream(fail_at=8), "segprop", checkpoint_dir=tmp_path,
                     **options)
    resumed = digits_resnet(blocks=(2, 1, 1))
    result = run_schedule(resumed, stream(), "segprop", checkpoint_dir=tmp_path, **options)
    assert result.steps == 12 and [s.stage for s in result.stages] == [1, 2]   # resumed at step 6, in stage 1
    a, b = straight.state_dict(), resumed.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# -- other architectures ---------------------------------------------------------------------------------

def test_llama_with_lora_trains_only_the_adapters_of_the_active_segment_and_head(text_batches):
    model = edgetrain.load_model("tiny")
    edgetrain.add_lora(model, rank=2)
    lora = {n for n, p in model.named_parameters() if p.requires_grad}
    learner = edgetrain.Learner(model, method="segprop", optimizer="adamw", lr=1e-3, probe=False,
                                method_options={"head_blocks": 1, "segments": 3, "steps_per_stage": 2,
                                                "snapcheck": True})
    method = learner.method
    assert len(method.adapters) == 0 and method.snapcheck is not None   # [B, T, d] everywhere: identity
    for batch in text_batches(4, seq_len=16):
        stage = method.stage
        learner.step(batch)
        trained = {n for n, p in model.named_parameters() if p.requires_grad} if method.stage is stage else None
        if trained is not None:
            wanted = {f"blocks.{i}." for i in range(stage.start, stage.end)} | {"blocks.3."}
            assert trained and trained <= lora and all(any(n.startswith(w) for w in wanted) for n in trained)
    method.finish()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == lora


def test_vit_stages_and_identity_adapters():
    model = build_vit(ViTConfig(image_size=8, patch_size=4, in_channels=1, dim=16, depth=4, num_heads=2,
                                num_classes=10))
    result = run_schedule(model, digits_stream("train", batch_size=16, image=True, shuffle=False), "segprop",
                          steps_per_stage=2, lr=1e-3, head_blocks=2, segments=2, snapcheck=True, checkpoint=True)
    assert result.steps == 4 and result.snapcheck["puts"] == 2
    assert not any("stage_adapters" in n for n, _ in model.named_parameters())


def test_transformer_states_get_a_linear_adapter_and_matching_shapes_none():
    """[B, T, d] states: a linear map when the width differs, the identity (no module) when it matches;
    an adapter that cannot exist is refused by name."""
    adapter = make_adapter(torch.Size([2, 5, 16]), torch.Size([2, 5, 24]))
    assert isinstance(adapter, LinearAdapter) and adapter(torch.rand(3, 5, 16)).shape == (3, 5, 24)
    assert make_adapter(torch.Size([2, 5, 16]), torch.Size([7, 5, 16])) is None
    with pytest.raises(EdgetrainError, match="identity"):
        make_adapter(torch.Size([2, 5, 16]), torch.Size([2, 5, 24]), kind="identity")
    with pytest.raises(EdgetrainError, match="upsamples"):
        make_adapter(torch.Size([2, 8, 4, 4]), torch.Size([2, 8, 8, 8]))


def test_lw_auxiliary_classifiers_and_head_stage():
    model = digits_resnet()
    method = edgetrain.methods.METHODS.get("lw")(model, head_blocks=1, segments=2)
    assert [s.name for s in method.stages] == ["embed + units 0..0", "units 1..2", "head"]
    assert set(method.adapters) == {"0", "1"}
    aux0 = method.adapters["0"]
    assert isinstance(aux0.adapter, ConvAdapter) and isinstance(method.adapters["1"].adapter, nn.Identity)
    assert aux0.head.fc.weight.shape == model.head.fc.weight.shape and aux0.head.fc.weight is not model.head.fc.weight
    with pytest.raises(EdgetrainError, match="already carries"):
        edgetrain.methods.METHODS.get("segprop")(model)
    method.finish()


def test_flops_per_sample_follow_the_paper_accounting():
    model = digits_resnet(blocks=(2, 1, 1))
    method = edgetrain.methods.METHODS.get("segprop")(model, head_blocks=1, segments=3)
    e2e, stages = schedule_flops(method, torch.rand(4, 1, 8, 8))
    e2e_ckpt, stages_ckpt = schedule_flops(method, torch.rand(4, 1, 8, 8), checkpointing=True)
    assert e2e_ckpt == pytest.approx(e2e * 4 / 3)
    for stage in stages:
        assert stage.total == pytest.approx(3 * stage.active_forward + stage.frozen_forward)
        assert stage.total_snapcheck == pytest.approx(3 * stage.active_forward)
    assert stages[0].frozen_forward == 0 and stages[-1].frozen_forward > stages[1].frozen_forward > 0
    assert all(s.total < e2e for s in stages)
    method.finish()
