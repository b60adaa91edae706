"""The deployer's state in the store: server rotation and served versions, weight digests, locks.

The deployer takes servers out of the gateways' rotation and announces the version each serves
(`set_rotation`, `set_serving_version`; the gateways read `rotation`), keeps the weight digests it
verifies swaps against (`record_digests`), and holds its locks across hosts (`exclusive`,
store/locks.py); `rtrl status` reads `lock_holders`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.exc import DBAPIError

from store import locks
from store.base import StoreBase, upsert
from store.errors import LockBusy, StoreError
from store.models import DeployLockHolder, RecordedDigests, ServerRotation, VersionHistory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RotationRecord:
    url: str
    in_rotation: bool
    reason: str
    updated_at: datetime
    version: int | None = None  # the weight version the deployer says it serves; None: changing or unknown
    epoch: int = 0  # grows on every announcement of `version`


@dataclass(frozen=True)
class LockHolder:
    """Who holds a deploy lock, as it recorded itself (`Store.exclusive`, `Store.lock_holders`)."""

    name: str
    holder: str  # host:pid
    purpose: str
    acquired_at: datetime
    held: bool | None = None  # lock_holders: whether the lock is held now (False: a stale row); None: unknown

    def __str__(self) -> str:
        return (
            f"{self.holder}"
            + (f" ({self.purpose})" if self.purpose else "")
            + f" since {self.acquired_at.isoformat()}"
        )


class DeployStore(StoreBase):
    """Rotation, served versions, weight digests and deploy locks (see the module docstring)."""

    def record_digests(self, model: str, version: int, digests: dict[str, str]) -> None:
        """Keep the weight digests a verified server reported for `version` of registry model
        `model`, the baseline later swaps to it are checked against; recording again replaces them."""
        values = {"model": model, "version": version, "digests": dict(digests), "recorded_at": self.clock()}
        with self.transaction() as session:
            session.execute(upsert(self.dialect, RecordedDigests, values, ["model", "version"]))

    def recorded_digests(self, model: str, version: int) -> dict[str, str] | None:
        """The digests recorded for `version` of `model`; None when none were."""
        with self.transaction() as session:
            row = session.get(RecordedDigests, (model, version))
            return None if row is None else dict(row.digests)

    @contextmanager
    def exclusive(self, name: str, purpose: str = "") -> Iterator[LockHolder]:
        """Hold lock `name` for the block, for every process on every host of this store (a
        PostgreSQL advisory lock, or an flock beside the SQLite file: store/locks.py), recording
        this process as its holder. Raises LockBusy at once, naming the holder, when it is held."""
        try:
            release = locks.try_lock(self.engine, self.url, name, self._local_locks)
        except DBAPIError as exc:
            raise self._database_error(exc) from exc
        if release is None:
            raise LockBusy(name, self._holder_text(name))
        try:
            holder = LockHolder(name, locks.this_process(), purpose[:500], self.clock())
            values = {
                "name": name,
                "holder": holder.holder,
                "purpose": holder.purpose,
                "acquired_at": holder.acquired_at,
            }
            with self.transaction() as session:  # overwrites a row a killed holder left
                session.execute(upsert(self.dialect, DeployLockHolder, values, ["name"]))
            try:
                yield holder
            finally:
                try:
                    with (
                        self.transaction() as session
                    ):  # before the lock is released: the next holder's row stays
                        session.execute(
                            delete(DeployLockHolder).where(
                                DeployLockHolder.name == name, DeployLockHolder.holder == holder.holder
                            )
                        )
                except StoreError as exc:
                    log.warning(
                        "the %s lock's holder row stays (%s); the next holder overwrites it", name, exc
                    )
        finally:
            release()

    def _holder_text(self, name: str) -> str | None:
        """The recorded holder of lock `name`, for a LockBusy message (best effort)."""
        try:
            with self.transaction() as session:
                row = session.get(DeployLockHolder, name)
                return (
                    None
                    if row is None
                    else str(LockHolder(row.name, row.holder, row.purpose, row.acquired_at))
                )
        except StoreError:
            return None

    def lock_holders(self) -> list[LockHolder]:
        """Every recorded lock holder, with whether its lock is held now (`rtrl status`). A row whose
        lock is free (held False) was left by a holder that was killed; the next holder replaces it."""
        with self.transaction() as session:
            rows = session.scalars(select(DeployLockHolder).order_by(DeployLockHolder.name)).all()
            found = [LockHolder(r.name, r.holder, r.purpose, r.acquired_at) for r in rows]
        try:
            return [
                replace(h, held=locks.held(self.engine, self.url, h.name, self._local_locks)) for h in found
            ]
        except DBAPIError as exc:
            raise self._database_error(exc) from exc

    # ---- server rotation ---------------------------------------------------------------------------

    def set_rotation(self, url: str, in_rotation: bool, reason: str) -> None:
        """Take a serving vLLM server out of the gateways' rotation, or put it back."""
        url = url.rstrip("/")
        with self.transaction() as session:
            row = session.get(ServerRotation, url, with_for_update=True)
            if row is None:
                row = ServerRotation(
                    url=url, in_rotation=in_rotation, reason=reason[:500], updated_at=self.clock()
                )
                session.add(row)
            row.in_rotation, row.reason, row.updated_at = in_rotation, reason[:500], self.clock()

    def set_serving_version(self, url: str, version: int | None, reason: str) -> int:
        """Announce the weight version a serving vLLM server serves: None before a change (a swap,
        a relabel), the version once it is verified. Returns the row's new version epoch."""
        url = url.rstrip("/")
        with self.transaction() as session:
            row = session.get(ServerRotation, url, with_for_update=True)
            if row is None:
                row = ServerRotation(
                    url=url, in_rotation=True, reason=reason[:500], updated_at=self.clock(), version_epoch=0
                )
                session.add(row)
            row.serving_version, row.version_epoch = version, (row.version_epoch or 0) + 1
            row.reason, row.updated_at = reason[:500], self.clock()
            if version is not None:
                served = session.get(VersionHistory, version, with_for_update=True)
                if served is None:
                    session.add(
                        VersionHistory(
                            version=version, first_served_at=self.clock(), last_served_at=self.clock()
                        )
                    )
                else:
                    served.last_served_at = self.clock()
            return row.version_epoch

    def rotation(self) -> dict[str, RotationRecord]:
        """Every server with a rotation row, by url (a server without one is in rotation)."""
        with self.transaction() as session:
            return {
                r.url: RotationRecord(
                    r.url, r.in_rotation, r.reason, r.updated_at, r.serving_version, r.version_epoch or 0
                )
                for r in session.scalars(select(ServerRotation))
            }
