"""The cycle lease: kept alive while its worker lives, expired soon after it dies.

One cycle at a time holds the lease (a row of the store's ``cycles`` table, `store.Store.acquire_cycle`).
Its worker renews it from a thread every quarter of ``trainer.lease_ttl_s`` (`keep_lease`) for as
long as the job runs, training, gate and swap included, so the TTL can be short whatever a cycle's
length. When the worker dies (SIGKILL, OOM, the host) the renewals stop; within the TTL the lease
has expired, and the next reader (beat's check, or the next cycle) fails that cycle and releases
its episodes (`expire_abandoned`): the loop re-runs it within minutes, not hours. That failure
counts against the episodes like any other (a batch that kills its worker is a poisoned batch): at
``trainer.max_episode_failures`` they are quarantined instead (docs/security.md, Poisoned episodes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from schemas.settings import Settings
from store import Store
from trainer import checkpoint

log = logging.getLogger(__name__)


def expire_abandoned(settings: Settings, store: Store) -> list[int]:
    """Fail the cycles whose lease expired (their episodes go back to the pool, their staged
    baselines are discarded); their ids."""
    expired = store.expire_cycles(max_episode_failures=settings.trainer.max_episode_failures)
    for cycle_id in expired:
        checkpoint.discard_baselines(settings.trainer.checkpoint_dir, cycle_id)
        log.warning(
            "cycle %d: its lease expired (the worker died or hung); failed, its episodes released", cycle_id
        )
    return expired


@contextmanager
def keep_lease(store: Store, owner: str, ttl_s: float) -> Iterator[None]:
    """Renew the lease of the cycle `owner` holds every ``ttl_s / 4`` until the block ends.

    Renewing is a no-op while `owner` holds no active cycle (before it acquires one, after it
    ends). A renewal that fails (the store unreachable) is logged and tried again at the next
    tick; when the lease is lost meanwhile, the cycle's own next write raises `store.LeaseLost`.
    """
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl_s / 4):
            try:
                store.renew_lease(owner, ttl_s)
            except Exception as exc:  # noqa: BLE001 - the keeper must outlive any one failure
                log.warning(
                    "could not renew the cycle lease of %s: %r; retrying in %.0fs", owner, exc, ttl_s / 4
                )

    thread = threading.Thread(target=renew, name="rtrl-lease", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)
