"""The personaliser on a torch decoder (the tiny preset, LoRA, mesp by default): gated promotion on held-out
perplexity, a harmful window rejected, forget and stale marks, rollback, kept versions, adapters in every
format, pause/stop within one step, and a run killed -9 at random moments that resumes from its checkpoint
and always serves a complete adapter."""
from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import edgetrain
from edgetrain.personalise import NothingToRollBackError, StoreBusyError, is_held_out, read_events
from personalise_kit import FAST, Recorder, english_texts, greek_texts, make, training_only

HERE = Path(__file__).resolve().parent


def _logits(model, text: str = "The function returns the value of the expression.") -> torch.Tensor:
    ids = torch.tensor([list(text.encode())])
    with torch.no_grad():
        return model(ids)


def _trained_on(store: Path) -> set[str]:
    with sqlite3.connect(store / "examples.sqlite") as raw:
        return {row[0] for row in raw.execute("SELECT example FROM trained_on")}


def test_windows_promote_only_better_adapters_and_the_app_gets_the_promoted_one(tmp_path):
    recorder = Recorder()
    personaliser = make(tmp_path, on_event=recorder)
    ids = personaliser.add_many(english_texts(40))
    assert personaliser.model_for_inference() is not None and personaliser.adapter_path() is None  # base served
    result = personaliser.run(max_steps=18)
    assert result.steps == 18 and result.windows == 3 and result.promoted
    for event in recorder.of("promoted"):
        assert event["value"] < event["reference"] and event["by"] > 0
    for event in recorder.of("rejected"):
        assert event["value"] >= event["reference"] and event["by"] <= 0
    status = personaliser.status()
    assert status["served"] == status["promoted"] == result.promoted[-1]
    assert status["held_out"] == sum(is_held_out(i, FAST["holdout_every"]) for i in ids) > 0
    # Held-out examples were never trained on.
    with sqlite3.connect(tmp_path / "examples.sqlite") as raw:
        held = {example for (example,) in raw.execute("SELECT id FROM examples") if is_held_out(example, 4)}
    assert held and not held & _trained_on(tmp_path)
    # The app's model is the base with the promoted adapter, nothing else.
    served = personaliser.model_for_inference()
    torch.manual_seed(0)
    expected = edgetrain.load_model("tiny")
    edgetrain.load_lora(expected, personaliser.adapter_path())
    torch.testing.assert_close(_logits(served), _logits(expected.eval()))
    assert not torch.allclose(_logits(served), _logits(_base_model()))
    log = read_events(tmp_path / "events.jsonl")
    assert [e["event"] for e in log if e["event"] != "step"] == [e["event"] for e in recorder.events
                                                                 if e["event"] != "step"]
    assert {"window", "checkpoint", "evaluated", "promoted", "stopped"} <= {e["event"] for e in log}


def _base_model():
    torch.manual_seed(0)
    return edgetrain.load_model("tiny").eval()


def test_a_harmful_window_is_rejected_and_the_better_version_stays_served(tmp_path):
    recorder = Recorder()
    personaliser = make(tmp_path, on_event=recorder)
    personaliser.add_many(english_texts(40))
    first = personaliser.run(max_steps=6)
    assert first.promoted == [1]
    # A flood of text in another script, all of it training data: the next window learns mostly that.
    personaliser.add_many(training_only(greek_texts(400)))
    harmful = personaliser.run(max_steps=6)
    assert harmful.promoted == [] and harmful.rejected == 1
    rejected = recorder.of("rejected")[-1]
    assert rejected["value"] > rejected["reference"] and rejected["by"] < 0  # says by how much it was worse
    assert personaliser.status()["served"] == 1


def test_forget_deletes_examples_marks_stale_and_a_rebuild_from_the_base_clears_it(tmp_path):
    recorder = Recorder()
    personaliser = make(tmp_path, on_event=recorder)
    texts = english_texts(40)
    ids = personaliser.add_many(texts)
    secret_text = f"a secret the user regrets {os.getpid()} " * 300  # longer than a page: overflow pages too
    secret = personaliser.add(secret_text)
    assert personaliser.add_many([secret_text]) == [secret]
    assert personaliser.run(max_steps=8).promoted == [1]  # and two steps into the next window
    assert (tmp_path / "window" / "train.jsonl").exists()
    trained = next(i for i in ids if not is_held_out(i, 4))
    held = next(i for i in ids if is_held_out(i, 4))
    result = personaliser.forget([trained, held, secret, "0000000000000000"])
    assert result == {"forgotten": [trained, held, secret], "unknown": ["0000000000000000"], "stale": [1]}
    assert recorder.of("stale")[-1]["versions"] == [1]
    status = personaliser.status()
    assert status["examples"] == 38 and status["promoted"] == 1 and status["served"] == "base"
    assert status["versions"][0]["stale"] is True
    # The forgotten text is gone from the database file, not only from its index.
    for name in ("examples.sqlite", "examples.sqlite-wal"):
        path = tmp_path / name
        assert not path.exists() or b"a secret the user regrets" not in path.read_bytes()
    assert not (tmp_path / "window").exists()  # the window's snapshot held copies: dropped
    run = personaliser.run(max_steps=6)
    window = recorder.of("window")[-1]
    assert window["start"] == "base" and window["reference"] == pytest.approx(recorder.of("window")[0]["reference"],
                                                                                rel=0.2)
    assert run.promoted == [2]
    status = personaliser.status()
    assert status["served"] == 2 and status["served_stale"] is False
    version = {v["version"]: v for v in status["versions"]}
    assert version[2]["stale"] is False and version[2]["parent"] is None and version[1]["stale"] is True
    with sqlite3.connect(tmp_path / "examples.sqlite") as raw:
        existing = {row[0] for row in raw.execute("SELECT id FROM examples")}
        seen_by_2 = {row[0] for row in raw.execute("SELECT example FROM trained_on WHERE version = 2")}
    assert seen_by_2 and seen_by_2 <= existing and texts[ids.index(trained)] not in json.dumps(recorder.events)


def test_an_example_dropped_by_retention_and_added_again_is_still_known_to_the_versions_that_saw_it(tmp_path):
    texts = english_texts(40)
    personaliser = make(tmp_path)
    ids = personaliser.add_many(texts)
    assert personaliser.run(max_steps=6).promoted == [1]
    oldest = next(n for n, i in enumerate(ids) if not is_held_out(i, 4))
    personaliser.store.set_retention(len(ids) - oldest - 1, None)  # drops everything up to it: no stale mark
    assert personaliser.status()["versions"][0]["stale"] is False
    personaliser.store.set_retention(None, None)
    assert personaliser.add(texts[oldest]) == ids[oldest]
    assert personaliser.forget([ids[oldest]])["stale"] == [1]


def test_serve_stale_keeps_serving_the_stale_version_until_a_rebuild(tmp_path):
    personaliser = make(tmp_path, serve_stale=True)
    ids = personaliser.add_many(english_texts(40))
    personaliser.run(max_steps=6)
    personaliser.forget([next(i for i in ids if not is_held_out(i, 4))])
    status = make(tmp_path).status()  # the choice is kept in the store
    assert status["served"] == 1 and status["served_stale"] is True


def test_rollback_serves_the_previous_version_and_only_the_newest_k_are_kept(tmp_path):
    recorder = Recorder()
    personaliser = make(tmp_path, on_event=recorder, keep_versions=2, window_steps=4)
    personaliser.add_many(english_texts(40))
    with pytest.raises(NothingToRollBackError):
        personaliser.rollback()
    while len(personaliser.status()["versions"]) < 2 or personaliser.status()["promoted"] < 3:
        assert personaliser.run(max_steps=4).steps == 4
    status = personaliser.status()
    newest = status["promoted"]
    kept = [v["version"] for v in status["versions"]]
    assert kept == [newest - 1, newest] and not (tmp_path / "versions" / "v000001").exists()
    assert personaliser.rollback() == newest - 1
    assert recorder.of("rollback")[-1] == {**recorder.of("rollback")[-1], "from": newest, "to": newest - 1}
    status = personaliser.status()
    assert status["served"] == newest - 1
    assert {v["version"]: v["state"] for v in status["versions"]}[newest] == "rolled_back"
    torch.testing.assert_close(_logits(personaliser.model_for_inference()),
                               _logits(_with_adapter(tmp_path / f"versions/v{newest - 1:06d}/adapter.safetensors")))
    personaliser.rollback()
    assert personaliser.status()["served"] == "base"  # nothing older kept


def _with_adapter(path: Path):
    torch.manual_seed(0)
    model = edgetrain.load_model("tiny")
    edgetrain.load_lora(model, path)
    return model.eval()


def test_the_promoted_adapter_in_every_format_gives_the_same_model(tmp_path):
    from edgetrain.adapters.convert import detect_format, load_adapter

    personaliser = make(tmp_path)
    personaliser.add_many(english_texts(40))
    personaliser.run(max_steps=6)
    expected = _logits(personaliser.model_for_inference())
    for name in ("edgetrain", "peft", "mlx-lm"):
        path = personaliser.adapter_path(name)
        assert detect_format(path) == name
        torch.manual_seed(0)
        model = edgetrain.load_model("tiny")
        load_adapter(model, path)
        torch.testing.assert_close(_logits(model.eval()), expected, rtol=1e-5, atol=1e-5)
    gguf = personaliser.adapter_path("gguf")
    assert gguf.suffix == ".gguf" and detect_format(gguf) == "gguf"
    assert personaliser.adapter_path("peft") == personaliser.adapter_path("peft")  # converted once


def test_pause_and_stop_take_effect_within_one_step(tmp_path):
    recorder = Recorder()
    personaliser = make(tmp_path, on_event=recorder, window_steps=1000, checkpoint_every=1000, seq_len=64,
                        batch_size=8)
    personaliser.add_many(english_texts(40))
    personaliser.start()
    deadline = time.monotonic() + 60
    while len(recorder.of("step")) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    longest = max(e["seconds"] for e in recorder.of("step"))
    paused = personaliser.pause()
    steps_at_pause = len(recorder.of("step"))
    time.sleep(max(0.3, 3 * longest))
    assert len(recorder.of("step")) == steps_at_pause, "a step ran after pause() returned"
    personaliser.resume()
    while len(recorder.of("step")) < steps_at_pause + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    stopped = personaliser.stop()
    longest = max(e["seconds"] for e in recorder.of("step"))
    print(f"pause latency {paused * 1000:.1f} ms, stop latency {stopped * 1000:.1f} ms, "
          f"longest step {longest * 1000:.1f} ms")
    # Within one step: the step under way finishes, no other begins (plus scheduling slack on a busy machine).
    assert paused <= longest + 0.1 and stopped <= longest + 0.1
    assert recorder.of("paused")[0]["reason"] == "app" and recorder.of("stopped")[-1]["reason"] == "stop"
    assert recorder.of("checkpoint")[-1]["step"] == len(recorder.of("step"))  # stop() checkpoints the window


def test_one_run_per_store(tmp_path):
    personaliser = make(tmp_path, window_steps=1000)
    personaliser.add_many(english_texts(40))
    personaliser.start()
    time.sleep(0.2)
    try:
        with pytest.raises(StoreBusyError):
            make(tmp_path).run(max_steps=1)
        assert personaliser.status()["running"] is True
    finally:
        personaliser.stop()
    assert personaliser.status()["running"] is False


def test_a_version_damaged_after_writing_is_not_served_and_leftovers_of_a_crash_are_removed(tmp_path):
    recorder = Recorder()
    personaliser = make(tmp_path, on_event=recorder, window_steps=4)
    personaliser.add_many(english_texts(40))
    while personaliser.status()["promoted"] in (None, 1):
        personaliser.run(max_steps=4)
    newest = personaliser.status()["promoted"]
    path = personaliser.adapter_path()
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # bit rot in the weights
    path.write_bytes(bytes(data))
    assert personaliser.served_version().version < newest
    assert recorder.of("version_damaged")[-1]["version"] == newest
    personaliser.model_for_inference()
    orphan = tmp_path / "versions" / "v000099"
    orphan.mkdir()
    (orphan / "adapter.safetensors").write_bytes(b"half written")
    personaliser.run(max_steps=1)
    assert not orphan.exists()


def test_an_example_damaged_in_the_store_is_skipped_with_an_event(tmp_path):
    recorder = Recorder()
    personaliser = make(tmp_path, on_event=recorder)
    ids = personaliser.add_many(english_texts(40))
    with sqlite3.connect(tmp_path / "examples.sqlite") as raw:
        raw.execute("UPDATE examples SET body = '{not json' WHERE id = ?", (ids[0],))
    assert personaliser.run(max_steps=2).steps == 2
    assert recorder.of("skipped_example")[0]["id"] == ids[0]


def test_kill_9_during_a_run_resumes_from_the_checkpoint_and_always_serves_a_complete_adapter(tmp_path):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    seed = rng.getstate()[1][0]
    make(tmp_path).add_many(english_texts(40))
    for attempt in range(2):  # each child pays torch's start-up: two random moments
        served_before = make(tmp_path, model=None).served_version()
        child = subprocess.Popen([sys.executable, str(HERE / "crash_child.py"), "run", str(tmp_path)],
                                 stdout=subprocess.PIPE, text=True)
        events = []
        # An add from this process while the child trains: it does not wait for training.
        started = time.perf_counter()
        make(tmp_path, model=None).add(f"a note added during run {attempt}")
        assert time.perf_counter() - started < 2
        # First a moment soon after a checkpoint of an open window (the resume path), then any moment.
        extra = rng.randint(0, 3) if attempt == 0 else rng.randint(3, 30)
        while attempt == 0 and not any(e["event"] == "checkpoint" for e in events) or extra > 0:
            line = child.stdout.readline()
            assert line, f"the child ended early (random seed {seed})"
            events.append(json.loads(line))
            if attempt > 0 or any(e["event"] == "checkpoint" for e in events[:-1]):
                extra -= 1
        time.sleep(rng.random() * 0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        recorder = Recorder()
        personaliser = make(tmp_path, on_event=recorder)
        served = personaliser.served_version()
        promoted = [e["version"] for e in events if e["event"] == "promoted"]
        if promoted:
            assert served is not None and served.version >= promoted[-1], f"random seed {seed}"
        personaliser.model_for_inference()  # complete and loadable, whatever the moment of the kill
        personaliser.run(max_steps=1)
        kinds = [e["event"] for e in events]
        last_window = max((e for e in events if e["event"] == "window"), key=lambda e: e["window"], default=None)
        checkpoints = [e for e in events if e["event"] == "checkpoint" and last_window
                       and e["window"] == last_window["window"]]
        closed = any(e["event"] in ("promoted", "rejected") and e.get("window") == (last_window or {}).get("window")
                     for e in events)
        # A kill between a promotion's commit and its "promoted" line: the window closed, unseen in the events.
        known = [v for v in promoted + [served_before.version if served_before else None] if v is not None]
        closed = closed or (served is not None and served.version > max(known, default=0))
        if checkpoints and not closed:
            resumed = recorder.of("window_resumed")
            assert resumed and resumed[0]["window"] == last_window["window"], f"{kinds} (random seed {seed})"
            assert resumed[0]["step"] >= checkpoints[-1]["step"], f"random seed {seed}"
        assert personaliser.store.integrity_problems() == []
        personaliser.close()


def test_the_same_seed_makes_the_same_store_whatever_drew_random_numbers_before(tmp_path):
    from edgetrain.training.checkpoint import load_safetensors_checked

    adapters = []
    for name in ("first", "second"):
        torch.rand(1000)  # the app (or an earlier store) drew from torch's global generator
        personaliser = make(tmp_path / name, seed=7)
        tensors, _ = load_safetensors_checked(tmp_path / name / personaliser.bound["base"])
        adapters.append(tensors)
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    assert all(torch.equal(adapters[0][key], adapters[1][key]) for key in adapters[0])
    third = make(tmp_path / "third", seed=8)
    tensors, _ = load_safetensors_checked(tmp_path / "third" / third.bound["base"])
    assert any(not torch.equal(tensors[key], adapters[0][key]) for key in tensors)
