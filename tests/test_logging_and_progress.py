"""The library speaks through the "edgetrain" logger, never print(); the CLI shows progress unless --quiet;
a progress bar appears only on an interactive terminal."""
from __future__ import annotations

import ast
import io
import logging
from pathlib import Path

import pytest

import edgetrain
from edgetrain.cli import main as cli_main
from edgetrain.utils.logs import ROOT_LOGGER, configure_cli_logging
from edgetrain.utils.progress import NoBar, progress_bar

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
