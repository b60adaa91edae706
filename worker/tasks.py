"""Celery tasks of the worker: the cycle chain (train → gate → deploy, worker/chain.py), beat's
periodic check and artefact retention (deployer/artefacts.py), with their retries; and `rtrl train
pause|resume`'s flag in Redis.

Lines (schemas/lines.py, docs/lora.md "An adapter per tenant"): beat's check looks at the global
line and at every tenant with an adapter of its own, and enqueues the cycle of the line that is
due and waited longest (`maybe_train`, `_line_wait`); one cycle at a time holds the lease whichever its line, so
the lines take turns.

Registered on the app in worker/app.py; run by ``rtrl worker``. The worker process opens one
`store.Store` and one `registry.Registry` on first use and keeps them (`worker_resources`), and
hands both to the chain (the gate and the rolling swap use the same store).

Retries are declared here: a transient failure (broker, store, MLflow or vLLM unreachable or
timing out) before the challenger is registered fails the cycle cleanly (its episodes are
released) and the task is retried with exponential backoff and jitter. After registration nothing
is retried (`AfterRegistration`): a retry would register another version. Anything else fails the
task for an operator to read (`rtrl train status`, docs/runbooks/trainer.md).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import redis.exceptions
from celery import Task
from celery.signals import worker_shutting_down

from deployer import trust
from registry import NoChampion, Registry, RegistryUnavailable
from schemas.clock import utcnow
from schemas.lines import Line, all_lines, global_line, tenant_line
from schemas.settings import Settings
from serving import Unreachable
from store import DatabaseUnavailable, Store
from trainer.lease import expire_abandoned
from trainer.selection import count_trainable
from worker.app import BEAT_TASK, CYCLE_TASK, PRUNE_TASK, QUEUE, app, current_settings
from worker.chain import run_chain

log = logging.getLogger(__name__)

# Failures worth a retry: the service will most likely be back. Bugs and bad data are not here.
TRANSIENT = (
    ConnectionError,
    TimeoutError,
    Unreachable,  # a vLLM server (the gate's and the deployer's calls) unreachable or timing out
    RegistryUnavailable,  # MLflow not answering
    DatabaseUnavailable,  # the store unreachable or locked (the transaction was rolled back)
    redis.exceptions.ConnectionError,  # Redis (the queue's pending key) unreachable
    redis.exceptions.TimeoutError,
)
# Beat sets this key when it enqueues a cycle and the cycle clears it when it starts, so a slow
# queue never piles up duplicate cycles. It expires on its own if the message is lost.
PENDING_KEY = "rtrl:trainer:cycle-pending"
# `rtrl train pause` sets this key (JSON: since, reason) and `rtrl train resume` deletes it; beat
# enqueues nothing while it exists. Redis persists it (append-only file).
PAUSED_KEY = "rtrl:trainer:paused"

# Set when this worker begins a warm shutdown (SIGTERM): the cycle under way stops at its next
# step boundary and fails cleanly (its episodes are trainable again at once) instead of being
# SIGKILLed at the end of the supervisor's grace and waiting for its lease to expire.
STOPPING = threading.Event()


@worker_shutting_down.connect  # type: ignore[untyped-decorator]
def _on_shutdown(**_: Any) -> None:
    STOPPING.set()


@dataclass(frozen=True)
class Resources:
    """What a worker process opens once and every task uses."""

    settings: Settings
    store: Store
    registry: Registry


_resources: Resources | None = None


def worker_resources() -> Resources:
    """This process's store and registry, opened on first use for the configured settings (and
    again if the app was configured with other settings since)."""
    global _resources
    settings = current_settings()
    if _resources is None or _resources.settings is not settings:
        if _resources is not None:
            _resources.store.close()
        store = Store(settings.store.url)
        store.check_schema()  # a worker on a store nobody migrated fails with what to do, not "no such table"
        _resources = Resources(settings, store, Registry.from_settings(settings))
    return _resources


def next_cycle_due(settings: Settings, store: Store, tenant: str | None = None) -> datetime | None:
    """When the cadence allows the next cycle of `tenant`'s line (None: the global line): the start
    of the line's last cycle that spent its episodes plus ``trainer.cadence_s``; None when nothing
    holds it back."""
    if settings.trainer.cadence_s <= 0:
        return None
    last = store.last_cycle_started_at(("promoted", "rejected"), line=tenant)
    return None if last is None else last + timedelta(seconds=settings.trainer.cadence_s)


def pause_training(settings: Settings, reason: str) -> dict[str, Any]:
    """Stop beat from enqueueing cycles until `resume_training` (a running cycle finishes)."""
    state = {"paused": True, "since": utcnow().isoformat(), "reason": reason}
    _redis(settings.celery.broker_url).set(
        PAUSED_KEY, json.dumps({"since": state["since"], "reason": reason})
    )
    return state


def resume_training(settings: Settings) -> dict[str, Any]:
    """Let beat enqueue cycles again."""
    _redis(settings.celery.broker_url).delete(PAUSED_KEY)
    return {"paused": False}


def pause_state(client: Any) -> dict[str, Any] | None:
    """``{"since", "reason"}`` of `rtrl train pause` from the Redis `client`, or None when training runs."""
    raw = client.get(PAUSED_KEY)
    return None if raw is None else dict(json.loads(raw))


def training_paused(settings: Settings) -> dict[str, Any] | bool | str:
    """For status displays: `pause_state` from the broker, False when training runs, or
    ``"unknown (...)"`` when Redis does not answer within 2 s; never raises."""
    import redis

    try:
        client = redis.Redis.from_url(settings.celery.broker_url, socket_timeout=2, socket_connect_timeout=2)
        return pause_state(client) or False
    except redis.RedisError as exc:
        return f"unknown ({exc})"


def _redis(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


@app.task(  # type: ignore[untyped-decorator]
    name=CYCLE_TASK,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=TRANSIENT,
    retry_backoff=10,
    retry_backoff_max=300,
    retry_jitter=True,
    max_retries=3,
)
def train_cycle(self: Task, tenant: str | None = None) -> dict[str, Any]:
    """One cycle of `tenant`'s adapter line (None: the global line), then the eval gate and, on
    pass, the rolling swap; returns the outcome as JSON."""
    res = worker_resources()
    _redis(res.settings.celery.broker_url).delete(PENDING_KEY)
    owner = f"{socket.gethostname()}:{os.getpid()}:{self.request.id}"
    line = global_line(res.settings) if tenant is None else tenant_line(res.settings, tenant)
    # A redelivered message (the previous worker died mid-cycle) takes over that cycle's lease.
    return run_chain(
        res.settings,
        res.store,
        res.registry,
        owner=owner,
        takeover_suffix=self.request.id,
        stopping=STOPPING.is_set,
        line=line,
    )


@app.task(name=BEAT_TASK)  # type: ignore[untyped-decorator]
def maybe_train() -> str:
    """Enqueue a cycle when training is not paused, the cadence allows one, the champion has
    ≥ min_samples trainable episodes and no cycle is active; returns what it decided."""
    res = worker_resources()
    settings = res.settings
    client = _redis(settings.celery.broker_url)
    state = pause_state(client)
    if state is not None:
        return f"paused since {state['since']} ({state['reason']}); `rtrl train resume` to continue"
    expire_abandoned(settings, res.store)  # a dead worker's cycle releases its episodes first
    lines = all_lines(settings, res.store.adapter_tenants() if settings.trainer.adapter == "lora" else [])
    waits = [_line_wait(settings, res, line) for line in lines]
    due = [(line, why) for line, why in zip(lines, waits, strict=True) if why is None]
    if not due:
        if len(lines) == 1:
            return str(waits[0])
        return "; ".join(f"{line.label}: {why}" for line, why in zip(lines, waits, strict=True))
    if res.store.active_cycles():
        return "busy: a cycle is active"
    line = min(due, key=lambda found: _last_started(res.store, found[0]))[0]  # the longest wait first
    ttl = int(settings.trainer.lease_ttl_s)
    if not client.set(PENDING_KEY, "1", nx=True, ex=ttl):
        return "busy: a cycle is already queued"
    task = train_cycle.apply_async(kwargs={"tenant": line.tenant}, queue=QUEUE)
    log.info("enqueued cycle %s of the %s line", task.id, line.label)
    return f"enqueued {task.id} ({line.label})"


def _line_wait(settings: Settings, res: Resources, line: Line) -> str | None:
    """Why `line` is not due for a cycle (the cadence, too few trainable episodes), or None."""
    due = next_cycle_due(settings, res.store, line.tenant)
    if due is not None and due > utcnow():
        return f"cadence: next cycle not before {due.isoformat()} (trainer.cadence_s {settings.trainer.cadence_s:g})"
    registry = res.registry if line.tenant is None else Registry.for_line(line)
    try:
        champion = trust.champion(registry, res.store)
    except NoChampion:
        if line.tenant is None:
            raise
        return "no v1 yet: the fleet reconciler registers it (rtrl deploy reconcile)"
    available = count_trainable(settings, res.store, champion, tenant=line.tenant)
    if available < settings.trainer.min_samples:
        return f"waiting: {available} < {settings.trainer.min_samples} trainable episodes of v{champion}"
    return None


def _last_started(store: Store, line: Line) -> datetime:
    """When `line`'s last cycle that spent its episodes started (the oldest first: no line starves)."""
    last = store.last_cycle_started_at(("promoted", "rejected"), line=line.tenant)
    return last if last is not None else datetime.min.replace(tzinfo=UTC)


@app.task(name=PRUNE_TASK)  # type: ignore[untyped-decorator]
def prune_artefacts() -> str:
    """Delete the artefacts ``deployer.retention`` does not keep (as ``rtrl deploy prune``); returns
    the summary. Not retried: the next run, a day later, finds whatever this one left."""
    from deployer.artefacts import prune

    res = worker_resources()
    report = prune(res.settings, res.registry, res.store)
    log.info("artefact retention: %s", report.summary())
    for error in report.errors:
        log.error("artefact retention: %s", error)
    return report.summary()
