"""One SQLAlchemy engine per process per store URL, shared by every store opened on that URL.

`acquire(url, dialect, busy_timeout_s)` returns the engine of the URL, created on first use with
its dialect's settings (SQLite: WAL, busy timeout, ``synchronous=FULL`` and ``BEGIN IMMEDIATE``;
PostgreSQL: pre-ping, no server-side prepared statements), and counts one more user; `release`
counts one less and disposes the engine (closing its pooled connections) when its last user
releases it, so a process that closes every store holds no connection, as when each store had an
engine of its own. `share` counts one more user of an engine already held (`StoreBase.sharing`).

An in-memory SQLite URL is never shared: each store on ``sqlite://`` is a database of its own.

After a fork the child drops the pooled connections it inherited without closing them
(``Engine.dispose(close=False)``, as SQLAlchemy prescribes): they belong to the parent, whose
sockets and SQLite handles a child must not use. The child opens its own on first use. rtrl's own
processes start by exec (`rtrl run`'s supervisor, a solo-pool Celery worker, spawn), so this
only matters to a caller that forks with a store open.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from sqlalchemy import Engine, create_engine, event

# Re-entrant: a store never closed releases its engine from the garbage collector, which may run
# in this very thread while it holds the lock (inside `acquire`).
_lock = threading.RLock()
_shared: dict[tuple[str, float], Engine] = {}  # (url, busy timeout) -> its engine
_users: dict[Engine, int] = {}  # every engine handed out, in-memory ones too -> its users


def acquire(url: str, dialect: str, busy_timeout_s: float) -> Engine:
    """The engine of `url` (one per process; a new one for in-memory SQLite), with one more user."""
    key = (url, busy_timeout_s)
    with _lock:
        engine = None if _in_memory(url, dialect) else _shared.get(key)
        if engine is None:
            engine = _create(url, dialect, busy_timeout_s)
            if not _in_memory(url, dialect):
                _shared[key] = engine
        _users[engine] = _users.get(engine, 0) + 1
        return engine


def share(engine: Engine) -> None:
    """Count one more user of `engine`, which the caller already holds."""
    with _lock:
        _users[engine] += 1


def release(engine: Engine) -> None:
    """Count one user less; the last one disposes the engine and forgets it."""
    with _lock:
        left = _users.get(engine, 0) - 1
        if left > 0:
            _users[engine] = left
            return
        _users.pop(engine, None)
        for key in [k for k, e in _shared.items() if e is engine]:
            del _shared[key]
    engine.dispose()


def users(engine: Engine) -> int:
    """How many stores hold `engine` now (0: disposed)."""
    with _lock:
        return _users.get(engine, 0)


def _in_memory(url: str, dialect: str) -> bool:
    from sqlalchemy.engine import make_url

    return dialect == "sqlite" and make_url(url).database in (None, "", ":memory:")


def _create(url: str, dialect: str, busy_timeout_s: float) -> Engine:
    if dialect == "sqlite":
        engine = create_engine(url, connect_args={"timeout": busy_timeout_s})
        _configure_sqlite(engine, busy_timeout_s)
        return engine
    # PostgreSQL. No server-side prepared statements: a prepared IN-list query gets a generic plan
    # that cannot hash the list and scans the table (the labeler's lookups went from 5 ms to 200 ms
    # as the tables grew; bench/bench_labeler.py), and a pooler in transaction mode (PgBouncer)
    # cannot hold them anyway.
    engine = create_engine(url, pool_pre_ping=True, connect_args={"prepare_threshold": None})
    # An executemany INSERT without ON CONFLICT goes as multi-row INSERTs (one statement per
    # page of rows) rather than psycopg's one statement per row, as the psycopg2 dialect does;
    # the labeler's batches (with ON CONFLICT) go through store/bulk.py instead.
    engine.dialect.use_insertmanyvalues_wo_returning = True
    return engine


def _configure_sqlite(engine: Engine, busy_timeout_s: float) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module so BEGIN IMMEDIATE below is ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        # FULL: offsets are committed right after a DB commit, so that commit must survive power loss.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # another thread of the parent may have held it at the fork
    for engine in list(_users):
        engine.dispose(close=False)  # the parent's connections stay the parent's


os.register_at_fork(after_in_child=_after_fork_in_child)
