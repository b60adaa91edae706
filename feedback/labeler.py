"""The feedback labeler: consume interactions and feedback from Kafka, store them, label episodes.

Started with ``rtrl labeler`` (``run(settings)``); scale out by starting more replicas in the same
consumer group (at most one per partition), on PostgreSQL. Replicas coordinate through row locks on
the episodes (store/settle.py, Concurrency), and rely on interactions and feedback being
co-partitioned: keyed by request_id on topics with the same partition count, read with the range
assignor, so one replica reads a request's interaction and its feedback (docs/runbooks/labeler.md,
Replicas). The loop is ``Labeler.step``:

    poll -> parse/validate -> write events (idempotent on event_id) -> dead-letter the rejects
    (DLQ topic, flushed, and the dead_letters table) -> join/settle -> commit the DB transaction
    -> commit the offsets -> (a reward spec with a judge term) a judge pass: grade closed episodes
    and settle them (feedback/judging.py)

Error policy: no single record can stop the labeler.

* a record that fails validation (a token id outside the serving model's vocabulary included), is a
  duplicate, names a tenant with no row (``labeler.unknown_tenants``), or is past a cap (a prompt
  over ``limits.max_prompt_bytes``, a segment or a feedback past its episode's cap: store/caps.py)
  -> dead letter with a reason (feedback/records.py, store/events.py);
* the database is unreachable or locked, the transaction lost a deadlock to another replica, or
  the DLQ producer fails -> nothing of the batch is committed, the consumer seeks back to the
  batch's first offsets, backs off (0.5 s doubling to 30 s) and processes it again;
* any other failure while a batch is written (a record the database refuses, an overflow, a bug
  tied to one record) -> the batch is written again one record at a time, each in its own
  transaction with its offset committed after it; the record that fails alone becomes a dead
  letter ``record: <error>`` and the rest go on;
* a record that kills the process (so no exception is seen) -> every poll notes in the store where
  each partition's batch starts (`store.Store.note_attempt`); a batch start that a previous process
  noted and never committed means that process died on it, so the batch is processed one record at
  a time, noting each; a record that was started `POISON_AFTER` times by processes that died is
  dead-lettered ``poison: ...`` without being processed again;
* the offset commit fails (group rebalance) -> the batch is already in the DB; whoever reads the
  partition next re-reads it and every record is a no-op replay;
* broker connection errors -> kafka-python reconnects inside ``poll``; a poll that raises one
  (kafka-python 3.0.12 lets a failed metadata refresh out of it while no broker answers) is
  retried after ``POLL_RETRY_S``, nothing read, the readiness check ``kafka`` failing meanwhile;
* the window pass (join stranded feedback, settle expired episodes) fails for any other reason ->
  the expired episodes are settled one at a time, each in its own transaction; one that fails alone
  is closed without a reward and quarantined with the error (``rtrl dlq episodes``), never read again;
* the judge is out -> its episodes are labelled without the judge term and flagged (feedback/judging.py);
  the store fails during a judge pass -> the episodes stay ``judging`` for the next pass.

A crash between the DB commit and the offset commit re-delivers the batch: interactions and
feedback are recognised as replays by event_id + source offset, dead letters by their id
(``dlq:topic:partition:offset``); only the DLQ *topic* can receive a record twice, so its
consumers dedupe on event_id.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import streams
from feedback import metrics
from feedback.judging import judge_for, judge_pass
from feedback.records import Checks, holdout_key, parse_record, vocab_size
from schemas.clock import Clock, Sleep, utcnow
from schemas.events import DEAD_LETTER_SCHEMA, FeedbackEvent, InteractionEvent
from schemas.rewards import RewardSpec, get_spec
from schemas.settings import Settings
from store import Caps, DatabaseUnavailable, Rejected, Settled, SettleReport, SourceRecord, Store
from store.events import Event
from telemetry import Readiness

log = logging.getLogger("rtrl.labeler")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
WINDOW_CHECK = timedelta(seconds=1)  # how often open episodes are checked against the settle window
LAG_EVERY_S = 5.0  # how often the consumer lag per partition is measured (feedback/metrics.py)
DLQ_FLUSH_TIMEOUT_S = 30.0
POLL_RETRY_S = (
    1.0  # after a poll that raised a Kafka error (kafka-python's own reconnect backoff is at most 1 s)
)
# A record started this many times by labeler processes that then died is dead-lettered unprocessed.
# With a first death in batch mode that is 3 deaths in all: the supervisor's 5 restarts suffice.
POISON_AFTER = 2
OPEN_TENANT = "default"  # the tenant of every call to a gateway with gateway.auth=open (ingest/auth.py)


@dataclass
class StepReport:
    """What one step of the loop did (for logs and tests)."""

    records: int = 0
    interactions: int = 0
    feedback: int = 0
    dead_lettered: int = 0
    replayed: int = 0
    settle: SettleReport = field(default_factory=SettleReport)
    settled_window: int = 0
    judged: int = 0  # settled by a judge pass (feedback/judging.py)
    one_by_one: bool = False  # the batch was written a record at a time (see the error policy)


class Transient(Exception):
    """The store or the DLQ producer failed: read the batch again after a pause."""


class Labeler:
    """One consumer of the labeler group. Not thread-safe: one thread calls ``step`` / ``run``.

    ``clock`` is the labeler's time (ingest times, the settle window, the accepted event window);
    ``sleep`` is how it waits out a backoff. Tests pass their own to move time instead of waiting.
    """

    def __init__(
        self,
        settings: Settings,
        store: Store,
        consumer: Any,
        producer: streams.Producer,
        *,
        spec: RewardSpec | None = None,
        clock: Clock = utcnow,
        sleep: Sleep = time.sleep,
        after_db_commit: Callable[[int], None] | None = None,
        before_write: Callable[[list[SourceRecord]], None] | None = None,
        readiness: Readiness | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.consumer = consumer
        self.producer = producer
        self.spec = spec or get_spec(settings.labeler.reward_spec)
        # The serving model's vocabulary, once (a one-line operator error when nothing gives it).
        self.checks = Checks(spec=self.spec, limits=settings.limits, vocab_size=vocab_size(settings))
        limits = settings.limits
        self.caps = Caps(segments=limits.max_segments_per_episode, feedback=limits.max_feedback_per_episode)
        self.holdout_key = holdout_key(settings)  # the eval gate's held-out buckets (store/settle.py)
        self.judge = judge_for(self.spec, settings.labeler.judge)  # None unless the spec has a judge term
        self.clock = clock
        self.sleep = sleep
        # Test hooks: after the DB commit and before the offset commit (the crash window), and
        # right before records are written (where a poison record would kill the process).
        self.after_db_commit = after_db_commit
        self.before_write = before_write
        self.expected: dict[str, type[Event]] = {
            settings.kafka.interactions_topic: InteractionEvent,
            settings.kafka.feedback_topic: FeedbackEvent,
        }
        self._backoff_s = BACKOFF_START_S
        self._last_window_check: datetime | None = None
        # The last start of work this process noted per partition: seeing it again means this
        # process did not die on it (it is still running).
        self._noted: dict[tuple[str, int], tuple[int, str]] = {}
        self.readiness = readiness or Readiness()
        self._lag_at = 0.0
        self._lag_series: set[tuple[str, int]] = set()

    def run(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set."""
        log.info(
            "labeler consuming %s with spec %s; token ids below %s; tenants without a row: %s",
            sorted(self.expected),
            self.spec.spec_id,
            self.checks.vocab_size,
            self.settings.labeler.unknown_tenants,
        )
        while not stop.is_set():
            self.step()

    def step(self) -> StepReport | None:
        """One poll -> store -> commit round; None when nothing was done (idle, or backing off)."""
        labeler = self.settings.labeler
        try:
            with streams.kafka_errors():
                batch = self.consumer.poll(
                    timeout_ms=labeler.poll_timeout_ms, max_records=labeler.max_poll_records
                )
        except streams.BrokerError as exc:  # no broker answers (the module docstring): nothing was read
            log.warning("poll failed (%r); polling again in %.1fs", exc, POLL_RETRY_S)
            metrics.POLL_FAILURES.inc()
            self.readiness.set("kafka", False, f"poll failing: {exc!r}"[:500])
            self.sleep(POLL_RETRY_S)
            return None
        records = [SourceRecord(r.topic, r.partition, r.offset, r.value) for rs in batch.values() for r in rs]
        now = self.clock()
        since = None if self._last_window_check is None else now - self._last_window_check
        # Due on the first step, every WINDOW_CHECK, and whenever the clock was stepped back.
        window_due = since is None or since >= WINDOW_CHECK or since < timedelta(0)
        if not records and not window_due:
            return None
        report = StepReport(records=len(records))
        try:
            died_here = self._note_batch_starts(batch)
            if died_here:
                log.warning("a labeler did not get past %s: writing the batch a record at a time", died_here)
                self._one_by_one(batch, now, report, count_attempts=True)
            else:
                try:
                    self._write(records, now, report)
                    self._commit_offsets({tp: rs[-1].offset + 1 for tp, rs in batch.items()})
                except Transient:
                    raise
                except Exception as exc:  # tied to a record of the batch: find it, dead-letter it
                    log.warning(
                        "batch of %d records failed (%r): writing it a record at a time", len(records), exc
                    )
                    report = StepReport(records=len(records))
                    self._one_by_one(batch, now, report, count_attempts=False)
            if window_due:
                self._window_pass(now, report)
            if self.judge is not None and (window_due or report.settle.settled_terminal):
                report.judged = self._judge(now)
        except (Transient, DatabaseUnavailable) as exc:
            # Nothing uncommitted is lost: read it again after a pause (committed records are replays).
            cause = exc.__cause__ if isinstance(exc, Transient) else exc
            log.warning(
                "batch of %d records not stored (%s); retrying in %.1fs", len(records), cause, self._backoff_s
            )
            for tp, rs in batch.items():
                self.consumer.seek(tp, rs[0].offset)
            metrics.STORE_UP.set(0)
            self.readiness.set(
                "store", False, f"writes failing, retrying in {self._backoff_s:.1f}s: {cause}"[:500]
            )
            self.sleep(self._backoff_s)
            self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
            return None
        self._backoff_s = BACKOFF_START_S
        metrics.STORE_UP.set(1)
        self.readiness.set("store", True)
        metrics.LAST_STEP.set(time.time())
        self._measure_lag()
        if records or report.settled_window:
            log.debug("%s", report)
        return report

    def _window_pass(self, now: datetime, report: StepReport) -> None:
        """Join stranded feedback and settle the expired episodes (one transaction); where that
        fails for a reason tied to an episode, settle them one at a time (`_settle_one_by_one`)."""
        window_s = self.settings.labeler.settle_window_s
        try:
            with self.store.labelling(now) as tx:
                stranded = tx.join_stranded(self.spec, window_s)
                expired = tx.settle_expired(self.spec, window_s)
        except DatabaseUnavailable:
            raise
        except Exception as exc:  # tied to an episode: find it, close it (the error policy)
            log.warning("window pass failed (%r): settling the expired episodes one at a time", exc)
            stranded, expired = SettleReport(), self._settle_one_by_one(now)
        _count_stranded(stranded, report)
        report.settled_window = len(expired)
        _count_settled(expired)
        self._last_window_check = now

    def _settle_one_by_one(self, now: datetime) -> list[Settled]:
        """Each expired episode in its own transaction; one that fails alone is closed without a
        reward and quarantined with the error (store/episode_rows.py, `close_unsettled`)."""
        window_s = self.settings.labeler.settle_window_s
        with self.store.labelling(now) as tx:
            expired = tx.expired_ids(window_s)
        settled: list[Settled] = []
        for episode_id in expired:
            try:
                with self.store.labelling(now) as tx:
                    settled += tx.settle_expired(self.spec, window_s, [episode_id])
            except DatabaseUnavailable:
                raise
            except Exception as exc:  # this episode alone fails: kept, quarantined with the reason
                reason = f"settle: {type(exc).__name__}: {exc}"
                log.error(
                    "episode %s cannot be settled (%s): closed without a reward, quarantined",
                    episode_id,
                    reason,
                )
                with self.store.labelling(now) as tx:
                    if tx.close_unsettled(episode_id, reason):
                        metrics.SETTLE_FAILED.inc()
        return settled

    def _judge(self, now: datetime) -> int:
        """A judge pass (feedback/judging.py); the episodes it settled. A store failure leaves them
        waiting for the next pass (the batch before it is committed already)."""
        assert self.judge is not None
        try:
            settled = judge_pass(self.store, self.spec, self.judge, self.settings.labeler.judge_batch, now)
        except DatabaseUnavailable as exc:
            log.warning("judge pass not stored (%s); the episodes wait for the next pass", exc)
            return 0
        _count_settled(settled)
        return len(settled)

    def close(self) -> None:
        """Release the judge's connections (the consumer and producer are the caller's)."""
        if self.judge is not None:
            self.judge.close()

    def _measure_lag(self) -> None:
        """Lag per assigned partition: the high watermark the last fetch saw minus the position."""
        now = time.monotonic()
        if now - self._lag_at < LAG_EVERY_S:
            return
        self._lag_at = now
        assigned = self.consumer.assignment()
        self.readiness.set("kafka", bool(assigned), "" if assigned else "no partition assigned (yet)")
        for topic, partition in self._lag_series - {(tp.topic, tp.partition) for tp in assigned}:
            metrics.LAG.remove(topic, str(partition))  # another replica reports it now
        self._lag_series = {(tp.topic, tp.partition) for tp in assigned}
        for tp in assigned:
            highwater = self.consumer.highwater(tp)
            if highwater is None:
                continue  # no fetch response for it yet
            try:
                position = self.consumer.position(tp, timeout_ms=100)
            except Exception:  # noqa: BLE001 - a position being reset or fetched: measured next time
                continue
            metrics.LAG.labels(tp.topic, str(tp.partition)).set(max(0, highwater - position))

    # ---- writing ---------------------------------------------------------------------------------

    def _write(self, records: list[SourceRecord], now: datetime, report: StepReport) -> None:
        """Validate and write `records` in one transaction; raises Transient for store/DLQ outages."""
        if not records:
            return
        parsed = [(r, parse_record(r, self.expected[r.topic], self.checks, now)) for r in records]
        if self.before_write is not None:
            self.before_write(records)
        try:
            with self.store.labelling(now) as tx:
                # ---- write events idempotently; collect dead letters (invalid + duplicates) -------
                written = tx.write_events(parsed, self.settings.labeler.unknown_tenants, self.caps)
                # ---- dead letters reach the DLQ topic before the DB commits: never lost ---------------
                self._produce_dead_letters(written.rejected, now)
                # ---- join feedback, settle on terminal feedback --------------------------------------
                settled = tx.join_and_settle(
                    self.spec, written.interactions, written.feedback, holdout_key=self.holdout_key
                )
            # ---- the DB transaction committed when the block above exited ----------------------------
        except (DatabaseUnavailable, streams.BrokerError) as exc:
            raise Transient(str(exc)) from exc
        report.interactions += len(written.interactions)
        report.feedback += len(written.feedback)
        report.dead_lettered += len(written.rejected)
        report.replayed += written.replayed
        for name in ("joined", "late_feedback", "late_segments", "settled_terminal", "settled_window"):
            setattr(report.settle, name, getattr(report.settle, name) + getattr(settled, name))
        # ---- counted once committed (a batch read again is a replay, not counted twice) ---------
        metrics.EVENTS.labels("interaction").inc(len(written.interactions))
        metrics.EVENTS.labels("feedback").inc(len(written.feedback))
        metrics.REPLAYED.inc(written.replayed)
        _count_dead_letters(written.rejected)
        metrics.FEEDBACK_JOINED.inc(settled.joined)
        metrics.FEEDBACK_LATE.inc(settled.late_feedback)
        _count_settled(settled.settled)
        if self.after_db_commit is not None:
            self.after_db_commit(len(records))

    def _dead_letter(self, record: SourceRecord, reason: str, now: datetime, report: StepReport) -> None:
        """Store and produce a dead letter for `record` without processing it (its own transaction)."""
        rejected = Rejected(record, reason[:9_000])
        try:
            with self.store.labelling(now) as tx:
                written = tx.write_events([(record, rejected)])
                self._produce_dead_letters(written.rejected, now)
        except (DatabaseUnavailable, streams.BrokerError) as exc:
            raise Transient(str(exc)) from exc
        report.dead_lettered += len(written.rejected)
        report.replayed += written.replayed
        metrics.REPLAYED.inc(written.replayed)
        _count_dead_letters(written.rejected)

    def _one_by_one(
        self, batch: dict[Any, list[Any]], now: datetime, report: StepReport, count_attempts: bool
    ) -> None:
        """Each record in its own transaction, its offset committed after it (the error policy)."""
        report.one_by_one = True
        for tp, rs in batch.items():
            for r in rs:
                record = SourceRecord(r.topic, r.partition, r.offset, r.value)
                deaths = (
                    self._note(record.topic, record.partition, record.offset, "record")
                    if count_attempts
                    else 0
                )
                if deaths >= POISON_AFTER:
                    log.error(
                        "dead-lettering %s unprocessed: labelers died %d times on it", record.source, deaths
                    )
                    self._dead_letter(
                        record, f"poison: {deaths} labeler processes died while processing it", now, report
                    )
                else:
                    try:
                        self._write([record], now, report)
                    except Transient:
                        raise
                    except Exception as exc:  # this record alone fails: keep it, with the reason
                        log.warning("dead-lettering %s: %r", record.source, exc)
                        self._dead_letter(record, f"record: {type(exc).__name__}: {exc}", now, report)
                self._commit_offsets({tp: record.offset + 1})

    # ---- offsets and the poison-pill bookkeeping ----------------------------------------------

    def _note(self, topic: str, partition: int, offset: int, mode: str) -> int:
        """How many labeler processes started this work and died (0 when none did)."""
        if self._noted.get((topic, partition)) == (offset, mode):
            return 0  # this process started it before and is alive: not a death
        self._noted[(topic, partition)] = (offset, mode)
        return self.store.note_attempt(topic, partition, offset, mode) - 1

    def _note_batch_starts(self, batch: dict[Any, list[Any]]) -> str | None:
        """Note where each partition's batch starts (one transaction); a start some labeler process
        died on, or that this process is working through a record at a time, if any."""
        starts = {(tp.topic, tp.partition): rs[0].offset for tp, rs in batch.items()}
        again = {key for key, offset in starts.items() if self._noted.get(key, (-1, ""))[0] == offset}
        fresh = {key: offset for key, offset in starts.items() if key not in again}
        died = self.store.note_batch_starts(fresh) if fresh else set()
        for key, offset in fresh.items():
            self._noted[key] = (offset, "batch")
        # This process's own retry of a batch it was writing a record at a time stays one by one.
        one_by_one = died | {key for key in again if self._noted[key][1] == "record"}
        return ", ".join(f"{t}:{p}:{starts[(t, p)]}" for t, p in sorted(one_by_one)) or None

    def _commit_offsets(self, offsets: dict[Any, int]) -> None:
        """Commit the next offset of each partition (a `TopicPartition` of the batch, or a (topic, partition))."""
        if not offsets:
            return
        try:
            streams.commit(self.consumer, offsets)
        except streams.BrokerError as exc:
            # The group rebalanced or the broker is away; the records are stored, the next commit
            # covers them, and a re-delivery meanwhile is a no-op replay.
            log.warning("offset commit failed after the DB commit (%r); re-delivery is idempotent", exc)

    def _produce_dead_letters(self, rejected: list[Rejected], now: datetime) -> None:
        if not rejected:
            return
        deliveries = []
        for item in rejected:
            record = item.to_wire(now)
            log.info("dead-letter %s: %s", record.source, record.reason[:200])
            deliveries.append(
                self.producer.send(
                    self.settings.kafka.dlq_topic,
                    key=record.source.encode(),
                    value=record.model_dump_json().encode(),
                    schema=DEAD_LETTER_SCHEMA,
                )
            )
        self.producer.flush(timeout=DLQ_FLUSH_TIMEOUT_S)
        for delivery in deliveries:
            delivery.get(
                timeout=DLQ_FLUSH_TIMEOUT_S
            )  # raises the streams.BrokerError if the broker refused it


def _count_dead_letters(rejected: list[Rejected]) -> None:
    for item in rejected:
        metrics.DEAD_LETTERS.labels(metrics.reason_label(item.reason)).inc()


def _count_stranded(stranded: SettleReport, report: StepReport) -> None:
    """Count what the window pass joined of feedback two replicas' writes left unjoined."""
    found = stranded.joined + stranded.late_feedback
    if not found:
        return
    log.info(
        "joined %d feedback stored unjoined while another replica created its episode "
        "(%d late, %d episodes settled)",
        found,
        stranded.late_feedback,
        stranded.settled_terminal,
    )
    for name in ("joined", "late_feedback", "settled_terminal"):
        setattr(report.settle, name, getattr(report.settle, name) + getattr(stranded, name))
    metrics.FEEDBACK_STRANDED.inc(found)
    metrics.FEEDBACK_JOINED.inc(stranded.joined)
    metrics.FEEDBACK_LATE.inc(stranded.late_feedback)
    _count_settled(stranded.settled)


def _count_settled(settled: list[Settled]) -> None:
    for episode in settled:
        metrics.SETTLED.labels(episode.reason).inc()
        sign = metrics.sign(episode.reward)
        metrics.SETTLED_BY_VERSION.labels(episode.policy_version, sign).inc()
        if sign != "zero":
            metrics.REWARD_SUM.labels(episode.policy_version, sign).inc(abs(episode.reward))
        if episode.unfinished:
            metrics.SETTLED_UNFINISHED.labels(episode.policy_version).inc()
        metrics.SETTLE_LATENCY.observe(episode.latency_s)


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
        session_timeout_ms=settings.labeler.session_timeout_ms,
        heartbeat_interval_ms=min(3_000, settings.labeler.session_timeout_ms // 3),
    )


def make_producer(settings: Settings) -> streams.Producer:
    """The DLQ producer: acks from all in-sync replicas, idempotent retries."""
    return streams.Producer(streams.producer(settings.kafka, "rtrl-labeler-dlq"))


def freeze_heap() -> None:
    """Leave the objects alive now (modules, clients, settings: the process once set up) out of the
    cyclic garbage collector's passes: a full collection, then ``gc.freeze``.

    A batch allocates thousands of containers that live until it is written (events, their lists,
    rows), so they are promoted to the oldest generation and make the collector run full passes,
    each over every object of the process: more than half of the time of parsing and building rows
    went there (docs/platform.md, A batch's objects and Python's garbage collector). Reference
    counting still frees a frozen object, but one left in a reference cycle is never freed: so
    this runs once, when the process is set up, after a collection (no garbage is frozen)."""
    gc.collect()
    gc.freeze()


def prepare_store(settings: Settings, store: Store) -> None:
    """Migrate the store; under ``gateway.auth=open`` give the open gateway's one tenant its row
    (ingest/auth.py, OPEN_TENANT), so that ``labeler.unknown_tenants=refuse`` keeps a local loop
    without keys running (docs/security.md, Forged events)."""
    store.migrate()
    if settings.gateway.auth == "open":
        store.set_tenant(OPEN_TENANT)


def run(settings: Settings, stop: threading.Event | None = None, readiness: Readiness | None = None) -> None:
    """Run the labeler until SIGTERM/SIGINT (or ``stop``): migrate, create topics, consume.
    `readiness` (the exporter's, `rtrl labeler`) hears whether the store and Kafka work. On the
    main thread, where the process is the labeler's, it also handles the signals and freezes the
    set-up heap before consuming (`freeze_heap`); on another thread (a test's) it does neither."""
    stop = stop or threading.Event()
    store = Store(settings.store.url)
    prepare_store(settings, store)
    streams.ensure_topics(settings.kafka)
    consumer = make_consumer(settings)
    producer = make_producer(settings)
    owns_process = threading.current_thread() is threading.main_thread()  # rtrl labeler, not a test's thread
    if owns_process:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    labeler = None
    try:
        labeler = Labeler(settings, store, consumer, producer, readiness=readiness)
        if owns_process:
            freeze_heap()
        labeler.run(stop)
    finally:
        if labeler is not None:
            labeler.close()
        consumer.close(autocommit=False)  # offsets are only ever committed after a DB commit
        producer.close()
        store.close()
