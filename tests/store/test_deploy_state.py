"""The deployer's state in the store (store/locks.py, `Store.exclusive`, `Store.record_digests`), on
SQLite and on the session's real PostgreSQL: recorded digests, and locks that hold across
processes, name their holder, and are released when that holder is SIGKILLed."""

from __future__ import annotations

import os
import pickle
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from store import LockBusy, Store
from store.locks import lock_key, lock_path

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def any_store(url: str) -> Iterator[Store]:
    """A migrated store at `url` (tests/store/conftest.py) on the wall clock: these locks cross processes."""
    opened = Store(url)
    opened.migrate()
    yield opened
    opened.close()


# ---- recorded digests ----------------------------------------------------------------------------


def test_digests_round_trip_and_recording_again_replaces_them(any_store: Store) -> None:
    assert any_store.recorded_digests("tiny", 2) is None
    any_store.record_digests("tiny", 2, {"embed": "aa", "lm_head": "bb"})
    assert any_store.recorded_digests("tiny", 2) == {"embed": "aa", "lm_head": "bb"}
    any_store.record_digests("tiny", 2, {"embed": "cc"})  # the gate ran again on another download
    assert any_store.recorded_digests("tiny", 2) == {"embed": "cc"}
    # Another version, and v2 of another registry model, are other checkpoints.
    assert any_store.recorded_digests("tiny", 3) is None
    assert any_store.recorded_digests("other", 2) is None
    any_store.record_digests("other", 2, {"embed": "dd"})
    assert any_store.recorded_digests("tiny", 2) == {"embed": "cc"}


# ---- locks ------------------------------------------------------------------------------------------


def test_a_held_lock_fails_fast_naming_its_holder_and_is_free_after_the_block(
    any_store: Store, url: str
) -> None:
    other = Store(url)  # another process's handle on the same store, as far as the lock can tell
    me = f"{socket.gethostname()}:{os.getpid()}"
    try:
        with any_store.exclusive("rollout", "promote v3") as holder:
            assert (holder.name, holder.holder, holder.purpose) == ("rollout", me, "promote v3")
            started = time.monotonic()
            with pytest.raises(
                LockBusy, match=re.escape(f"the rollout lock is held by {me} (promote v3) since ")
            ) as busy:
                with other.exclusive("rollout", "align"):
                    pytest.fail("two holders of one lock")
            assert time.monotonic() - started < 5  # fails fast: never waits for the holder
            assert busy.value.name == "rollout" and busy.value.holder is not None
            with pytest.raises(LockBusy):  # not re-entrant, even on the same handle
                with any_store.exclusive("rollout"):
                    pass
            with other.exclusive("staging", "gate v3"):  # another name: no wait, no conflict
                assert {(h.name, h.purpose, h.held) for h in any_store.lock_holders()} == {
                    ("rollout", "promote v3", True),
                    ("staging", "gate v3", True),
                }
        assert any_store.lock_holders() == []  # each holder removed its row before it released
        with other.exclusive("rollout", "align"):  # released after the block
            pass
        with pytest.raises(RuntimeError, match="boom"):
            with any_store.exclusive("rollout"):
                raise RuntimeError("boom")
        with other.exclusive("rollout"):  # released after a block that raised, too
            pass
    finally:
        other.close()


HOLD = """
import sys, time
from store import Store
store = Store(sys.argv[1])
with store.exclusive("rollout", "doomed"):
    print("held", flush=True)
    time.sleep(600)
"""


def holding_child(url: str) -> subprocess.Popen[str]:
    """A process that holds the "rollout" lock of the store at `url` (purpose "doomed") until killed."""
    child = subprocess.Popen([sys.executable, "-c", HOLD, url], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], 60)
    if not (ready and child.stdout.readline().strip() == "held"):
        child.kill()
        child.wait()
        pytest.fail("the child did not take the lock")
    return child


def test_a_lock_whose_holder_process_is_sigkilled_is_released(any_store: Store, url: str) -> None:
    child = holding_child(url)
    try:
        with pytest.raises(LockBusy, match=f":{child.pid} \\(doomed\\)"):
            with any_store.exclusive("rollout"):
                pass
        os.kill(child.pid, signal.SIGKILL)  # no finally runs: the row stays, the lock must not
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    deadline = (
        time.monotonic() + 30
    )  # PostgreSQL ends the dead client's session when it sees the socket close
    while True:
        try:
            with any_store.exclusive("rollout", "after the kill") as holder:
                (row,) = any_store.lock_holders()
                assert (row.holder, row.purpose, row.held) == (
                    holder.holder,
                    "after the kill",
                    True,
                )  # overwritten
            break
        except LockBusy:
            assert time.monotonic() < deadline, "the lock of a SIGKILLed holder was never released"
            time.sleep(0.2)


def test_a_stale_holder_row_is_reported_as_not_held(any_store: Store, url: str) -> None:
    child = holding_child(url)
    try:
        ((name, held),) = [(h.name, h.held) for h in any_store.lock_holders()]
        assert (name, held) == ("rollout", True)
    finally:
        child.kill()  # SIGKILL
        child.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any_store.lock_holders()[0].held:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    (stale,) = any_store.lock_holders()
    assert stale.holder.endswith(f":{child.pid}") and stale.held is False


@pytest.mark.unit
def test_an_sqlite_stores_lock_is_a_file_beside_the_database(tmp_path: Path) -> None:
    assert lock_path(str(tmp_path / "rtrl.db"), "rollout") == tmp_path / "rtrl.db.rollout.lock"
    store = Store(f"sqlite:///{tmp_path / 'rtrl.db'}")
    store.migrate()
    with store.exclusive("staging"):
        assert (tmp_path / "rtrl.db.staging.lock").exists()
    store.close()


@pytest.mark.unit
def test_an_in_memory_stores_lock_is_held_in_the_process() -> None:
    store = Store("sqlite://")
    store.migrate()
    with store.exclusive("rollout", "first"):
        with pytest.raises(LockBusy, match="held by .* \\(first\\)"):
            with store.exclusive("rollout"):
                pass
        assert [(h.name, h.held) for h in store.lock_holders()] == [("rollout", True)]
    with store.exclusive("rollout"):
        pass
    store.close()


@pytest.mark.unit
def test_advisory_lock_keys_are_fixed() -> None:
    # sha256("rtrl:<name>")[:8] as a signed big-endian int64: the values docs/runbooks/deployer.md gives.
    assert lock_key("rollout") == -2899374342673118491
    assert lock_key("staging") == -3586840187377909985


@pytest.mark.unit
def test_lock_busy_pickles_with_its_holder() -> None:
    error = pickle.loads(pickle.dumps(LockBusy("rollout", "node-a:41 (promote v3) since then")))
    assert (error.name, error.holder, str(error)) == (
        "rollout",
        "node-a:41 (promote v3) since then",
        "the rollout lock is held by node-a:41 (promote v3) since then",
    )
    assert (
        str(LockBusy("staging", None)) == "the staging lock is held (its holder has not recorded itself yet)"
    )
