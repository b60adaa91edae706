"""Background Kafka publishing for the gateway, with the on-disk spool as the fallback.

`Publisher.publish` never blocks, never raises and never touches the disk: it puts the record on a
bounded in-memory queue and returns. `Publisher.publish_confirmed` does the same and returns a
future that resolves once the record is durable, acknowledged by Kafka or fsynced in the spool (or
fails with `NotDurable` and the reason): the feedback route answers 202 only then
(docs/security.md, Accepted means durable). A sender thread hands records to a `streams.Producer` (a kafka-python producer, acks=all,
a linger of `LINGER_MS`; not idempotent, see `_new_producer`). Every accepted record ends in one of three places:

* **Kafka**, acknowledged;
* **the spool** (`ingest.spool.Spool`, fsynced): when Kafka does not acknowledge it within
  ``publish_timeout_s``, when there is no producer (broker unreachable), or when the queue or the
  in-flight bound is reached;
* **the overflow file** (``spool_dir/overflow.jsonl``, a dead letter with the reason): when Kafka
  will never take it as it is (over ``kafka.max_message_bytes``, or refused by the broker as too
  large), or when the spool is full;
* **nowhere, counted and logged** (outcome ``dropped``, or ``lost`` when the disk fails): when the
  overflow file is full too (``overflow_max_bytes``), or when both in-memory queues are full.
  A confirmed record (feedback) that ends here fails its future, so its client gets a 503 and
  retries: only fire-and-forget records (captures) can be lost, and never silently.

Disk writes never run on the event loop. What `publish` cannot queue (the queue is full, the record
is too large for Kafka) goes to a second bounded queue that a disk thread writes, as does what the
sender spools while there is no producer; the disk thread writes whatever has gathered with one
fsync (`Spool.append_many`), so the spool keeps up with an outage at any request rate.

Nothing depends on the producer keeping its promises. A watchdog thread gives every record handed
to the producer a deadline of ``publish_timeout_s`` + `WATCHDOG_GRACE_S`; a record still unsettled
then is spooled by the watchdog, and the producer that let it hang is *retired* (closed in the
background, never waited for) and replaced by a fresh one. The same happens to a producer that
fails `RETIRE_AFTER_FAILED_REPLAYS` spool replays in a row. This is what keeps a broker restart
from wedging the gateway: a kafka-python producer that lost its broker can stay stuck on its old
connection state, its futures never completing.

A replayer thread (re)connects to the broker and replays the spool oldest segment first,
deleting a segment only after each of its records was acknowledged or dead-lettered for good; a
restarted gateway replays what a previous one left.

Guarantees: at-least-once into Kafka (or a dead letter on disk) for everything `publish` accepted,
except what is in memory when the process is killed hard (the queue plus the records in flight,
both bounded); on a clean shutdown those are spooled too. Retries, replays and a retired
producer's late deliveries can duplicate a record: consumers are idempotent on ``event_id``.
Order is kept within the spool; spooled records may land after newer live ones (the labeler joins
by request id and never relies on cross-record order).

Readiness tells the truth: `connected` is false while there is no working producer, and
`in_flight_age_s` is the age of the oldest unsettled record (``rtrl_gateway_publish_oldest_in_flight_seconds``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import streams
from ingest.metrics import GatewayMetrics
from ingest.spool import Spool, SpoolRecord
from schemas.settings import Settings

log = logging.getLogger(__name__)

QUEUE_SIZE = 10_000  # records waiting for the sender thread (and, apart, for the disk thread)
DISK_BATCH = 1_000  # records the disk thread writes with one fsync at most
MAX_IN_FLIGHT = 20_000  # records handed to the producer and not yet settled
# Records wait up to this long to share a produce request. Nobody waits for a capture event, and
# one request per record cost the gateway about 0.6 ms of CPU per generation more than batching
# (bench/bench_gateway.py, measured on 2 cores), plus the broker's work on the extra requests.
LINGER_MS = 100
WATCHDOG_GRACE_S = 1.0  # the producer's own delivery timeout fires first; the watchdog catches a hang
WATCHDOG_TICK_S = 0.25
RETIRE_AFTER_FAILED_REPLAYS = 2
RECORD_OVERHEAD_BYTES = 512  # record and batch headers around key + value + schema header


class NotDurable(Exception):
    """A confirmed record is neither on Kafka nor in the spool (the message says why and where it is)."""


@dataclass(frozen=True)
class _ToDisk:
    record: SpoolRecord
    reason: str
    undeliverable: bool  # a dead letter (Kafka will never take it), not a spool append


@dataclass
class _InFlight:
    record: SpoolRecord
    sent_at: float  # time.monotonic() when handed to the producer
    producer: streams.Producer


class Publisher:
    """Publishes wire events to Kafka from background threads; spools what the broker does not take."""

    def __init__(
        self,
        settings: Settings,
        metrics: GatewayMetrics,
        replay_interval_s: float = 1.0,
        connect: Callable[[], streams.Producer | None] | None = None,
    ) -> None:
        self._kafka = settings.kafka
        self._connect = connect or self._new_producer  # tests hand in producers that misbehave
        self._timeout_s = settings.gateway.publish_timeout_s
        self._metrics = metrics
        self._replay_interval_s = replay_interval_s
        gateway = settings.gateway
        self.spool = Spool(
            gateway.spool_dir, gateway.spool_max_bytes, overflow_max_bytes=gateway.overflow_max_bytes
        )
        metrics.bind(metrics.spool_bytes, lambda: self.spool.size_bytes)
        metrics.bind(metrics.overflow_bytes, lambda: self.spool.overflow_bytes)
        metrics.spool_max_bytes.set(gateway.spool_max_bytes)
        metrics.overflow_max_bytes.set(gateway.overflow_max_bytes)
        metrics.bind(metrics.oldest_in_flight, lambda: self.in_flight_age_s)
        self._queue: queue.Queue[SpoolRecord | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self._disk: queue.Queue[_ToDisk | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self._waiters: dict[int, Future[str]] = {}  # id(record) -> its confirmation
        self._waiters_lock = threading.Lock()
        self._producer: streams.Producer | None = None
        self._producer_lock = threading.Lock()
        self._failed_replays = 0
        self._in_flight: dict[int, _InFlight] = {}  # insertion order = send order = deadline order
        self._in_flight_lock = threading.Lock()
        self._next_ticket = 0
        self._stop = threading.Event()
        self._first_attempt = threading.Event()  # set once the first connection attempt finished
        self._closed = False
        self._threads = [
            threading.Thread(target=self._send_loop, name="rtrl-publisher-send", daemon=True),
            threading.Thread(target=self._replay_loop, name="rtrl-publisher-replay", daemon=True),
            threading.Thread(target=self._watchdog_loop, name="rtrl-publisher-watchdog", daemon=True),
            threading.Thread(target=self._disk_loop, name="rtrl-publisher-disk", daemon=True),
        ]

    # ---- API ----------------------------------------------------------------------------------

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    @property
    def connected(self) -> bool:
        """True while there is a producer that has not been retired."""
        return self._producer is not None

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def in_flight_age_s(self) -> float:
        """Seconds the oldest record handed to the producer has waited for its acknowledgement (0 if none)."""
        with self._in_flight_lock:
            oldest = next(iter(self._in_flight.values()), None)
        return 0.0 if oldest is None else time.monotonic() - oldest.sent_at

    @property
    def confirm_within_s(self) -> float:
        """The longest a record waits for its fate once the sender took it: Kafka's acknowledgement
        within publish_timeout_s, else the watchdog spools it by its next tick after the grace."""
        return self._timeout_s + WATCHDOG_GRACE_S + WATCHDOG_TICK_S

    def publish(self, topic: str, key: str, value: str, schema: str, event_id: str | None = None) -> None:
        """Queue one record for Kafka. Never blocks on the broker or the disk; never drops the
        record silently (outcome ``dropped`` or ``lost``, logged, when nowhere can take it)."""
        self._accept(SpoolRecord(topic=topic, key=key, value=value, schema=schema, event_id=event_id))

    def publish_confirmed(
        self, topic: str, key: str, value: str, schema: str, event_id: str | None = None
    ) -> Future[str]:
        """`publish`, and a future of the record's durability: its result is ``kafka`` (acknowledged)
        or ``spooled`` (fsynced in the spool); it fails with `NotDurable` when the record went to
        the overflow file or nowhere. Await it with ``asyncio.wrap_future`` (never blocks the loop)."""
        record = SpoolRecord(topic=topic, key=key, value=value, schema=schema, event_id=event_id)
        confirmed: Future[str] = Future()
        confirmed.set_running_or_notify_cancel()  # a waiter that gives up cannot cancel it under us
        with self._waiters_lock:
            self._waiters[id(record)] = confirmed
        self._accept(record)
        return confirmed

    def _accept(self, record: SpoolRecord) -> None:
        size = len(record.key.encode()) + len(record.value.encode()) + len(record.schema)
        size += RECORD_OVERHEAD_BYTES
        if size > self._kafka.max_message_bytes:
            limit = self._kafka.max_message_bytes
            reason = f"record of about {size} bytes is over kafka.max_message_bytes {limit}"
            self._to_disk(_ToDisk(record, reason, undeliverable=True))
            return
        if self._closed:  # the threads are gone: write it here (only a request racing shutdown)
            self._spool(record, "publisher closed")
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._to_disk(_ToDisk(record, f"publish queue full ({QUEUE_SIZE} records)", undeliverable=False))

    def _resolve(self, record: SpoolRecord, where: str | None, reason: str = "") -> None:
        """Settle the confirmation of `record`, if it has one: durable `where`, or not (`reason`)."""
        with self._waiters_lock:
            confirmed = self._waiters.pop(id(record), None)
        if confirmed is None:
            return
        if where is not None:
            confirmed.set_result(where)
        else:
            confirmed.set_exception(NotDurable(reason))

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the threads; flush what the broker takes in `timeout_s`, spool the rest."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        self._closed = True
        try:
            self._queue.put(
                None, timeout=timeout_s
            )  # the sender drains everything queued before it, then exits
        except queue.Full:
            pass
        self._threads[0].join(timeout=timeout_s + 5)
        self._stop.set()
        try:  # the disk thread writes everything handed to it before, then exits
            self._disk.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        for thread in self._threads[1:]:
            thread.join(timeout=timeout_s + 5)
        while True:  # what a stuck or dead sender left queued
            try:
                record = self._queue.get_nowait()
            except queue.Empty:
                break
            if record is not None:
                self._spool(record, "queued at shutdown")
        self._write(self._drain_disk()[0])  # what a stuck or dead disk thread left
        with self._producer_lock:
            producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.flush(timeout=timeout_s)
            except streams.BrokerError as exc:
                log.warning("kafka flush on shutdown: %s; spooling unacknowledged records", exc)
        # Outcome unknown for whatever is still in flight: spool it (a duplicate is harmless).
        with self._in_flight_lock:
            leftover = [entry.record for entry in self._in_flight.values()]
            self._in_flight.clear()
        for record in leftover:
            self._spool(record, "unacknowledged at shutdown")
        if producer is not None:
            producer.close_now()
        self.spool.close()

    # ---- sending ------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        # Hold records (in the bounded queue) until the first connection attempt is over, so a
        # gateway that just started does not spool what a healthy broker would take a moment later.
        self._first_attempt.wait()
        while True:
            record = self._queue.get()
            try:
                if record is None:
                    return
                self._send(record)
            except Exception:  # noqa: BLE001 - this thread must outlive any one record
                log.exception(
                    "publishing %s record %s failed unexpectedly; spooling it",
                    record and record.topic,
                    record and record.event_id,
                )
                if record is not None:
                    self._spool(record, "unexpected error while sending")
            finally:
                self._queue.task_done()

    def _send(self, record: SpoolRecord) -> None:
        producer = self._producer
        if producer is None:  # the disk thread spools it, in a batch with the others waiting
            self._to_disk(
                _ToDisk(record, "no connection to the Kafka broker", undeliverable=False), block=True
            )
            return
        with self._in_flight_lock:
            if len(self._in_flight) >= MAX_IN_FLIGHT:
                ticket = None
            else:
                ticket = self._next_ticket
                self._next_ticket += 1
                self._in_flight[ticket] = _InFlight(record, time.monotonic(), producer)
        if ticket is None:
            self._spool(record, f"{MAX_IN_FLIGHT} records in flight to Kafka")
            return
        try:
            delivery = self._produce(producer, record)
        except streams.RecordTooLarge as exc:  # no retry can fix it: dead-lettered, not spooled again
            if self._settle(ticket) is not None:
                self._undeliverable(record, f"kafka refused the record: {exc!r}")
            return
        except (
            streams.BrokerError,
            AssertionError,
        ) as exc:  # metadata not available in max_block_ms, producer closed...
            if self._settle(ticket) is not None:
                self._spool(record, f"kafka send failed: {exc!r}")
            if isinstance(exc, streams.BrokerTimeout):
                # send() blocked max_block_ms for metadata: every queued record would wait as long.
                # Without a producer they go straight to the spool until a new one connects.
                self._retire(producer, f"send blocked {self._timeout_s:g}s waiting for metadata")
            return
        delivery.add_callback(self._on_ack, ticket)
        delivery.add_errback(self._on_error, ticket)

    def _produce(self, producer: streams.Producer, record: SpoolRecord) -> streams.Delivery:
        return producer.send(
            record.topic, key=record.key.encode(), value=record.value.encode(), schema=record.schema
        )

    def _settle(self, ticket: int) -> SpoolRecord | None:
        # Whoever removes the ticket owns the record's fate; the watchdog or close() may have
        # spooled it already (then a late acknowledgement only makes a harmless duplicate).
        with self._in_flight_lock:
            entry = self._in_flight.pop(ticket, None)
        return None if entry is None else entry.record

    def _on_ack(self, ticket: int, _metadata: object) -> None:
        record = self._settle(ticket)
        if record is not None:
            self._metrics.publish.labels(record.topic, "ok").inc()
            self._resolve(record, "kafka")

    def _on_error(self, ticket: int, exc: BaseException) -> None:
        record = self._settle(ticket)
        if record is None:
            return
        if isinstance(exc, streams.RecordTooLarge):
            self._undeliverable(record, f"kafka refused the record: {exc!r}")
        else:
            self._spool(record, f"kafka did not acknowledge: {exc!r}")

    # ---- the disk ---------------------------------------------------------------------------------

    def _to_disk(self, item: _ToDisk, block: bool = False) -> None:
        """Hand `item` to the disk thread. The event loop's callers never wait: when that queue is
        full too, the record is dropped, counted and logged (its confirmation fails)."""
        try:
            self._disk.put(item, block=block)
        except queue.Full:
            reason = f"{item.reason}; and the disk queue is full ({QUEUE_SIZE} records)"
            self._fate(item.record, "dropped", reason, f"the gateway is overloaded: {reason}")

    def _disk_loop(self) -> None:
        stop = False
        while not stop:
            first = self._disk.get()
            items, stop = self._drain_disk(DISK_BATCH - 1) if first is not None else ([], True)
            try:
                self._write([first, *items] if first is not None else items)
            except Exception:  # noqa: BLE001 - this thread must outlive any one batch
                log.exception("the publisher's disk thread failed on a batch")

    def _drain_disk(self, most: int = QUEUE_SIZE) -> tuple[list[_ToDisk], bool]:
        """Up to `most` items waiting for the disk thread, and whether close() asked it to stop."""
        items: list[_ToDisk] = []
        while len(items) < most:
            try:
                item = self._disk.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return items, True
            items.append(item)
        return items, False

    def _write(self, items: list[_ToDisk]) -> None:
        spool = [(item.record, item.reason) for item in items if not item.undeliverable]
        if spool:
            self._spool_many(spool)
        for item in items:
            if item.undeliverable:
                self._undeliverable(item.record, item.reason)

    def _spool(self, record: SpoolRecord, reason: str) -> None:
        self._spool_many([(record, reason)])

    def _spool_many(self, batch: list[tuple[SpoolRecord, str]]) -> None:
        """Spool every record of `batch` (with why), fsynced once; settle their confirmations."""
        try:
            outcomes = self.spool.append_many([record for record, _ in batch])
        except OSError as exc:  # the disk is full or gone: nothing left to put it on; say so loudly
            for record, reason in batch:
                why = f"spooling it failed ({exc!r}) after: {reason}"
                self._fate(record, "lost", why, f"the gateway could not write its spool: {exc!r}")
            return
        for (record, reason), outcome in zip(batch, outcomes, strict=True):
            if outcome == "spooled":
                self._metrics.publish.labels(record.topic, outcome).inc()
                log.info("spooled %s record %s: %s", record.topic, record.event_id, reason)
                self._resolve(record, "spooled")
            elif outcome == "overflow":
                why = f"spool full, written to {self.spool.overflow_path} after: {reason}"
                self._fate(record, outcome, why, "the gateway's spool is full (Kafka is unreachable)")
            else:
                why = f"spool and overflow file (overflow_max_bytes {self.spool.overflow_max_bytes}) full after: {reason}"
                self._fate(record, outcome, why, "the gateway's spool and overflow file are full")

    def _undeliverable(self, record: SpoolRecord, reason: str) -> None:
        never = f"kafka will never take this record: {reason}"
        try:
            written = self.spool.dead_letter(record, reason)
        except OSError as exc:
            self._fate(record, "lost", f"dead-lettering it failed ({exc!r}) after: {reason}", never)
            return
        if written:
            self._fate(
                record, "undeliverable", f"dead-lettered to {self.spool.overflow_path}: {reason}", never
            )
        else:
            self._fate(record, "dropped", f"overflow file full after: {reason}", never)

    def _fate(self, record: SpoolRecord, outcome: str, why: str, told: str) -> None:
        """A record that is neither on Kafka nor in the spool: logged (LOST/DROPPED loudly), counted
        by `outcome`, and its confirmation failed with `told` (what a client may read)."""
        self._metrics.publish.labels(record.topic, outcome).inc()
        word = outcome.upper() if outcome in ("lost", "dropped") else outcome
        log.error("%s %s record %s: %s", word, record.topic, record.event_id, why)
        self._resolve(record, None, told)

    # ---- the watchdog -------------------------------------------------------------------------

    def _watchdog_loop(self) -> None:
        while not self._stop.wait(WATCHDOG_TICK_S):
            try:
                self.expire()
            except Exception:  # noqa: BLE001 - the watchdog must outlive any one failure
                log.exception("publisher watchdog")

    def expire(self, now: float | None = None) -> int:
        """Spool every in-flight record past its deadline and retire the producers that let it hang;
        returns how many records were spooled. The watchdog thread calls this every tick."""
        now = time.monotonic() if now is None else now
        deadline = self._timeout_s + WATCHDOG_GRACE_S
        expired: list[_InFlight] = []
        with self._in_flight_lock:
            while self._in_flight:
                ticket, entry = next(iter(self._in_flight.items()))
                if now - entry.sent_at < deadline:
                    break  # every later ticket was sent later
                del self._in_flight[ticket]
                expired.append(entry)
        for entry in expired:
            self._spool(entry.record, f"no acknowledgement from Kafka within {deadline:g}s")  # never raises
        for producer in {id(e.producer): e.producer for e in expired}.values():
            self._retire(producer, f"{len(expired)} records unsettled after {deadline:g}s")
        return len(expired)

    def _retire(self, producer: streams.Producer, reason: str) -> None:
        """Stop using `producer` (if it is still the current one) and close it in the background."""
        with self._producer_lock:
            if self._producer is not producer:
                return  # already retired
            self._producer = None
            self._failed_replays = 0
        self._metrics.kafka_connected.set(0)
        self._metrics.producer_replaced.inc()
        log.warning(
            "kafka producer retired (%s); a new one connects, events go to the spool meanwhile", reason
        )
        threading.Thread(target=producer.close_now, name="rtrl-publisher-retire", daemon=True).start()

    # ---- connecting and replaying -------------------------------------------------------------

    def _new_producer(self) -> streams.Producer | None:
        timeout_ms = int(self._timeout_s * 1000)
        try:
            client = streams.producer(
                self._kafka,
                "rtrl-gateway",
                # Not idempotent: kafka-python's idempotent producer turns one refused batch (a record
                # over the broker's size limit) into a fatal state that fails every later record, and
                # carries producer-id and sequence state across broker restarts that the gateway gains
                # nothing from. Duplicates from retries are harmless: consumers dedupe on event_id.
                enable_idempotence=False,
                linger_ms=LINGER_MS,
                # A record Kafka has not acknowledged within publish_timeout_s is spooled instead.
                delivery_timeout_ms=timeout_ms + LINGER_MS + 1,
                request_timeout_ms=timeout_ms,
                max_block_ms=timeout_ms,
                bootstrap_timeout_ms=timeout_ms,
            )
        except (streams.BrokerError, streams.BrokersUnreachable) as exc:
            log.warning(
                "kafka %s unreachable: %s; events go to the spool", self._kafka.bootstrap_servers, exc
            )
            return None
        return streams.Producer(client)

    def _replay_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._replay_once()
            except Exception:  # noqa: BLE001 - the replayer must outlive any one failure
                log.exception("publisher replay loop")
            finally:
                self._first_attempt.set()  # never leave the sender waiting for a first attempt
            self._stop.wait(self._replay_interval_s)

    def _replay_once(self) -> None:
        """Connect when there is no producer, then replay the spool with the one there is."""
        if self._producer is None:
            producer = self._connect()
            with self._producer_lock:
                self._producer = producer
            self._metrics.kafka_connected.set(1 if producer is not None else 0)
            if producer is not None and self._first_attempt.is_set():
                log.info("kafka producer connected to %s", self._kafka.bootstrap_servers)
            self._first_attempt.set()
        producer = self._producer
        if producer is not None and not self._replay(producer):
            self._failed_replays += 1
            if self._failed_replays >= RETIRE_AFTER_FAILED_REPLAYS:
                self._retire(producer, f"{self._failed_replays} spool replays in a row failed")

    def _replay(self, producer: streams.Producer) -> bool:
        """Replay sealed spool segments oldest first; stop at the first that is not fully settled.
        Returns False when a segment could not be replayed (it is retried later)."""
        for path in self.spool.sealed_segments():
            if self._stop.is_set():
                return True
            segment = self.spool.read(path)
            started = time.monotonic()
            undeliverable: list[tuple[SpoolRecord, str]] = []
            problem = ""
            try:
                deadline = time.monotonic() + self._timeout_s
                deliveries = []
                for record in segment.records:
                    try:
                        deliveries.append((record, self._produce(producer, record)))
                    except streams.RecordTooLarge as exc:
                        undeliverable.append((record, f"kafka refused the record: {exc!r}"))
                try:
                    producer.flush(timeout=self._timeout_s)
                except streams.BrokerError:
                    # A timeout, or kafka-python's UnknownError('Future not done') when the broker
                    # made it split a batch over its size limit: each record is waited for below.
                    pass
                unacked = 0
                for record, delivery in deliveries:
                    # flush() can also return while split batches are still in flight: wait for
                    # each record until the deadline.
                    try:
                        delivery.get(timeout=max(0.0, deadline - time.monotonic()))
                    except streams.RecordTooLarge as exc:
                        undeliverable.append((record, f"kafka refused the record: {exc!r}"))
                    except streams.BrokerError as exc:
                        unacked += 1
                        problem = problem or f" (first: {exc!r})"
                if unacked:
                    problem = f"{unacked} of {len(deliveries)} unacknowledged{problem}"
            except (streams.BrokerError, AssertionError) as exc:
                problem = repr(exc)
            if problem:
                log.warning("replay of %s incomplete: %s; retrying later", path.name, problem)
                return False
            self._failed_replays = 0
            dropped = self.spool.remove(segment, undeliverable)
            if dropped:
                log.error("DROPPED %d dead letters of %s: overflow file full", dropped, path.name)
            refused = {id(r) for r, _ in undeliverable}
            for record in segment.records:
                outcome = "undeliverable" if id(record) in refused else "replayed"
                self._metrics.publish.labels(record.topic, outcome).inc()
            for record, reason in undeliverable:
                log.error(
                    "%s record %s dead-lettered to %s: %s",
                    record.topic,
                    record.event_id,
                    self.spool.overflow_path,
                    reason,
                )
            log.info(
                "replayed %d records from %s in %.2fs (%d dead-lettered: %d unreadable lines, %d refused by Kafka)",
                len(segment.records) - len(undeliverable),
                path.name,
                time.monotonic() - started,
                len(segment.bad_lines) + len(undeliverable),
                len(segment.bad_lines),
                len(undeliverable),
            )
        return True
