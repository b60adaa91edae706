"""The errors of `streams`: what rtrl code outside this package catches instead of kafka-python's.

`StreamsError` is the root. A kafka-python error that reaches a caller through `kafka_errors` (or
through `streams.Producer` and its deliveries, or `streams.commit`) arrives as a `BrokerError`
chained to it (``__cause__``): `RecordTooLarge` for a record the broker will never take as it is,
`BrokerTimeout` for a request that was not answered in time, `BrokerError` itself for any other.
A `BrokerError` reads as the kafka-python error it stands for (same ``str`` and ``repr``), so logs
and dead-letter reasons name the broker's error. Errors that are not kafka-python's pass through
unchanged. Importing this module does not import Kafka.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from schemas.errors import OperatorError


class StreamsError(Exception):
    """Root of the errors the streams package raises on purpose."""


class BrokersUnreachable(StreamsError, OperatorError):
    """No broker of ``kafka.bootstrap_servers`` answered while a client was being created."""


class BrokerError(StreamsError):
    """Kafka failed a request: kafka-python's error, which is the ``__cause__``. ``retriable`` is
    kafka-python's word on whether the same request may succeed later."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(*cause.args)
        self.cause = cause
        self.retriable = bool(getattr(cause, "retriable", False))

    def __str__(self) -> str:
        return str(self.cause)

    def __repr__(self) -> str:
        return repr(self.cause)


class RecordTooLarge(BrokerError):
    """The broker refuses the record as too large (a message or a batch over its limit): no retry
    delivers it as it is."""


class BrokerTimeout(BrokerError):
    """A request was not answered in time (for a send: no metadata within ``max_block_ms``)."""


def broker_error(exc: BaseException) -> BaseException:
    """`exc` as a streams error when it is kafka-python's (see the module docstring), else `exc`."""
    if "kafka" not in sys.modules:  # then nothing raised a kafka-python error
        return exc
    from kafka import errors

    if not isinstance(exc, errors.KafkaError):
        return exc
    if isinstance(exc, errors.MessageSizeTooLargeError | errors.RecordListTooLargeError):
        return RecordTooLarge(exc)
    if isinstance(exc, errors.KafkaTimeoutError):
        return BrokerTimeout(exc)
    return BrokerError(exc)


@contextmanager
def kafka_errors() -> Iterator[None]:
    """Raise a kafka-python error escaping the block as its streams error (`broker_error`)."""
    try:
        yield
    except Exception as exc:
        translated = broker_error(exc)
        if translated is exc:
            raise
        raise translated from exc
