"""The trainer's cycles and the versions they train from: leases, gate decisions, served versions.

The trainer's contract (docs/internals.md): ``acquire_cycle`` / ``heartbeat_cycle`` /
``finish_cycle`` keep at most one *active* cycle (status ``running`` or ``registered``, i.e.
training, or registered and waiting for gate/deploy). A cycle whose lease expired is marked
``failed`` by the next ``acquire_cycle`` and its episodes released. A unique ``active_slot`` column
makes this hold inside the database, so two workers racing on PostgreSQL cannot both win.
``finish_cycle(.., "failed")`` releases the cycle's claimed episodes (the data was not learnt
from); ``rejected`` keeps them (a model was trained on them and judged), so a rejected batch is not
retrained forever. The claims themselves are `EpisodeStore.mark_used` (store/episodes.py).

Every failure counts against the episodes it releases (``episodes.failed_cycles``), on each path
that fails a cycle (``finish_cycle``, an expired lease, a reclaimed job), unless the caller says the
failure was not the data's (``count_failure=False``: the worker was stopping, or the store, MLflow,
the network or the disk failed, trainer/cycle.py `NOT_THE_DATAS`; or the batch had trained and
registered). The count and the release are one transaction, so two paths failing one cycle count
it once. An episode at ``max_episode_failures`` is quarantined instead of released
(`release_claims`): one poisoned episode cannot fail every cycle that selects it (docs/security.md,
Poisoned episodes). `EpisodeStore.quarantined` lists them and `EpisodeStore.release_quarantined`
gives them back.

Policy versions are ``int`` in this API and ``"vN"`` in the tables (schemas/versions.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from schemas.settings.trainer import MAX_EPISODE_FAILURES_DEFAULT
from schemas.versions import format_version, parse_version
from store import settle
from store.base import StoreBase
from store.errors import DatabaseError, LeaseLost
from store.models import (
    ACTIVE_CYCLE_STATUSES,
    FINAL_CYCLE_STATUSES,
    Cycle,
    Episode,
    GateDecisionRow,
    VersionHistory,
)

CYCLE_STATUSES = ACTIVE_CYCLE_STATUSES + FINAL_CYCLE_STATUSES
# Which status a cycle may move to from where it is (a final status never changes).
_TRANSITIONS = {
    "running": {"registered", "promoted", "rejected", "failed", "skipped"},
    "registered": {"promoted", "rejected", "failed"},
}
_ACTIVE_SLOT = 1
QUARANTINE_REASON_CHARS = 2000  # of the failed cycle's error, kept on each episode it quarantines


@dataclass(frozen=True)
class CycleRecord:
    """A training cycle as the store holds it (what `rtrl train status` prints)."""

    id: int
    status: str
    owner: str
    lease_expires_at: datetime
    champion: int
    challenger: int | None
    started_at: datetime
    finished_at: datetime | None
    episode_ids: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    reward_spec: str | None = None  # the spec of the episodes it trained on (`Store.mark_used`)
    line: str | None = None  # the tenant whose adapter line it trained; None: the global line


class CycleStore(StoreBase):
    """Training cycles and their leases, the gate's decisions, the versions served (see the module docstring)."""

    def trained_cycles(self, spec_id: str) -> int:
        """Cycles that trained a version (registered, promoted or rejected) on episodes of the reward
        spec `spec_id`: the k of that spec's PARL λ schedule (`settle.trained_cycles`)."""
        with self.transaction() as session:
            return settle.trained_cycles(session, spec_id)

    def acquire_cycle(
        self,
        owner: str,
        ttl_s: float,
        champion: int,
        *,
        max_episode_failures: int = MAX_EPISODE_FAILURES_DEFAULT,
        line: str | None = None,
    ) -> int | None:
        """Start a cycle of `line` (a tenant's adapter line; None: the global line) training from its
        version `champion`; its id, or None when another cycle, of any line, holds the lease.
        A cycle whose lease expired is failed first, its episodes released or quarantined (`release_claims`)."""
        now = self.clock()
        try:
            with self.transaction() as session:
                active = session.scalars(select(Cycle).where(Cycle.status.in_(ACTIVE_CYCLE_STATUSES))).all()
                for cycle in active:
                    if cycle.lease_expires_at > now:
                        return None
                    self._end_cycle(
                        session,
                        cycle.id,
                        "failed",
                        now,
                        error=f"lease expired at {cycle.lease_expires_at.isoformat()}",
                        quarantine_after=max_episode_failures,
                    )
                cycle = Cycle(
                    status="running",
                    owner=owner,
                    lease_expires_at=now + timedelta(seconds=ttl_s),
                    champion_version=format_version(champion),
                    started_at=now,
                    active_slot=_ACTIVE_SLOT,
                    line=line,
                )
                session.add(cycle)
                session.flush()
                return cycle.id
        except DatabaseError as exc:
            if isinstance(exc.__cause__, IntegrityError):
                return None  # another worker inserted its active cycle between our read and our insert
            raise

    def reclaim_cycle(
        self, owner_suffix: str, reason: str, *, max_episode_failures: int = MAX_EPISODE_FAILURES_DEFAULT
    ) -> int | None:
        """Fail the active cycle whose owner ends with ``:owner_suffix`` and release its episodes.

        For a job delivered again after its worker died (the suffix is the Celery task id, which
        acks_late redelivers unchanged): the old cycle's lease is still valid but nobody runs it,
        so it ends now and the cycle re-runs instead of waiting for the lease to expire. The failure
        counts against its episodes: a batch that kills its worker (a CUDA assert aborts the process)
        is a poisoned batch. Returns the failed cycle's id, or None when there was none.
        """
        with self.transaction() as session:
            active = session.scalars(select(Cycle).where(Cycle.status.in_(ACTIVE_CYCLE_STATUSES))).all()
            for cycle in active:
                if cycle.owner.endswith(f":{owner_suffix}"):
                    ended = self._end_cycle(
                        session,
                        cycle.id,
                        "failed",
                        self.clock(),
                        error=reason,
                        quarantine_after=max_episode_failures,
                    )
                    return None if ended is None else cycle.id
        return None

    def expire_cycles(self, *, max_episode_failures: int = MAX_EPISODE_FAILURES_DEFAULT) -> list[int]:
        """Fail every active cycle whose lease has expired and release (or quarantine) its episodes; their ids.

        A lease expires when its worker stopped renewing it: the process died (SIGKILL, OOM, the
        machine) or hung. Called before anything counts trainable episodes, so that episodes a
        dead cycle claimed go back to the pool at once instead of blocking the next cycle.
        """
        now = self.clock()
        with self.transaction() as session:
            active = session.scalars(select(Cycle).where(Cycle.status.in_(ACTIVE_CYCLE_STATUSES))).all()
            expired = [c for c in active if c.lease_expires_at <= now]
            ended = [
                cycle.id
                for cycle in expired
                if self._end_cycle(
                    session,
                    cycle.id,
                    "failed",
                    now,
                    error=f"lease expired at {cycle.lease_expires_at.isoformat()}: its worker "
                    f"({cycle.owner}) stopped renewing it",
                    quarantine_after=max_episode_failures,
                )
                is not None
            ]
            return ended

    def renew_lease(self, owner: str, ttl_s: float) -> int | None:
        """Extend the lease of the active cycle `owner` holds; its id, or None when it holds none."""
        with self.transaction() as session:
            cycle = session.scalars(
                select(Cycle).where(Cycle.status.in_(ACTIVE_CYCLE_STATUSES), Cycle.owner == owner)
            ).first()
            if cycle is None:
                return None
            cycle.lease_expires_at = self.clock() + timedelta(seconds=ttl_s)
            return cycle.id

    def heartbeat_cycle(self, cycle_id: int, ttl_s: float) -> None:
        """Extend the lease; raises LeaseLost if the cycle is no longer active."""
        with self.transaction() as session:
            result = session.execute(
                update(Cycle)
                .where(Cycle.id == cycle_id, Cycle.status.in_(ACTIVE_CYCLE_STATUSES))
                .values(lease_expires_at=self.clock() + timedelta(seconds=ttl_s))
            )
            if result.rowcount != 1:  # type: ignore[attr-defined]
                raise LeaseLost(f"cycle {cycle_id} is not active")

    def finish_cycle(
        self,
        cycle_id: int,
        status: str,
        challenger: int | None = None,
        metrics: dict[str, Any] | None = None,
        error: str | None = None,
        *,
        count_failure: bool = True,
        max_episode_failures: int = MAX_EPISODE_FAILURES_DEFAULT,
    ) -> list[str]:
        """Move a cycle to ``registered`` (still active) or a final status (promoted/rejected/failed).

        ``failed`` releases its episodes, counting the failure against each (`release_claims`) unless
        `count_failure` is False; returns the ids of those it quarantined instead (else [])."""
        if status not in CYCLE_STATUSES or status == "running":
            raise ValueError(f"cannot finish a cycle as {status!r}; use one of {CYCLE_STATUSES[1:]}")
        with self.transaction() as session:
            cycle = session.get(Cycle, cycle_id, with_for_update=True)
            if cycle is None:
                raise LeaseLost(f"cycle {cycle_id} does not exist")
            if cycle.status == status and status in FINAL_CYCLE_STATUSES:
                return []  # a retried finish is a no-op
            if status not in _TRANSITIONS.get(cycle.status, set()):
                raise LeaseLost(f"cycle {cycle_id} is {cycle.status}; cannot move it to {status}")
            if challenger is not None:
                cycle.challenger_version = format_version(challenger)
            if metrics is not None:
                cycle.metrics = {**(cycle.metrics or {}), **metrics}
            if status == "registered":
                cycle.status = status
                return []
            # Locked FOR UPDATE and found active above: this transaction ends it.
            return (
                self._end_cycle(
                    session,
                    cycle_id,
                    status,
                    self.clock(),
                    error=error,
                    quarantine_after=max_episode_failures if count_failure else None,
                )
                or []
            )

    @staticmethod
    def _end_cycle(
        session: Session,
        cycle_id: int,
        status: str,
        now: datetime,
        error: str | None,
        quarantine_after: int | None,
    ) -> list[str] | None:
        """End the cycle if it is still active; a failed one gives its claims back (`release_claims`).
        The quarantined ids, or None when another transaction ended it first.

        The status is checked in the UPDATE itself: the expiring paths read the active cycles
        without locking them, so a worker finishing its cycle (``promoted``) can commit between
        that read and this write. An unguarded UPDATE would then turn the promoted cycle into a
        failed one and release its episodes, to be trained on a second time."""
        values: dict[str, Any] = {"status": status, "finished_at": now, "active_slot": None}
        if error is not None:
            values["error"] = error
        ended = session.execute(
            update(Cycle)
            .where(Cycle.id == cycle_id, Cycle.status.in_(ACTIVE_CYCLE_STATUSES))
            .values(**values)
        ).rowcount  # type: ignore[attr-defined]
        if ended != 1:
            return None
        if status != "failed":
            return []
        return release_claims(session, cycle_id, now, error or "failed", quarantine_after)

    def get_cycle(self, cycle_id: int) -> CycleRecord | None:
        with self.transaction() as session:
            cycle = session.get(Cycle, cycle_id)
            return None if cycle is None else _record(cycle)

    def recent_cycles(self, limit: int) -> list[CycleRecord]:
        """The newest `limit` cycles, newest first."""
        with self.transaction() as session:
            return [_record(c) for c in session.scalars(select(Cycle).order_by(Cycle.id.desc()).limit(limit))]

    def last_cycle_started_at(self, statuses: tuple[str, ...], *, line: str | None = None) -> datetime | None:
        """When the newest cycle of `line` (None: the global line) that ended in one of `statuses`
        started; None when there is none."""
        of_line = Cycle.line.is_(None) if line is None else Cycle.line == line
        with self.transaction() as session:
            # max() keeps the column's type, so the value comes back as an aware UTC datetime.
            return session.scalar(
                select(func.max(Cycle.started_at)).where(Cycle.status.in_(statuses), of_line)
            )

    def active_cycles(self) -> list[CycleRecord]:
        """Cycles holding an unexpired lease (running, or registered and waiting for gate/deploy)."""
        now = self.clock()
        with self.transaction() as session:
            rows = session.scalars(select(Cycle).where(Cycle.status.in_(ACTIVE_CYCLE_STATUSES))).all()
            return [_record(c) for c in rows if c.lease_expires_at > now]

    # ---- eval gate decisions ---------------------------------------------------------------------

    def record_gate_decision(
        self,
        challenger: int,
        champion: int,
        passed: bool,
        reason: str,
        record: dict[str, Any],
        decided_at: datetime,
        model: str | None = None,
    ) -> None:
        """Keep one decision of the eval gate (every run of the gate adds one) on version
        `challenger` of registry model `model` (what authorises its promotion: store/promotions.py)."""
        with self.transaction() as session:
            session.add(
                GateDecisionRow(
                    model=model,
                    challenger_version=challenger,
                    champion_version=champion,
                    passed=passed,
                    reason=reason,
                    record=record,
                    decided_at=decided_at,
                )
            )

    def gate_decisions(self, challenger: int) -> list[dict[str, Any]]:
        """The gate's decision records for version `challenger`, newest first."""
        with self.transaction() as session:
            rows = session.scalars(
                select(GateDecisionRow)
                .where(GateDecisionRow.challenger_version == challenger)
                .order_by(GateDecisionRow.id.desc())
            ).all()
            return [dict(row.record) for row in rows]

    # ---- served versions ------------------------------------------------------------------------

    def served_versions(self) -> list[int]:
        """Every version a serving server was announced on, most recently served first
        (`DeployStore.set_serving_version` announces them)."""
        return served_versions(self)


def release_claims(
    session: Session, cycle_id: int, now: datetime, error: str, quarantine_after: int | None
) -> list[str]:
    """Give the episodes a failed cycle claimed back to the pool; the ids of those quarantined instead.

    With `quarantine_after`, the failure counts against every one of them (``failed_cycles`` + 1),
    and those that reach it are quarantined, with the cycle's error, rather than released: they stay
    ``settled`` and unclaimed, and selection skips them (store/episodes.py). All the batch is counted,
    not the one episode that broke it: a batch fails as a whole (docs/security.md, Poisoned episodes).
    None: the failure was not the data's; the episodes go back uncounted.
    """
    claimed = Episode.used_in_cycle == cycle_id
    quarantined: list[str] = []
    if quarantine_after is not None:
        session.execute(update(Episode).where(claimed).values(failed_cycles=Episode.failed_cycles + 1))
        spent = (claimed, Episode.failed_cycles >= quarantine_after)
        quarantined = list(
            session.scalars(select(Episode.episode_id).where(*spent).order_by(Episode.episode_id))
        )
        if quarantined:
            reason = f"cycle {cycle_id} failed: {error}"[:QUARANTINE_REASON_CHARS]
            session.execute(
                update(Episode).where(*spent).values(quarantined_at=now, quarantine_reason=reason)
            )
    session.execute(update(Episode).where(claimed).values(used_in_cycle=None))
    return quarantined


def served_versions(store: StoreBase) -> list[int]:
    """Every version a serving server was announced on, most recently served first."""
    with store.transaction() as session:
        return list(
            session.scalars(
                select(VersionHistory.version).order_by(
                    VersionHistory.last_served_at.desc(), VersionHistory.version.desc()
                )
            )
        )


def _record(cycle: Cycle) -> CycleRecord:
    return CycleRecord(
        id=cycle.id,
        status=cycle.status,
        owner=cycle.owner,
        lease_expires_at=cycle.lease_expires_at,
        champion=parse_version(cycle.champion_version),
        challenger=None if cycle.challenger_version is None else parse_version(cycle.challenger_version),
        started_at=cycle.started_at,
        finished_at=cycle.finished_at,
        episode_ids=list(cycle.episode_ids or []),
        metrics=dict(cycle.metrics or {}),
        error=cycle.error,
        reward_spec=cycle.reward_spec,
        line=cycle.line,
    )
