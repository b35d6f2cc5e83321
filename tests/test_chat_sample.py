"""samples/chat_personalise.py driven in a real terminal (tmux): type, read the screen, kill it with SIGKILL
while it trains, start it again, and find every exchange whose reply was shown still in the store and the
training window resumed from its checkpoint."""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgetrain.data import default_text_corpus
from edgetrain.personalise import Store, read_events

REPO = Path(__file__).parent.parent
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux to drive a real terminal")


class Terminal:
    """One tmux session on a private server socket, running one command."""

    def __init__(self, socket: Path) -> None:
        self.socket = str(socket)

    def _tmux(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)}: {done.stderr}")
        return done.stdout

    def start(self, command: list[str], env: dict[str, str]) -> None:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        self._tmux("new-session", "-d", "-s", "chat", "-x", "200", "-y", "50",
                   f"cd {shlex.quote(str(REPO))} && exec env {exports} {shlex.join(command)}")

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-J", "-S", "-5000", "-t", "chat", check=False)

    def type(self, text: str) -> None:
        self._tmux("send-keys", "-t", "chat", "-l", text)
        self._tmux("send-keys", "-t", "chat", "Enter")

    def wait_for(self, what: str, count: int = 1, timeout: float = 240.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if screen.count(what) >= count:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{what!r} x{count} not on the screen after {timeout} s:\n{self.screen()[-3000:]}")

    def pid(self) -> int:
        return int(self._tmux("list-panes", "-t", "chat", "-F", "#{pane_pid}").split()[0])

    def close(self) -> None:
        self._tmux("kill-server", check=False)


def _wait_for_event(store: Path, name: str, after: int, timeout: float = 240.0) -> dict:
    """The first `name` event after the first `after` events of the store's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = read_events(store / "events.jsonl")[after:]
        found = [event for event in events if event["event"] == name]
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no {name!r} event after {timeout} s: {read_events(store / 'events.jsonl')[-10:]}")


def _chat(tmp_path: Path, model: str, max_tokens: int) -> None:
    store = tmp_path / "store"
    with Store(store) as seed:  # earlier notes of the user's, so there is something to hold out and train on
        paragraphs = [p for p in default_text_corpus().split("\n\n") if 200 < len(p) < 1200]
        for paragraph in paragraphs[:12]:
            seed.add(paragraph)
    command = [sys.executable, "samples/chat_personalise.py", "--store", str(store), "--model", model,
               "--max-tokens", str(max_tokens), "--window-steps", "200", "--seq", "64",
               *(["--no-guard"] if model == "tiny" else [])]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
           **{k: v for k, v in os.environ.items() if k in ("EDGETRAIN_CACHE", "HOME")}}
    said = ["my cat is called Pixel", "I water the ficus on Sundays", "the spare key is under the blue pot"]
    terminal = Terminal(tmp_path / "tmux.sock")
    try:
        terminal.start(command, env)
        terminal.wait_for("you> ")
        for number, line in enumerate(said, 1):
            terminal.type(line)
            terminal.wait_for("bot> ", count=number)
        # Idle at the prompt, it trains: kill it between a checkpoint and the next one.
        checkpoint = _wait_for_event(store, "checkpoint", after=0)
        _wait_for_event(store, "step", after=len(read_events(store / "events.jsonl")))
        os.kill(terminal.pid(), signal.SIGKILL)
        events_before_restart = len(read_events(store / "events.jsonl"))
        deadline = time.monotonic() + 30
        while "chat" in terminal._tmux("list-sessions", "-F", "#{session_name}", check=False) \
                and time.monotonic() < deadline:
            time.sleep(0.2)

        with Store(store) as kept:
            bodies = [str(body) for _, _, _, body in kept.rows()]
        for line in said:
            assert sum(line in body for body in bodies) == 1, (line, bodies[-3:])

        terminal.start(command, env)
        screen = terminal.wait_for("you> ")
        assert f"{12 + len(said)} exchanges kept" in screen, screen[-2000:]
        resumed = _wait_for_event(store, "window_resumed", after=events_before_restart)
        assert resumed["window"] == checkpoint["window"] and resumed["step"] >= checkpoint["step"] >= 1, resumed
        terminal.type("what is my cat called?")
        terminal.wait_for("bot> ", count=1)
        terminal.type("/quit")
        deadline = time.monotonic() + 60
        while "chat" in terminal._tmux("list-sessions", "-F", "#{session_name}", check=False) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        with Store(store) as kept:
            assert kept.count()[0] == 12 + len(said) + 1
    finally:
        terminal.close()


def test_the_chat_keeps_every_exchange_and_resumes_training_after_a_kill(tmp_path):
    _chat(tmp_path, "tiny", max_tokens=6)


@pytest.mark.slow
def test_the_chat_on_smollm2(tmp_path, smollm2_file):
    _chat(tmp_path, "smollm2-135m", max_tokens=16)
