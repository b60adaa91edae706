"""The daemon supervisor behind ``rtrl run`` (and the demo): runs the loop's processes and keeps them up.

The loop is four long-lived processes: the gateway, the labeler, the Celery worker (training cycle,
eval gate, deploy) and Celery beat (the schedule). Each is an ``rtrl`` subcommand; the supervisor
starts them in their own process groups with logs under ``<run_dir>/logs/``, restarts one that
exits (with backoff, and gives up on a process that keeps crashing), and stops them all on
SIGTERM/SIGINT. State lives in Kafka, the SQL store and MLflow, so a restarted process resumes
where its predecessor committed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from schemas.settings import Settings

log = logging.getLogger("rtrl.supervisor")

# Every process the loop is made of, as the rtrl subcommand that runs it.
PROCESSES: dict[str, list[str]] = {
    "gateway": ["gateway"],
    "labeler": ["labeler"],
    "worker": ["worker"],
    "beat": ["beat"],
}

MAX_RESTARTS = 5  # within RESTART_WINDOW_S; past that a process is left down and reported
RESTART_WINDOW_S = 300.0


def prepare(settings: Settings) -> int:
    """What the loop needs before its processes start: the store's tables, the topics, and a
    champion in the registry that every vLLM server serves. Idempotent; returns the champion."""
    from deployer import registry
    from feedback.store import Store
    from feedback.topics import ensure_topics

    store = Store(settings.store.url)
    try:
        store.migrate()
    finally:
        store.close()
    ensure_topics(settings.kafka)
    champion = registry.bootstrap(settings, Path(settings.vllm.model_dir))
    log.info("champion is v%d", champion)
    return champion


class SupervisorError(RuntimeError):
    """A supervised process could not be kept running."""


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: list[float] = field(default_factory=list)
    given_up: bool = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts, watches and stops the loop's processes."""

    def __init__(self, settings: Settings, names: Iterable[str] = PROCESSES) -> None:
        self.settings = settings
        logs = Path(settings.services.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.children = {
            name: Child(name, [sys.executable, "-m", "rtrl.cli", *PROCESSES[name]], logs / f"{name}.log")
            for name in names
        }

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
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        log.info("started %s (pid %d), log %s", child.name, child.proc.pid, child.log_path)

    def check(self) -> list[str]:
        """Restart children that exited. Returns the names restarted now."""
        restarted = []
        now = time.monotonic()
        for child in self.children.values():
            if child.running or child.given_up or child.proc is None:
                continue
            code = child.proc.returncode
            child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S]
            if len(child.restarts) >= MAX_RESTARTS:
                child.given_up = True
                log.error("%s exited (code %s) %d times in %ds; leaving it down, see %s",
                          child.name, code, MAX_RESTARTS, RESTART_WINDOW_S, child.log_path)
                continue
            log.warning("%s exited with code %s; restarting (see %s)", child.name, code, child.log_path)
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
                    raise SupervisorError(f"processes kept crashing: {', '.join(self.failed())}")
                time.sleep(poll_s)
        finally:
            self.stop()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
