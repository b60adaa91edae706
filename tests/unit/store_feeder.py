"""Test helper (not a test module): feed events into a Store the way the labeler's step does,
without Kafka, so store, join and settle logic are unit-testable on SQLite in tmp_path."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

from feedback.ingest import BatchWrite, SourceRecord, parse_record, write_batch
from feedback.rewards import TAB_V1, RewardSpec
from feedback.settle import SettleReport, join_and_settle, settle_expired
from feedback.store import Store
from schemas.events import FeedbackEvent, InteractionEvent

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TOPICS: dict[str, Any] = {"interactions": InteractionEvent, "feedback": FeedbackEvent}


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def interaction(
    episode: str = "e1", segment: int = 0, request: str | None = None, version: str = "v1", **kw: Any
) -> InteractionEvent:
    fields: dict[str, Any] = {
        "event_id": f"i-{episode}-{segment}",
        "request_id": request or f"r-{episode}-{segment}",
        "episode_id": episode,
        "segment_index": segment,
        "model": "tiny",
        "policy_version": version,
        "prompt": "def f(",
        "prompt_token_ids": [1, 2, 3],
        "completion": "x):",
        "completion_token_ids": [4, 5],
        "completion_logprobs": [-0.5, -1.25],
        "created_at": T0,
    }
    return InteractionEvent(**(fields | kw))


def feedback(
    request: str, kind: str, value: float = 1.0, event_id: str | None = None, **kw: Any
) -> FeedbackEvent:
    return FeedbackEvent(
        event_id=event_id or f"f-{request}-{kind}",
        request_id=request,
        kind=kind,
        value=value,
        created_at=T0,
        **kw,
    )


class Feeder:
    """Assigns offsets per topic like a one-partition Kafka topic and runs write + join/settle."""

    def __init__(self, store: Store, spec: RewardSpec = TAB_V1) -> None:
        self.store = store
        self.spec = spec
        self.offsets: Counter[str] = Counter()

    def record(
        self, item: InteractionEvent | FeedbackEvent | bytes, topic: str | None = None
    ) -> SourceRecord:
        if isinstance(item, bytes):
            raw, topic = item, topic or "interactions"
        else:
            raw = item.model_dump_json().encode()
            topic = topic or ("interactions" if isinstance(item, InteractionEvent) else "feedback")
        offset = self.offsets[topic]
        self.offsets[topic] += 1
        return SourceRecord(topic, 0, offset, raw)

    def send(
        self, *items: InteractionEvent | FeedbackEvent | bytes, now: datetime = T0
    ) -> tuple[BatchWrite, SettleReport]:
        return self.process([self.record(item) for item in items], now)

    def process(self, records: list[SourceRecord], now: datetime = T0) -> tuple[BatchWrite, SettleReport]:
        with self.store.transaction() as session:
            parsed = [(r, parse_record(r, TOPICS[r.topic])) for r in records]
            written = write_batch(session, self.store.dialect, parsed, now)
            report = join_and_settle(session, self.spec, now, written.interactions, written.feedback)
        return written, report

    def settle_window(self, now: datetime, window_s: float = 30.0) -> int:
        with self.store.transaction() as session:
            return settle_expired(session, self.spec, now, window_s)
