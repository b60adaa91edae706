"""Validation of consumed Kafka records: each becomes an event to store or a `Rejected` with a reason.

Pure: no Kafka client, no SQL. Beyond the wire schema (schemas/events.py) a record is refused when
its ``created_at`` lies outside the accepted window (``settings.limits``: a skewed or hostile
clock, or data past retention) or a scored feedback value lies outside the reward spec's range.
Text a model produced is never a reason: a NUL or a lone surrogate in it arrives as U+FFFD
(`schemas.events.storable_text`). The reasons' classes are listed in store/events.py, which writes
the results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from schemas.events import (
    FeedbackEvent,
    InteractionEvent,
    SchemaError,
    event_time_problem,
    parse_event,
    storable_text,
)
from schemas.rewards import RewardSpec
from schemas.settings import LimitsSettings
from schemas.versions import parse_version
from store.events import Event, Rejected, SourceRecord


@dataclass(frozen=True)
class Checks:
    """What a record is checked against besides its schema."""

    spec: RewardSpec
    limits: LimitsSettings


def parse_record(
    record: SourceRecord, expected: type[Event], checks: Checks, now: datetime
) -> Event | Rejected:
    """Validate one record against the topic's schema and `checks`, or say why it is rejected."""
    if record.value is None:
        return Rejected(record, "schema: record has no value (tombstone)")
    try:
        event: Event = parse_event(record.value, expected)
    except SchemaError as exc:
        return Rejected(record, f"schema: {exc}", _readable_event_id(record.value))
    problem = event_time_problem(
        event.created_at, now, checks.limits.max_future_skew_s, checks.limits.max_event_age_s
    )
    if problem is not None:
        return Rejected(record, f"content: {problem}", event.event_id)
    if isinstance(event, FeedbackEvent):
        problem = checks.spec.value_problem(event.kind, event.value)
        if problem is not None:
            return Rejected(record, f"content: {problem}", event.event_id)
    if isinstance(event, InteractionEvent):
        # Its text holds no NUL and no lone surrogate: the schema replaced them (storable_text), so
        # whatever the tokenizer produced is stored, on every backend.
        try:
            parse_version(event.policy_version)
        except ValueError as exc:
            return Rejected(record, f"content: {exc}", event.event_id)
    return event


def _readable_event_id(raw: bytes) -> str | None:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    event_id = data.get("event_id") if isinstance(data, dict) else None
    if not isinstance(event_id, str) or not 0 < len(event_id) <= 200:
        return None
    # Kept only when the dead letter can hold it as it is (no NUL, no lone surrogate): an id is
    # shown to find the producer, never altered.
    return event_id if storable_text(event_id) == event_id else None
