"""Several gateway processes behind one port (``gateway.workers`` > 1): a pre-fork supervisor.

Started by `ingest.app.run` when ``gateway.workers`` is more than 1 (with 1 the gateway is one
process, as before, and nothing here runs). The supervisor:

1. moves spools no worker of this run would replay into the workers' (`ingest.spool.adopt_spools`:
   a previous run's with another worker count, or the one-process spool), before any worker opens one;
2. binds the listening socket once, with the gateway's socket options (`ingest.app.listening_socket`);
3. sets ``PROMETHEUS_MULTIPROC_DIR`` to a fresh private directory (removed at exit), so that
   ``/metrics`` from any worker is the sum over the workers (`ingest.metrics`);
4. starts ``workers`` processes (multiprocessing's *spawn*: a fresh interpreter each, so no worker
   inherits another's threads, Kafka producer, event loop or prometheus_client's value class), each
   running the whole gateway (`ingest.app.serve`) on its copy of the socket with its own spool,
   ``spool_dir/worker-<i>`` (`worker_settings`);
5. restarts a worker that exits while the gateway is not stopping, after a back-off (logged); a
   worker that dies within `STARTUP_S` of its start `MAX_FAILED_STARTS` times in a row stops the
   gateway with exit status 1 (a broken configuration must not restart forever);
6. on SIGTERM or SIGINT sends SIGTERM to every worker and waits for each to drain (`stop_timeout_s`)
   before it exits 0. Each worker drains as the single process does (ingest/app.py: requests in
   flight finish, captures are handed over, the publisher flushes or spools): "Accepted means
   durable" holds per worker, because each worker's accepted events are in its own spool or on Kafka.

Why one shared socket (pre-fork) and not SO_REUSEPORT with a socket per worker: the options the
gateway sets on the listening socket (send buffer, TCP_USER_TIMEOUT) are set once on the one socket
and inherited by every accepted connection, whichever worker accepts it; and the socket outlives
each worker. With SO_REUSEPORT each worker's socket has its own accept queue, and the connections
waiting in it are reset when that worker closes its socket to drain or dies; with one queue, a
worker that drains or dies simply stops taking from it and the others (or its replacement) take
the rest. The kernel does not balance a shared queue evenly (the worker that is waiting in accept
wins), which matters little: each keeps its own upstream pool.

A worker dies with its supervisor: it asks Linux for SIGTERM when its parent exits
(``PR_SET_PDEATHSIG``), so a supervisor killed with SIGKILL leaves no gateway behind draining an
orphaned port (the SIGTERM still lets it drain what it has). Elsewhere the worker watches its
parent's pid.

What stays per worker (docs/scaling.md, Gateway): the rate limits, per-tenant slots and token
budgets, the feedback event rate, the vLLM connection pool (``upstream_connections`` each), the key
cache, the fleet's rotation and version view, the canary counts (flushed under an instance per
process, ingest/canary_traffic.py), the Kafka producer and the spool (``spool_max_bytes`` each).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from ingest.metrics import MULTIPROC_ENV
from ingest.spool import adopt_spools, worker_spool_dir
from schemas.settings import Settings

log = logging.getLogger(__name__)

STARTUP_S = 15.0  # a worker that dies sooner failed to start
MAX_FAILED_STARTS = 5  # in a row, for one worker: the gateway exits 1
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)  # before the n-th restart in a row of a worker that failed to start
PR_SET_PDEATHSIG = 1
WATCH_PARENT_EVERY_S = 1.0

Target = Callable[..., None]


def worker_settings(settings: Settings, index: int) -> Settings:
    """The settings of worker `index`: the gateway's, with its own spool directory."""
    gw = settings.gateway
    spool = worker_spool_dir(gw.spool_dir, index, gw.workers)
    return settings.model_copy(update={"gateway": gw.model_copy(update={"spool_dir": spool})})


def die_with_parent(parent: int) -> None:
    """Have this process get SIGTERM when `parent` exits: ``prctl(PR_SET_PDEATHSIG)`` on Linux, else
    a thread that watches the parent's pid. Exits now when the parent is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_watch_parent, args=(parent,), name="rtrl-watch-parent", daemon=True).start()
    if os.getppid() != parent:  # it died before the death signal was armed
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_PARENT_EVERY_S)
    os.kill(os.getpid(), signal.SIGTERM)


def gateway_worker(settings: Settings, index: int, sock: socket.socket, parent: int) -> None:
    """A worker process: the whole gateway (`ingest.app.serve`) on the supervisor's socket."""
    die_with_parent(parent)
    logging.Formatter.converter = time.gmtime
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)sZ %(levelname)s %(name)s [%(process)d worker-{index}] %(message)s",
    )
    logging.getLogger("kafka").setLevel(logging.WARNING)
    from ingest.app import serve  # in the worker: the supervisor never builds the app

    serve(worker_settings(settings, index), sock)


@dataclass
class Slot:
    """One worker's place: its process now, when it started, its failed starts in a row."""

    index: int
    process: BaseProcess | None = None
    started_at: float = 0.0
    failed_starts: int = 0
    restart_at: float | None = None
    history: list[int] = field(default_factory=list)  # pids, oldest first (tests, logs)


class Supervisor:
    """Runs `workers` processes of `target(*args(index), parent_pid)` and keeps them running (the
    module docstring); `run` returns the exit status. `on_exit(pid)` is called for every worker
    that exited (the metrics' ``mark_process_dead``)."""

    def __init__(
        self,
        target: Target,
        args: Callable[[int], tuple[object, ...]],
        workers: int,
        stop_timeout_s: float,
        on_exit: Callable[[int], None] = lambda pid: None,
    ) -> None:
        self.target, self.args, self.stop_timeout_s, self.on_exit = target, args, stop_timeout_s, on_exit
        self.slots = [Slot(i) for i in range(workers)]
        self.context = multiprocessing.get_context("spawn")
        self.stopping = threading.Event()

    def start(self, slot: Slot) -> None:
        process = self.context.Process(
            target=self.target, args=(*self.args(slot.index), os.getpid()), name=f"rtrl-gateway-{slot.index}"
        )
        process.start()
        assert process.pid is not None
        slot.process, slot.started_at, slot.restart_at = process, time.monotonic(), None
        slot.history.append(process.pid)
        log.info("gateway worker %d started (pid %d)", slot.index, process.pid)

    def run(self) -> int:
        """Start the workers, watch them until `stop` (or a signal), stop them; the exit status."""
        for slot in self.slots:
            self.start(slot)
        status = 0
        while not self.stopping.is_set():
            sentinels = [s.process.sentinel for s in self.slots if s.process is not None]
            if sentinels:
                wait(sentinels, timeout=0.2)  # wakes when a worker exits
            else:
                time.sleep(0.2)  # every worker waiting out its back-off
            if not self.check():
                status = 1
                break
        self.stop_all()
        return status

    def check(self) -> bool:
        """Notice exited workers and restart those due; False when one keeps failing to start."""
        now = time.monotonic()
        for slot in self.slots:
            process = slot.process
            if process is not None and not process.is_alive() and not self.stopping.is_set():
                self._exited(slot, now)
                if slot.failed_starts >= MAX_FAILED_STARTS:
                    log.error(
                        "gateway worker %d failed to start %d times in a row; stopping the gateway "
                        "(its log lines above say why)",
                        slot.index,
                        slot.failed_starts,
                    )
                    return False
            if slot.process is None and slot.restart_at is not None and now >= slot.restart_at:
                self.start(slot)
        return True

    def _exited(self, slot: Slot, now: float) -> None:
        assert slot.process is not None and slot.process.pid is not None
        pid, code = slot.process.pid, slot.process.exitcode
        slot.process.join()
        self.on_exit(pid)
        slot.process = None
        lived = now - slot.started_at
        slot.failed_starts = slot.failed_starts + 1 if lived < STARTUP_S else 0
        delay = BACKOFF_S[min(max(slot.failed_starts - 1, 0), len(BACKOFF_S) - 1)]
        slot.restart_at = now + delay
        log.error(
            "gateway worker %d (pid %d) exited with %s after %.1fs; restarting it in %gs",
            slot.index,
            pid,
            code,
            lived,
            delay,
        )

    def stop(self, signum: int = signal.SIGTERM, _frame: FrameType | None = None) -> None:
        """Ask `run` to stop the workers (a signal handler)."""
        self.stopping.set()

    def stop_all(self) -> None:
        """SIGTERM every worker, wait up to `stop_timeout_s` for all to drain; SIGKILL what is left."""
        self.stopping.set()
        running = [s.process for s in self.slots if s.process is not None and s.process.is_alive()]
        for process in running:
            assert process.pid is not None
            os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for process in running:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error(
                    "gateway worker pid %d still running %gs after SIGTERM; killing it (what it had not "
                    "spooled is lost)",
                    process.pid,
                    self.stop_timeout_s,
                )
                process.kill()
                process.join()
        for slot in self.slots:
            if slot.process is not None and slot.process.pid is not None:
                self.on_exit(slot.process.pid)
                slot.process = None


def stop_timeout_s(settings: Settings) -> float:
    """How long a worker may take to drain: uvicorn's grace, the captures' grace, the publisher's
    last flush, and a margin (ingest/app.py, Graceful shutdown)."""
    gw = settings.gateway
    return 2 * gw.shutdown_grace_s + gw.publish_timeout_s + 10.0


def supervise(settings: Settings, sock: socket.socket) -> int:
    """Run ``settings.gateway.workers`` gateway workers on `sock` until SIGTERM/SIGINT; the exit status."""
    from prometheus_client import multiprocess

    gw = settings.gateway
    for spool in adopt_spools(gw.spool_dir, gw.workers):
        log.warning("moved the spool left in %s into this run's workers' spools", spool)
    metrics_dir = Path(tempfile.mkdtemp(prefix="rtrl-gateway-metrics-"))
    os.environ[MULTIPROC_ENV] = str(metrics_dir)  # inherited by the workers (spawn)
    supervisor = Supervisor(
        gateway_worker,
        lambda i: (settings, i, sock),
        gw.workers,
        stop_timeout_s(settings),
        on_exit=lambda pid: multiprocess.mark_process_dead(pid, str(metrics_dir)),  # type: ignore[no-untyped-call]
    )
    previous = {sig: signal.signal(sig, supervisor.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    log.info(
        "rtrl gateway supervisor (pid %d): %d workers; metrics in %s", os.getpid(), gw.workers, metrics_dir
    )
    try:
        return supervisor.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)
