"""Process management shared by the local services: detached start, pid files, health waits, stop.

Each backend module (kafka, postgres, redis, mlflow, vllm) subclasses :class:`Service` and says
how to prepare its data, which command to run and how to check health; this module does the rest
the same way for all of them:

- A service runs detached in its own session (``start_new_session=True``), so it outlives the
  ``rtrl services up`` process and its whole process tree (vLLM's engine processes, PostgreSQL's
  backends) is one process group that ``down`` can signal at once.
- ``<run_dir>/logs/<name>.log`` gets its stdout and stderr; ``<run_dir>/pids/<name>.json`` records
  the pid and the kernel start time of the leader, so a recycled pid is never mistaken for it.
- Stop: the service's own stop signal to the leader (its graceful shutdown), then SIGKILL to the
  whole group after a grace period, until no process of the group is left.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from schemas.clock import wait_until
from schemas.errors import OperatorError
from schemas.settings import Settings
from services.logs import quiet_connection_retries

LOG_TAIL_LINES = 40

log = logging.getLogger(__name__)


class ServiceError(OperatorError, RuntimeError):
    """A local service could not be prepared, started or stopped (the message says which and why)."""


@dataclass(frozen=True)
class ServiceStatus:
    """What `rtrl services status` reports for one service."""

    name: str
    healthy: bool
    pid: int | None
    address: str
    detail: str


@dataclass(frozen=True)
class _PidRecord:
    pid: int
    start_ticks: int


def run_dir(settings: Settings) -> Path:
    """The absolute run dir (a relative ``services.run_dir`` is relative to the working directory)."""
    return settings.services.run_dir.expanduser().resolve()


def _proc_start_ticks(pid: int) -> int | None:
    """Kernel start time of `pid` (clock ticks since boot), or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2 (comm) may contain spaces and parentheses; the fields after the last ')' are fixed.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie is a process that has exited
        return None
    return int(fields[19])


def process_alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie has exited)."""
    return _proc_start_ticks(pid) is not None


def _group_alive(pgid: int) -> bool:
    _reap(pgid)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # killpg(…, 0) also succeeds for zombies; a group of only zombies is a stopped group.
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _reap(pid: int) -> None:
    """Collect the exit status of `pid` when it is our child (the test fixture starts and stops in one process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # started by another `rtrl services up`; init reaps it


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on host:port (binding it the way a server would fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file ('' when there is none)."""
    if not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        text = f.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


class Service(ABC):
    """One local service: how to prepare it, run it, check it and stop it."""

    #: Name used in `--only`, the pid file and the log file.
    name: str
    #: Signal that starts the service's graceful shutdown.
    stop_signal: signal.Signals = signal.SIGTERM
    #: Seconds between the stop signal and SIGKILL of the whole process group.
    stop_grace_s: float = 20.0
    #: The logger of the client library `check` uses, when it logs each refused connection attempt
    #: itself: those records are dropped while `wait_healthy` waits (services.logs.quiet_connection_retries).
    client_logger: str | None = None

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.host = settings.services.host
        self.run_dir = run_dir(settings)
        self.data_dir = self.run_dir / self.name
        self.log_path = self.run_dir / "logs" / f"{self.name}.log"
        self.pid_path = self.run_dir / "pids" / f"{self.name}.json"

    # --- what a backend says ------------------------------------------------------------------

    @property
    @abstractmethod
    def ports(self) -> tuple[int, ...]:
        """Ports the service binds (all must be free before it starts)."""

    @property
    @abstractmethod
    def address(self) -> str:
        """Where clients reach it (a URL or host:port), for `status`."""

    @abstractmethod
    def command(self) -> list[str]:
        """The command line of the long-running process."""

    @abstractmethod
    def check(self) -> str:
        """Cheap health check over the service's own protocol; returns a detail, raises when unhealthy."""

    def prepare(self) -> None:
        """One-time setup before the first start (install, initdb, format); must be idempotent."""
        return None

    def env(self) -> dict[str, str]:
        """Environment of the process (the caller's environment plus these)."""
        return {}

    def run_as(self) -> str | None:
        """User to run as (PostgreSQL refuses root); None = the caller."""
        return None

    def after_start(self) -> None:
        """Runs once the service is healthy after `up` (create roles, topics, warm up); must be idempotent."""
        return None

    def requires(self) -> tuple[str, ...]:
        """Services that must be healthy, their `after_start` done, before this one starts (`up` starts
        them too)."""
        return ()

    # --- the shared mechanics -----------------------------------------------------------------

    def _read_pid(self) -> _PidRecord | None:
        if not self.pid_path.exists():
            return None
        raw = json.loads(self.pid_path.read_text())
        return _PidRecord(pid=int(raw["pid"]), start_ticks=int(raw["start_ticks"]))

    def pid(self) -> int | None:
        """Pid of the running leader process this run dir started, or None."""
        record = self._read_pid()
        if record is None:
            return None
        _reap(record.pid)
        if _proc_start_ticks(record.pid) != record.start_ticks:
            return None
        return record.pid

    def status(self) -> ServiceStatus:
        pid = self.pid()
        if pid is None:
            detail = (
                "not running"
                if not self.pid_path.exists()
                else "exited (stale pid file); see " + str(self.log_path)
            )
            return ServiceStatus(self.name, False, None, self.address, detail)
        try:
            detail = self.check()
        except Exception as exc:  # any failure of a health probe means "not healthy", with the reason shown
            return ServiceStatus(self.name, False, pid, self.address, f"unhealthy: {exc}")
        return ServiceStatus(self.name, True, pid, self.address, detail)

    def check_ports(self) -> None:
        """Raise ServiceError when one of the service's ports is taken by another process."""
        busy = [p for p in self.ports if port_in_use(self.host, p)]
        if busy:
            raise ServiceError(
                f"{self.name}: port(s) {', '.join(map(str, busy))} on {self.host} are in use by a process this "
                f"run dir ({self.run_dir}) did not start; stop it or choose other ports "
                f"(RTRL_SERVICES__*_PORT)"
            )

    def start(self) -> int:
        """Prepare and start the process detached; returns its pid. Does not wait for health."""
        if self.pid() is not None:
            raise ServiceError(f"{self.name}: already running (pid {self.pid()})")
        self.check_ports()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.pid_path.parent.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.prepare()
        cmd = self.command()
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} rtrl services: {' '.join(cmd)}\n".encode())
            log.flush()
            user = self.run_as()
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                env={**os.environ, **self.env()},
                start_new_session=True,  # own session and process group: survives us, stopped as a group
                user=user,
                group=user,
            )
        _CHILDREN[proc.pid] = proc  # keep the Popen alive so it does not warn; reaped via _reap
        ticks = _proc_start_ticks(proc.pid)
        if ticks is None:
            raise ServiceError(f"{self.name}: exited immediately\n{tail(self.log_path)}")
        self.pid_path.write_text(json.dumps({"pid": proc.pid, "start_ticks": ticks, "cmd": cmd}))
        return proc.pid

    def wait_healthy(self, timeout_s: float) -> str:
        """Poll `check` until it passes; raises ServiceError with the log's tail on exit or timeout.

        A service that does not answer yet is said once, at INFO ("waiting for kafka at ..."); the
        refused connection attempts its client library would log meanwhile are not
        (`client_logger`), and are again once the wait is over."""
        last: list[str | None] = [None]

        def healthy() -> str | None:
            if self.pid() is None:
                raise ServiceError(
                    f"{self.name}: exited during start-up; last lines of {self.log_path}:\n{tail(self.log_path)}"
                )
            try:
                return self.check()
            except Exception as exc:  # not up yet: keep polling until the deadline
                if last[0] is None:
                    log.info("waiting for %s at %s to answer", self.name, self.address)
                last[0] = f"{type(exc).__name__}: {exc}"
                return None

        quiet: AbstractContextManager[object] = (
            nullcontext() if self.client_logger is None else quiet_connection_retries(self.client_logger)
        )
        try:
            with quiet:
                return wait_until(
                    healthy, timeout_s=timeout_s, interval_s=0.5, what=f"{self.name} not healthy"
                )
        except TimeoutError as exc:
            raise ServiceError(
                f"{exc} ({last[0] or 'no check yet'}); last lines of {self.log_path}:\n{tail(self.log_path)}"
            ) from None

    def stop(self) -> bool:
        """Stop the service and every process of its group; returns False when it was not running."""
        record = self._read_pid()
        if record is None:
            return False
        pgid = record.pid  # start_new_session made the leader's pid the group id
        running = _proc_start_ticks(record.pid) == record.start_ticks
        if running:
            os.kill(record.pid, self.stop_signal)
            try:  # a stopped (SIGSTOP) or hung-in-a-stop group handles the stop signal only once continued
                os.killpg(pgid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            try:
                wait_until(
                    lambda: not _group_alive(pgid), timeout_s=self.stop_grace_s, what=f"{self.name} stopping"
                )
            except TimeoutError:
                pass  # SIGKILL below
        # Children may outlive a leader that exited (or was killed earlier): the group goes too.
        # Only when the leader was ours: a stale pid file's pgid may belong to someone else by now.
        if running or _group_is_ours(pgid, self.run_dir):

            def killed() -> bool:
                if not _group_alive(pgid):
                    return True
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    return True
                return False

            try:
                wait_until(killed, timeout_s=self.stop_grace_s, interval_s=0.1, what=f"{self.name} killed")
            except TimeoutError:
                raise ServiceError(
                    f"{self.name}: process group {pgid} survived SIGKILL for {self.stop_grace_s:.0f} s "
                    f"(stuck in the kernel?); check it with `ps -g {pgid}`"
                ) from None
        _CHILDREN.pop(record.pid, None)
        self.pid_path.unlink(missing_ok=True)
        return running


def _group_is_ours(pgid: int, run_dir: Path) -> bool:
    """A group left behind by a dead leader is ours when its processes run with cwd under our run dir."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            cwd = Path(os.readlink(proc / "cwd"))
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        if run_dir in cwd.parents or cwd == run_dir:
            return True
    return False


_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
