"""The loop's Kafka topics: created explicitly (rtrl's brokers do not auto-create them).

One implementation, used by the labeler at start-up, by ``rtrl run`` / the demo before the loop
starts, and by ``rtrl services up`` once the local broker is healthy.
"""

from __future__ import annotations

from schemas.settings import KafkaSettings
from streams.clients import admin


def ensure_topics(kafka: KafkaSettings, replication_factor: int = 1) -> list[str]:
    """Create the interactions, feedback and dead-letter topics that do not exist, taking records of
    ``kafka.max_message_bytes`` whatever the broker's default; returns those created."""
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    client = admin(kafka, "rtrl-topics")
    created: list[str] = []
    try:
        existing = set(client.list_topics())
        for topic in (kafka.interactions_topic, kafka.feedback_topic, kafka.dlq_topic):
            if topic in existing:
                continue
            try:
                config = {"max.message.bytes": str(kafka.max_message_bytes)}
                client.create_topics([NewTopic(topic, kafka.partitions, replication_factor, topic_configs=config)])
                created.append(topic)
            except TopicAlreadyExistsError:
                pass  # another process created it meanwhile
    finally:
        client.close()
    return created
