"""The labeler's store: events, dead letters, the join and settle of episodes, its progress.

`LabellingStore.labelling(now)` is one labeler batch (`Labelling`: write events and dead letters
(store/events.py), join and settle (store/settle.py)) in one transaction; `note_batch_starts` and
`note_attempt` keep the poison-pill bookkeeping of feedback/labeler.py; `dead_letters`,
`dead_letter` and `mark_replayed` serve `rtrl dlq`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from schemas.events import FeedbackEvent, InteractionEvent
from schemas.rewards import RewardSpec
from store import episode_rows, events, settle, settle_reads
from store.base import StoreBase
from store.caps import Caps
from store.models import DeadLetter, LabelerProgress


@dataclass(frozen=True)
class DeadLetterEntry:
    """A stored dead letter (what `rtrl dlq` lists and shows)."""

    event_id: str
    source: str
    original_event_id: str | None
    reason: str
    payload: bytes
    created_at: datetime
    source_topic: str | None
    replayed_at: datetime | None


class Labelling:
    """One labeler batch: everything `Store.labelling` commits (or rolls back) together."""

    def __init__(self, session: Session, dialect: str, now: datetime) -> None:
        self._session = session
        self._dialect = dialect
        self.now = now

    def write_events(
        self,
        parsed: Sequence[tuple[events.SourceRecord, events.Event | events.Rejected]],
        unknown_tenants: Literal["refuse", "accept"] = "accept",
        caps: Caps | None = None,
    ) -> events.BatchWrite:
        """Insert the valid events idempotently and the dead letters; with `unknown_tenants` =
        refuse, an event of a tenant without a row is a dead letter too, and with `caps` one past a
        cap of its episode (store/caps.py); see store/events.py."""
        return events.write_events(self._session, parsed, self.now, unknown_tenants, caps)

    def join_and_settle(
        self,
        spec: RewardSpec,
        interactions: list[InteractionEvent],
        feedback: list[FeedbackEvent],
        *,
        holdout_key: bytes,
    ) -> settle.SettleReport:
        """Open episodes (their held-out bucket keyed by `holdout_key`), join feedback, settle on
        terminal feedback; see store/settle.py."""
        return settle.join_and_settle(
            self._session, self._dialect, spec, self.now, interactions, feedback, holdout_key
        )

    def join_stranded(self, spec: RewardSpec, window_s: float) -> settle.SettleReport:
        """Join feedback left unjoined by two replicas' concurrent writes; see store/settle.py."""
        return settle.join_stranded(self._session, self._dialect, spec, self.now, window_s)

    def settle_expired(
        self, spec: RewardSpec, window_s: float, episode_ids: list[str] | None = None
    ) -> list[settle.Settled]:
        """Settle open episodes whose last event is older than the window (of `episode_ids` when
        given); returns them."""
        return settle.settle_expired(self._session, spec, self.now, window_s, episode_ids)

    def expired_ids(self, window_s: float) -> list[str]:
        """The open episodes whose last event is older than the window (at most a pass's worth)."""
        return settle_reads.expired_ids(self._session, self.now, window_s)

    def close_unsettled(self, episode_id: str, reason: str) -> bool:
        """Close and quarantine an open episode that settling fails on; see store/episode_rows.py."""
        return episode_rows.close_unsettled(self._session, episode_id, self.now, reason)

    def awaiting_judge(self, limit: int) -> list[settle.ToJudge]:
        """Closed episodes waiting for the judge of the reward spec; see store/settle.py."""
        return settle.awaiting_judge(self._session, limit)

    def settle_judged(self, spec: RewardSpec, grades: dict[str, float | None]) -> list[settle.Settled]:
        """Settle judging episodes with their grades (None: the judge failed); see store/settle.py."""
        return settle.settle_judged(self._session, spec, self.now, grades)


class LabellingStore(StoreBase):
    """The labeler's writes and `rtrl dlq`'s reads (see the module docstring)."""

    @contextmanager
    def labelling(self, now: datetime) -> Iterator[Labelling]:
        """The labeler's unit of work: one transaction, committed when the block exits cleanly."""
        with self.transaction() as session:
            yield Labelling(session, self.dialect, now)

    # ---- dead letters -----------------------------------------------------------------------------

    def dead_letters(self, limit: int, reason_prefix: str | None = None) -> list[DeadLetterEntry]:
        """The newest dead letters (optionally those whose reason starts with `reason_prefix`)."""
        with self.transaction() as session:
            query = (
                select(DeadLetter).order_by(DeadLetter.created_at.desc(), DeadLetter.event_id).limit(limit)
            )
            if reason_prefix:
                query = query.where(DeadLetter.reason.startswith(reason_prefix, autoescape=True))
            return [_dead_letter_entry(r) for r in session.scalars(query)]

    def dead_letter(self, event_id: str) -> DeadLetterEntry | None:
        with self.transaction() as session:
            row = session.get(DeadLetter, event_id)
            return None if row is None else _dead_letter_entry(row)

    def mark_replayed(self, event_id: str) -> bool:
        """Record that a dead letter was produced again; False when it already was (replay once)."""
        with self.transaction() as session:
            result = session.execute(
                update(DeadLetter)
                .where(DeadLetter.event_id == event_id, DeadLetter.replayed_at.is_(None))
                .values(replayed_at=self.clock())
            )
            return bool(result.rowcount)  # type: ignore[attr-defined]

    # ---- labeler progress (the poison-pill policy of feedback/labeler.py) ---------------------------

    def note_attempt(self, topic: str, partition: int, offset: int, mode: str) -> int:
        """Count one more start of work at `offset` of the partition in `mode` (batch | record);
        returns how many starts there were without the work being committed in between."""
        with self.transaction() as session:
            row = session.get(LabelerProgress, (topic, partition), with_for_update=True)
            if row is None:
                row = LabelerProgress(topic=topic, partition=partition, offset=offset, mode=mode, attempts=0)
                session.add(row)
            if row.offset != offset or row.mode != mode:
                row.offset, row.mode, row.attempts = offset, mode, 0
            row.attempts += 1
            row.updated_at = self.clock()
            return row.attempts

    def note_batch_starts(self, starts: dict[tuple[str, int], int]) -> set[tuple[str, int]]:
        """Note, for each (topic, partition), that a batch starting at the given offset is begun, in
        one transaction; returns the partitions where a labeler died on that start before (the same
        start was noted and never moved on from, as a batch or as a single record)."""
        died: set[tuple[str, int]] = set()
        with self.transaction() as session:
            for (topic, partition), offset in starts.items():
                row = session.get(LabelerProgress, (topic, partition), with_for_update=True)
                if row is None:
                    row = LabelerProgress(
                        topic=topic, partition=partition, offset=offset, mode="batch", attempts=0
                    )
                    session.add(row)
                elif row.offset == offset:
                    died.add((topic, partition))
                    if row.mode == "record":
                        continue  # died on that one record: its own count goes on in note_attempt
                else:
                    row.offset, row.mode, row.attempts = offset, "batch", 0
                row.attempts += 1
                row.updated_at = self.clock()
        return died


def _dead_letter_entry(row: DeadLetter) -> DeadLetterEntry:
    return DeadLetterEntry(
        event_id=row.event_id,
        source=row.source,
        original_event_id=row.original_event_id,
        reason=row.reason,
        payload=bytes(row.payload),
        created_at=row.created_at,
        source_topic=row.source_topic,
        replayed_at=row.replayed_at,
    )
