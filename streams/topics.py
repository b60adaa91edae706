"""The loop's Kafka topics: created explicitly (rtrl's brokers do not auto-create them).

One implementation, used by the labeler at start-up, by ``rtrl run`` / the demo before the loop
starts, and by ``rtrl services up`` once the local broker is healthy.
"""

from __future__ import annotations

from schemas.errors import OperatorError
from schemas.settings import KafkaSettings
from streams.clients import admin
from streams.errors import StreamsError


class TopicsRefused(StreamsError, OperatorError):
    """The brokers refused to create a topic as configured (say, more replicas than brokers)."""


def ensure_topics(kafka: KafkaSettings) -> list[str]:
    """Create the interactions, feedback and dead-letter topics that do not exist, with
    ``kafka.partitions``, ``kafka.replication_factor`` and ``kafka.min_insync_replicas``, taking
    records of ``kafka.max_message_bytes`` whatever the broker's default; returns those created.
    Topics that exist are left as they are."""
    from kafka.admin import NewTopic
    from kafka.errors import InvalidReplicationFactorError, TopicAlreadyExistsError

    client = admin(kafka, "rtrl-topics")
    created: list[str] = []
    try:
        existing = set(client.list_topics())
        for topic in (kafka.interactions_topic, kafka.feedback_topic, kafka.dlq_topic):
            if topic in existing:
                continue
            config = {"max.message.bytes": str(kafka.max_message_bytes)}
            if kafka.min_insync_replicas is not None:
                config["min.insync.replicas"] = str(kafka.min_insync_replicas)
            try:
                client.create_topics(
                    [NewTopic(topic, kafka.partitions, kafka.replication_factor, topic_configs=config)]
                )
                created.append(topic)
            except TopicAlreadyExistsError:
                pass  # another process created it meanwhile
            except InvalidReplicationFactorError as exc:
                raise TopicsRefused(
                    f"cannot create {topic} with replication factor {kafka.replication_factor} ({exc}): the cluster "
                    "has fewer brokers; set RTRL_KAFKA__REPLICATION_FACTOR to at most its broker count"
                ) from exc
    finally:
        client.close()
    return created
