"""The daemon supervisor behind ``rtrl run`` (and the demo): runs the loop's processes and keeps them up.

The loop is five long-lived processes: the gateway, the labeler, the Celery worker (training cycle,
eval gate, deploy), Celery beat (the schedule) and the fleet reconciler. Each is an ``rtrl``
subcommand; the supervisor starts them in their own process groups with logs under
``<run_dir>/logs/`` and hands each its settings (`services.launch.child_env`). A process that exits is
restarted: at once the first time, then after a delay that doubles from `BACKOFF_START_S` (capped
at `BACKOFF_MAX_S`), each delay jittered by ±25 % so that processes failing on the same cause do
not restart in lockstep. One that exited `MAX_RESTARTS` times within `RESTART_WINDOW_S` is
reported as crash-looping and retried at the cap for as long as it keeps failing: it is never a
reason to stop the others (a labeler that cannot write must not take the gateway, and users'
inference, down with it). SIGTERM/SIGINT stops them all. State lives in Kafka, the SQL store and
MLflow, so a restarted process resumes where its predecessor committed. `check` also rotates the
logs in ``<run_dir>/logs/`` that outgrew ``services.log_max_bytes`` (`services.logs.rotate`).

``rtrl run`` starts with its dependencies down: the gateway starts at once (it answers 503 with
``Retry-After`` until it has read the API keys, and spools events while Kafka is away), while
`prepare` (tables, topics, a champion on every server) is retried in the background with the same
kind of backoff; the other processes, which need what it makes, start once it has succeeded.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from schemas.clock import Monotonic
from schemas.settings import Settings
from services.launch import child_env, rtrl_command
from services.logs import rotate
from telemetry import Exporter, Readiness, start_exporter

if TYPE_CHECKING:
    from registry import Registry
    from store import Store

log = logging.getLogger("services.supervisor")

# Every process the loop is made of, as the rtrl subcommand that runs it.
PROCESSES: dict[str, list[str]] = {
    "gateway": ["gateway"],
    "labeler": ["labeler"],
    "worker": ["worker"],
    "beat": ["beat"],
    "reconciler": ["deploy", "reconcile", "--forever"],
}

RESTARTS = Counter("rtrl_supervisor_child_restarts_total", "Restarts of each supervised process.", ["child"])
CHILD_UP = Gauge("rtrl_supervisor_child_up", "1 while a supervised process runs, else 0.", ["child"])
CRASH_LOOPING = Gauge(
    "rtrl_supervisor_child_crash_looping",
    "1 while a supervised process is crash-looping (exited MAX_RESTARTS times within RESTART_WINDOW_S).",
    ["child"],
)
PREPARED = Gauge(
    "rtrl_supervisor_prepared", "1 once the store, topics and champion are ready and every process may start."
)

MAX_RESTARTS = 5  # restarts within RESTART_WINDOW_S; past that the process is crash-looping (reported)
RESTART_WINDOW_S = 300.0
BACKOFF_START_S = 1.0  # delay before the second restart within the window; doubles after that
BACKOFF_MAX_S = 60.0
JITTER = 0.25  # each delay is scaled by a factor drawn from [1 - JITTER, 1 + JITTER]
# Processes that start before `prepare` has succeeded: the gateway serves (503 until the keys load)
# and spools from the first second. Every other one needs the tables, topics or champion it makes.
WITHOUT_PREPARE = frozenset({"gateway"})


def restart_delay(
    recent_restarts: int, draw: Callable[[], float] = random.random, at_cap: bool = False
) -> float:
    """Seconds to wait before restarting a process that was already restarted this many times
    recently (`at_cap`: a crash-looping one, retried at `BACKOFF_MAX_S`); `draw` gives the jitter
    (uniform in [0, 1); 0.5 means none)."""
    if recent_restarts == 0 and not at_cap:
        return 0.0
    base = BACKOFF_MAX_S if at_cap else min(BACKOFF_START_S * 2 ** (recent_restarts - 1), BACKOFF_MAX_S)
    return float(base * (1 - JITTER + 2 * JITTER * draw()))


def prepare(settings: Settings, store: Store, registry: Registry) -> int:
    """What the loop needs before its processes start: the store's tables, the topics, and a
    champion in the registry, which every vLLM server that answers is brought to (one that does
    not is left to the fleet reconciler, which restarts local servers: waiting for it here would
    keep the reconciler from ever starting). Idempotent; returns the champion."""
    import streams
    from deployer.rollout import bootstrap

    store.migrate()
    streams.ensure_topics(settings.kafka)
    champion = bootstrap(settings, registry, Path(settings.vllm.model_dir), keep_going=True)
    log.info("champion is v%d", champion)
    return champion


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: list[float] = field(default_factory=list)  # monotonic times of recent restarts
    restart_at: float | None = None  # when an exited process is due to start again
    crash_looping: bool = False  # exited MAX_RESTARTS times within the window: retried at the cap
    last_exit_code: int | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts, watches and stops the loop's processes. ``monotonic`` is the clock of the backoff.

    With `prerequisite` (``rtrl run`` passes `prepare`), only the processes in `WITHOUT_PREPARE`
    start at once; `prerequisite` is retried in a background thread (backoff from 1 s doubling to
    `BACKOFF_MAX_S`, jittered) until it returns, and `check` starts the others after that."""

    def __init__(
        self,
        settings: Settings,
        names: Iterable[str] = PROCESSES,
        monotonic: Monotonic = time.monotonic,
        draw: Callable[[], float] = random.random,
        prerequisite: Callable[[], object] | None = None,
    ) -> None:
        self.settings = settings
        self.monotonic = monotonic
        self.draw = draw
        logs = self.logs_dir = Path(settings.services.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self._rotate_errors: dict[Path, str] = {}  # the last rotation error per log, said once
        self.children = {
            name: Child(name, rtrl_command(*PROCESSES[name]), logs / f"{name}.log") for name in names
        }
        for name in self.children:
            RESTARTS.labels(name)  # at 0 from the start: the first restart is an increase a rule sees
        self._prerequisite = prerequisite
        self.prepared = threading.Event()
        self._stopping = threading.Event()
        if prerequisite is None:
            self.prepared.set()
        self.readiness = Readiness()
        self._exporter: Exporter | None = None

    def serve_metrics(self) -> None:
        """Start this process's metrics, health and readiness endpoint (settings.metrics.supervisor_port)."""
        self._exporter = start_exporter(self.settings, "supervisor", self.readiness)

    @property
    def state_path(self) -> Path:
        """``<run_dir>/supervisor.json``: what `rtrl status` reads about the daemon's processes."""
        return Path(self.settings.services.run_dir) / "supervisor.json"

    def write_state(self, stopped: bool = False) -> None:
        """Record each child's pid, restarts and state (atomically; `check` calls this)."""
        now = self.monotonic()
        state = {
            "pid": os.getpid(),
            "updated_at": time.time(),
            "stopped": stopped,
            "prepared": self.prepared.is_set(),
            "children": {
                c.name: {
                    "pid": c.proc.pid if c.running and c.proc is not None else None,
                    "running": c.running,
                    "restarts_recent": len([t for t in c.restarts if now - t < RESTART_WINDOW_S]),
                    "crash_looping": c.crash_looping,
                    "last_exit_code": c.last_exit_code,
                    "waiting_for_prepare": c.proc is None,
                    "log": str(c.log_path),
                }
                for c in self.children.values()
            },
        }
        for child in self.children.values():
            CHILD_UP.labels(child.name).set(1 if child.running else 0)
            CRASH_LOOPING.labels(child.name).set(1 if child.crash_looping else 0)
        PREPARED.set(1 if self.prepared.is_set() else 0)
        looping = self.crash_looping()
        self.readiness.set(
            "prepared", self.prepared.is_set(), "" if self.prepared.is_set() else "waiting for dependencies"
        )
        self.readiness.set("children", not looping, f"crash-looping: {', '.join(looping)}" if looping else "")
        tmp = self.state_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(state, indent=1))
            tmp.replace(self.state_path)
        except OSError as exc:  # a full disk must not stop the supervisor
            log.warning("cannot write %s: %s", self.state_path, exc)

    def start(self) -> None:
        if not self.prepared.is_set():
            threading.Thread(target=self._prepare_until_done, name="prepare", daemon=True).start()
            waiting = [name for name in self.children if name not in WITHOUT_PREPARE]
            if waiting:
                log.info("%s start once the store, topics and champion are ready", ", ".join(waiting))
        for child in self.children.values():
            if self.prepared.is_set() or child.name in WITHOUT_PREPARE:
                self._spawn(child)
        self.write_state()

    def _prepare_until_done(self) -> None:
        assert self._prerequisite is not None
        attempts = 0
        last = ""
        while not self._stopping.is_set():
            try:
                self._prerequisite()
            except Exception as exc:  # noqa: BLE001 - a dependency still down: say so, try again
                attempts += 1
                problem = str(exc).splitlines()[0] if str(exc) else repr(exc)
                delay = restart_delay(attempts, self.draw)
                if problem != last:
                    log.error(
                        "waiting for the loop's dependencies: %s; retrying (every %.0fs at most)",
                        problem,
                        BACKOFF_MAX_S,
                    )
                    last = problem
                else:
                    log.info(
                        "still waiting (attempt %d): %s; next try in %.0fs", attempts + 1, problem, delay
                    )
                self._stopping.wait(delay)
            else:
                if attempts:
                    log.info("dependencies ready after %d attempts", attempts + 1)
                self.prepared.set()
                return

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
            if child.proc is None and self.prepared.is_set():  # was waiting for `prepare`
                self._spawn(child)
                continue
            if (
                child.running
                and child.crash_looping
                and child.restarts
                and now - child.restarts[-1] > BACKOFF_MAX_S
            ):
                child.crash_looping = False  # it has stayed up longer than the retry interval: recovered
                log.info(
                    "%s has run for %.0fs since its last restart: no longer crash-looping",
                    child.name,
                    now - child.restarts[-1],
                )
            if child.running or child.proc is None:
                continue
            if child.restart_at is None:  # an exit not seen before
                code = child.last_exit_code = child.proc.returncode
                child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S]
                looping = len(child.restarts) >= MAX_RESTARTS
                if looping and not child.crash_looping:
                    log.error(
                        "%s exited (code %s) %d times in %.0fs: crash-looping; retrying it every ~%.0fs "
                        "while the other processes run on, see %s",
                        child.name,
                        code,
                        MAX_RESTARTS,
                        RESTART_WINDOW_S,
                        BACKOFF_MAX_S,
                        child.log_path,
                    )
                child.crash_looping = looping
                delay = restart_delay(len(child.restarts), self.draw, at_cap=looping)
                child.restart_at = now + delay
                log.warning(
                    "%s exited with code %s; restarting in %.0fs (see %s)",
                    child.name,
                    code,
                    delay,
                    child.log_path,
                )
            if now >= child.restart_at:
                child.restart_at = None
                child.restarts.append(now)
                self._spawn(child)
                RESTARTS.labels(child.name).inc()
                restarted.append(child.name)
        self.rotate_logs()
        self.write_state()
        return restarted

    def rotate_logs(self) -> list[Path]:
        """Copy-truncate each log in ``<run_dir>/logs/`` larger than ``services.log_max_bytes``
        (`services.logs.rotate`): the children's and those of the local services of the same run dir,
        which `services.base` redirects there the same way (append mode). Returns those rotated."""
        services = self.settings.services
        rotated = []
        for path in sorted(self.logs_dir.glob("*.log")):
            try:
                if rotate(path, services.log_max_bytes, services.log_backups):
                    rotated.append(path)
                    log.info(
                        "rotated %s (over %d bytes; %d backups kept)",
                        path,
                        services.log_max_bytes,
                        services.log_backups,
                    )
                self._rotate_errors.pop(path, None)
            except OSError as exc:  # a full disk must not stop the supervisor; the log stays as it was
                if self._rotate_errors.get(path) != str(exc):
                    log.warning("cannot rotate %s: %s; it keeps growing", path, exc)
                self._rotate_errors[path] = str(exc)
        return rotated

    def crash_looping(self) -> list[str]:
        """Processes that exited `MAX_RESTARTS` times within `RESTART_WINDOW_S` (still being retried)."""
        return [c.name for c in self.children.values() if c.crash_looping]

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every process group, then SIGKILL what is left after ``grace_s``."""
        self._stopping.set()
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
        self.write_state(stopped=True)
        if self._exporter is not None:
            self._exporter.stop()
            self._exporter = None

    def run_forever(self, poll_s: float = 2.0) -> None:
        """Start everything and keep it running until SIGTERM/SIGINT."""
        stopping = False

        def _stop(signum: int, _frame: object) -> None:
            nonlocal stopping
            log.info("received %s, stopping", signal.Signals(signum).name)
            stopping = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        self.serve_metrics()
        self.start()
        try:
            while not stopping:
                self.check()
                time.sleep(poll_s)
        finally:
            self.stop()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
