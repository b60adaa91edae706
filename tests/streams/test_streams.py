"""The Kafka client factory against the session's real broker (produce/consume, committed offsets
outlive a consumer, the loop's topics), and the connection settings it hands every client."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from factories import fresh_topics
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from pydantic import SecretStr

import streams
from schemas.settings import KafkaSettings, Settings
from streams.topics import TopicsRefused

pytestmark = pytest.mark.integration


def _topic(kafka: KafkaSettings, partitions: int = 1) -> str:
    name = f"test.streams.{uuid.uuid4().hex[:8]}"
    admin = streams.admin(kafka, "rtrl-tests")
    try:
        admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        admin.close()
    return name


def _consumer(kafka: KafkaSettings, topic: str, group: str) -> KafkaConsumer:
    consumer: KafkaConsumer = streams.consumer(
        kafka, "rtrl-tests", topic, group_id=group, auto_offset_reset="earliest", consumer_timeout_ms=15_000
    )
    return consumer


def _produce(kafka: KafkaSettings, topic: str, values: list[bytes]) -> None:
    producer = streams.producer(kafka, "rtrl-tests")
    try:
        for i, value in enumerate(values):
            producer.send(topic, key=f"k{i}".encode(), value=value).get(timeout=30)
    finally:
        producer.close()


@pytest.mark.unit
def test_every_client_gets_the_connection_and_security_settings() -> None:
    plain = streams.connection_config(KafkaSettings(bootstrap_servers="a:9092, b:9092"))
    assert plain == {"bootstrap_servers": ["a:9092", "b:9092"], "security_protocol": "PLAINTEXT",
                     "reconnect_backoff_max_ms": 2000}  # fmt: skip
    secure = KafkaSettings(
        bootstrap_servers="broker:9093", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256",
        sasl_username="rtrl", sasl_password=SecretStr("pw"), ssl_cafile=Path("/ca.pem"),
        ssl_certfile=Path("/client.pem"), ssl_keyfile=Path("/client.key"),
    )  # fmt: skip
    assert streams.connection_config(secure) == {
        "bootstrap_servers": ["broker:9093"], "security_protocol": "SASL_SSL", "reconnect_backoff_max_ms": 2000,
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "rtrl", "sasl_plain_password": "pw", "ssl_cafile": "/ca.pem",
        "ssl_certfile": "/client.pem", "ssl_keyfile": "/client.key",
    }  # fmt: skip


def test_ensure_topics_creates_what_is_missing_once(kafka_service: Settings) -> None:
    kafka = fresh_topics(kafka_service, partitions=2).kafka
    assert sorted(streams.ensure_topics(kafka)) == sorted([kafka.interactions_topic, kafka.feedback_topic, kafka.dlq_topic])
    assert streams.ensure_topics(kafka) == []


def test_more_replicas_than_brokers_is_one_clear_error(kafka_service: Settings) -> None:
    kafka = fresh_topics(kafka_service).kafka.model_copy(update={"replication_factor": 3})
    with pytest.raises(TopicsRefused, match="replication factor 3 .* set RTRL_KAFKA__REPLICATION_FACTOR"):
        streams.ensure_topics(kafka)


def test_rtrl_topics_exist_with_configured_partitions(kafka_service: Settings) -> None:
    kafka = kafka_service.kafka
    admin = streams.admin(kafka, "rtrl-tests")
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
