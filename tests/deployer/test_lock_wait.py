"""A wait for a held deploy lock (`deployer.swap.rollout_lock`, `LockWait`, the worker's chain with
``deployer.lock_wait_s``) ends within a second of its stop condition (the worker's SIGTERM), on
SQLite and on the session's real PostgreSQL, with the lock held by another store's connection as a
reconciler tick in another process would hold it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers import STORE_BACKENDS, migrated_store_url

from deployer.errors import RolloutBusy, WaitStopped
from deployer.swap import NO_WAIT, LockWait, rollout_lock
from store import Store


@pytest.fixture(params=STORE_BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return migrated_store_url(request, tmp_path)


def test_a_wait_on_a_held_lock_ends_within_a_second_of_the_stop(url: str) -> None:
    """A reconciler tick holds "rollout" on its own connection; the worker waits with 300 s to go
    and is told to stop 0.3 s in: `WaitStopped` (a RolloutBusy, which the chain handles as a lock
    that stayed held), well before the tick lets go."""
    stop = threading.Event()
    with Store(url) as tick, Store(url) as worker, tick.exclusive("rollout", "align the fleet to @champion"):
        threading.Timer(0.3, stop.set).start()
        began = time.monotonic()
        with pytest.raises(
            WaitStopped,
            match=r"^stopped waiting for the rollout lock after 0\.\d s: this process is stopping; ",
        ) as caught:
            with LockWait(300.0, stop.is_set).hold(worker, "rollout", "promote v3"):
                pytest.fail("the lock was taken while another held it")
        assert time.monotonic() - began < 1.3
        assert isinstance(caught.value, RolloutBusy)
        assert [h.purpose for h in worker.lock_holders()] == ["align the fleet to @champion"]


def test_a_free_lock_is_taken_even_when_stopping_and_no_wait_fails_at_once(url: str) -> None:
    """Only the wait is given up: a stopping worker still takes a free lock (the chain decides
    itself whether to go on). Without a wait, a held lock is RolloutBusy at once, as before."""
    with Store(url) as store, Store(url) as other:
        with LockWait(300.0, lambda: True).hold(store, "staging", "gate v3"):
            assert [h.purpose for h in store.lock_holders()] == ["gate v3"]
            began = time.monotonic()
            with pytest.raises(RolloutBusy, match=r"^another staging is under way: ") as caught:
                with NO_WAIT.hold(other, "staging", "align staging to @champion"):
                    pass
            assert not isinstance(caught.value, WaitStopped) and time.monotonic() - began < 1
        with rollout_lock(other, "staging", "align staging to @champion"):
            pass
