"""Exceptions of the store. `StoreError` is the root; catch it, not its children."""

from __future__ import annotations

from schemas.errors import OperatorError


class StoreError(Exception):
    """Root of every error the store raises on purpose."""


class StoreNotMigrated(StoreError, OperatorError):
    """The database has no rtrl tables, or an older revision than this rtrl needs."""


class UnsupportedStoreUrl(StoreError, OperatorError):
    """``store.url`` names a database rtrl cannot use."""


class DatabaseError(StoreError):
    """The database failed or refused a statement (unreachable, locked, a constraint raced by another
    writer); the transaction was rolled back and nothing of it is stored. Retrying later is safe."""


class DatabaseUnavailable(DatabaseError, OperatorError):
    """The database could not be reached, or stayed locked past the busy timeout."""


class LeaseLost(StoreError):
    """The training cycle is no longer active (finished, or its lease expired and another took over)."""


class EpisodesUnavailable(StoreError):
    """Episodes asked for by a cycle are unknown, not settled, or already used by another cycle."""


class LockBusy(StoreError):
    """Another process, on this host or another, holds the lock (`Store.exclusive`); it is never
    waited for. `holder` says who holds it ("host:pid, purpose, since when") when it is recorded."""

    def __init__(self, name: str, holder: str | None) -> None:
        self.name, self.holder = name, holder
        super().__init__(
            f"the {name} lock is held by {holder}"
            if holder
            else f"the {name} lock is held (its holder has not recorded itself yet)"
        )

    def __reduce__(self) -> tuple[type[LockBusy], tuple[str, str | None]]:
        return LockBusy, (self.name, self.holder)  # pickled (Celery results) with its own arguments


class CanaryRunning(StoreError, OperatorError):
    """A live canary is running already (at most one runs per store); the message names it and how
    to end it (store/canaries.py)."""
