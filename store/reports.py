"""What operators read: row counts (`stats`), reconciliation counts, and ``rtrl report``'s numbers.

`ReportStore.report(since)` reads every number of ``rtrl report``'s page (rtrl/report.py) in one
transaction, as plain rows: per policy version (`VersionRow`), per cycle (`CycleRow`), dead letters
per day and reason prefix, the busiest tenants (`TenantRow`); `report_versions`, `report_cycles`,
`report_dead_letters` and `report_tenants` read one part each. Only what happened at or after
`since` counts when it is given: episodes by when they settled, segments and feedback by when they
were ingested, cycles by when they started, dead letters by when they were written.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, select
from sqlalchemy.orm import Session

from schemas.rewards import NO_FEEDBACK
from schemas.versions import parse_version
from store.base import StoreBase
from store.cycles import CYCLE_STATUSES
from store.models import Cycle, DeadLetter, Episode, Feedback, Interaction

TOP_TENANTS = 20  # tenants `report` lists, the busiest first


# ---- what the page shows -----------------------------------------------------------------------


@dataclass(frozen=True)
class VersionRow:
    """The traffic one policy version served. An episode belongs to the oldest version among its
    segments (as in training); segments count under the version that generated each."""

    version: int
    episodes: int = 0  # settled episodes
    mean_reward: float | None = None
    positive: int = 0  # settled episodes with reward > 0
    no_feedback: int = 0  # settled by the window with the no_feedback component (no signal at all)
    judged: int = 0  # settled episodes with an `accepted` or a `rejected` signal
    accepted: int = 0  # of those, the ones with an `accepted` signal
    segments: int = 0  # interactions it served, sub-agent segments (frozen by design) left out
    untrainable: int = 0  # of those, captured with trainable = false

    @property
    def positive_rate(self) -> float | None:
        return _rate(self.positive, self.episodes)

    @property
    def acceptance(self) -> float | None:
        return _rate(self.accepted, self.judged)

    @property
    def no_feedback_rate(self) -> float | None:
        return _rate(self.no_feedback, self.episodes)

    @property
    def untrainable_rate(self) -> float | None:
        return _rate(self.untrainable, self.segments)


@dataclass(frozen=True)
class CycleRow:
    """A training cycle and what its metrics recorded (worker/chain.py, ``_chain``)."""

    id: int
    status: str
    champion: int
    challenger: int | None
    started_at: datetime
    finished_at: datetime | None
    episodes: int | None
    mean_reward: float | None
    gate: str | None  # pass | fail; None when it never reached the gate
    gate_reason: str | None
    challenger_score: float | None
    champion_score: float | None
    swap_ms: float | None
    data_to_deploy_s: float | None
    error: str | None


@dataclass(frozen=True)
class TenantRow:
    """The settled episodes of one tenant."""

    tenant: str
    episodes: int
    mean_reward: float | None
    no_feedback: int  # settled by the window with the no_feedback component (no signal at all)

    @property
    def no_feedback_rate(self) -> float | None:
        return _rate(self.no_feedback, self.episodes)


@dataclass(frozen=True)
class ReportRows:
    """Every number of ``rtrl report``'s page, read in one transaction (`ReportStore.report`)."""

    versions: list[VersionRow] = field(default_factory=list)  # by version
    cycles: list[CycleRow] = field(default_factory=list)  # by id
    dead_letters: dict[date, Counter[str]] = field(default_factory=dict)  # day -> reason prefix -> count
    tenants: list[TenantRow] = field(default_factory=list)  # the busiest, most episodes first
    tenant_count: int = 0  # tenants with a settled episode


class ReportStore(StoreBase):
    """Operators' reads (see the module docstring)."""

    def count_judging(self) -> int:
        """Episodes closed and waiting for the judge of a judged reward spec (feedback/judging.py)."""
        with self.transaction() as session:
            return int(
                session.scalar(select(func.count()).select_from(Episode).where(Episode.status == "judging"))
                or 0
            )

    def stats(self, orphan_after_s: float | None = None) -> dict[str, int]:
        """Row counts per table and status. Feedback still unjoined after ``orphan_after_s`` is orphaned."""
        now = self.clock()
        with self.transaction() as session:

            def count(model: Any, *where: Any) -> int:
                return int(session.scalar(select(func.count()).select_from(model).where(*where)) or 0)

            out = {
                "interactions": count(Interaction),
                "interactions_late": count(Interaction, Interaction.late.is_(True)),
                "feedback": count(Feedback),
                "feedback_joined": count(Feedback, Feedback.joined_episode_id.is_not(None)),
                "feedback_late": count(Feedback, Feedback.late.is_(True)),
                "feedback_unjoined": count(Feedback, Feedback.joined_episode_id.is_(None)),
                "episodes_open": count(Episode, Episode.status == "open"),
                "episodes_judging": count(Episode, Episode.status == "judging"),
                "episodes_settled": count(Episode, Episode.status == "settled"),
                "episodes_settled_terminal": count(
                    Episode, (Episode.status == "settled") & (Episode.settle_reason == "terminal_feedback")
                ),
                "episodes_settled_window": count(
                    Episode, (Episode.status == "settled") & (Episode.settle_reason == "window")
                ),
                "episodes_used": count(Episode, Episode.used_in_cycle.is_not(None)),
                "episodes_quarantined": count(Episode, Episode.quarantined_at.is_not(None)),
                "dead_letters": count(DeadLetter),
            }
            if orphan_after_s is not None:
                cutoff = now - timedelta(seconds=orphan_after_s)
                out["feedback_orphaned"] = count(
                    Feedback, Feedback.joined_episode_id.is_(None), Feedback.ingested_at < cutoff
                )
            for status in CYCLE_STATUSES:
                out[f"cycles_{status}"] = count(Cycle, Cycle.status == status)
            return out

    def source_counts(self, topic: str, partition: int, low: int, high: int) -> tuple[int, int]:
        """(stored, dead-lettered) rows whose source record is offset low..high-1 of the partition."""

        def rows(model: Any) -> int:
            query = (
                select(func.count())
                .select_from(model)
                .where(
                    model.source_topic == topic,
                    model.source_partition == partition,
                    model.source_offset >= low,
                    model.source_offset < high,
                )
            )
            return int(session.scalar(query) or 0)

        with self.transaction() as session:
            return rows(Interaction) + rows(Feedback), rows(DeadLetter)

    # ---- rtrl report --------------------------------------------------------------------------

    def report(self, since: datetime | None = None, *, top_tenants: int = TOP_TENANTS) -> ReportRows:
        """Every number of the report page, in one transaction (one consistent view)."""
        with self.transaction() as session:
            tenants, tenant_count = _tenants(session, since, top_tenants)
            return ReportRows(
                versions=_versions(session, since),
                cycles=_cycles(session, since),
                dead_letters=_dead_letters(session, since),
                tenants=tenants,
                tenant_count=tenant_count,
            )

    def report_versions(self, since: datetime | None = None) -> list[VersionRow]:
        """The traffic each policy version served, by version."""
        with self.transaction() as session:
            return _versions(session, since)

    def report_cycles(self, since: datetime | None = None) -> list[CycleRow]:
        """The cycles and what their metrics recorded, by id."""
        with self.transaction() as session:
            return _cycles(session, since)

    def report_dead_letters(self, since: datetime | None = None) -> dict[date, Counter[str]]:
        """Dead letters per UTC day and reason prefix (``schema``, ``content``, ``duplicate``, ...)."""
        with self.transaction() as session:
            return _dead_letters(session, since)

    def report_tenants(
        self, since: datetime | None = None, limit: int = TOP_TENANTS
    ) -> tuple[list[TenantRow], int]:
        """The `limit` tenants with the most settled episodes (most first), and how many have any."""
        with self.transaction() as session:
            return _tenants(session, since, limit)


def _settled(since: datetime | None) -> list[ColumnElement[bool]]:
    where = [Episode.status == "settled", Episode.reward.is_not(None)]
    return where + ([Episode.settled_at >= since] if since is not None else [])


def _no_feedback() -> ColumnElement[int]:
    # JSON_EXTRACT on SQLite, ->> on PostgreSQL: NULL when the component is absent.
    has = Episode.reward_components[NO_FEEDBACK].as_float().is_not(None)
    return func.sum(case((and_(Episode.settle_reason == "window", has), 1), else_=0))


def _versions(session: Session, since: datetime | None) -> list[VersionRow]:
    rows: dict[int, dict[str, Any]] = defaultdict(dict)
    episodes = (
        select(
            Episode.policy_number,
            func.count(),
            func.avg(Episode.reward),
            func.sum(case((Episode.reward > 0, 1), else_=0)),
            _no_feedback(),
        )
        .where(*_settled(since))
        .group_by(Episode.policy_number)
    )
    for number, count, mean, positive, no_feedback in session.execute(episodes):
        rows[number].update(
            episodes=count,
            mean_reward=_float(mean),
            positive=int(positive or 0),
            no_feedback=int(no_feedback or 0),
        )

    # One row per episode that got an accepted or rejected signal: a retried signal counts once.
    judged = (
        select(
            Feedback.joined_episode_id.label("episode_id"),
            func.max(case((Feedback.kind == "accepted", 1), else_=0)).label("accepted"),
        )
        .where(Feedback.kind.in_(("accepted", "rejected")), Feedback.joined_episode_id.is_not(None))
        .group_by(Feedback.joined_episode_id)
        .subquery()
    )
    acceptance = (
        select(Episode.policy_number, func.count(), func.sum(judged.c.accepted))
        .join(judged, judged.c.episode_id == Episode.episode_id)
        .where(*_settled(since))
        .group_by(Episode.policy_number)
    )
    for number, count, accepted in session.execute(acceptance):
        rows[number].update(judged=count, accepted=int(accepted or 0))

    where = [Interaction.role != "subagent"] + (
        [Interaction.ingested_at >= since] if since is not None else []
    )
    segments = (
        select(
            Interaction.policy_number,
            func.count(),
            func.sum(case((Interaction.trainable.is_(False), 1), else_=0)),
        )
        .where(*where)
        .group_by(Interaction.policy_number)
    )
    for number, count, untrainable in session.execute(segments):
        rows[number].update(segments=count, untrainable=int(untrainable or 0))
    return [VersionRow(version=n, **rows[n]) for n in sorted(rows)]


def _cycles(session: Session, since: datetime | None) -> list[CycleRow]:
    query = select(
        Cycle.id,
        Cycle.status,
        Cycle.champion_version,
        Cycle.challenger_version,
        Cycle.started_at,
        Cycle.finished_at,
        Cycle.metrics,
        Cycle.error,
    ).order_by(Cycle.id)
    if since is not None:
        query = query.where(Cycle.started_at >= since)
    out = []
    for id_, status, champion, challenger, started, finished, metrics, error in session.execute(query):
        m: dict[str, Any] = metrics if isinstance(metrics, dict) else {}
        episodes = _float(m.get("episodes"))
        gate = m.get("gate")
        out.append(
            CycleRow(
                id=id_,
                status=status,
                champion=parse_version(champion),
                challenger=None if challenger is None else parse_version(challenger),
                started_at=started,
                finished_at=finished,
                episodes=None if episodes is None else int(episodes),
                mean_reward=_float(m.get("mean_reward")),
                gate=gate if isinstance(gate, str) else None,
                gate_reason=_str(m.get("gate_reason")),
                challenger_score=_float(m.get("challenger_score")),
                champion_score=_float(m.get("champion_score")),
                swap_ms=_float(m.get("swap_ms")),
                data_to_deploy_s=_float(m.get("data_to_deploy_s")),
                error=error,
            )
        )
    return out


_PREFIX = re.compile(r"\s*([\w.-]{1,24})")


def _dead_letters(session: Session, since: datetime | None) -> dict[date, Counter[str]]:
    """Dead letters per UTC day and reason prefix (``schema``, ``content``, ``duplicate``, ...)."""
    query = select(DeadLetter.created_at, func.substr(DeadLetter.reason, 1, 40))
    if since is not None:
        query = query.where(DeadLetter.created_at >= since)
    days: dict[date, Counter[str]] = defaultdict(Counter)
    for created, head in session.execute(query):
        match = _PREFIX.match(head or "")
        days[created.date()][match.group(1) if match else "other"] += 1
    return dict(sorted(days.items()))


def _tenants(session: Session, since: datetime | None, limit: int) -> tuple[list[TenantRow], int]:
    query = (
        select(Episode.tenant, func.count(), func.avg(Episode.reward), _no_feedback())
        .where(*_settled(since))
        .group_by(Episode.tenant)
        .order_by(func.count().desc(), Episode.tenant)
        .limit(limit)
    )
    rows = [TenantRow(t, n, _float(mean), int(nf or 0)) for t, n, mean, nf in session.execute(query)]
    total = session.scalar(select(func.count(func.distinct(Episode.tenant))).where(*_settled(since)))
    return rows, int(total or 0)


def _float(value: Any) -> float | None:
    """A finite number from SQL (a Decimal on some drivers) or from a metrics JSON, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal) or not math.isfinite(value):
        return None
    return float(value)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _rate(part: int, whole: int) -> float | None:
    return part / whole if whole else None
