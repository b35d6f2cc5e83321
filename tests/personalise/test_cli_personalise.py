"""`edgetrain personalise add | run | status | forget | rollback`, in-process through edgetrain.cli.main."""
from __future__ import annotations

import io
import json

from edgetrain.cli import main
from edgetrain.personalise import Store, parse_example
from personalise_kit import english_texts


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["personalise", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_add_prints_one_id_per_example_and_the_existing_id_for_duplicates(tmp_path, capsys, monkeypatch):
    store = str(tmp_path / "store")
    note = tmp_path / "note.txt"
    note.write_text("a whole file is one example\nacross lines\n")
    lines = tmp_path / "more.jsonl"
    records = [{"text": "first line"}, {"messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "hello"}]},
               {"text": "first line"}]
    lines.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    code, out, _ = _run(capsys, "add", "--store", store, str(note), str(lines))
    ids = out.split()
    assert code == 0 and len(ids) == 4 and ids[1] == ids[3]
    assert ids[0] == parse_example("a whole file is one example\nacross lines\n").id
    monkeypatch.setattr("sys.stdin", io.StringIO("typed on standard input\n"))
    code, out, _ = _run(capsys, "add", "--store", store, "-")
    assert out.strip() == parse_example("typed on standard input\n").id
    monkeypatch.setattr("sys.stdin", io.StringIO('{"text": "first line"}\n'))
    assert _run(capsys, "add", "--store", store, "-")[1].strip() == ids[1]
    with Store(store) as examples:
        assert examples.count()[0] == 4


def test_bad_input_is_refused_with_the_file_and_line_and_nothing_is_added(tmp_path, capsys):
    store = str(tmp_path / "store")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"messages": [{"role": "user", "content": "no answer"}]}\n')
    code, out, err = _run(capsys, "add", "--store", store, str(bad))
    assert code == 2 and out == "" and f"{bad}:2:" in err and "assistant" in err
    code, _, err = _run(capsys, "add", "--store", store, str(tmp_path / "missing.txt"))
    assert code == 2 and "no such file" in err
    with Store(store) as examples:
        assert examples.count()[0] == 0


def test_run_status_forget_rollback(tmp_path, capsys):
    store = str(tmp_path / "store")
    texts = tmp_path / "notes.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_texts(40)))
    ids = _run(capsys, "add", "--store", store, str(texts))[1].split()
    fast = ["--seq", "32", "--window-steps", "6", "--lr", "5e-3", "--holdout-every", "4", "--no-guard"]
    code, out, _ = _run(capsys, "run", "--store", store, "--model", "tiny", "--max-steps", "12", *fast)
    summary = json.loads(out)
    assert code == 0 and summary["steps"] == 12 and summary["promoted"] and summary["served"] == summary["promoted"][-1]
    code, out, err = _run(capsys, "run", "--store", store, "--model", "mlp-digits", "--max-steps", "1")
    assert code == 2 and "personalises 'tiny'" in err
    code, out, _ = _run(capsys, "run", "--store", store, "--max-steps", "0", "--require-power", "--max-temp", "200",
                        "--min-free-mb", "1", *fast)
    assert code == 0 and json.loads(out)["ended"] == "max_steps"
    status = json.loads(_run(capsys, "status", "--store", store, "--json")[1])
    assert status["model"] == "tiny" and status["examples"] == 40 and status["served"] == summary["served"]
    assert status["held_out"] + status["training_examples"] == 40
    assert [v["version"] for v in status["versions"] if v["promoted"]] == [summary["served"]]
    text = _run(capsys, "status", "--store", store)[1]
    assert "held out" in text and f"v{summary['served']}" in text and "promoted" in text
    code, out, err = _run(capsys, "forget", "--store", store, ids[5], "ffffffffffffffff")
    assert code == 2 and out.split() == [ids[5]] and "ffffffffffffffff" in err
    assert _run(capsys, "status", "--store", store, "--json")[1] and \
        json.loads(_run(capsys, "status", "--store", store, "--json")[1])["examples"] == 39
    code, out, _ = _run(capsys, "rollback", "--store", store)
    served = json.loads(_run(capsys, "status", "--store", store, "--json")[1])["served"]
    assert code == 0 and out.strip() == ("serving the base model" if served == "base" else f"serving version {served}")


def test_run_follows_the_policy_flags_with_this_machines_readings(tmp_path, capsys):
    from edgetrain.personalise import SystemSensors

    store = str(tmp_path / "store")
    _run(capsys, "add", "--store", store, *[str(p) for p in _text_files(tmp_path, 12)])
    code, out, _ = _run(capsys, "run", "--store", store, "--model", "tiny", "--max-steps", "1", "--require-power",
                        "--unknown", "deny", "--seq", "32")
    on_power = SystemSensors().read().on_power
    assert code == 0 and json.loads(out)["ended"] == ("max_steps" if on_power else "policy")
    status = json.loads(_run(capsys, "status", "--store", store, "--json")[1])
    assert status["policy"]["allowed"] is bool(on_power)
    if not on_power:
        assert "on battery" in status["last_pause"]["reason"] or "on_power unknown" in status["last_pause"]["reason"]


def _text_files(directory, count):
    files = []
    for number, text in enumerate(english_texts(count)):
        path = directory / f"note{number}.txt"
        path.write_text(text)
        files.append(path)
    return files
