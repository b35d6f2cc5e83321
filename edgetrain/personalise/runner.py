"""A Personaliser's run: the loop that trains in windows while the policy allows, and its thread control.

Runner holds what the app's thread and the training thread share (the pause, stop and wake flags, the
app's idle flag, the background thread and its error) and the loop that reads them at every step boundary,
asks the policy, and drives the windows (edgetrain.personalise.window). run_lock keeps one run per store,
across processes.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Protocol

from edgetrain.personalise.errors import PersonaliseError, StoreBusyError
from edgetrain.personalise.kinds import NotEnoughData
from edgetrain.personalise.policy import Decision
from edgetrain.personalise.run_result import RunResult
from edgetrain.personalise.window import Interrupted, WindowOwner, Windows
from edgetrain.utils.logs import get_logger

log = get_logger("edgetrain.personalise.personaliser")  # the Personaliser's logger, as before the split

LOCK = "run.lock"


@contextmanager
def run_lock(directory: Path, blocking: bool = True) -> Iterator[bool]:
    """The run lock of the store in `directory` (one training run per store, across processes).
    blocking=True: raises StoreBusyError when held elsewhere; False: yields whether it was acquired."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one run per store is then the app's to ensure
        yield True
        return
    path = directory / LOCK
    handle = open(path, "a+b")
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            if blocking:
                raise StoreBusyError(f"store {directory} is being trained by another run "
                                     "(another process, or another Personaliser of this one)") from None
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    finally:
        handle.close()


class RunOwner(WindowOwner, Protocol):
    """What the run reads off the Personaliser besides what its windows read."""

    policy: Any
    sensors: Any
    poll_seconds: float


class Runner:
    """The run of `owner` (its store, policy, sensors and settings are read off the Personaliser)."""

    def __init__(self, owner: RunOwner) -> None:
        self.owner = owner
        self.windows = Windows(owner, self.interrupted)
        self.idle: bool | None = None
        self.pause_requested = threading.Event()
        self.stop_requested = threading.Event()
        self.wake = threading.Event()
        self.acknowledged = threading.Event()
        self.requested_at = 0.0
        self.latency: float | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.decision: Decision | None = None
        self.read_at = 0.0
        self.active = False

    # -- what the app's thread calls ----------------------------------------------------------------------
    def set_idle(self, idle: bool) -> None:
        self.idle = bool(idle)
        self.wake.set()

    def start(self, max_steps: int | None, max_seconds: float | None) -> threading.Thread:
        if self.thread is not None and self.thread.is_alive():
            raise PersonaliseError("the personaliser is already running in the background")
        self.error = None
        self.active = True  # a stop() from now on reaches the run, even before the thread has begun it

        def target() -> None:
            try:
                self.run(max_steps, max_seconds, wait=True)
            except BaseException as exc:  # noqa: BLE001 -- handed to the app by stop()/join()
                self.error = exc
                self.owner.events.emit("error", error=f"{type(exc).__name__}: {exc}")
                log.warning("the personaliser's background run failed: %r", exc)

        self.thread = threading.Thread(target=target, name="edgetrain-personaliser", daemon=True)
        self.thread.start()
        return self.thread

    def request(self, event: threading.Event) -> None:
        self.acknowledged.clear()
        self.requested_at = time.perf_counter()
        event.set()
        self.wake.set()

    def pause(self, wait: bool, timeout: float | None) -> float | None:
        running = self.active
        self.request(self.pause_requested)
        return self.await_acknowledged(wait and running, timeout)

    def resume(self) -> None:
        self.pause_requested.clear()
        self.wake.set()

    def stop(self, wait: bool, timeout: float | None) -> float | None:
        if not self.active:
            return None
        self.request(self.stop_requested)
        latency = self.await_acknowledged(wait, timeout)
        if wait and self.thread is not None:
            self.join(timeout)
        return latency

    def join(self, timeout: float | None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
            if self.error is not None:
                error, self.error = self.error, None
                raise error

    def await_acknowledged(self, wait: bool, timeout: float | None) -> float | None:
        if not wait:
            return None
        if not self.acknowledged.wait(timeout):
            return None
        return self.latency

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    # -- the run ------------------------------------------------------------------------------------------
    def run(self, max_steps: int | None, max_seconds: float | None, wait: bool) -> RunResult:
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0):
            raise PersonaliseError(f"max_steps must be a whole number >= 0 or None, got {max_steps!r}")
        owner = self.owner
        result = RunResult()
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        with run_lock(owner.directory):
            owner.require_model()
            self.active = True
            failure: BaseException | None = None
            try:
                self.windows.clean_up()
                result.reason = self.loop(result, max_steps, deadline, wait)
            except BaseException as exc:
                result.reason = "error"
                failure = exc
                raise
            finally:
                self.active = False
                self.acknowledge()
                try:
                    try:
                        self.windows.checkpoint()
                    finally:
                        self.windows.current = None
                    owner.events.emit("stopped", reason=result.reason, steps=result.steps)
                except Exception as exc:
                    if failure is None:
                        raise
                    # The run's own error says what stopped it (a full disk names the file it could not
                    # write); the last checkpoint failing too, on the same disk, must not replace it.
                    log.warning("after %s, the run's last checkpoint failed too: %s", type(failure).__name__, exc)
        return result

    def acknowledge(self) -> None:
        if not self.acknowledged.is_set():
            self.latency = time.perf_counter() - self.requested_at if self.requested_at else None
            self.acknowledged.set()

    def loop(self, result: RunResult, max_steps: int | None, deadline: float | None, wait: bool) -> str:
        windows = self.windows
        paused_for: str | None = None
        waiting_for: str | None = None
        while True:
            if self.stop_requested.is_set():
                self.acknowledge()
                self.stop_requested.clear()
                return "stop"
            if max_steps is not None and result.steps >= max_steps:
                return "max_steps"
            if deadline is not None and time.monotonic() >= deadline:
                return "max_seconds"
            if self.pause_requested.is_set():
                self.acknowledge()
                if paused_for != "app":
                    paused_for = "app"
                    self.note_pause("app")
                    windows.checkpoint()
                if not wait:
                    return "paused"
                self.sleep(deadline)
                continue
            decision = self.decide()
            if not decision.allowed:
                if paused_for != decision.reason:
                    paused_for = decision.reason
                    self.note_pause(decision.reason)
                    windows.checkpoint()
                if not wait:
                    return "policy"
                self.sleep(deadline)
                continue
            if paused_for is not None:
                self.owner.events.emit("resumed", after=paused_for)
                paused_for = None
            windows.check_generation()
            try:
                if windows.current is None:
                    windows.open()
                    continue  # decide again: the window's first batch tells the step's memory need
            except NotEnoughData as exc:
                reason = str(exc)
                if waiting_for != reason:
                    waiting_for = reason
                    self.owner.events.emit("waiting", reason=reason)
                if not wait:
                    return "waiting"
                self.sleep(deadline, self.owner.poll_seconds * 4)
                continue
            except Interrupted:
                continue
            waiting_for = None
            window = windows.current
            if window.learner.steps_done < window.state["steps"]:
                windows.step(window, result)
            # A window whose steps are done meets the gate at once, so a run that ends with it has judged it.
            if windows.current is window and window.learner.steps_done >= window.state["steps"]:
                try:
                    windows.gate(window, result)
                except Interrupted:
                    continue

    def sleep(self, deadline: float | None, seconds: float | None = None) -> None:
        seconds = self.owner.poll_seconds if seconds is None else seconds
        if deadline is not None:
            seconds = max(0.0, min(seconds, deadline - time.monotonic()))
        self.wake.wait(seconds)
        self.wake.clear()

    def interrupted(self) -> bool:
        return self.stop_requested.is_set() or self.pause_requested.is_set()

    def note_pause(self, reason: str) -> None:
        self.owner.events.emit("paused", reason=reason)
        self.owner.store.set_meta("last_pause", {"reason": reason, "time": time.time()})

    def decide(self) -> Decision:
        """The policy's decision: the sensors are read every `check_every_s`; the app's idle flag and the
        step's memory need are taken as they are now."""
        owner = self.owner
        now = time.monotonic()
        previous = self.decision
        if previous is None or now - self.read_at >= owner.policy.check_every_s:
            try:
                readings = owner.sensors.read()
            except Exception as exc:  # noqa: BLE001 -- an injected reader's failure: treat as unknown readings
                from edgetrain.personalise.sensors import Readings

                readings = Readings(notes={"error": f"the sensors raised {type(exc).__name__}: {exc}"})
            self.read_at = now
        else:
            readings = previous.readings
        self.decision = owner.policy.decide(readings, idle=self.idle, need_bytes=self.windows.need_bytes)
        if previous is None or previous.allowed != self.decision.allowed or previous.reasons != self.decision.reasons:
            owner.store.set_meta("policy", {**self.decision.to_dict(), "time": time.time()})
        return self.decision
