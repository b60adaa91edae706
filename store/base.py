"""What every typed store shares: the URL, the process's engine of it, transactions, the schema.

`StoreBase(url, *, busy_timeout_s=30.0, clock=utcnow)` opens a store on the process's engine of
`url` (store/engines.py: one per process per URL, so opening several stores costs no second
pool); ``StoreBase.sharing(other)`` opens one on another store's engine, URL and clock. A store
is a context manager (``with CycleStore(url) as cycles:``): leaving the block closes it, which
releases its hold on the engine (the last store of a URL disposes it; a store that is never
closed releases it when it is garbage-collected). The typed stores (store/labelling.py,
store/episodes.py, store/cycles.py, store/deploys.py, store/promotions.py, store/canaries.py,
store/tenants.py, store/reports.py, store/retention.py) add the methods of one consumer each;
`store.Store` is all of them.

``migrate()`` brings the schema to the newest Alembic revision (shipped in ``store/migrations``);
commands that only read call ``check_schema()`` instead, so a read never changes the schema. On
SQLite several processes share one store through WAL journaling, a busy timeout, and ``BEGIN
IMMEDIATE`` transactions (writers queue up front instead of failing when a read lock cannot be
upgraded).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from schemas.clock import Clock, utcnow
from store import engines
from store.errors import DatabaseError, DatabaseUnavailable, StoreNotMigrated, UnsupportedStoreUrl

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


class StoreBase:
    """A handle on the SQL store at `url`. Thread-safe; a context manager that closes on exit.

    ``clock`` is the time lease expiry and orphan counts are measured on (tests move it).
    """

    url: str
    clock: Clock
    dialect: str
    engine: Engine

    def __init__(self, url: str, *, busy_timeout_s: float = 30.0, clock: Clock = utcnow) -> None:
        try:
            parsed = make_url(url)
        except ArgumentError:
            raise UnsupportedStoreUrl(
                f"store URL {url!r} is not a database URL; set RTRL_STORE__URL to sqlite:///PATH or "
                "postgresql+psycopg://USER@HOST:PORT/DB"
            ) from None
        dialect = parsed.get_backend_name()
        if dialect not in ("sqlite", "postgresql"):
            raise UnsupportedStoreUrl(
                f"unsupported store URL {parsed.render_as_string(hide_password=True)!r}; set RTRL_STORE__URL "
                "to sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB"
            )
        if dialect == "sqlite" and parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = engines.acquire(url, dialect, busy_timeout_s)
        self._attach(url, dialect, engine, clock, {})

    @classmethod
    def sharing(cls, other: StoreBase) -> Self:
        """A store of this type on `other`'s engine, URL and clock (closing either leaves the other open)."""
        engines.share(other.engine)
        store = cls.__new__(cls)
        store._attach(other.url, other.dialect, other.engine, other.clock, other._local_locks)
        return store

    def _attach(
        self, url: str, dialect: str, engine: Engine, clock: Clock, local_locks: dict[str, threading.Lock]
    ) -> None:
        self.url, self.dialect, self.engine, self.clock = url, dialect, engine, clock
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._local_locks = local_locks  # an in-memory SQLite store's locks (store/locks.py)
        # close() or, for a store never closed, its garbage collection releases the engine once.
        self._release = weakref.finalize(self, engines.release, engine)
        self._release.atexit = False

    def close(self) -> None:
        """Release this store's hold on the engine (idempotent); other stores on it keep working."""
        self._release()

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    @property
    def where(self) -> str:
        """The store's URL with its password hidden (for messages and reports)."""
        return make_url(self.url).render_as_string(hide_password=True)

    # ---- schema ---------------------------------------------------------------------------------

    def _alembic_config(self) -> Any:
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        return config

    def migrate(self, revision: str = "head") -> None:
        """Run the Alembic migrations up to ``revision`` (idempotent; safe from several processes)."""
        from alembic import command

        config = self._alembic_config()
        try:
            with self.engine.begin() as connection:
                if self.dialect == "postgresql":
                    # Two processes starting at once must not both create the tables.
                    connection.exec_driver_sql("SELECT pg_advisory_xact_lock(7215031)")
                config.attributes["connection"] = connection
                command.upgrade(config, revision)
        except DBAPIError as exc:
            raise self._database_error(exc) from exc

    def check_schema(self) -> None:
        """Raise StoreNotMigrated unless the database is at the newest revision. Never migrates,
        and never creates a SQLite file that is not there."""
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        head = ScriptDirectory.from_config(self._alembic_config()).get_current_head()
        parsed = make_url(self.url)
        where = parsed.render_as_string(hide_password=True)
        if self.dialect == "sqlite" and parsed.database and not Path(parsed.database).exists():
            # Connecting would create an empty database file: a read must not leave one behind.
            raise StoreNotMigrated(
                f"the store {where} does not exist; run `rtrl labeler migrate` (or `rtrl run`)"
            )
        try:
            with self.engine.connect() as connection:
                current = MigrationContext.configure(connection).get_current_revision()
        except DBAPIError as exc:
            raise self._database_error(exc) from exc
        if current != head:
            found = "no rtrl tables" if current is None else f"revision {current}, not {head}"
            raise StoreNotMigrated(
                f"the store at {where} has {found}; run `rtrl labeler migrate` (or `rtrl run`)"
            )

    # ---- transactions ---------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on any exception.

        A failure of the database itself (a driver error: unreachable, locked, a raced constraint)
        leaves as `DatabaseError`, so callers decide on retries without knowing SQLAlchemy. For the
        store package itself and for tests that inspect rows; other packages call the typed stores' methods.
        """
        try:
            with self._sessions() as session, session.begin():
                yield session
        except DBAPIError as exc:
            raise self._database_error(exc) from exc

    def _database_error(self, exc: DBAPIError) -> DatabaseError | StoreNotMigrated:
        detail = " ".join(f"{type(exc.orig).__name__}: {exc.orig}".split())[
            :1000
        ]  # drivers write several lines
        where = self.where
        if "no such table" in detail or "UndefinedTable" in detail or "no such column" in detail:
            return StoreNotMigrated(
                f"the store at {where} lacks rtrl's tables ({detail}); run `rtrl labeler migrate`"
            )
        if str(getattr(exc.orig, "sqlstate", "") or "").startswith("40"):
            # Deadlock or serialization failure: it raced another writer (a labeler replica); the
            # transaction was rolled back whole, and running it again is the remedy.
            return DatabaseUnavailable(
                f"the store at {where} rolled the transaction back after a conflict ({detail})"
            )
        if isinstance(exc, OperationalError | InterfaceError):
            return DatabaseUnavailable(
                f"the store at {where} is unreachable or locked ({detail}); is it up? "
                "(`rtrl services up` starts the local one; `rtrl services status`; or set RTRL_STORE__URL)"
            )
        return DatabaseError(detail)


def upsert(dialect: str, model: Any, values: dict[str, Any], keys: list[str], only_if: Any = None) -> Any:
    """INSERT `values`, or on a conflict over `keys` UPDATE the row to them (SQLite and PostgreSQL);
    with `only_if` (a function of the statement's ``excluded`` row giving a condition), only when it holds."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        statement: Any = pg_insert(model).values(values)
    else:
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        statement = sqlite_insert(model).values(values)
    changed = {name: statement.excluded[name] for name in values if name not in keys}
    where = None if only_if is None else only_if(statement.excluded)
    return statement.on_conflict_do_update(index_elements=keys, set_=changed, where=where)
