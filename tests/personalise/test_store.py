"""The example store: real SQLite in a temp directory -- durable adds, idempotence, concurrent writers,
retention, named errors for bad input, damaged files and newer schemas (all leaving the store as it was),
and no returned add lost when the adding process is killed."""
from __future__ import annotations

import hashlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from edgetrain.personalise import (BadExampleError, DamagedStoreError, ModelMismatchError, Personaliser, Store,
                                   StoreVersionError, WrongKindError, read_events)
from personalise_kit import make

HERE = Path(__file__).resolve().parent


def _raw(store: Path) -> sqlite3.Connection:
    return sqlite3.connect(store / "examples.sqlite")


def test_add_is_committed_when_it_returns_and_adding_again_finds_the_same_id(tmp_path):
    with Store(tmp_path) as store:
        first = store.add("the user's first note")
        # Another connection (another process would see the same) reads it at once: it is committed.
        with _raw(tmp_path) as raw:
            assert raw.execute("SELECT id FROM examples").fetchall() == [(first,)]
            assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert store.add("the user's first note") == first
        assert store.add({"text": "the user's first note"}) == first
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "name": "x"}]
        chat_id = store.add(chat)
        assert store.add([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]) == chat_id
        assert store.add(([1, 2.5, 3], 1)) == store.add({"input": [1.0, 2.5, 3.0], "label": 1})
        assert store.count()[0] == 3


def test_adds_from_threads_and_another_process_at_once_are_all_kept(tmp_path):
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside each other's transactions if they can
    Store(tmp_path).close()
    child = subprocess.Popen([sys.executable, str(HERE / "crash_child.py"), "add", str(tmp_path), "1000"],
                             stdout=subprocess.PIPE, text=True)
    store = Store(tmp_path)
    returned: list[str] = []
    lock = threading.Lock()

    together = threading.Barrier(4)

    def writer(offset: int) -> None:
        together.wait()
        for number in range(50):
            example_id = store.add(f"thread {offset} note {number}")
            with lock:
                returned.append(example_id)

    threads = [threading.Thread(target=writer, args=(offset,)) for offset in range(4)]
    child_ids = [child.stdout.readline().strip() for _ in range(20)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    child.kill()
    child.wait()
    kept = set(store.ids())
    store.close()
    assert len(returned) == 200 and set(returned) <= kept
    assert set(child_ids) <= kept


def test_the_retention_cap_drops_the_oldest_first_and_says_so(tmp_path):
    with Store(tmp_path) as store:
        ids = [store.add(f"note number {n}") for n in range(3)]
        assert store.set_retention(2, None) == ids[:1]
        newest = store.add("note number 3")
        assert store.ids() == [ids[2], newest]
        size = len('{"kind":"text","text":"note number 4"}'.encode())
        store.set_retention(None, 2 * size)
        store.add("note number 4")
        store.add("a much longer note that alone is larger than the byte cap allows two of")
        assert store.count()[1] <= 2 * size
    dropped = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "examples_dropped"]
    assert dropped[0]["ids"] == ids[:1] and dropped[0]["count"] == 1
    assert ids[1] in dropped[1]["ids"] and all(e["reason"] == "retention cap" for e in dropped)


@pytest.mark.parametrize("bad", ["", "   \n", 42, None, [], [{"role": "user", "content": "no reply"}],
                                 [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}],
                                 ([1.0, float("nan")], 0), ([1.0], -1), ([1.0], 1.5), (["a"], 0),
                                 {"text": "x", "label": 1}, {"messages": "not a list"}])
def test_bad_examples_are_named_errors_and_leave_the_store_usable(tmp_path, bad):
    with Store(tmp_path) as store:
        store.add("a good note")
        with pytest.raises(BadExampleError):
            store.add(bad)
        with pytest.raises(BadExampleError):  # all or none: the good one before the bad is not written
            store.add_many(["another good note", bad])
        assert store.count()[0] == 1
        store.add("one more good note")
        assert store.count()[0] == 2


def test_examples_of_the_wrong_kind_for_the_model_are_named_errors(tmp_path):
    decoder = make(tmp_path / "decoder")
    with pytest.raises(WrongKindError, match="labelled example for a decoder"):
        decoder.add(([0.0] * 64, 3))
    decoder.add("text is what a decoder learns from")
    classifier = Personaliser(tmp_path / "classifier", "mlp-digits")
    with pytest.raises(WrongKindError, match="text example for a classifier"):
        classifier.add("text")
    with pytest.raises(WrongKindError, match="64"):
        classifier.add(([0.5] * 10, 3))
    with pytest.raises(WrongKindError, match="outside the model's 10 classes"):
        classifier.add(([0.5] * 64, 10))
    classifier.add(([0.5] * 64, 9))
    assert decoder.store.count()[0] == 1 and classifier.store.count()[0] == 1


def test_a_store_keeps_its_model_and_refuses_examples_another_kind_would_need(tmp_path):
    store = Store(tmp_path)
    store.add(([0.5] * 64, 1))
    store.close()
    with pytest.raises(WrongKindError, match="cannot learn from"):
        make(tmp_path)
    assert Personaliser(tmp_path).bound is None  # refused before anything was recorded
    Personaliser(tmp_path, "mlp-digits")
    with pytest.raises(ModelMismatchError, match="personalises 'mlp-digits'"):
        make(tmp_path)
    with pytest.raises(ModelMismatchError, match="method"):
        Personaliser(tmp_path, "mlp-digits", method="fgd")
    assert Personaliser(tmp_path).bound["name"] == "mlp-digits"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_store_written_by_a_newer_edgetrain_is_refused_and_left_untouched(tmp_path):
    with Store(tmp_path) as store:
        kept = store.add("a note written by the newer version")
    with _raw(tmp_path) as raw:
        raw.execute("UPDATE schema SET version = 99")
    before = _digest(tmp_path / "examples.sqlite")
    with pytest.raises(StoreVersionError, match="newer edgetrain"):
        Store(tmp_path)
    assert _digest(tmp_path / "examples.sqlite") == before
    with _raw(tmp_path) as raw:  # what the newer edgetrain would find: everything as it left it
        raw.execute("UPDATE schema SET version = 1")
    with Store(tmp_path) as store:
        assert store.ids() == [kept]


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_store_is_a_named_error_and_is_left_as_it_is(tmp_path, damage):
    with Store(tmp_path) as store:
        for number in range(200):
            store.add(f"note {number} " + "x" * 200)
        store.checkpoint_wal()
    path = tmp_path / "examples.sqlite"
    data = path.read_bytes()
    path.write_bytes(os.urandom(4096) if damage == "garbage" else data[:100] + os.urandom(len(data) - 100))
    before = _digest(path)
    with pytest.raises(DamagedStoreError, match="left as it is"):
        store = Store(tmp_path)
        store.ids()
    assert _digest(path) == before


def test_kill_9_while_adding_loses_no_add_that_returned(tmp_path):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    seed = rng.getstate()[1][0]
    returned: list[str] = []
    for attempt in range(5):
        child = subprocess.Popen([sys.executable, str(HERE / "crash_child.py"), "add", str(tmp_path),
                                  str(attempt * 100_000)], stdout=subprocess.PIPE, text=True)
        for _ in range(rng.randint(1, 60)):
            line = child.stdout.readline()
            assert line.endswith("\n"), f"the child ended early (random seed {seed})"
            returned.append(line.strip())
        os.kill(child.pid, signal.SIGKILL)  # typically in the middle of the next add
        child.wait()
        with Store(tmp_path) as store:
            kept = set(store.ids())
            assert set(returned) <= kept, f"adds that returned were lost (random seed {seed})"
            assert store.integrity_problems() == []
            store.add(f"the store takes adds after kill {attempt}")
