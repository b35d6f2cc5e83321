"""edgetrain train --log-jsonl: one JSON line of step statistics per step, continued across a resume."""
from __future__ import annotations

import json
import math

from edgetrain.cli import main
from edgetrain.training.learner import StepStats

COMMON = ["train", "--model", "tiny", "--method", "bp", "--seq", "16", "--batch", "2", "--rank", "2", "--quiet"]


def test_one_line_per_step_and_a_resumed_run_goes_on_appending(tmp_path, capsys):
    log, checkpoints = tmp_path / "steps.jsonl", tmp_path / "ckpt"
    options = ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1", "--log-jsonl", str(log)]
    assert main(COMMON + ["--steps", "3"] + options) == 0
    assert main(COMMON + ["--steps", "5"] + options) == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    fields = set(StepStats.__dataclass_fields__) | {"method"}
    assert all(set(line) == fields for line in lines)
    assert all(math.isfinite(line["loss"]) and line["method"] == "bp" and line["tokens"] == 32 for line in lines)
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["steps_done"] == 5


def test_a_log_path_that_cannot_be_written_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "a-directory").mkdir()
    code = main(COMMON + ["--steps", "1", "--log-jsonl", str(tmp_path / "a-directory"), "--checkpoint-dir",
                          str(tmp_path / "ckpt"), "--checkpoint-every", "1"])
    assert code == 2 and "--log-jsonl" in capsys.readouterr().err
    assert not list((tmp_path / "ckpt").glob("step-*"))
    (tmp_path / "a-file").write_text("not a directory")
    assert main(COMMON + ["--steps", "1", "--log-jsonl", str(tmp_path / "a-file" / "steps.jsonl")]) == 2
    assert "--log-jsonl" in capsys.readouterr().err


def test_schedule_accumulation_and_clipping_flags_reach_the_learner(tmp_path, capsys):
    log = tmp_path / "steps.jsonl"
    assert main(COMMON + ["--steps", "3", "--lr", "0.01", "--lr-schedule", "linear-warmup", "--schedule-option",
                          "warmup_steps=2", "--accumulate", "2", "--max-grad-norm", "0.5",
                          "--log-jsonl", str(log)]) == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    from edgetrain.training.schedules import LRSchedule

    warmup = LRSchedule.make("linear-warmup", {"warmup_steps": 2})
    assert [line["lr"] for line in lines] == [warmup.rate(0.01, step) for step in range(3)]
    assert lines[0]["lr"] < lines[1]["lr"] < lines[2]["lr"] == 0.01
    assert all(math.isfinite(line["loss"]) and line["tokens"] == 32 for line in lines)
    capsys.readouterr()
    assert main(COMMON + ["--steps", "1", "--accumulate", "3"]) == 2  # 3 micro-batches of a 2-sample batch
    assert "accumulate=3" in capsys.readouterr().err
    assert main(COMMON + ["--steps", "1", "--method", "mezo", "--max-grad-norm", "1"]) == 2
    assert "method 'mezo' steps in its own way" in capsys.readouterr().err
