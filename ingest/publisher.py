"""Background Kafka publishing for the gateway, with the on-disk spool as the fallback.

`Publisher.publish` never blocks and never raises: it puts the record on a bounded in-memory queue
and returns. A sender thread hands records to a kafka-python `KafkaProducer` (acks=all,
idempotent, short linger); a record Kafka does not acknowledge within ``publish_timeout_s`` is
written to the `ingest.spool.Spool`, and so is every record while there is no producer at all
(broker unreachable since start-up) or the queue/in-flight bound is reached. A replayer thread
(re)connects to the broker and replays the spool oldest segment first, deleting a segment only
after every record in it was acknowledged; a restarted gateway replays what a previous one left.

Guarantees: at-least-once into Kafka for everything `publish` accepted, except what is in memory
when the process is killed hard (the queue plus the producer's unacknowledged batches, both
bounded); on a clean shutdown those are spooled too. Replays and retries can duplicate a record:
consumers are idempotent on ``event_id``. Order is kept within the spool; spooled records may land
after newer live ones (the labeler joins by request id and never relies on cross-record order).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError

import streams
from ingest.metrics import GatewayMetrics
from ingest.spool import Spool, SpoolRecord
from schemas.settings import Settings

log = logging.getLogger(__name__)

QUEUE_SIZE = 10_000  # records waiting for the sender thread
MAX_IN_FLIGHT = 20_000  # records handed to the producer and not yet acknowledged
LINGER_MS = 5


class Publisher:
    """Publishes wire events to Kafka from background threads; spools what the broker does not take."""

    def __init__(self, settings: Settings, metrics: GatewayMetrics, replay_interval_s: float = 1.0) -> None:
        self._kafka = settings.kafka
        self._timeout_s = settings.gateway.publish_timeout_s
        self._metrics = metrics
        self._replay_interval_s = replay_interval_s
        self.spool = Spool(settings.gateway.spool_dir, settings.gateway.spool_max_bytes)
        metrics.spool_bytes.set_function(lambda: self.spool.size_bytes)
        self._queue: queue.Queue[SpoolRecord | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self._producer: KafkaProducer | None = None
        self._in_flight: dict[int, SpoolRecord] = {}
        self._in_flight_lock = threading.Lock()
        self._next_ticket = 0
        self._stop = threading.Event()
        self._first_attempt = threading.Event()  # set once the first connection attempt finished
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name="rtrl-publisher-send", daemon=True)
        self._replayer = threading.Thread(target=self._replay_loop, name="rtrl-publisher-replay", daemon=True)

    # ---- API ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._sender.start()
        self._replayer.start()

    @property
    def connected(self) -> bool:
        return self._producer is not None

    def publish(self, topic: str, key: str, value: str, schema: str, event_id: str | None = None) -> None:
        """Queue one record for Kafka. Never blocks on the broker; never drops the record."""
        record = SpoolRecord(topic=topic, key=key, value=value, schema=schema, event_id=event_id)
        if self._closed:
            self._spool(record, "publisher closed")
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._spool(record, f"publish queue full ({QUEUE_SIZE} records)")

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the threads; flush what the broker takes in `timeout_s`, spool the rest."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        self._closed = True
        self._queue.put(None)  # the sender drains everything queued before it, then exits
        self._sender.join()
        self._stop.set()
        self._replayer.join()
        producer = self._producer
        if producer is not None:
            try:
                producer.flush(timeout=timeout_s)
            except KafkaError as exc:
                log.warning("kafka flush on shutdown: %s; spooling unacknowledged records", exc)
            # Outcome unknown for whatever is still in flight: spool it (a duplicate is harmless).
            with self._in_flight_lock:
                leftover = list(self._in_flight.values())
                self._in_flight.clear()
            for record in leftover:
                self._spool(record, "unacknowledged at shutdown")
            producer.close(timeout=0)
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
            finally:
                self._queue.task_done()

    def _send(self, record: SpoolRecord) -> None:
        producer = self._producer
        if producer is None:
            self._spool(record, "no connection to the Kafka broker")
            return
        with self._in_flight_lock:
            if len(self._in_flight) >= MAX_IN_FLIGHT:
                ticket = None
            else:
                ticket = self._next_ticket
                self._next_ticket += 1
                self._in_flight[ticket] = record
        if ticket is None:
            self._spool(record, f"{MAX_IN_FLIGHT} records in flight to Kafka")
            return
        try:
            future = self._produce(producer, record)
        except KafkaError as exc:  # metadata not available within max_block_ms, producer closed...
            if self._settle(ticket) is not None:
                self._spool(record, f"kafka send failed: {exc!r}")
            return
        future.add_callback(self._on_ack, ticket)
        future.add_errback(self._on_error, ticket)

    def _produce(self, producer: KafkaProducer, record: SpoolRecord) -> Any:
        return producer.send(
            record.topic,
            key=record.key.encode(),
            value=record.value.encode(),
            headers=[("schema", record.schema.encode())],
        )

    def _settle(self, ticket: int) -> SpoolRecord | None:
        # Whoever removes the ticket owns the record's fate; close() may have spooled it already.
        with self._in_flight_lock:
            return self._in_flight.pop(ticket, None)

    def _on_ack(self, ticket: int, _metadata: Any) -> None:
        record = self._settle(ticket)
        if record is not None:
            self._metrics.publish.labels(record.topic, "ok").inc()

    def _on_error(self, ticket: int, exc: BaseException) -> None:
        record = self._settle(ticket)
        if record is not None:
            self._spool(record, f"kafka did not acknowledge: {exc!r}")

    def _spool(self, record: SpoolRecord, reason: str) -> None:
        if self.spool.append(record):
            log.info("spooled %s record %s: %s", record.topic, record.event_id, reason)
            self._metrics.publish.labels(record.topic, "spooled").inc()
        else:
            log.error("spool full: %s record %s written to %s", record.topic, record.event_id, self.spool.overflow_path)
            self._metrics.publish.labels(record.topic, "overflow").inc()

    # ---- connecting and replaying -------------------------------------------------------------

    def _connect(self) -> KafkaProducer | None:
        timeout_ms = int(self._timeout_s * 1000)
        try:
            producer: KafkaProducer = streams.producer(
                self._kafka,
                "rtrl-gateway",
                linger_ms=LINGER_MS,
                # A record Kafka has not acknowledged within publish_timeout_s is spooled instead.
                delivery_timeout_ms=timeout_ms + LINGER_MS + 1,
                request_timeout_ms=timeout_ms,
                max_block_ms=timeout_ms,
                bootstrap_timeout_ms=timeout_ms,
            )
        except (KafkaError, streams.BrokersUnreachable) as exc:
            log.warning("kafka %s unreachable: %s; events go to the spool", self._kafka.bootstrap_servers, exc)
            return None
        return producer

    def _replay_loop(self) -> None:
        while not self._stop.is_set():
            if self._producer is None:
                self._producer = self._connect()
                self._metrics.kafka_connected.set(1 if self._producer is not None else 0)
                self._first_attempt.set()
            if self._producer is not None:
                self._replay(self._producer)
            self._stop.wait(self._replay_interval_s)

    def _replay(self, producer: KafkaProducer) -> None:
        """Replay sealed spool segments oldest first; stop at the first that is not fully acked."""
        for path in self.spool.sealed_segments():
            if self._stop.is_set():
                return
            segment = self.spool.read(path)
            started = time.monotonic()
            try:
                futures = [self._produce(producer, record) for record in segment.records]
                producer.flush(timeout=self._timeout_s)
                unacked = [f for f in futures if not f.succeeded()]
                problem = f"{len(unacked)} of {len(futures)} unacknowledged" if unacked else ""
                if unacked and unacked[0].exception is not None:
                    problem += f" (first: {unacked[0].exception!r})"
            except KafkaError as exc:
                problem = repr(exc)
            if problem:
                log.warning("replay of %s incomplete: %s; retrying later", path.name, problem)
                return
            self.spool.remove(segment)
            for record in segment.records:
                self._metrics.publish.labels(record.topic, "replayed").inc()
            log.info(
                "replayed %d records from %s in %.2fs (%d unreadable lines dead-lettered)",
                len(segment.records), path.name, time.monotonic() - started, len(segment.bad_lines),
            )
