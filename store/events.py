"""From consumed Kafka records to rows: write events idempotently and keep every reject.

The labeler validates each record (feedback/records.py) into an event or a `Rejected`; `write_events`
(called through `store.Store.labelling`) makes every consumed record end as exactly one of: a new
``interactions``/``feedback`` row, a no-op (the same record re-read after a crash: its event_id is
stored *from the same offset*), or a ``dead_letters`` row with a reason. A dead letter's id is
derived from ``topic:partition:offset``, so re-reading a dead-lettered record cannot create a
second one. This is what makes produced = stored + dead-lettered exact (``rtrl labeler reconcile``).

Dead-letter reasons (``Rejected.reason`` starts with the class, for stats and alerting):

* ``schema: ...``     not JSON, unknown schema_version, wrong topic, failed validation (NaN
                      logprob, unknown feedback kind, oversize, ...)
* ``content: ...``    valid per schema but not storable: NUL characters, unparseable policy version
* ``duplicate: ...``  a second record carrying an event_id already stored from another offset, or a
                      second event for an (episode_id, segment_index) that is already stored
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from schemas.events import DeadLetterRecord, FeedbackEvent, InteractionEvent
from schemas.versions import parse_version
from store.bulk import among, insert_rows
from store.models import DeadLetter, Feedback, Interaction

# What of a rejected payload travels on the DLQ topic: the broker's default message limit is 1 MB
# and a dead letter that cannot be produced would block the partition forever. The SQL row keeps
# the full original bytes.
DLQ_PAYLOAD_CHARS = 64 * 1024

INTERACTIONS: Table = Interaction.__table__  # type: ignore[assignment]
FEEDBACK: Table = Feedback.__table__  # type: ignore[assignment]
DEAD_LETTERS: Table = DeadLetter.__table__  # type: ignore[assignment]

Event = InteractionEvent | FeedbackEvent


@dataclass(frozen=True)
class SourceRecord:
    """One consumed Kafka record (what the labeler needs of kafka-python's ConsumerRecord)."""

    topic: str
    partition: int
    offset: int
    value: bytes | None

    @property
    def source(self) -> str:
        return f"{self.topic}:{self.partition}:{self.offset}"


@dataclass(frozen=True)
class Rejected:
    """A record that will be dead-lettered, and why."""

    record: SourceRecord
    reason: str
    original_event_id: str | None = None

    @property
    def event_id(self) -> str:
        return f"dlq:{self.record.source}"

    def to_wire(self, now: datetime) -> DeadLetterRecord:
        raw = self.record.value or b""
        payload = raw.decode("utf-8", errors="replace")
        reason = self.reason[:9_000]
        if len(payload) > DLQ_PAYLOAD_CHARS:
            reason += f" [payload truncated to {DLQ_PAYLOAD_CHARS} of {len(payload)} chars; full bytes in the store]"
            payload = payload[:DLQ_PAYLOAD_CHARS]
        return DeadLetterRecord(
            event_id=self.event_id,
            source=self.record.source,
            original_event_id=self.original_event_id,
            reason=reason,
            payload=payload,
            created_at=now,
        )

    def to_row(self, now: datetime) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "source": self.record.source,
            "original_event_id": self.original_event_id,
            "reason": self.reason,
            "payload": self.record.value or b"",
            "created_at": now,
            "source_topic": self.record.topic,
            "source_partition": self.record.partition,
            "source_offset": self.record.offset,
        }


@dataclass
class BatchWrite:
    """What one batch did to the store."""

    interactions: list[InteractionEvent] = field(default_factory=list)
    feedback: list[FeedbackEvent] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    replayed: int = 0


def write_events(
    session: Session, parsed: Sequence[tuple[SourceRecord, Event | Rejected]], now: datetime
) -> BatchWrite:
    """Insert the valid events of a batch (idempotently) and collect everything to dead-letter."""
    out = BatchWrite()
    valid = [(r, e) for r, e in parsed if not isinstance(e, Rejected)]
    out.rejected.extend(e for _, e in parsed if isinstance(e, Rejected))

    # Where each event_id / segment already lives, so replays are told apart from duplicates.
    ids = [e.event_id for _, e in valid]
    stored: dict[str, str] = {}
    for model in (Interaction, Feedback):
        rows = session.execute(
            select(model.event_id, model.source_topic, model.source_partition, model.source_offset).where(
                among(session, model.event_id, ids)
            )
        )
        stored.update({row[0]: f"{row[1]}:{row[2]}:{row[3]}" for row in rows})
    segment_keys = [(e.episode_id, e.segment_index) for _, e in valid if isinstance(e, InteractionEvent)]
    segments: dict[tuple[str, int], str] = {}
    if segment_keys:
        # By episode id (the unique index's leading column), not a (episode, segment) tuple IN,
        # which PostgreSQL answers with a scan of the whole table.
        wanted = set(segment_keys)
        segment_rows = session.execute(
            select(Interaction.episode_id, Interaction.segment_index, Interaction.event_id).where(
                among(session, Interaction.episode_id, sorted({episode for episode, _ in wanted}))
            )
        )
        segments = {(row[0], row[1]): row[2] for row in segment_rows if (row[0], row[1]) in wanted}

    interaction_rows: list[dict[str, Any]] = []
    feedback_rows: list[dict[str, Any]] = []
    for record, event in valid:
        if event.event_id in stored:
            if stored[event.event_id] == record.source:
                out.replayed += 1  # re-read after a crash before the offset commit: already done
            else:
                out.rejected.append(
                    Rejected(
                        record,
                        f"duplicate: event_id already stored from {stored[event.event_id]}",
                        event.event_id,
                    )
                )
            continue
        if isinstance(event, InteractionEvent):
            key = (event.episode_id, event.segment_index)
            if key in segments:
                out.rejected.append(
                    Rejected(
                        record,
                        f"duplicate: segment {event.segment_index} of episode {event.episode_id} "
                        f"already stored as event {segments[key]}",
                        event.event_id,
                    )
                )
                continue
            segments[key] = event.event_id
            interaction_rows.append(_interaction_row(record, event, now))
            out.interactions.append(event)
        else:
            feedback_rows.append(_feedback_row(record, event, now))
            out.feedback.append(event)
        stored[event.event_id] = record.source

    # ON CONFLICT DO NOTHING is the backstop for a concurrent replica that inserted the same
    # event_id since the read above; a concurrent (episode, segment) conflict raises and the batch
    # is retried, when the read above sees it and dead-letters it. One statement per table and
    # batch on PostgreSQL (store/bulk.py).
    insert_rows(session, INTERACTIONS, interaction_rows, ["event_id"])
    insert_rows(session, FEEDBACK, feedback_rows, ["event_id"])
    if out.rejected:
        # A record dead-lettered before a crash is re-read too: it is a replay, not a new dead letter
        # (and is not produced to the DLQ topic a second time).
        dead_ids = [r.event_id for r in out.rejected]
        known = set(session.scalars(select(DeadLetter.event_id).where(among(session, DeadLetter.event_id, dead_ids))))
        out.replayed += len(known)
        out.rejected = [r for r in out.rejected if r.event_id not in known]
    if out.rejected:
        insert_rows(session, DEAD_LETTERS, [r.to_row(now) for r in out.rejected], ["event_id"])
    return out


def _interaction_row(record: SourceRecord, event: InteractionEvent, now: datetime) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "request_id": event.request_id,
        "episode_id": event.episode_id,
        "segment_index": event.segment_index,
        "tenant": event.tenant,
        "session_id": event.session_id,
        "model": event.model,
        "policy_version": event.policy_version,
        "policy_number": parse_version(event.policy_version),
        "prompt": event.prompt,
        "prompt_token_ids": list(event.prompt_token_ids),
        "completion": event.completion,
        "completion_token_ids": list(event.completion_token_ids),
        "completion_logprobs": list(event.completion_logprobs),
        "finish_reason": event.finish_reason,
        "sampling": event.sampling.model_dump(mode="json"),
        "role": event.role.value,
        "agent": event.agent,
        "trainable": event.trainable,
        "redacted": list(event.redacted),
        "late": False,
        "created_at": event.created_at,
        "ingested_at": now,
        "source_topic": record.topic,
        "source_partition": record.partition,
        "source_offset": record.offset,
    }


def _feedback_row(record: SourceRecord, event: FeedbackEvent, now: datetime) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "request_id": event.request_id,
        "episode_id": event.episode_id,
        "tenant": event.tenant,
        "kind": event.kind.value,
        "value": event.value,
        "joined_episode_id": None,
        "late": False,
        "created_at": event.created_at,
        "ingested_at": now,
        "source_topic": record.topic,
        "source_partition": record.partition,
        "source_offset": record.offset,
    }
