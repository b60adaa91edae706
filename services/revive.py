"""Restart the local vLLM servers that died: the first step of every reconciler tick.

vLLM's API server exits when its engine dies (``EngineDeadError``, e.g. the CPU LoRA logits path of
docs/platform.md), and nothing else would start it again: the gateway would route around it (or
answer 503 when it was the only one) until an operator ran ``rtrl services up``. `Reviver` is what
``rtrl deploy reconcile`` (and so ``rtrl run``'s reconciler) runs before aligning the fleet:

- a vLLM server this run dir started (``rtrl services up`` left a pid file) whose process exited is
  started again; one whose health check has failed for ``services.vllm_unhealthy_restart_s`` (a
  hung engine) is stopped and started;
- a serving server is first taken out of the gateways' rotation with the deployer's mark, so no
  request reaches it while it comes back on its base weights labelled "default"; the same tick's
  `deployer.rollout.align_fleet` then swaps it to ``@champion``, verifies it and puts it back;
- a server that fails again soon after is retried with a growing delay (30 s doubling to 10 min),
  so a server that cannot start costs a start attempt now and then, not every tick.

One server is restarted by one reconciler at a time: the restart (its rotation mark, stop, start,
health wait) holds a lock of the store keyed by this host and the server's port (`restart_lock`,
``vllm-restart-<port>-<host>``; `store.Store.exclusive`: a PostgreSQL advisory lock, or an flock
beside the SQLite file), taken without waiting. A tick that finds it held skips that server (logged
at info, no attempt counted); one that takes it first looks again and leaves alone a server
another reconciler has brought back meanwhile. Two reconcilers on one run dir and host may thus
run side by side (docs/scaling.md, Several workers and reconcilers). When the store cannot be
reached the restart goes ahead without the lock: a store outage must not keep a dead server down.

Servers without a pid file are left alone: ``rtrl services down`` removes it (a server an
operator stopped stays stopped), and a fleet rtrl does not manage is restarted by whatever manages
it. ``services.restart_vllm = false`` turns all of this off.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

from deployer.swap import DEPLOYER_MARK
from schemas.clock import wait_until
from schemas.settings import Settings
from store import LockBusy, Store, StoreError

from .base import ServiceError, port_in_use
from .vllm import Vllm
from .vllm import servers as vllm_servers

log = logging.getLogger(__name__)

FIRST_RETRY_S = 30.0
MAX_RETRY_S = 600.0
PORT_FREE_S = 30.0  # how long a restart waits for the dead server's port to be released


def restart_lock_name(url: str) -> str:
    """The store lock a restart of the local server at `url` holds: this host's name and the
    server's port (two reconcilers on one host mean the same server by them; reconcilers on other
    hosts restart other servers, which must not wait on this one). Safe as a file name (SQLite's
    flock, store/locks.py) and within the 64 characters of ``deploy_locks.name``."""
    parts = urlsplit(url if "//" in url else f"//{url}")
    return f"vllm-restart-{parts.port}-{socket.gethostname()}"[:64]


@contextmanager
def restart_lock(store_url: str, url: str, purpose: str) -> Iterator[bool]:
    """Hold the restart lock of the server at `url` (`restart_lock_name`) for the block, without
    waiting: True when this caller may restart it, False when another holds the lock (skip it this
    tick). True without any lock when the store cannot be reached (logged at error)."""
    with ExitStack() as stack:
        mine = True
        try:
            store = stack.enter_context(Store(store_url))
            stack.enter_context(store.exclusive(restart_lock_name(url), purpose))
        except LockBusy as exc:
            log.info("%s: another reconciler is restarting it (%s); skipped this tick", url, exc)
            mine = False
        except StoreError as exc:
            log.error("%s: cannot take its restart lock (%s); restarting it without the lock", url, exc)
        yield mine


@dataclass
class _Attempts:
    count: int = 0
    next_at: float = 0.0


class Reviver:
    """Restarts dead local vLLM servers; one instance lives as long as the reconciler, so it
    remembers for how long a server has been unhealthy and how often it was restarted."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._unhealthy_since: dict[str, float] = {}
        self._attempts: dict[str, _Attempts] = {}

    def managed(self) -> list[Vllm]:
        """The vLLM servers this run dir started and did not stop (their pid file is there)."""
        return [unit for unit in vllm_servers(self.settings) if unit.pid_path.exists()]

    def __call__(self) -> dict[str, str | None]:
        """Restart the managed servers that need it: {url: None when restarted, else why it failed}."""
        if not self.settings.services.restart_vllm:
            return {}
        done: dict[str, str | None] = {}
        for unit in self.managed():
            reason = self._why_restart(unit)
            if reason is None:
                continue
            url = unit.address
            attempts = self._attempts.setdefault(unit.name, _Attempts())
            if self.clock() < attempts.next_at:
                log.warning(
                    "%s (%s): %s; next restart attempt in %.0fs",
                    unit.name,
                    url,
                    reason,
                    attempts.next_at - self.clock(),
                )
                continue
            with restart_lock(self.settings.store.url, url, f"restart {unit.name}: {reason}") as mine:
                if not mine or self._came_back(unit):
                    continue
                log.error("%s (%s): %s; restarting it (log: %s)", unit.name, url, reason, unit.log_path)
                done[url] = self._restart(unit, reason)
            attempts.count += 1
            attempts.next_at = self.clock() + min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** (attempts.count - 1))
        return done

    def _why_restart(self, unit: Vllm) -> str | None:
        status = unit.status()
        now = self.clock()
        if status.healthy:
            self._unhealthy_since.pop(unit.name, None)
            attempts = self._attempts.get(unit.name)
            if attempts is not None and now >= attempts.next_at:
                del self._attempts[unit.name]  # healthy past its back-off: the next failure starts afresh
            return None
        if status.pid is None:
            return "its process exited"
        since = self._unhealthy_since.setdefault(unit.name, now)
        limit = self.settings.services.vllm_unhealthy_restart_s
        if now - since < limit:
            return None
        return f"unhealthy for {now - since:.0f}s ({status.detail})"

    def _came_back(self, unit: Vllm) -> bool:
        """Whether `unit`, found dead or hung, is healthy now that this tick holds its restart lock:
        another reconciler restarted it between this tick's look and its lock."""
        if not unit.status().healthy:
            return False
        log.info(
            "%s (%s) is healthy again (restarted by another reconciler); left alone", unit.name, unit.address
        )
        self._unhealthy_since.pop(unit.name, None)
        return True

    def _restart(self, unit: Vllm, reason: str) -> str | None:
        """Stop and start `unit` (out of the gateways' rotation first when it serves); the caller
        holds its restart lock. None when it came back healthy, else why not."""
        url = unit.address
        canary = (self.settings.vllm.canary_server or "").rstrip("/")
        if url in (u.rstrip("/") for u in self.settings.vllm.servers) or url == canary:
            try:
                with Store(self.settings.store.url) as store:
                    store.set_rotation(url, False, f"{DEPLOYER_MARK}restarted by the reconciler: {reason}")
            except Exception as exc:  # noqa: BLE001 - a store outage must not keep a dead server down
                log.error(
                    "%s: cannot take it out of rotation before the restart (%r); restarting anyway", url, exc
                )
        try:
            unit.stop()  # a hung process group, or what a dead leader left behind
            # A killed group's sockets close as its processes are torn down, which takes a moment
            # on a loaded machine: starting before that fails on a port "in use".
            try:
                wait_until(
                    lambda: not any(port_in_use(unit.host, p) for p in unit.ports),
                    timeout_s=PORT_FREE_S,
                    interval_s=0.2,
                    what=f"{unit.name}'s port(s) {unit.ports} free",
                )
            except TimeoutError as exc:
                raise ServiceError(f"{unit.name}: {exc}; see `ss -ltnp`") from None
            unit.start()
            unit.wait_healthy(self.settings.services.start_timeout_s)
            unit.after_start()
        except ServiceError as exc:
            log.error("%s: restart failed: %s", unit.name, exc)
            return f"restart failed: {str(exc).splitlines()[0]}"
        self._unhealthy_since.pop(unit.name, None)
        log.warning("%s (%s) restarted on its base weights; aligning it to @champion", unit.name, url)
        return None
