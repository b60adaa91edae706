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
* ``content: ...``    valid per schema but not usable: an unparseable policy version, a created_at
                      outside the accepted window, a feedback value outside the reward spec's range
                      (never the text: a NUL or a lone surrogate in a prompt or completion is
                      stored as U+FFFD, schemas.events.storable_text)
* ``duplicate: ...``  a second record carrying an event_id already stored from another offset, or a
                      second event for an (episode_id, segment_index) that is already stored
* ``unknown tenant: <id>``  the event's tenant has no row in ``tenants`` (``labeler.unknown_tenants
                      = refuse``, the default): one query per batch asks which of its tenants exist.
                      Anyone who reaches a broker can write any tenant into a record; the gateway
                      writes only the tenants of its keys, and a key's tenant has a row
                      (docs/security.md, Forged events). An event stored from the same record before
                      (while the setting said accept) stays a replay.
* ``cap: ...``        a segment past ``limits.max_segments_per_episode`` or a feedback past
                      ``limits.max_feedback_per_episode`` of its episode (store/caps.py), or a prompt
                      over ``limits.max_prompt_bytes`` (feedback/records.py)

The labeler adds ``record: ...`` and ``poison: ...`` (feedback/labeler.py, its error policy);
token ids outside the serving model's vocabulary are a ``content`` reason (feedback/records.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from schemas.events import DeadLetterRecord, FeedbackEvent, InteractionEvent
from schemas.versions import parse_version
from store.bulk import among, insert_rows
from store.errors import DatabaseUnavailable
from store.models import DeadLetter, Feedback, Interaction, Tenant

if TYPE_CHECKING:
    from store.caps import Caps

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
    session: Session,
    parsed: Sequence[tuple[SourceRecord, Event | Rejected]],
    now: datetime,
    unknown_tenants: Literal["refuse", "accept"] = "accept",
    caps: Caps | None = None,
) -> BatchWrite:
    """Insert the valid events of a batch (idempotently) and collect everything to dead-letter.

    Optimistic: the batch's events are inserted at once, skipping any that conflicts with a stored
    row (its event_id, or an interaction's episode and segment, stored before or by a concurrent
    replica meanwhile); only the skipped ones are looked up, to tell a replay (stored from the same
    offset) from a duplicate. The one read before the insert is whether the batch's event ids are
    in the other table (an event_id is unique across interactions and feedback); with
    `unknown_tenants` = refuse, one more: which of the batch's tenants exist; with `caps`, how
    much the batch's episodes hold (store/caps.py)."""
    out = BatchWrite()
    if unknown_tenants == "refuse":
        parsed = _refuse_unknown_tenants(session, parsed)
    if caps is not None:
        from store.caps import apply_caps  # store/caps.py builds on this module's records

        parsed = apply_caps(session, parsed, caps)
    out.rejected.extend(e for _, e in parsed if isinstance(e, Rejected))
    batch = _Batch.of([(r, e) for r, e in parsed if not isinstance(e, Rejected)])
    elsewhere, inserted = _insert_new(session, batch.candidates, now)
    duplicates = _name_skipped(session, batch, elsewhere, inserted, out)
    out.interactions = [
        e for _, _, e in batch.candidates if isinstance(e, InteractionEvent) and e.event_id in inserted
    ]
    out.feedback = [
        e for _, _, e in batch.candidates if isinstance(e, FeedbackEvent) and e.event_id in inserted
    ]
    out.rejected.extend(rejected for _, rejected in sorted(duplicates, key=lambda item: item[0]))
    _write_dead_letters(session, out, now)
    return out


@dataclass
class _Batch:
    """A batch's valid events split by duplicates inside the batch: the first occurrence is the
    one inserted (`candidates`); a second one (`again`) is named once the first is known."""

    first: dict[str, str] = field(default_factory=dict)  # event_id -> source
    segments: dict[tuple[str, int], str] = field(default_factory=dict)  # (episode, segment) -> event_id
    candidates: list[tuple[int, SourceRecord, Event]] = field(
        default_factory=list
    )  # (position in the batch, ...)
    again: list[tuple[int, SourceRecord, Event]] = field(default_factory=list)

    @classmethod
    def of(cls, valid: list[tuple[SourceRecord, Event]]) -> _Batch:
        batch = cls()
        for position, (record, event) in enumerate(valid):
            if event.event_id in batch.first or (
                isinstance(event, InteractionEvent)
                and (event.episode_id, event.segment_index) in batch.segments
            ):
                batch.again.append((position, record, event))
                continue
            if isinstance(event, InteractionEvent):
                batch.segments[(event.episode_id, event.segment_index)] = event.event_id
            batch.first[event.event_id] = record.source
            batch.candidates.append((position, record, event))
        return batch


def _insert_new(
    session: Session, candidates: list[tuple[int, SourceRecord, Event]], now: datetime
) -> tuple[dict[str, str], set[str]]:
    """Insert the candidates, skipping conflicts with stored rows (ON CONFLICT DO NOTHING on every
    unique index) and those whose event_id is in the other table (an event_id is unique across
    both: such an event is a duplicate). Returns (those in the other table -> their source, the
    event ids inserted)."""
    ids = {
        "interactions": [e.event_id for _, _, e in candidates if isinstance(e, InteractionEvent)],
        "feedback": [e.event_id for _, _, e in candidates if isinstance(e, FeedbackEvent)],
    }
    elsewhere = {
        **sources_of(session, Feedback, ids["interactions"]),
        **sources_of(session, Interaction, ids["feedback"]),
    }
    rows: dict[str, list[dict[str, Any]]] = {"interactions": [], "feedback": []}
    for _, record, event in candidates:
        if event.event_id not in elsewhere:
            if isinstance(event, InteractionEvent):
                rows["interactions"].append(_interaction_row(record, event, now))
            else:
                rows["feedback"].append(_feedback_row(record, event, now))
    inserted = insert_rows(session, INTERACTIONS, rows["interactions"], returning="event_id")
    inserted |= insert_rows(session, FEEDBACK, rows["feedback"], returning="event_id")
    return elsewhere, inserted


def _name_skipped(
    session: Session, batch: _Batch, elsewhere: dict[str, str], inserted: set[str], out: BatchWrite
) -> list[tuple[int, Rejected]]:
    """The events not inserted: a replay (counted in `out.replayed`) or a duplicate of what is
    stored or of an earlier event of the batch. Returns the duplicates' dead letters by position."""
    duplicates: list[tuple[int, Rejected]] = []
    skipped = [(p, r, e) for p, r, e in batch.candidates if e.event_id not in inserted]
    stored = {
        **elsewhere,
        **sources_of(
            session, Interaction, [e.event_id for _, _, e in skipped if e.event_id not in elsewhere]
        ),
        **sources_of(session, Feedback, [e.event_id for _, _, e in skipped if e.event_id not in elsewhere]),
    }
    segment_of = _stored_segments(session, [e for _, _, e in skipped if e.event_id not in stored])
    for position, record, event in skipped:
        if event.event_id in stored:
            if stored[event.event_id] == record.source:
                out.replayed += 1  # re-read after a crash before the offset commit: already done
            else:
                duplicates.append((position, _duplicate_event(record, event, stored[event.event_id])))
        elif isinstance(event, InteractionEvent) and (event.episode_id, event.segment_index) in segment_of:
            key = (event.episode_id, event.segment_index)
            duplicates.append((position, _duplicate_segment(record, event, segment_of[key])))
        else:  # the conflicting row is gone again (retention): the batch's retry will insert it
            raise DatabaseUnavailable(
                f"event {event.event_id} conflicted with a row that is gone; retrying the batch"
            )
    for position, record, event in batch.again:  # what the first occurrence turned out to be, or stored
        if event.event_id in batch.first:
            duplicates.append(
                (
                    position,
                    _duplicate_event(record, event, stored.get(event.event_id, batch.first[event.event_id])),
                )
            )
        else:
            assert isinstance(event, InteractionEvent)
            key = (event.episode_id, event.segment_index)
            duplicates.append(
                (position, _duplicate_segment(record, event, segment_of.get(key, batch.segments[key])))
            )
    return duplicates


def _refuse_unknown_tenants(
    session: Session, parsed: Sequence[tuple[SourceRecord, Event | Rejected]]
) -> list[tuple[SourceRecord, Event | Rejected]]:
    """`parsed` with each event whose tenant has no row turned into an ``unknown tenant`` reject,
    unless that event is stored from this very record (a replay: it stays one)."""
    tenants = {e.tenant for _, e in parsed if not isinstance(e, Rejected)}
    if not tenants:
        return list(parsed)
    known = set(session.scalars(select(Tenant.tenant).where(among(session, Tenant.tenant, sorted(tenants)))))
    unknown = [e.event_id for _, e in parsed if not isinstance(e, Rejected) and e.tenant not in known]
    if not unknown:
        return list(parsed)
    stored = {**sources_of(session, Interaction, unknown), **sources_of(session, Feedback, unknown)}
    return [
        (r, Rejected(r, f"unknown tenant: {e.tenant}", e.event_id))
        if not isinstance(e, Rejected) and e.tenant not in known and stored.get(e.event_id) != r.source
        else (r, e)
        for r, e in parsed
    ]


def _write_dead_letters(session: Session, out: BatchWrite, now: datetime) -> None:
    """Store `out.rejected`, leaving out (and counting as replayed) those already stored."""
    if out.rejected:
        # A record dead-lettered before a crash is re-read too: it is a replay, not a new dead letter
        # (and is not produced to the DLQ topic a second time).
        dead_ids = [r.event_id for r in out.rejected]
        known = set(
            session.scalars(select(DeadLetter.event_id).where(among(session, DeadLetter.event_id, dead_ids)))
        )
        out.replayed += len(known)
        out.rejected = [r for r in out.rejected if r.event_id not in known]
    if out.rejected:
        insert_rows(session, DEAD_LETTERS, [r.to_row(now) for r in out.rejected], conflict=["event_id"])


def sources_of(
    session: Session, model: type[Interaction] | type[Feedback], event_ids: list[str]
) -> dict[str, str]:
    """Where each of `event_ids` stored in `model`'s table came from (topic:partition:offset)."""
    if not event_ids:
        return {}
    rows = session.execute(
        select(model.event_id, model.source_topic, model.source_partition, model.source_offset).where(
            among(session, model.event_id, event_ids)
        )
    )
    return {row[0]: f"{row[1]}:{row[2]}:{row[3]}" for row in rows}


def _stored_segments(session: Session, events: list[Event]) -> dict[tuple[str, int], str]:
    """The stored event of each (episode, segment) of the interactions among `events`."""
    wanted = {(e.episode_id, e.segment_index) for e in events if isinstance(e, InteractionEvent)}
    if not wanted:
        return {}
    # By episode id (the unique index's leading column), not a (episode, segment) tuple IN,
    # which PostgreSQL answers with a scan of the whole table.
    rows = session.execute(
        select(Interaction.episode_id, Interaction.segment_index, Interaction.event_id).where(
            among(session, Interaction.episode_id, sorted({episode for episode, _ in wanted}))
        )
    )
    return {(row[0], row[1]): row[2] for row in rows if (row[0], row[1]) in wanted}


def _duplicate_event(record: SourceRecord, event: Event, stored_from: str) -> Rejected:
    return Rejected(record, f"duplicate: event_id already stored from {stored_from}", event.event_id)


def _duplicate_segment(record: SourceRecord, event: InteractionEvent, stored_as: str) -> Rejected:
    return Rejected(
        record,
        f"duplicate: segment {event.segment_index} of episode {event.episode_id} already stored as event {stored_as}",
        event.event_id,
    )


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
    text = {} if event.text is None else {"text": event.text}  # left out: NULL (`insert_rows`)
    return {
        **text,
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
