"""Kafka for every rtrl process: the one client factory, the loop's topics, and the only package
that imports kafka-python.

`producer`, `consumer` and `admin` build kafka-python clients that carry the connection and
security settings of ``settings.kafka`` (security protocol, SASL, TLS files); `ensure_topics`
creates the interactions, feedback and dead-letter topics. Code outside this package sends records
through a `Producer`, commits and reads offsets with `commit`, `partitions_of` and
`committed_offsets`, and catches `BrokerError` (and its kinds) where it would catch kafka-python's
errors: `kafka_errors` turns those into streams' own (streams/errors.py). Importing this package
does not import Kafka.
"""

from streams.clients import admin, connection_config, consumer, producer
from streams.errors import (
    BrokerError,
    BrokersUnreachable,
    BrokerTimeout,
    RecordTooLarge,
    StreamsError,
    broker_error,
    kafka_errors,
)
from streams.offsets import commit, committed_offsets, partitions_of
from streams.producing import Delivery, Producer
from streams.topics import ensure_topics

__all__ = [
    "BrokerError",
    "BrokerTimeout",
    "BrokersUnreachable",
    "Delivery",
    "Producer",
    "RecordTooLarge",
    "StreamsError",
    "admin",
    "broker_error",
    "commit",
    "committed_offsets",
    "connection_config",
    "consumer",
    "ensure_topics",
    "kafka_errors",
    "partitions_of",
    "producer",
]
