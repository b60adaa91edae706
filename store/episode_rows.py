"""An episodes row as the labeler's settling transaction reads, locks and writes it (store/settle.py).

The rows are read and written as a batch (`save_rows`, store/bulk.py), not one ORM object at a
time; `lock_episodes` takes the row locks store/settle.py's Concurrency section relies on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Table, select, update
from sqlalchemy.orm import Session

from store.bulk import among, update_rows
from store.models import Episode

EPISODES: Table = Episode.__table__  # type: ignore[assignment]

# What of an episodes row settling reads and writes (not used_in_cycle, eval_bucket).
EPISODE_COLUMNS = (
    "episode_id",
    "tenant",
    "policy_version",
    "policy_number",
    "status",
    "first_event_at",
    "last_event_at",
    "settled_at",
    "settle_reason",
    "reward",
    "reward_components",
    "reward_spec",
    "metrics",
)


@dataclass
class EpisodeRow:
    """An episodes row as this transaction read (and locked) it, and what it changed since: the rows
    are read and written as a batch (`save_rows`, store/bulk.py), not one ORM object at a time."""

    episode_id: str
    tenant: str
    policy_version: str
    policy_number: int
    status: str
    first_event_at: datetime
    last_event_at: datetime
    settled_at: datetime | None
    settle_reason: str | None
    reward: float | None
    reward_components: dict[str, float] | None
    reward_spec: str | None
    metrics: dict[str, Any] | None
    changed: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, row: Any) -> EpisodeRow:
        return cls(**{name: getattr(row, name) for name in EPISODE_COLUMNS})

    @classmethod
    def new(cls, row: dict[str, Any]) -> EpisodeRow:
        """The episode as `row` (an insert's values) creates it."""
        values: dict[str, Any] = {name: row.get(name) for name in EPISODE_COLUMNS}
        return cls(**values)

    def set(self, **values: Any) -> None:
        for name, value in values.items():
            if getattr(self, name) != value:
                setattr(self, name, value)
                self.changed[name] = value


def save_rows(session: Session, episodes: Iterable[EpisodeRow]) -> None:
    """Write what changed in `episodes` (each once, however often it changed)."""
    episodes = list(episodes)
    rows = [{"episode_id": e.episode_id, **e.changed} for e in episodes if e.changed]
    update_rows(session, EPISODES, "episode_id", rows)
    for episode in episodes:
        episode.changed = {}


def lock_episodes(session: Session, ids: set[str]) -> dict[str, EpisodeRow]:
    """The episodes `ids` as committed now, locked until the transaction ends (in episode id order,
    so replicas locking overlapping sets queue instead of deadlocking). No lock on SQLite, where the
    transaction already holds the database's only write lock."""
    query = (
        select(*(EPISODES.c[name] for name in EPISODE_COLUMNS))
        .where(among(session, EPISODES.c.episode_id, sorted(ids)))
        .order_by(EPISODES.c.episode_id)
        .with_for_update()
    )
    return {row.episode_id: EpisodeRow.of(row) for row in session.execute(query)}


def close_unsettled(session: Session, episode_id: str, now: datetime, reason: str) -> bool:
    """Close an open episode that settling fails on alone (feedback/labeler.py, the window pass's
    error policy): ``settled`` with reason ``error`` and no reward, and quarantined with `reason`, so
    no pass reads it again and no cycle trains it (`rtrl dlq episodes` lists it). False when it is
    not open any more."""
    result = session.execute(
        update(EPISODES)
        .where(EPISODES.c.episode_id == episode_id, EPISODES.c.status == "open")
        .values(
            status="settled",
            settled_at=now,
            settle_reason="error",
            metrics={"settle_error": reason[:500]},
            quarantined_at=now,
            quarantine_reason=reason[:9_000],
        )
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]
