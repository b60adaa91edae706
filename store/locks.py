"""Locks whose scope is the store: the deployer's "one rollout at a time" ("rollout") and "one gate
run on the staging server at a time" ("staging") hold for every process on every host that uses
the same store. Taken through `Store.exclusive(name, purpose)`, which also records who holds it.

- PostgreSQL: a session-level advisory lock, ``pg_try_advisory_lock(lock_key(name))``, taken on a
  connection of its own that stays open (in autocommit: never idle in a transaction) until the
  block ends, then ``pg_advisory_unlock`` and the connection goes back to the pool (closed for
  good when the unlock fails, which ends the session and its lock). A holder that dies (SIGKILL,
  OOM) loses its connection and the server releases the lock; one whose host vanished is found by
  the session's TCP keepalives (about 25 s). Not through a proxy that pools transactions
  (PgBouncer in transaction mode): the lock belongs to a server session. The key of a name is
  fixed: the first 8 bytes of sha256("rtrl:<name>") as a signed 64-bit integer (`lock_key`;
  "rollout" is -2899374342673118491, "staging" -3586840187377909985), so every process and
  `pg_locks` agree on it. The lock belongs to the database the store URL names.
- SQLite: the store is a file on one host, so an flock on ``<database file>.<name>.lock`` beside
  it has the same scope; the kernel releases it when its holder dies.
- In-memory SQLite: a lock of this `Store` object (nothing else can see the database anyway).

Every lock fails fast: a held lock is never waited for. Different names never block each other
(a gate run holds "staging" while a rollout holds "rollout"). A lock is not re-entrant: taking a
name this process already holds fails like any other holder's.

If the PostgreSQL connection holding a lock is lost mid-block (the server restarted, a network
partition longer than the keepalives), the server releases the lock while the holder, which does
not watch that connection, carries on: a second holder could then start. That is the one way this
lock is weaker than an flock on one host.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

log = logging.getLogger(__name__)

Release = Callable[[], None]


def lock_key(name: str) -> int:
    """The PostgreSQL advisory lock key of lock `name`: stable across processes and hosts (Python's
    own ``hash()`` of a string is salted per process)."""
    return int.from_bytes(hashlib.sha256(f"rtrl:{name}".encode()).digest()[:8], "big", signed=True)


def this_process() -> str:
    """How a holder names itself: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def lock_path(database: str, name: str) -> Path:
    """The file an SQLite store's lock `name` is an flock on: beside the database file."""
    path = Path(database)
    return path.with_name(f"{path.name}.{name}.lock")


def sqlite_database(url: str) -> str | None:
    """The database file of an SQLite URL; None for an in-memory database."""
    database = make_url(url).database
    return None if not database or database == ":memory:" else database


def try_lock(engine: Engine, url: str, name: str, local: dict[str, threading.Lock]) -> Release | None:
    """Take lock `name` when it is free: the function that releases it, or None when another holds
    it. `local` holds the locks of an in-memory SQLite store. Raises DBAPIError when PostgreSQL
    cannot be reached."""
    if engine.dialect.name == "postgresql":
        return _try_advisory(engine, name)
    database = sqlite_database(url)
    if database is None:
        lock = local.setdefault(name, threading.Lock())
        return lock.release if lock.acquire(blocking=False) else None
    return _try_flock(lock_path(database, name))


def held(engine: Engine, url: str, name: str, local: dict[str, threading.Lock]) -> bool | None:
    """Whether some process holds lock `name` now, looked up without taking it (taking it, even
    for a moment, could make a real holder's attempt fail). None when it cannot be told."""
    if engine.dialect.name == "postgresql":
        # A bigint advisory key shows in pg_locks as classid (high half), objid (low half), objsubid 1
        # (the query docs/runbooks/deployer.md, Locks, gives operators).
        query = text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
            " AND ((classid::bigint << 32) | objid::bigint) = :key"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        with engine.connect() as connection:
            return bool(connection.execute(query, {"key": lock_key(name)}).scalar())
    database = sqlite_database(url)
    if database is None:
        lock = local.get(name)
        return lock is not None and lock.locked()
    return _flock_held(lock_path(database, name))


# The server's TCP keepalives on a lock's connection: a holder whose host vanished (no FIN, no RST)
# is found dead, and its lock released, after about idle + interval * count seconds, not after the
# kernel's default two hours.
_KEEPALIVE = (
    "SELECT set_config('tcp_keepalives_idle', '10', false), set_config('tcp_keepalives_interval', '5', false),"
    " set_config('tcp_keepalives_count', '3', false)"
)


def _try_advisory(engine: Engine, name: str) -> Release | None:
    connection = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    try:
        connection.execute(text(_KEEPALIVE))
        got = connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": lock_key(name)}).scalar()
    except BaseException:
        connection.close()
        raise
    if not got:
        connection.close()
        return None

    def release() -> None:
        try:
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": lock_key(name)})
            connection.close()
        except DBAPIError as exc:
            # The connection is gone or broken: closing it for good ends the session, and with it
            # the lock, on the server's side.
            log.warning("could not unlock %s (%s); dropping its connection, which releases it", name, exc)
            connection.invalidate()
            connection.close()

    return release


def _try_flock(path: Path) -> Release | None:
    handle = path.open("a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    except BaseException:
        handle.close()
        raise

    def release() -> None:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()

    return release


def _flock_held(path: Path) -> bool | None:
    """Whether /proc/locks (Linux) lists an flock on `path`'s file."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return False
    file_id = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:9978175 0 EOF" (waiters, "1: -> FLOCK ...", never occur: no one waits)
    return any(len(f) > 5 and f[1] == "FLOCK" and f[5] == file_id for f in (line.split() for line in lines))
