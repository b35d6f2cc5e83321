"""The library speaks through the "edgetrain" logger, never print(); the CLI shows progress unless --quiet;
a progress bar appears only on an interactive terminal."""
from __future__ import annotations

import ast
import io
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from progress_testkit import FakeClock, StampedStream, longest_silence

import edgetrain
from edgetrain.cli import main as cli_main
from edgetrain.utils import progress
from edgetrain.utils.logs import ROOT_LOGGER, configure_cli_logging
from edgetrain.utils.progress import NoBar, NoStages, clock_text, progress_bar, stage_progress

PACKAGE = Path(edgetrain.__file__).resolve().parent
# Programs (a main() run from the command line) may print their results; library code may not.
PRINTING_ALLOWED = {"cli", "profiler/worker.py", "backends/mlx/profile.py", "distributed/elastic_run.py",
                    "recipes/scpl_pipeline.py", "recipes/subnet_dp/run.py"}


def _allowed(path: Path) -> bool:
    relative = path.relative_to(PACKAGE).as_posix()
    return any(relative == entry or relative.startswith(entry + "/") for entry in PRINTING_ALLOWED)


def _prints_outside_main(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    in_main = {id(node) for function in ast.walk(tree) if isinstance(function, ast.FunctionDef)
               and function.name == "main" for node in ast.walk(function)}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "print" and id(node) not in in_main]


def test_library_code_never_prints():
    found = {str(path.relative_to(PACKAGE)): lines for path in sorted(PACKAGE.rglob("*.py"))
             if not _allowed(path) and (lines := _prints_outside_main(path))}
    assert found == {}, f"print() in library code (use edgetrain.utils.logs.get_logger): {found}"


def test_fit_logs_progress_lines_at_info_and_prints_nothing(tiny_lora, text_batches, caplog, capsys):
    learner = edgetrain.Learner(tiny_lora(), method="bp", probe=False)
    with caplog.at_level(logging.INFO, logger=ROOT_LOGGER):
        learner.fit(text_batches(4), max_steps=4, log_every=2, progress=True)  # not a terminal: no bar
    lines = [r.getMessage() for r in caplog.records if r.name == "edgetrain.training.learner"]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"] and "loss" in lines[0]
    assert capsys.readouterr() == ("", "")
    with pytest.raises(edgetrain.EdgetrainError, match="log_every"):
        learner.fit(text_batches(1), max_steps=5, log_every=-1)


def test_the_cli_handler_shows_info_or_only_warnings_when_quiet(edgetrain_logger_as_found, capsys):
    configure_cli_logging()
    configure_cli_logging()  # again: still one handler
    assert sum(h.get_name() == "edgetrain-cli" for h in edgetrain_logger_as_found.handlers) == 1
    logging.getLogger("edgetrain.anything").info("progress")
    assert capsys.readouterr().err == "edgetrain: progress\n"
    configure_cli_logging(quiet=True)
    logging.getLogger("edgetrain.anything").info("progress")
    logging.getLogger("edgetrain.anything").warning("a warning")
    assert capsys.readouterr().err == "edgetrain: a warning\n"


def test_cli_train_shows_step_lines_and_quiet_silences_them(edgetrain_logger_as_found, capsys):
    argv = ["train", "--model", "tiny", "--method", "bp", "--steps", "2", "--seq", "16", "--batch", "2", "--rank", "2"]
    assert cli_main(argv) == 0
    captured = capsys.readouterr()
    assert "edgetrain: step 2/2  loss" in captured.err and '"steps_done": 2' in captured.out
    assert cli_main([*argv, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and '"steps_done": 2' in captured.out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_only_on_a_terminal(monkeypatch):
    with progress_bar(3, description="x", enabled=False) as bar:
        assert isinstance(bar, NoBar)
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with progress_bar(3, description="fit bp") as bar:
        bar.update(3)
    assert "fit bp" in terminal.getvalue() and "3/3" in terminal.getvalue()
    piped = io.StringIO()
    monkeypatch.setattr("sys.stderr", piped)
    with progress_bar(3, description="fit bp") as bar:
        bar.update(3)
    assert piped.getvalue() == ""


@pytest.fixture
def fake_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(progress, "time", clock)
    monkeypatch.setattr(progress, "HEARTBEAT_TICK_S", 0.001)
    return clock


def _lowering(clock: FakeClock, seconds: tuple[int, ...] = (10, 30)) -> None:
    """Two stages of 100 and 300 units (the shape of a program's methods), taking `seconds` of the fake clock."""
    with stage_progress("lowering", 400, unit="node") as stages:
        for name, size, spent in zip("ab", (100, 300), seconds):
            stages.begin(name, size)
            clock.pass_seconds(spent)


def test_stages_say_each_begin_and_a_heartbeat_with_the_estimate(fake_clock, edgetrain_logger_as_found):
    configure_cli_logging()
    err = StampedStream(fake_clock)
    sys_stderr, sys.stderr = sys.stderr, err
    try:
        _lowering(fake_clock)
    finally:
        sys.stderr = sys_stderr
    # b runs at a's pace, 0.1 s a unit: 30 s for its 300, less what it has had.
    assert [line for _, line in err.lines] == [
        "edgetrain: lowering: a: 100 nodes",
        "edgetrain: lowering: a: 8 s (8 s in all), 0 of 400 nodes done",
        "edgetrain: lowering: b: 300 nodes",
        "edgetrain: lowering: b: 8 s (18 s in all), 100 of 400 nodes done, about 22 s left",
        "edgetrain: lowering: b: 16 s (26 s in all), 100 of 400 nodes done, about 14 s left",
        "edgetrain: lowering: b: 24 s (34 s in all), 100 of 400 nodes done, about 6 s left",
        "edgetrain: lowering: done in 40 s"]
    assert not [thread for thread in threading.enumerate() if thread.name == "edgetrain-heartbeat"]


def test_no_estimate_from_the_pace_of_a_small_first_stage(fake_clock, edgetrain_logger_as_found, capsys):
    # Lowering a 1-node method is mostly fixed cost: its pace once promised an hour for a 6-minute export.
    configure_cli_logging()
    with stage_progress("lowering", 400, unit="node") as stages:
        stages.begin("a", 1)
        fake_clock.pass_seconds(5)
        stages.begin("b", 99)
        fake_clock.pass_seconds(9)
        stages.begin("c", 300)
        fake_clock.pass_seconds(9)
    lines = capsys.readouterr().err.splitlines()
    assert "edgetrain: lowering: b: 8 s (13 s in all), 1 of 400 nodes done" in lines
    assert "edgetrain: lowering: c: 8 s (22 s in all), 100 of 400 nodes done, about 34 s left" in lines


def test_no_ten_seconds_without_a_line_however_long_a_stage(fake_clock, edgetrain_logger_as_found):
    configure_cli_logging()
    err = StampedStream(fake_clock)
    sys_stderr, sys.stderr = sys.stderr, err
    try:
        start = fake_clock.monotonic()
        _lowering(fake_clock, (3, 95))
        end = fake_clock.monotonic()
    finally:
        sys.stderr = sys_stderr
    assert longest_silence(start, end, err) <= 10


def test_no_stage_lines_nor_heartbeat_unless_info_is_shown(fake_clock, edgetrain_logger_as_found, capsys):
    configure_cli_logging(quiet=True)  # what --quiet does
    with stage_progress("lowering", 400, unit="node") as stages:
        assert isinstance(stages, NoStages)
        assert not [thread for thread in threading.enumerate() if thread.name == "edgetrain-heartbeat"]
    _lowering(fake_clock)
    assert capsys.readouterr() == ("", "")


def test_on_a_terminal_the_bar_keeps_time_instead_of_heartbeat_lines(fake_clock, edgetrain_logger_as_found,
                                                                   monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    configure_cli_logging()
    _lowering(fake_clock)
    text = terminal.getvalue()
    assert "lowering: b: 300 nodes" in text and "400/400" in text
    assert "in all" not in text  # no heartbeat line: the bar is redrawn


def test_clock_text_reads_as_a_person_would():
    assert [clock_text(s) for s in (0.4, 7, 59.6, 125, 3725)] == ["0 s", "7 s", "1:00", "2:05", "1:02:05"]


def test_a_library_logging_through_the_root_logger_does_not_double_the_cli_lines():
    # ExecuTorch calls logging.debug(), which gives a root logger without handlers one that prints everything
    # (logging.basicConfig): each edgetrain line printed twice before the CLI claimed the root logger.
    script = ("import logging, sys\n"
              "import edgetrain.cli.list as listing\n"
              "from edgetrain.cli import main\n"
              "def noisy(args):\n"
              "    logging.debug('from a library')\n"
              "    logging.getLogger('a.library').warning('a warning of a library')\n"
              "    logging.getLogger('edgetrain.cli.list').info('a progress line')\n"
              "    return 0\n"
              "listing.main = noisy\n"
              "sys.exit(main(['list']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ours = [line for line in done.stderr.splitlines() if "a progress line" in line or "a warning" in line]
    assert ours == ["a warning of a library", "edgetrain: a progress line"]
