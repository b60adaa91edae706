"""The labeler's sustained rate from Kafka through join and reward into PostgreSQL, against a raw
kafka-python consumer of the same topics, in the same run.

    .venv/bin/python bench/bench_labeler.py [--interactions 20000] [--feedback 20000] [--profile]

Starts its own Kafka and PostgreSQL (a private run dir on free ports; both stopped at the end),
creates fresh topics with the default partition count, and produces N interactions (single-segment
episodes, as the gateway writes them: 64-token prompts, 16-token completions with logprobs) and M
feedback events about them (thumbs up or down, which settle the episode at once under the default
reward spec). Then, one after the other on the same records:

* baseline: a raw kafka-python consumer in a group of its own reads both topics to the end
  (records fetched, nothing parsed): records/s from its first batch to its last;
* rtrl: one `feedback.labeler.Labeler` (the code of ``rtrl labeler``), in a group of its own, reads
  the same records and parses, checks, stores, joins and rewards them in a fresh PostgreSQL
  database: records/s from its first batch (both clocks start once the consumer has joined its
  group) until its steps report every interaction and feedback stored and every feedback joined,
  which the store is then checked to hold.

Target (issue 14): value ≥ 5,000 records/s and ratio ≥ 0.25. The last line is one JSON object:
``{"name", "value": labeler records/s, "baseline": raw records/s, "ratio", "records", ...}``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

import streams
from feedback.labeler import Labeler, make_consumer, make_producer
from rtrl.services import up
from rtrl.services.testing import private_services
from schemas.events import FeedbackEvent, InteractionEvent
from schemas.settings import Settings, StoreSettings, local_postgres_url
from store import Store


def events(n_interactions: int, n_feedback: int, tag: str) -> tuple[list[InteractionEvent], list[FeedbackEvent]]:
    start = datetime.now(UTC) - timedelta(minutes=5)
    interactions = [
        InteractionEvent(
            event_id=f"i-{tag}-{i}", request_id=f"r-{tag}-{i}", episode_id=f"r-{tag}-{i}", model="rtrl-tiny",
            policy_version="v1", prompt="Q: What is 3 plus 4?\nA:" * 4, prompt_token_ids=list(range(1, 65)),
            completion=" The answer is 7!", completion_token_ids=list(range(100, 116)),
            completion_logprobs=[-0.5] * 16, created_at=start + timedelta(milliseconds=i),
        )
        for i in range(n_interactions)
    ]  # fmt: skip
    feedback = [
        FeedbackEvent(event_id=f"f-{tag}-{i}", request_id=f"r-{tag}-{i % n_interactions}",
                      kind="thumbs_up" if i % 2 else "thumbs_down", value=1.0,
                      created_at=start + timedelta(milliseconds=i, seconds=1))
        for i in range(n_feedback)
    ]  # fmt: skip
    return interactions, feedback


def produce(settings: Settings, interactions: list[InteractionEvent], feedback: list[FeedbackEvent]) -> None:
    producer = streams.producer(settings.kafka, "rtrl-bench", linger_ms=20, batch_size=512 * 1024)
    try:
        for topic, batch in ((settings.kafka.interactions_topic, interactions), (settings.kafka.feedback_topic, feedback)):
            for event in batch:
                producer.send(topic, key=event.request_id.encode(), value=event.model_dump_json().encode())
        producer.flush(timeout=300)
    finally:
        producer.close()


def raw_rate(settings: Settings, total: int) -> float:
    """Records/s of a bare kafka-python consumer reading both topics from the start."""
    consumer = streams.consumer(settings.kafka, "rtrl-bench-raw", settings.kafka.interactions_topic,
                                settings.kafka.feedback_topic, group_id=f"bench-raw-{uuid.uuid4().hex[:8]}",
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                max_poll_records=settings.labeler.max_poll_records)  # fmt: skip
    seen, started = 0, None
    try:
        deadline = time.monotonic() + 600
        while seen < total and time.monotonic() < deadline:
            batch = consumer.poll(timeout_ms=500)
            if batch and started is None:
                started = time.perf_counter()
            seen += sum(len(records) for records in batch.values())
        elapsed = time.perf_counter() - (started or time.perf_counter())
    finally:
        consumer.close()
    if seen < total:
        raise RuntimeError(f"the raw consumer read {seen} of {total} records in 10 minutes")
    return seen / elapsed


def labeler_rate(
    settings: Settings, n_interactions: int, n_feedback: int, profile: bool = False
) -> tuple[float, float]:
    """(records/s, seconds) of one Labeler storing, joining and rewarding every record, timed like
    the raw consumer: from its first batch (after it joined the group) until its step reports show
    every interaction and feedback stored and every feedback joined; the store is checked to hold
    exactly that afterwards. With `profile`, the steps run under cProfile and the top functions
    are printed."""
    store = Store(settings.store.url)
    store.migrate()
    labeler = Labeler(settings, store, make_consumer(settings), make_producer(settings))
    profiler = cProfile.Profile() if profile else None
    stored = feedback = joined = 0
    started: float | None = None
    poll = labeler.consumer.poll

    def timed_poll(**kwargs: Any) -> Any:  # the clock starts as the raw consumer's does
        nonlocal started
        batch = poll(**kwargs)
        if batch and started is None:
            started = time.perf_counter()
        return batch

    labeler.consumer.poll = timed_poll
    deadline = time.monotonic() + 1800
    try:
        if profiler is not None:
            profiler.enable()
        while stored < n_interactions or feedback < n_feedback or joined < n_feedback:
            if time.monotonic() > deadline:
                raise RuntimeError("the labeler did not store every record within 30 minutes")
            report = labeler.step()
            if report is None:
                continue
            stored += report.interactions
            feedback += report.feedback
            joined += report.settle.joined
        elapsed = time.perf_counter() - (started or time.perf_counter())
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        with store.engine.connect() as conn:
            counted = (conn.execute(sa.text("SELECT COUNT(*) FROM interactions")).scalar_one(),
                       conn.execute(sa.text("SELECT COUNT(*) FROM feedback WHERE joined_episode_id IS NOT NULL")).scalar_one())  # fmt: skip
        if counted != (n_interactions, n_feedback):
            raise RuntimeError(f"the store holds {counted} (interactions, joined feedback), expected {(n_interactions, n_feedback)}")
    finally:
        labeler.consumer.close(autocommit=False)
        labeler.producer.close()
        store.close()
    return (n_interactions + n_feedback) / elapsed, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interactions", type=int, default=20_000)
    parser.add_argument("--feedback", type=int, default=20_000)
    parser.add_argument("--profile", action="store_true", help="Print where the labeler's thread spends its time.")
    args = parser.parse_args()
    if args.interactions < 1 or args.feedback < 0:
        parser.error("--interactions must be >= 1 and --feedback >= 0")
    with private_services("rtrl-bench-labeler-", enabled=("kafka", "postgres")) as base:
        up(base)
        tag = uuid.uuid4().hex[:8]
        kafka = base.kafka.model_copy(update={
            "interactions_topic": f"bench.{tag}.interactions", "feedback_topic": f"bench.{tag}.feedback",
            "dlq_topic": f"bench.{tag}.dlq", "labeler_group": f"bench.{tag}.labeler"})  # fmt: skip
        settings = base.model_copy(update={
            "kafka": kafka,
            "store": StoreSettings(url=local_postgres_url(base)),
            # Episodes settle by their terminal feedback; the window never fires during the run.
            "labeler": base.labeler.model_copy(update={"settle_window_s": 3600.0}),
        })  # fmt: skip
        streams.ensure_topics(settings.kafka)
        interactions, feedback = events(args.interactions, args.feedback, tag)
        produce(settings, interactions, feedback)
        total = len(interactions) + len(feedback)
        raw = raw_rate(settings, total)
        rate, seconds = labeler_rate(settings, len(interactions), len(feedback), args.profile)
    print(f"raw kafka-python consume: {raw:,.0f} records/s; labeler into PostgreSQL: {rate:,.0f} records/s "
          f"({seconds:.1f} s for {total:,} records)")  # fmt: skip
    print(json.dumps({
        "name": "labeler_records_per_s",
        "value": round(rate, 1),
        "baseline": round(raw, 1),
        "ratio": round(rate / raw, 4),
        "records": total,
        "interactions": len(interactions),
        "feedback": len(feedback),
        "labeler_s": round(seconds, 2),
        "store": "postgresql",
        "partitions": settings.kafka.partitions,
        "target_value": 5000,
        "target_ratio": 0.25,
    }))


if __name__ == "__main__":
    main()
