"""Kafka for every rtrl process: the one client factory and the loop's topics.

`producer`, `consumer` and `admin` build kafka-python clients that carry the connection and
security settings of ``settings.kafka`` (security protocol, SASL, TLS files); `ensure_topics`
creates the interactions, feedback and dead-letter topics. Importing this package does not
import Kafka.
"""

from streams.clients import BrokersUnreachable, StreamsError, admin, connection_config, consumer, producer
from streams.topics import ensure_topics

__all__ = ["BrokersUnreachable", "StreamsError", "admin", "connection_config", "consumer", "ensure_topics", "producer"]
