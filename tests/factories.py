"""Test data for every tier (not a test module): wire events, a clock to move by hand, a feeder that
runs the labeler's store writes without Kafka, and per-test Kafka topics.

Every test that needs an event builds it here, so a schema change is one edit.
"""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from feedback.records import Checks, parse_record
from schemas.events import FeedbackEvent, InteractionEvent
from schemas.rewards import TAB_V1, RewardSpec
from schemas.settings import LimitsSettings, Settings
from store import BatchWrite, Caps, SettleReport, SourceRecord, Store

T0 = datetime(2026, 1, 1, tzinfo=UTC)
HOLDOUT_KEY = b"test-holdout-key"  # the held-out buckets' key of the tests' episodes (store/settle.py)
TOPICS: dict[str, Any] = {"interactions": InteractionEvent, "feedback": FeedbackEvent}


def at(seconds: float) -> datetime:
    """T0 plus `seconds`."""
    return T0 + timedelta(seconds=seconds)


class FakeClock:
    """A wall clock that only moves when told: ``clock()`` is now, ``clock.advance(s)`` moves it."""

    def __init__(self, now: datetime = T0) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


class FakeMonotonic:
    """A monotonic clock and a sleep that advances it instead of waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def interaction(
    episode: str = "e1", segment: int = 0, request: str | None = None, version: str = "v1", **kw: Any
) -> InteractionEvent:
    """One served call of `episode`; ids derive from episode and segment, so they are repeatable."""
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
    """A feedback event about `request`; its id derives from request and kind unless given."""
    fields: dict[str, Any] = {
        "event_id": event_id or f"f-{request}-{kind}",
        "request_id": request,
        "kind": kind,
        "value": value,
        "created_at": T0,
    }
    return FeedbackEvent(**(fields | kw))


def wire(event: InteractionEvent | FeedbackEvent) -> bytes:
    """An event as the gateway produces it to Kafka."""
    return event.model_dump_json().encode()


class Feeder:
    """Assigns offsets per topic like a one-partition Kafka topic and runs the labeler's store work
    (validate, write, join, settle) for a batch, without Kafka.

    Its events are of tenants without a row (``default``) unless a test makes them: it stores them
    (`unknown_tenants` accept) and checks no vocabulary (`vocab_size` None) and no caps per episode
    (`caps` None) unless told to, as the tests that use it are about what comes after those checks."""

    def __init__(
        self,
        store: Store,
        spec: RewardSpec = TAB_V1,
        limits: LimitsSettings | None = None,
        *,
        unknown_tenants: Literal["refuse", "accept"] = "accept",
        vocab_size: int | None = None,
        caps: Caps | None = None,
    ) -> None:
        self.store = store
        self.caps = caps
        self.spec = spec
        self.checks = Checks(spec=spec, limits=limits or LimitsSettings(), vocab_size=vocab_size)
        self.unknown_tenants: Literal["refuse", "accept"] = unknown_tenants
        self.offsets: Counter[str] = Counter()

    def record(
        self, item: InteractionEvent | FeedbackEvent | bytes, topic: str | None = None
    ) -> SourceRecord:
        if isinstance(item, bytes):
            raw, topic = item, topic or "interactions"
        else:
            raw = wire(item)
            topic = topic or ("interactions" if isinstance(item, InteractionEvent) else "feedback")
        offset = self.offsets[topic]
        self.offsets[topic] += 1
        return SourceRecord(topic, 0, offset, raw)

    def send(
        self, *items: InteractionEvent | FeedbackEvent | bytes, now: datetime = T0
    ) -> tuple[BatchWrite, SettleReport]:
        return self.process([self.record(item) for item in items], now)

    def process(self, records: list[SourceRecord], now: datetime = T0) -> tuple[BatchWrite, SettleReport]:
        with self.store.labelling(now) as tx:
            written = tx.write_events(
                [(r, parse_record(r, TOPICS[r.topic], self.checks, now)) for r in records],
                self.unknown_tenants,
                self.caps,
            )
            report = tx.join_and_settle(
                self.spec, written.interactions, written.feedback, holdout_key=HOLDOUT_KEY
            )
        return written, report

    def settle_window(self, now: datetime, window_s: float = 30.0) -> int:
        with self.store.labelling(now) as tx:
            return len(tx.settle_expired(self.spec, window_s))


def fresh_topics(settings: Settings, partitions: int | None = None, prefix: str = "t") -> Settings:
    """`settings` with interactions, feedback and DLQ topics and a labeler group of this test's own."""
    tag = f"{prefix}.{uuid.uuid4().hex[:10]}"
    update: dict[str, Any] = {
        "interactions_topic": f"{tag}.interactions",
        "feedback_topic": f"{tag}.feedback",
        "dlq_topic": f"{tag}.dlq",
        "labeler_group": f"{tag}.labeler",
    }
    if partitions is not None:
        update["partitions"] = partitions
    return settings.model_copy(update={"kafka": settings.kafka.model_copy(update=update)})


def gate_decision(**fields: Any) -> Any:
    """A `deployer.gate.GateDecision` of v3 against champion v2, passed, on no prompts, decided at
    2026-01-01; `fields` set the rest or replace these."""
    from deployer.gate import GateDecision

    defaults: dict[str, Any] = {
        "passed": True,
        "challenger_version": 3,
        "champion_version": 2,
        "challenger_score": 0.5,
        "champion_score": 0.5,
        "tolerance": 0.05,
        "confidence": 0.95,
        "n_prompts": 0,
        "n_samples": 0,
        "reason": "ok",
        "decided_at": datetime(2026, 1, 1, tzinfo=UTC),
    }
    return GateDecision(**(defaults | fields))
