"""`Producer`: a kafka-python producer (from `streams.producer`) for code outside this package.

It sends rtrl's records (a key, a value and the ``schema`` header the consumers dispatch on) and
raises, or hands its errbacks, streams' errors (streams/errors.py) instead of kafka-python's: the
gateway's publisher decides between retrying, spooling and dead-lettering a record on
`RecordTooLarge`, `BrokerTimeout` and `BrokerError` alone. Wrap a producer once and keep the
wrapper: callers compare producers by identity.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from streams.errors import broker_error, kafka_errors

log = logging.getLogger(__name__)


class Delivery:
    """One record handed to the producer: its acknowledgement, or its failure, to come."""

    def __init__(self, future: Any) -> None:
        self._future = future

    def get(self, timeout: float) -> Any:
        """Wait up to `timeout` seconds for the acknowledgement (the record's metadata); raises the
        streams error of a refusal, or `BrokerTimeout` when none came in time."""
        with kafka_errors():
            return self._future.get(timeout=timeout)

    def add_callback(self, callback: Callable[..., object], *args: Any) -> None:
        """Call ``callback(*args, metadata)`` once the broker acknowledged the record (at once if it has)."""
        self._future.add_callback(callback, *args)

    def add_errback(self, errback: Callable[..., object], *args: Any) -> None:
        """Call ``errback(*args, error)`` with the streams error once the record failed (at once if it has)."""
        self._future.add_errback(lambda exc: errback(*args, broker_error(exc)))


class Producer:
    """A kafka-python producer that speaks streams' errors. ``client`` is the producer itself."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def send(self, topic: str, *, key: bytes, value: bytes, schema: str) -> Delivery:
        """Hand one record to the producer; raises at once what kafka-python raises at once (a record
        over ``max_request_size``, no metadata within ``max_block_ms``) as its streams error."""
        with kafka_errors():
            future = self.client.send(topic, key=key, value=value, headers=[("schema", schema.encode())])
        return Delivery(future)

    def flush(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for every record handed over so far to be sent."""
        with kafka_errors():
            self.client.flush(timeout=timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush and close (kafka-python's close: `timeout` None waits as long as it takes)."""
        with kafka_errors():
            self.client.close(timeout=timeout)

    def close_now(self) -> None:
        """Close now, whatever the producer still holds; never raises. Records still pending fail,
        and their errbacks run."""
        try:
            self.client.close(timeout=0)
            return
        except Exception as exc:  # noqa: BLE001 - closing a stuck producer must not kill a thread that matters
            log.info("closing a kafka producer with records pending: %r; forcing it", exc)
        # kafka-python's close() flushes before it force-closes, and the flush raises while batches
        # are pending, so the force-close is never reached: do it here, or the sender thread and
        # its sockets would live on.
        sender = getattr(self.client, "_sender", None)
        if sender is not None and sender.is_alive():
            sender.force_close()
            sender.join(timeout=5)
