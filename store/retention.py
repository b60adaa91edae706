"""Retention: delete what the loop no longer needs from the store, a short transaction at a time.

``rtrl store prune --older-than DAYS`` (rtrl/commands/store.py) calls `prune`; the operator's
view is docs/runbooks/daemon.md, Retention.

What goes, once older than the cutoff:

* settled episodes, settled before it, with their segments (``interactions``, late ones too) and
  the feedback joined to them; only when no active cycle holds them: an episode goes when no
  cycle claimed it (``used_in_cycle`` NULL) or the cycle that did has finished (promoted,
  rejected, failed, skipped). Open episodes stay, however old;
* feedback that never joined an episode (orphaned), by ``ingested_at``;
* segments whose episode is gone (a late segment stored while its episode was being pruned), by
  ``ingested_at``;
* dead letters, by ``created_at`` (when the labeler refused them);
* live canaries that ended (any state but ``running``), by ``ended_at``. A running canary stays
  whatever its age: its runner reads and ends its row. Canaries come from no Kafka record, so
  `kafka_floor` does not hold them back. A cycle's metrics and the challenger's MLflow tags may
  then name a pruned ``canary_id``;
* the gateways' counts of a canary's requests (``canary_traffic``), with the canaries of their
  version: once every canary of the version ended before the cutoff (none running), or, for a
  version with no canary record left, once the rows were last written before it.

What stays: cycles (the history `rtrl train status` shows; a cycle's ``episode_ids`` may then name
pruned episodes); ``labeler_progress``, the bookkeeping of `Store.note_attempt`, which is one row
per partition and does not grow; keys, tenants, rotation and served versions.

Reconciliation. ``rtrl labeler reconcile`` (feedback/reconcile.py) counts, per partition of the
event topics, the rows whose source offset lies in the range Kafka still holds, [beginning, end).
Deleting a row whose record Kafka still holds would make it report NOT balanced. So `prune` takes
`kafka_floor`, the beginning offset of each partition of the event topics, and deletes a row only
when its offset is below its partition's floor (an episode only when every one of its segments and
joined feedback is); a row of a partition not in `kafka_floor` stays. A beginning offset only
grows, so a floor read before the deletion stays safe however long the deletion takes. Rows old
enough but still in Kafka are counted as ``held``: they go on a later run, once Kafka's retention
has deleted their records. `kafka_floor=None` prunes by age alone (for when the topics are gone
for good): reconcile then reports NOT balanced until Kafka's retention deletes those records too.

Concurrency. Each batch is one transaction of at most `batch_size` episodes (with their rows),
feedback rows, segments, dead letters or canaries, so locks stay short and the labeler writes in
between. The rows of a batch are locked (``FOR UPDATE`` on PostgreSQL; SQLite writers take turns):
a cycle claiming one of its episodes meanwhile (`Store.mark_used`, all or none) finds it gone and
fails with EpisodesUnavailable, releasing the rest, and the next cycle selects again; an episode a
cycle claimed first no longer qualifies. An ended canary never changes again (the store ends and
stops only running ones, store/canaries.py), so deleting one races with nothing. A failed batch is
rolled back whole; running `prune` again is safe (what it deleted stays deleted, what it did not is
found again).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, exists, false, func, or_, select, true
from sqlalchemy.orm import InstrumentedAttribute, Session

from store.base import StoreBase
from store.models import (
    FINAL_CYCLE_STATUSES,
    Canary,
    CanaryTraffic,
    Cycle,
    DeadLetter,
    Episode,
    Feedback,
    Interaction,
)

BATCH_SIZE = 5000
# The tables whose rows come from Kafka records (a row stays while Kafka still holds its record),
# then the ones that do not.
KAFKA_TABLES = ("episodes", "interactions", "feedback", "dead_letters")
TABLES = (*KAFKA_TABLES, "canary_traffic", "canaries")

# (topic, partition) -> the partition's beginning offset in Kafka: records below it are gone.
KafkaFloor = Mapping[tuple[str, int], int]


@dataclass(frozen=True)
class PruneReport:
    """Rows deleted per table (with `dry_run`: that would be), and, per table of `KAFKA_TABLES`,
    rows old enough that stay because Kafka still holds their records (episodes, orphaned segments,
    unjoined feedback, dead letters; an episode's own segments and feedback are not counted again)."""

    dry_run: bool
    deleted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TABLES, 0))
    held: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KAFKA_TABLES, 0))


class RetentionStore(StoreBase):
    """The store as ``rtrl store prune`` uses it: `prune` below, as a method."""

    def prune(
        self,
        cutoff: datetime,
        kafka_floor: KafkaFloor | None,
        *,
        dry_run: bool = False,
        batch_size: int = BATCH_SIZE,
    ) -> PruneReport:
        """Delete what is older than `cutoff`; see `prune` and the module docstring."""
        return prune(self, cutoff, kafka_floor, dry_run=dry_run, batch_size=batch_size)


def prune(
    store: StoreBase,
    cutoff: datetime,
    kafka_floor: KafkaFloor | None,
    *,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
) -> PruneReport:
    """Delete what is older than `cutoff` (see the module docstring), `batch_size` rows of a
    kind per transaction; with `dry_run`, count it and change nothing."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    rules = _Rules(cutoff, kafka_floor)
    report = PruneReport(dry_run=dry_run)
    with store.transaction() as session:
        report.held.update(rules.held(session))
        if dry_run:
            report.deleted.update(rules.count(session))
            return report

    while True:  # episodes, with their segments and joined feedback
        with store.transaction() as session:
            ids = list(
                session.scalars(
                    select(Episode.episode_id).where(rules.episodes).limit(batch_size).with_for_update()
                )
            )
            if ids:
                report.deleted["interactions"] += _delete(session, Interaction.episode_id, ids)
                report.deleted["feedback"] += _delete(session, Feedback.joined_episode_id, ids)
                report.deleted["episodes"] += _delete(session, Episode.episode_id, ids)
        if len(ids) < batch_size:
            break
    report.deleted["interactions"] += _in_batches(
        store, Interaction.event_id, rules.orphaned_segments, batch_size
    )
    report.deleted["feedback"] += _in_batches(store, Feedback.event_id, rules.unjoined_feedback, batch_size)
    report.deleted["dead_letters"] += _in_batches(store, DeadLetter.event_id, rules.dead_letters, batch_size)
    with store.transaction() as session:  # a few rows per gateway process and canary: one statement
        report.deleted["canary_traffic"] += int(
            session.execute(
                delete(CanaryTraffic).where(rules.canary_traffic).execution_options(synchronize_session=False)
            ).rowcount  # type: ignore[attr-defined]
        )
    report.deleted["canaries"] += _in_batches(store, Canary.id, rules.canaries, batch_size)
    return report


class _Rules:
    """The WHERE clauses of what goes (`episodes`, ...) and of what is old enough but held."""

    def __init__(self, cutoff: datetime, kafka_floor: KafkaFloor | None) -> None:
        self.floor = kafka_floor

        finished_cycle = exists(
            select(Cycle.id).where(Cycle.id == Episode.used_in_cycle, Cycle.status.in_(FINAL_CYCLE_STATUSES))
        )
        self.old_episodes = and_(
            Episode.status == "settled",
            Episode.last_event_at < cutoff,  # implied by settled_at < cutoff; lets ix_episodes_open serve
            Episode.settled_at < cutoff,
            or_(Episode.used_in_cycle.is_(None), finished_cycle),
        )
        in_kafka = or_(
            exists(
                select(Interaction.event_id).where(
                    Interaction.episode_id == Episode.episode_id, ~self.gone(Interaction)
                )
            ),
            exists(
                select(Feedback.event_id).where(
                    Feedback.joined_episode_id == Episode.episode_id, ~self.gone(Feedback)
                )
            ),
        )
        self.episodes = and_(self.old_episodes, ~in_kafka)
        self.held_episodes = and_(self.old_episodes, in_kafka)

        self.old_segments = and_(
            Interaction.ingested_at < cutoff,
            ~exists(select(Episode.episode_id).where(Episode.episode_id == Interaction.episode_id)),
        )
        self.old_feedback = and_(
            Feedback.ingested_at < cutoff,
            or_(
                Feedback.joined_episode_id.is_(None),
                ~exists(select(Episode.episode_id).where(Episode.episode_id == Feedback.joined_episode_id)),
            ),
        )
        self.old_dead_letters = DeadLetter.created_at < cutoff
        self.orphaned_segments = and_(self.old_segments, self.gone(Interaction))
        self.unjoined_feedback = and_(self.old_feedback, self.gone(Feedback))
        self.dead_letters = and_(self.old_dead_letters, self.gone(DeadLetter))
        # Ended before the cutoff; a running canary has no ended_at, and is never taken whatever its age.
        self.canaries = and_(Canary.state != "running", Canary.ended_at < cutoff)
        # A version's traffic goes with its canaries: when none of them runs or ended after the cutoff
        # (and, with no canary record at all, by when its rows were last written).
        kept = exists(
            select(Canary.id).where(
                Canary.challenger_version == CanaryTraffic.version,
                or_(Canary.state == "running", Canary.ended_at >= cutoff),
            )
        )
        ended = exists(select(Canary.id).where(Canary.challenger_version == CanaryTraffic.version))
        self.canary_traffic = and_(~kept, or_(ended, CanaryTraffic.updated_at < cutoff))

    def gone(self, model: Any) -> ColumnElement[bool]:
        """True for a row whose source record Kafka no longer holds (below its partition's floor).
        A row of a partition not in the floor stays; a NULL source makes this NULL, which no
        WHERE takes, so such a dead letter stays too (it is not counted as held either)."""
        if self.floor is None:
            return true()
        if not self.floor:
            return false()
        return or_(
            *(
                and_(
                    model.source_topic == topic,
                    model.source_partition == partition,
                    model.source_offset < low,
                )
                for (topic, partition), low in sorted(self.floor.items())
            )
        )

    def count(self, session: Session) -> dict[str, int]:
        """What `prune` would delete now, per table."""
        eligible = select(Episode.episode_id).where(self.episodes)
        return {
            "episodes": _count(session, Episode, self.episodes),
            "interactions": _count(session, Interaction, Interaction.episode_id.in_(eligible))
            + _count(session, Interaction, self.orphaned_segments),
            "feedback": _count(session, Feedback, Feedback.joined_episode_id.in_(eligible))
            + _count(session, Feedback, self.unjoined_feedback),
            "dead_letters": _count(session, DeadLetter, self.dead_letters),
            "canary_traffic": _count(session, CanaryTraffic, self.canary_traffic),
            "canaries": _count(session, Canary, self.canaries),
        }

    def held(self, session: Session) -> dict[str, int]:
        """Rows old enough to go that stay because Kafka still holds their records."""
        if self.floor is None:
            return dict.fromkeys(KAFKA_TABLES, 0)
        return {
            "episodes": _count(session, Episode, self.held_episodes),
            "interactions": _count(session, Interaction, and_(self.old_segments, ~self.gone(Interaction))),
            "feedback": _count(session, Feedback, and_(self.old_feedback, ~self.gone(Feedback))),
            "dead_letters": _count(session, DeadLetter, and_(self.old_dead_letters, ~self.gone(DeadLetter))),
        }


def _count(session: Session, model: Any, condition: ColumnElement[bool]) -> int:
    return int(session.scalar(select(func.count()).select_from(model).where(condition)) or 0)


def _delete(session: Session, key: InstrumentedAttribute[Any], ids: list[Any]) -> int:
    result = session.execute(
        delete(key.class_).where(key.in_(ids)).execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def _in_batches(
    store: StoreBase, key: InstrumentedAttribute[Any], condition: ColumnElement[bool], batch_size: int
) -> int:
    """Delete the rows matching `condition`, `batch_size` per transaction; how many."""
    total = 0
    while True:
        with store.transaction() as session:
            ids = list(session.scalars(select(key).where(condition).limit(batch_size).with_for_update()))
            if ids:
                total += _delete(session, key, ids)
        if len(ids) < batch_size:
            return total
