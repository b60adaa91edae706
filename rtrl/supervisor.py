"""The daemon supervisor behind ``rtrl run`` (and the demo): runs the loop's processes and keeps them up.

The loop is four long-lived processes: the gateway, the labeler, the Celery worker (training cycle,
eval gate, deploy) and Celery beat (the schedule). Each is an ``rtrl`` subcommand; the supervisor
starts them in their own process groups with logs under ``<run_dir>/logs/`` and hands each its
settings (`rtrl.launch.child_env`). A process that exits is restarted: at once the first time,
then after a delay that doubles from `BACKOFF_START_S` (capped at `BACKOFF_MAX_S`); one that
exits again after `MAX_RESTARTS` restarts within `RESTART_WINDOW_S` is given up on, and
`run_forever` then stops everything and raises. SIGTERM/SIGINT stops them all. State lives in Kafka, the SQL store and
MLflow, so a restarted process resumes where its predecessor committed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rtrl.launch import child_env, rtrl_command
from schemas.clock import Monotonic
from schemas.errors import OperatorError
from schemas.settings import Settings

if TYPE_CHECKING:
    from registry import Registry
    from store import Store

log = logging.getLogger("rtrl.supervisor")

# Every process the loop is made of, as the rtrl subcommand that runs it.
PROCESSES: dict[str, list[str]] = {
    "gateway": ["gateway"],
    "labeler": ["labeler"],
    "worker": ["worker"],
    "beat": ["beat"],
    "reconciler": ["deploy", "reconcile", "--forever"],
}

MAX_RESTARTS = 5  # restarts within RESTART_WINDOW_S; the next exit leaves the process down, reported
RESTART_WINDOW_S = 300.0
BACKOFF_START_S = 1.0  # delay before the second restart within the window; doubles after that
BACKOFF_MAX_S = 60.0


def restart_delay(recent_restarts: int) -> float:
    """Seconds to wait before restarting a process that was already restarted this many times recently."""
    if recent_restarts == 0:
        return 0.0
    return float(min(BACKOFF_START_S * 2 ** (recent_restarts - 1), BACKOFF_MAX_S))


def prepare(settings: Settings, store: Store, registry: Registry) -> int:
    """What the loop needs before its processes start: the store's tables, the topics, and a
    champion in the registry that every vLLM server serves. Idempotent; returns the champion."""
    import streams
    from deployer.rollout import bootstrap

    store.migrate()
    streams.ensure_topics(settings.kafka)
    champion = bootstrap(settings, registry, Path(settings.vllm.model_dir))
    log.info("champion is v%d", champion)
    return champion


class SupervisorError(OperatorError, RuntimeError):
    """A supervised process could not be kept running (the message names it and its log)."""


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: list[float] = field(default_factory=list)  # monotonic times of recent restarts
    restart_at: float | None = None  # when an exited process is due to start again
    given_up: bool = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts, watches and stops the loop's processes. ``monotonic`` is the clock of the backoff."""

    def __init__(
        self, settings: Settings, names: Iterable[str] = PROCESSES, monotonic: Monotonic = time.monotonic
    ) -> None:
        self.settings = settings
        self.monotonic = monotonic
        logs = Path(settings.services.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.children = {name: Child(name, rtrl_command(*PROCESSES[name]), logs / f"{name}.log") for name in names}

    def start(self) -> None:
        for child in self.children.values():
            self._spawn(child)

    def _spawn(self, child: Child) -> None:
        with open(child.log_path, "ab") as out:
            child.proc = subprocess.Popen(
                child.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() reaches its children too
                env=child_env(self.settings),
            )
        log.info("started %s (pid %d), log %s", child.name, child.proc.pid, child.log_path)

    def check(self) -> list[str]:
        """Schedule the restart of children that exited and restart those that are due.

        Returns the names restarted now.
        """
        restarted = []
        now = self.monotonic()
        for child in self.children.values():
            if child.running or child.given_up or child.proc is None:
                continue
            if child.restart_at is None:  # an exit not seen before
                code = child.proc.returncode
                child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S]
                if len(child.restarts) >= MAX_RESTARTS:
                    child.given_up = True
                    log.error("%s exited (code %s) %d times in %.0fs; leaving it down, see %s",
                              child.name, code, MAX_RESTARTS, RESTART_WINDOW_S, child.log_path)
                    continue
                delay = restart_delay(len(child.restarts))
                child.restart_at = now + delay
                log.warning("%s exited with code %s; restarting in %.0fs (see %s)",
                            child.name, code, delay, child.log_path)
            if now >= child.restart_at:
                child.restart_at = None
                child.restarts.append(now)
                self._spawn(child)
                restarted.append(child.name)
        return restarted

    def failed(self) -> list[str]:
        return [c.name for c in self.children.values() if c.given_up]

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every process group, then SIGKILL what is left after ``grace_s``."""
        live = [c for c in self.children.values() if c.running]
        for child in live:
            assert child.proc is not None
            _signal_group(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in live:
            assert child.proc is not None
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", child.name, grace_s)
            _signal_group(child.proc.pid, signal.SIGKILL)  # stragglers in the group, if any
            child.proc.wait()

    def run_forever(self, poll_s: float = 2.0) -> None:
        """Start everything and keep it running until SIGTERM/SIGINT."""
        stopping = False

        def _stop(signum: int, _frame: object) -> None:
            nonlocal stopping
            log.info("received %s, stopping", signal.Signals(signum).name)
            stopping = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        self.start()
        try:
            while not stopping:
                self.check()
                if self.failed():
                    logs = ", ".join(str(self.children[name].log_path) for name in self.failed())
                    raise SupervisorError(f"processes kept crashing: {', '.join(self.failed())}; see {logs}")
                time.sleep(poll_s)
        finally:
            self.stop()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
