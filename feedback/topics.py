"""The loop's Kafka topics: created explicitly (the broker does not auto-create them).

One implementation, used by the labeler at start-up, by ``rtrl run`` / the demo before the loop
starts, and by ``rtrl services up`` once the local broker is healthy.
"""

from __future__ import annotations

from schemas.settings import KafkaSettings


def ensure_topics(kafka: KafkaSettings, replication_factor: int = 1) -> list[str]:
    """Create the interactions, feedback and dead-letter topics that do not exist; returns those created."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers.split(","), client_id="rtrl-topics")
    created: list[str] = []
    try:
        existing = set(admin.list_topics())
        for topic in (kafka.interactions_topic, kafka.feedback_topic, kafka.dlq_topic):
            if topic in existing:
                continue
            try:
                admin.create_topics([NewTopic(topic, kafka.partitions, replication_factor)])
                created.append(topic)
            except TopicAlreadyExistsError:
                pass  # another process created it meanwhile
    finally:
        admin.close()
    return created
