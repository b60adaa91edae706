"""The Kafka client factory against the session's real broker (produce/consume, committed offsets
outlive a consumer, the loop's topics), and the connection settings it hands every client."""

from __future__ import annotations

import time
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
    assert plain == {
        "bootstrap_servers": ["a:9092", "b:9092"],
        "security_protocol": "PLAINTEXT",
        "reconnect_backoff_max_ms": 2000,
        "bootstrap_timeout_ms": 10_000,
    }
    secure = KafkaSettings(
        bootstrap_servers="broker:9093",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-256",
        sasl_username="rtrl",
        sasl_password=SecretStr("pw"),
        ssl_cafile=Path("/ca.pem"),
        ssl_certfile=Path("/client.pem"),
        ssl_keyfile=Path("/client.key"),
    )
    assert streams.connection_config(secure) == {
        "bootstrap_servers": ["broker:9093"],
        "security_protocol": "SASL_SSL",
        "reconnect_backoff_max_ms": 2000,
        "bootstrap_timeout_ms": 10_000,
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "rtrl",
        "sasl_plain_password": "pw",
        "ssl_cafile": "/ca.pem",
        "ssl_certfile": "/client.pem",
        "ssl_keyfile": "/client.key",
    }


def test_ensure_topics_creates_what_is_missing_once(kafka_service: Settings) -> None:
    kafka = fresh_topics(kafka_service, partitions=2).kafka
    assert sorted(streams.ensure_topics(kafka)) == sorted(
        [kafka.interactions_topic, kafka.feedback_topic, kafka.dlq_topic]
    )
    assert streams.ensure_topics(kafka) == []


def test_more_replicas_than_brokers_is_one_clear_error(kafka_service: Settings) -> None:
    kafka = fresh_topics(kafka_service).kafka.model_copy(update={"replication_factor": 3})
    with pytest.raises(TopicsRefused, match="replication factor 3 .* set RTRL_KAFKA__REPLICATION_FACTOR"):
        streams.ensure_topics(kafka)


def test_rtrl_topics_exist_with_configured_partitions(kafka_service: Settings) -> None:
    kafka = kafka_service.kafka
    admin = streams.admin(kafka, "rtrl-tests")
    try:
        described = {
            t["name"]: t
            for t in admin.describe_topics([kafka.interactions_topic, kafka.feedback_topic, kafka.dlq_topic])
        }
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


def _poll_until_assigned(
    consumer: KafkaConsumer, partitions: set[TopicPartition], polls: int
) -> set[TopicPartition]:
    """Poll as a consumer busy between polls may: non-blocking polls 100 ms apart, so that every
    group join outlives the poll that starts it and finishes between two (streams/joins.py).
    Returns the assignment once it is `partitions`, or the last one seen."""
    for _ in range(polls):
        consumer.poll(timeout_ms=0)
        if consumer.assignment() == partitions:
            break
        time.sleep(0.1)
    return set(consumer.assignment())


def _join(consumer: KafkaConsumer, timeout_s: float = 30) -> set[TopicPartition]:
    """Poll with 200 ms polls, in which a join finishes, until the consumer has partitions (or the
    timeout passes); returns its assignment."""
    deadline = time.monotonic() + timeout_s
    while not consumer.assignment() and time.monotonic() < deadline:
        consumer.poll(timeout_ms=200)
    return set(consumer.assignment())


def _members(kafka: KafkaSettings, group: str) -> list[str]:
    admin = streams.admin(kafka, "rtrl-tests")
    try:
        described = admin.describe_groups([group])[group]
    finally:
        admin.close()
    return sorted(member["member_id"] for member in described["members"])


def test_a_consumer_whose_short_polls_are_spaced_by_work_joins_its_group(kafka_service: Settings) -> None:
    # Unfixed, every poll replaced the join that had finished since the last one with a new
    # JoinGroup: never joined in 100 polls. (Fixed, it joins in a few; the polls leave room for a
    # broker's group.initial.rebalance.delay.ms, 0 in rtrl's and 3 s by default.)
    topic = _topic(kafka_service.kafka, partitions=3)
    consumer = streams.consumer(
        kafka_service.kafka, "rtrl-tests", topic, group_id=f"g-{uuid.uuid4().hex[:6]}"
    )
    every = {TopicPartition(topic, p) for p in range(3)}
    try:
        assert _poll_until_assigned(consumer, every, polls=100) == every
    finally:
        consumer.close()


def test_a_leader_whose_rejoin_finishes_between_polls_applies_it_and_stays_in_the_group(
    kafka_service: Settings,
) -> None:
    # A new partition makes the leader rejoin; it assigns inside the join, so unfixed its next
    # poll saw nothing to do: the new assignment was never applied, heartbeats stayed off and the
    # broker dropped the member after its session timeout.
    kafka = kafka_service.kafka
    topic, group = _topic(kafka, partitions=1), f"g-{uuid.uuid4().hex[:6]}"
    consumer = streams.consumer(
        kafka,
        "rtrl-tests",
        topic,
        group_id=group,
        metadata_max_age_ms=500,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
    )
    try:
        assert _join(consumer) == {TopicPartition(topic, 0)}
        admin = streams.admin(kafka, "rtrl-tests")
        try:
            admin.create_partitions({topic: 2})
        finally:
            admin.close()
        both = {TopicPartition(topic, 0), TopicPartition(topic, 1)}
        assert _poll_until_assigned(consumer, both, polls=100) == both
        members = _members(kafka, group)
        deadline = time.monotonic() + 9  # past the 6 s session timeout: heartbeats must be on
        while time.monotonic() < deadline:
            consumer.poll(timeout_ms=100)
        assert len(members) == 1 and _members(kafka, group) == members
        assert consumer.assignment() == both
    finally:
        consumer.close()


def test_a_join_that_finished_before_its_consumer_left_the_group_is_not_applied(
    kafka_service: Settings,
) -> None:
    # A join finishes between two polls, then unsubscribe() leaves the group before any poll
    # applies it: its assignment belongs to a generation the consumer has left. Applied anyway, it
    # raised from the next poll (the generation it left has no protocol).
    topic = _topic(kafka_service.kafka, partitions=1)
    consumer = streams.consumer(
        kafka_service.kafka, "rtrl-tests", topic, group_id=f"g-{uuid.uuid4().hex[:6]}"
    )
    coordinator = consumer._coordinator  # the join task is kafka-python's own state (streams/joins.py)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            consumer.poll(timeout_ms=0)  # starts a join, or a new one after a failed attempt
            time.sleep(0.3)
            if coordinator._join_task is not None and coordinator._join_task.succeeded():
                break
        assert coordinator._join_task is not None and coordinator._join_task.succeeded(), (
            "no join finished unapplied"
        )
        consumer.unsubscribe()
        consumer.subscribe([topic])
        assert _poll_until_assigned(consumer, {TopicPartition(topic, 0)}, polls=100) == {
            TopicPartition(topic, 0)
        }
    finally:
        consumer.close()


def test_a_join_that_failed_between_polls_raises_its_error_from_the_next_poll(
    kafka_service: Settings,
) -> None:
    # A member whose only assignor the group's member does not support is refused by the broker
    # (INCONSISTENT_GROUP_PROTOCOL, not retriable). With polls that return before the JoinGroup
    # answer, the join fails between two polls: the next poll raises its error, where dropping it
    # would send the same refused JoinGroup on every poll for good.
    from kafka import errors
    from kafka.coordinator.assignors.range import RangePartitionAssignor
    from kafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor

    kafka = kafka_service.kafka
    topic, group = _topic(kafka, partitions=1), f"g-{uuid.uuid4().hex[:6]}"
    member = streams.consumer(
        kafka, "rtrl-tests", topic, group_id=group, partition_assignment_strategy=[RangePartitionAssignor]
    )
    other = streams.consumer(
        kafka,
        "rtrl-tests",
        topic,
        group_id=group,
        partition_assignment_strategy=[RoundRobinPartitionAssignor],
    )
    coordinator = other._coordinator  # the join task is kafka-python's own state (streams/joins.py)
    try:
        assert _join(member) == {TopicPartition(topic, 0)}
        failed_between_polls = False
        with pytest.raises(errors.InconsistentGroupProtocolError):
            for _ in range(100):
                task = coordinator._join_task
                failed_between_polls = task is not None and task.is_done and task.failed()
                other.poll(timeout_ms=0)
                time.sleep(0.3)
        assert failed_between_polls, "the refused join was not seen failed before the poll that raised"
        assert member.assignment() == {TopicPartition(topic, 0)}  # the group's member is unaffected
    finally:
        other.close()
        member.close()


@pytest.mark.unit
def test_the_join_fix_is_written_for_the_pinned_kafka_python() -> None:
    import kafka

    from streams.joins import FIXED_VERSION, fix_join_race

    assert kafka.__version__ == FIXED_VERSION, "re-check streams/joins.py against this kafka-python"
    assert fix_join_race() is True
