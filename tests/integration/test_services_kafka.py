"""The local Kafka broker is a real Kafka: produce/consume, and committed offsets outlive a consumer."""

from __future__ import annotations

import uuid

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from schemas.settings import KafkaSettings, Settings

pytestmark = pytest.mark.integration


def _topic(kafka: KafkaSettings, partitions: int = 1) -> str:
    name = f"test.services.{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    try:
        admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        admin.close()
    return name


def _consumer(kafka: KafkaSettings, topic: str, group: str) -> KafkaConsumer:
    return KafkaConsumer(
        topic,
        bootstrap_servers=kafka.bootstrap_servers,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=15_000,
    )


def _produce(kafka: KafkaSettings, topic: str, values: list[bytes]) -> None:
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all")
    try:
        for i, value in enumerate(values):
            producer.send(topic, key=f"k{i}".encode(), value=value).get(timeout=30)
    finally:
        producer.close()


def test_rtrl_topics_exist_with_configured_partitions(kafka_service: Settings) -> None:
    kafka = kafka_service.kafka
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    try:
        described = {t["name"]: t for t in admin.describe_topics(
            [kafka.interactions_topic, kafka.feedback_topic, kafka.dlq_topic])}
    finally:
        admin.close()
    assert set(described) == {kafka.interactions_topic, kafka.feedback_topic, kafka.dlq_topic}
    for topic in described.values():
        assert topic["error_code"] == 0
        assert len(topic["partitions"]) == kafka.partitions


def test_produce_then_consume_in_order(kafka_service: Settings) -> None:
    topic = _topic(kafka_service.kafka)
    values = [f"event-{i}".encode() for i in range(5)]
    _produce(kafka_service.kafka, topic, values)

    consumer = _consumer(kafka_service.kafka, topic, group=f"g-{uuid.uuid4().hex[:6]}")
    try:
        got = [record.value for _, record in zip(range(len(values)), consumer, strict=False)]
    finally:
        consumer.close()
    assert got == values


def test_committed_offsets_survive_a_consumer_restart(kafka_service: Settings) -> None:
    topic = _topic(kafka_service.kafka)
    group = f"g-{uuid.uuid4().hex[:6]}"
    _produce(kafka_service.kafka, topic, [f"m{i}".encode() for i in range(6)])

    first = _consumer(kafka_service.kafka, topic, group)
    try:
        seen = [record.value for _, record in zip(range(4), first, strict=False)]
        first.commit()  # synchronous: offset 4 is stored by the group coordinator
    finally:
        first.close()
    assert seen == [b"m0", b"m1", b"m2", b"m3"]

    second = _consumer(kafka_service.kafka, topic, group)
    try:
        rest = [record.value for _, record in zip(range(2), second, strict=False)]
        assert second.committed(TopicPartition(topic, 0)) == 4
    finally:
        second.close()
    assert rest == [b"m4", b"m5"]
