"""`edgetrain personalise status --plot FILE`: the history read back from the event log (gate_history), drawn
from a real store's windows, a hand-written log with a torn last line and damaged lines, and the refusals
(no gate yet, a suffix matplotlib cannot write, no matplotlib), each leaving no file behind."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgetrain.cli import main
from edgetrain.personalise import Store, read_events
from edgetrain.personalise.history import GateRecord, NoGateYetError, gate_history, require_history
from personalise_kit import english_texts, make

matplotlib_image = pytest.importorskip("matplotlib.image", reason="the plot extra (matplotlib) is not installed")

FIGURES = ("window", "value", "reference", "by", "margin", "retain", "retain_base", "retain_worsened",
           "retain_margin")


def _status(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["personalise", "status", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A real store with two gates of the tiny preset, the forgetting guard on (scored on the app's own
    English, since the preset's own answers are noise): the first window promoted, the second rejected
    because it had to beat its start by 90%."""
    directory = tmp_path_factory.mktemp("history") / "store"
    with make(directory, threads=1, retain_margin=0.05) as personaliser:
        personaliser.add_many(english_texts(40))
        personaliser.add_retain(english_texts(12, start=200))
        assert personaliser.run(max_steps=6).promoted == [1]
    with make(directory, threads=1, retain_margin=0.05, margin=0.9) as personaliser:
        assert personaliser.run(max_steps=6).rejected == 1
    return directory


def test_gate_history_holds_each_gate_with_its_events_figures(store):
    gates = [e for e in read_events(store / "events.jsonl") if e["event"] in ("promoted", "rejected")]
    rows = gate_history(store)
    assert [(row.window, row.promoted, row.reason, row.version) for row in rows] == \
        [(1, True, "", 1), (2, False, "held_out", None)]
    for row, event in zip(rows, gates, strict=True):
        assert row.metric == event["metric"] == "perplexity" and not row.higher_is_better
        assert {name: getattr(row, name) for name in FIGURES} == {name: event[name] for name in FIGURES}
    assert rows[0].value < rows[0].reference and rows[1].failed == ("held_out",)
    assert rows[1].needed == pytest.approx(rows[1].reference * 0.1)
    assert rows[0].retain_limit == pytest.approx(rows[0].retain_base * 1.05)


def test_status_plot_writes_a_picture_of_the_history_beside_the_usual_status(store, tmp_path, capsys):
    picture = tmp_path / "pictures" / "history.png"
    code, out, err = _status(capsys, "--store", str(store), "--plot", str(picture))
    assert code == 0, err
    assert "served:" in out and f"plot:      {picture} (2 windows: 1 promoted, 1 rejected (1 held out))" in out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, channels = matplotlib_image.imread(picture).shape
    assert 600 <= width <= 2000 and 400 <= height <= 2000 and channels in (3, 4)
    assert [p.name for p in picture.parent.iterdir()] == ["history.png"]  # no temp left beside it


def test_status_plot_with_json_prints_one_json_object_and_draws_the_format_the_suffix_names(store, tmp_path,
                                                                                            capsys):
    picture = tmp_path / "history.svg"
    code, out, err = _status(capsys, "--store", str(store), "--json", "--plot", str(picture))
    assert code == 0, err
    assert json.loads(out)["versions"][0]["version"] == 1
    assert picture.read_text(encoding="utf-8").lstrip().startswith("<?xml") and "<svg" in picture.read_text()


def _event(kind: str, window: int, **fields) -> str:
    return json.dumps({"event": kind, "time": 1.0e9 + window, "window": window, **fields})


def test_a_hand_written_log_is_read_line_by_line_and_what_cannot_be_read_is_skipped(tmp_path):
    figures = dict(metric="perplexity", margin=0.02, retain_base=5.0, retain_margin=0.05)
    (tmp_path / "events.jsonl.1").write_text(  # the rotated log: the older gates, read first
        _event("promoted", 1, version=1, value=9.0, reference=10.0, by=0.1, retain=5.1, retain_worsened=0.02,
               **figures) + "\n")
    lines = [
        _event("step", 2, step=1, loss=2.0),
        _event("evaluated", 2, metric="perplexity", value=8.0, reference=9.0),
        _event("rejected", 2, reason="forgetting", value=8.0, reference=9.0, by=1 / 9, retain=6.0,
               retain_worsened=0.2, **figures),
        "{not json at all",
        _event("rejected", 3, reason="held_out and forgetting", value=9.5, reference=9.0, by=-0.5 / 9, retain=6.0,
               retain_worsened=0.2, **figures),
        _event("promoted", 4, version="four", value=8.0, reference=9.0, by=1 / 9, **figures),  # damaged: skipped
        _event("promoted", 5, version=2, value=8.0, by=1 / 9, **figures),  # no reference: skipped
        _event("rejected", 6, reason="training failed: the loss is not finite"),
        _event("rejected", 7, reason="held_out", value=8.9, reference=8.8, by=-0.01, **figures)[:40],  # torn
    ]
    (tmp_path / "events.jsonl").write_text("\n".join(lines))
    rows = gate_history(tmp_path)
    assert [(row.window, row.promoted, row.failed) for row in rows] == \
        [(1, True, ()), (2, False, ("forgetting",)), (3, False, ("held_out", "forgetting")), (6, False, ())]
    assert rows[1] == GateRecord(window=2, promoted=False, reason="forgetting", version=None, metric="perplexity",
                                 value=8.0, reference=9.0, by=1 / 9, margin=0.02, retain=6.0, retain_base=5.0,
                                 retain_worsened=0.2, retain_margin=0.05, time=1.0e9 + 2)
    assert rows[3].value is None and rows[3].reason.startswith("training failed")
    assert rows[1].needed == pytest.approx(9.0 * 0.98) and rows[1].retain_limit == pytest.approx(5.25)


def test_a_classifiers_history_is_read_with_accuracy_higher_is_better(tmp_path):
    (tmp_path / "events.jsonl").write_text(_event("rejected", 1, reason="held_out", metric="accuracy", value=0.5,
                                                  reference=0.6, by=-0.1, margin=0.05) + "\n")
    [row] = gate_history(tmp_path)
    assert row.higher_is_better and row.needed == pytest.approx(0.65) and row.retain_limit is None


def test_the_picture_of_a_hand_written_history_marks_forgetting_and_failed_windows(tmp_path):
    from edgetrain.personalise.plot import plot_history

    figures = dict(metric="perplexity", margin=0.02, retain_base=5.0, retain_margin=0.05)
    (tmp_path / "events.jsonl").write_text("\n".join([
        _event("promoted", 1, version=1, value=9.0, reference=10.0, by=0.1, retain=5.1, retain_worsened=0.02,
               **figures),
        _event("rejected", 2, reason="forgetting", value=8.0, reference=9.0, by=1 / 9, retain=6.0,
               retain_worsened=0.2, **figures),
        _event("rejected", 3, reason="training failed: the loss is not finite"),
        _event("promoted", 4, version=2, value=8.5, reference=9.0, by=0.5 / 9, retain=5.2, retain_worsened=0.04,
               **figures)]) + "\n")
    picture = plot_history(gate_history(tmp_path), tmp_path / "history.png", title="hand-written")
    assert matplotlib_image.imread(picture).shape[:2] == (770, 990)  # 9 x 7 inches at 110 dpi


def test_a_store_with_no_gate_yet_is_refused_by_name_and_no_picture_is_written(tmp_path, capsys):
    assert gate_history(tmp_path / "nowhere") == []
    with pytest.raises(NoGateYetError, match="no event log"):
        require_history(tmp_path / "nowhere")
    with Store(tmp_path / "store") as examples:
        examples.add_many(english_texts(3))
    (tmp_path / "store" / "events.jsonl").write_text(_event("waiting", 1, reason="not enough") + "\n")
    picture = tmp_path / "history.png"
    code, out, err = _status(capsys, "--store", str(tmp_path / "store"), "--plot", str(picture))
    assert code == 2 and out == "" and "no gate yet" in err and "personalise run" in err
    assert not picture.exists()


def test_a_suffix_matplotlib_cannot_write_is_refused_by_name(store, tmp_path, capsys):
    for name, said in (("history.xyz", "suffix .xyz"), ("history", "no suffix")):
        code, out, err = _status(capsys, "--store", str(store), "--plot", str(tmp_path / name))
        assert code == 2 and out == "" and said in err and ".png" in err
        assert not (tmp_path / name).exists()


def test_without_matplotlib_the_plot_is_refused_with_the_extra_to_install(store, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    code, out, err = _status(capsys, "--store", str(store), "--plot", str(tmp_path / "history.png"))
    assert code == 2 and out == "" and "pip install 'edgetrain[plot]'" in err


@pytest.mark.parametrize("failing", ["render", "write"])
def test_a_failed_save_keeps_the_previous_picture_whole(store, tmp_path, monkeypatch, failing):
    import os

    import matplotlib.figure

    from edgetrain.files.space import DiskFullError
    from edgetrain.personalise.plot import plot_history

    picture = tmp_path / "history.png"
    picture.write_bytes(b"the previous picture")

    def torn(figure, target, **options):
        target.write(b"\x89PNG half of it")
        raise OSError(28, "No space left on device")

    def full(descriptor):
        raise OSError(28, "No space left on device")

    if failing == "render":
        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", torn)
    else:  # the picture is rendered; the disk fills while it is written
        monkeypatch.setattr(os, "fsync", full)
    # The write's ENOSPC is translated (DiskFullError, an OSError too); the render's is passed on as it is.
    with pytest.raises(DiskFullError if failing == "write" else OSError, match="(?i)no space left"):
        plot_history(gate_history(store), picture)
    monkeypatch.undo()
    assert picture.read_bytes() == b"the previous picture"
    assert [p.name for p in tmp_path.iterdir()] == ["history.png"]  # no temp left beside it


def test_status_without_plot_does_not_import_matplotlib(store):
    code = ("import sys; from edgetrain.cli import main; "
            f"assert main(['personalise', 'status', '--store', {str(store)!r}]) == 0; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "False"
