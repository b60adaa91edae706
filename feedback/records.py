"""Validation of consumed Kafka records: each becomes an event to store or a `Rejected` with a reason.

Pure: no Kafka client, no SQL. The reasons' classes are listed in store/events.py, which writes
the results.
"""

from __future__ import annotations

import json

from schemas.events import InteractionEvent, SchemaError, parse_event
from schemas.versions import parse_version
from store.events import Event, Rejected, SourceRecord


def parse_record(record: SourceRecord, expected: type[Event]) -> Event | Rejected:
    """Validate one record against the topic's schema, or say why it is rejected."""
    if record.value is None:
        return Rejected(record, "schema: record has no value (tombstone)")
    try:
        event: Event = parse_event(record.value, expected)
    except SchemaError as exc:
        return Rejected(record, f"schema: {exc}", _readable_event_id(record.value))
    if isinstance(event, InteractionEvent):
        texts = [event.prompt, event.completion, event.finish_reason or "", *event.sampling.stop]
        if any("\x00" in text for text in texts):
            # PostgreSQL text cannot hold NUL; reject on every backend so behaviour does not depend on it.
            return Rejected(record, "content: text contains a NUL character", event.event_id)
        try:
            parse_version(event.policy_version)
        except ValueError as exc:
            return Rejected(record, f"content: {exc}", event.event_id)
    return event


def _readable_event_id(raw: bytes) -> str | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    event_id = data.get("event_id") if isinstance(data, dict) else None
    return event_id if isinstance(event_id, str) and 0 < len(event_id) <= 200 else None
