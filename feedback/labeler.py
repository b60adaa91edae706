"""The feedback labeler: consume interactions and feedback from Kafka, store them, label episodes.

Started with ``rtrl labeler`` (``run(settings)``); scale out by starting more replicas in the same
consumer group (at most one per partition). The loop is ``Labeler.step``:

    poll -> parse/validate -> write events (idempotent on event_id) -> dead-letter the rejects
    (DLQ topic, flushed, and the dead_letters table) -> join/settle -> commit the DB transaction
    -> commit the offsets

Error policy:

* a record that fails validation or is a duplicate -> dead letter with a reason (feedback/records.py,
  store/events.py);
* the database or the DLQ producer fails -> nothing of the batch is committed, the consumer seeks
  back to the batch's first offsets, backs off (0.5 s doubling to 30 s) and processes it again;
* the offset commit fails (group rebalance) -> the batch is already in the DB; whoever reads the
  partition next re-reads it and every record is a no-op replay;
* broker connection errors -> kafka-python reconnects inside ``poll``;
* anything else (a bug) -> propagates and the process exits; the uncommitted batch is re-read on
  restart.

A crash between the DB commit and the offset commit re-delivers the batch: interactions and
feedback are recognised as replays by event_id + source offset, dead letters by their id
(``dlq:topic:partition:offset``); only the DLQ *topic* can receive a record twice, so its
consumers dedupe on event_id.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import streams
from feedback.records import parse_record
from schemas.clock import Clock, Sleep, utcnow
from schemas.events import DEAD_LETTER_SCHEMA, FeedbackEvent, InteractionEvent
from schemas.rewards import RewardSpec, get_spec
from schemas.settings import Settings
from store import DatabaseError, Rejected, SettleReport, SourceRecord, Store
from store.events import Event

log = logging.getLogger("rtrl.labeler")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
WINDOW_CHECK = timedelta(seconds=1)  # how often open episodes are checked against the settle window
DLQ_FLUSH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class StepReport:
    """What one step of the loop did (for logs and tests)."""

    records: int
    interactions: int
    feedback: int
    dead_lettered: int
    replayed: int
    settle: SettleReport
    settled_window: int


class Labeler:
    """One consumer of the labeler group. Not thread-safe: one thread calls ``step`` / ``run``.

    ``clock`` is the labeler's time (ingest times, the settle window); ``sleep`` is how it waits
    out a backoff. Tests pass their own to move time instead of waiting for it.
    """

    def __init__(
        self,
        settings: Settings,
        store: Store,
        consumer: Any,
        producer: Any,
        *,
        spec: RewardSpec | None = None,
        clock: Clock = utcnow,
        sleep: Sleep = time.sleep,
        after_db_commit: Callable[[int], None] | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.consumer = consumer
        self.producer = producer
        self.spec = spec or get_spec(settings.labeler.reward_spec)
        self.clock = clock
        self.sleep = sleep
        # Test hook, called with the batch's record count after the DB commit and before the offset
        # commit: the crash window.
        self.after_db_commit = after_db_commit
        self.expected: dict[str, type[Event]] = {
            settings.kafka.interactions_topic: InteractionEvent,
            settings.kafka.feedback_topic: FeedbackEvent,
        }
        self._backoff_s = BACKOFF_START_S
        self._last_window_check: datetime | None = None

    def run(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set."""
        log.info("labeler consuming %s with spec %s", sorted(self.expected), self.spec.spec_id)
        while not stop.is_set():
            self.step()

    def step(self) -> StepReport | None:
        """One poll -> store -> commit round; None when nothing was done (idle, or backing off)."""
        from kafka.errors import CommitFailedError, KafkaError
        from kafka.structs import OffsetAndMetadata

        labeler = self.settings.labeler
        batch = self.consumer.poll(timeout_ms=labeler.poll_timeout_ms, max_records=labeler.max_poll_records)
        records = [SourceRecord(r.topic, r.partition, r.offset, r.value) for rs in batch.values() for r in rs]
        now = self.clock()
        since = None if self._last_window_check is None else now - self._last_window_check
        # Due on the first step, every WINDOW_CHECK, and whenever the clock was stepped back.
        window_due = since is None or since >= WINDOW_CHECK or since < timedelta(0)
        if not records and not window_due:
            return None

        # ---- parse and validate: no I/O ----------------------------------------------------------
        parsed = [(r, parse_record(r, self.expected[r.topic])) for r in records]

        try:
            with self.store.labelling(now) as tx:
                # ---- write events idempotently; collect dead letters (invalid + duplicates) -------
                written = tx.write_events(parsed)
                # ---- dead letters reach the DLQ topic before the DB commits: never lost ---------------
                self._produce_dead_letters(written.rejected, now)
                # ---- join feedback, settle on terminal feedback and on the window --------------------
                settled = tx.join_and_settle(self.spec, written.interactions, written.feedback)
                settled_window = 0
                if window_due:
                    settled_window = tx.settle_expired(self.spec, labeler.settle_window_s)
            # ---- the DB transaction committed when the block above exited ----------------------------
        except (DatabaseError, KafkaError) as exc:
            # Nothing of this batch is committed: read it again after a pause.
            log.warning(
                "batch of %d records not stored (%s); retrying in %.1fs", len(records), exc, self._backoff_s
            )
            for tp, rs in batch.items():
                self.consumer.seek(tp, rs[0].offset)
            self.sleep(self._backoff_s)
            self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
            return None
        self._backoff_s = BACKOFF_START_S
        if window_due:
            self._last_window_check = now
        if self.after_db_commit is not None:
            self.after_db_commit(len(records))

        # ---- commit offsets only now that the DB has the batch ---------------------------------------
        if batch:
            offsets = {tp: OffsetAndMetadata(rs[-1].offset + 1, "", -1) for tp, rs in batch.items()}
            try:
                self.consumer.commit(offsets)
            except CommitFailedError as exc:
                # The group rebalanced; the batch is stored and its re-delivery will be no-op replays.
                log.warning("offset commit failed after the DB commit (%s); re-delivery is idempotent", exc)

        report = StepReport(
            records=len(records),
            interactions=len(written.interactions),
            feedback=len(written.feedback),
            dead_lettered=len(written.rejected),
            replayed=written.replayed,
            settle=settled,
            settled_window=settled_window,
        )
        if records or settled_window:
            log.debug("%s", report)
        return report

    def _produce_dead_letters(self, rejected: list[Rejected], now: datetime) -> None:
        if not rejected:
            return
        futures = []
        for item in rejected:
            record = item.to_wire(now)
            log.info("dead-letter %s: %s", record.source, record.reason[:200])
            futures.append(
                self.producer.send(
                    self.settings.kafka.dlq_topic,
                    key=record.source.encode(),
                    value=record.model_dump_json().encode(),
                    headers=[("schema", DEAD_LETTER_SCHEMA.encode())],
                )
            )
        self.producer.flush(timeout=DLQ_FLUSH_TIMEOUT_S)
        for future in futures:
            future.get(timeout=DLQ_FLUSH_TIMEOUT_S)  # raises the KafkaError if the broker refused it


def make_consumer(settings: Settings) -> Any:
    """The labeler group's consumer, subscribed to the interactions and feedback topics."""
    kafka = settings.kafka
    return streams.consumer(
        kafka,
        "rtrl-labeler",
        kafka.interactions_topic,
        kafka.feedback_topic,
        group_id=kafka.labeler_group,
        auto_offset_reset="earliest",
        max_poll_records=settings.labeler.max_poll_records,
    )


def make_producer(settings: Settings) -> Any:
    """The DLQ producer: acks from all in-sync replicas, idempotent retries."""
    return streams.producer(settings.kafka, "rtrl-labeler-dlq")


def run(settings: Settings, stop: threading.Event | None = None) -> None:
    """Run the labeler until SIGTERM/SIGINT (or ``stop``): migrate, create topics, consume."""
    stop = stop or threading.Event()
    store = Store(settings.store.url)
    store.migrate()
    streams.ensure_topics(settings.kafka)
    consumer = make_consumer(settings)
    producer = make_producer(settings)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    try:
        Labeler(settings, store, consumer, producer).run(stop)
    finally:
        consumer.close(autocommit=False)  # offsets are only ever committed after a DB commit
        producer.close()
        store.close()
