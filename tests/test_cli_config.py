"""edgetrain COMMAND --config run.toml: the flags as a TOML table, flags on the command line win, and a bad
file or value is refused by name before any work."""
from __future__ import annotations

import json
import os

import pytest

from edgetrain.cli import main

RUN = 'model = "tiny"\nmethod = "mezo"\nsteps = 2\nseq = 16\nbatch = 2\nrank = 2\nquiet = true\n'


def _logged(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_file_sets_the_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(RUN + f'log-jsonl = "{tmp_path / "a.jsonl"}"\n')
    assert main(["train", "--config", str(config)]) == 0
    assert [(line["step"], line["method"], line["tokens"]) for line in _logged(tmp_path / "a.jsonl")] == [
        (1, "mezo", 32), (2, "mezo", 32)]
    assert main(["train", "--config", str(config), "--method", "bp", "--steps", "3",
                 "--log-jsonl", str(tmp_path / "b.jsonl")]) == 0
    assert [(line["step"], line["method"]) for line in _logged(tmp_path / "b.jsonl")] == [(1, "bp"), (2, "bp"),
                                                                                          (3, "bp")]


def test_underscores_lists_and_a_required_flag_can_come_from_the_file(tmp_path, capsys):
    from edgetrain.cli import config_file
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--files", nargs="*")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    config = tmp_path / "run.toml"
    config.write_text('out = "x.pte"\nfiles = ["a", "b"]\ncheckpoint_every = 5\n')
    values = config_file.read_config(config, parser)
    assert values == {"out": "x.pte", "files": ["a", "b"], "checkpoint_every": 5}
    top = argparse.ArgumentParser()
    commands = top.add_subparsers(dest="command")
    command = commands.add_parser("run")
    command.add_argument("--out", required=True)
    assert config_file.apply_config(top, command, ["run"], {"out": "x.pte"}).out == "x.pte"
    assert config_file.apply_config(top, command, ["run", "--out", "y.pte"], {"out": "x.pte"}).out == "y.pte"


@pytest.mark.parametrize("text, message", [
    ('modle = "tiny"\n', "unknown key 'modle'"),
    ('steps = "many"\n', "steps: 'many' is not a valid value"),
    ("steps = 1.5\n", "steps: 1.5 is not a valid value"),
    ('quiet = "yes"\n', "quiet: expected true or false"),
    ("steps = [1, 2]\n", "expected one value for --steps"),
    ("[model]\nname = 1\n", "expected one value for --model"),
    ("steps = \n", "not valid TOML"),
    ('optimizer = true\n', "expected one value for --optimizer"),
])
def test_a_bad_file_or_value_is_refused_by_name_before_any_work(tmp_path, capsys, text, message):
    config = tmp_path / "run.toml"
    config.write_text(text)
    assert main(["train", "--config", str(config), "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--checkpoint-every", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and f"--config {config}" in err, err
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())


def test_a_config_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path, capsys):
    fifo = tmp_path / "run.toml"
    os.mkfifo(fifo)  # opening it to read would block forever
    assert main(["train", "--config", str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["list", "methods", "--config", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
