"""The local broker's SASL/SCRAM listener with ACLs (streams/acls.py, services/kafka.py): who can
reach it cannot forge events unless it is the component allowed to write them."""

from __future__ import annotations

import uuid

import pytest
from kafka.errors import GroupAuthorizationFailedError, TopicAuthorizationFailedError
from pydantic import SecretStr

import streams
from schemas.settings import KafkaSettings, Settings
from services.kafka import Kafka
from streams.acls import GATEWAY, LABELER

pytestmark = pytest.mark.integration

SHORT = {"bootstrap_timeout_ms": 5_000}


def _send(kafka: KafkaSettings, topic: str) -> None:
    producer = streams.producer(kafka, "rtrl-tests", max_block_ms=5_000, **SHORT)
    try:
        producer.send(topic, key=b"k", value=b"{}").get(timeout=10)
    finally:
        producer.close(timeout=2)


def test_only_the_gateway_principal_writes_events_and_strangers_are_refused(kafka_service: Settings) -> None:
    broker = Kafka(kafka_service)
    topic = kafka_service.kafka.interactions_topic

    # No credentials on the SASL listener: no connection at all.
    anonymous = broker.secured(GATEWAY).model_copy(
        update={
            "security_protocol": "PLAINTEXT",
            "sasl_mechanism": None,
            "sasl_username": None,
            "sasl_password": None,
        }
    )
    with pytest.raises((streams.BrokersUnreachable, streams.BrokerError)):
        _send(anonymous, topic)

    # A known principal with the wrong password: authentication fails.
    wrong = broker.secured(GATEWAY).model_copy(update={"sasl_password": SecretStr("not-" + uuid.uuid4().hex)})
    with pytest.raises((streams.BrokersUnreachable, streams.BrokerError)):
        _send(wrong, topic)

    # The labeler's principal may read events but not write them.
    with pytest.raises(TopicAuthorizationFailedError):
        _send(broker.secured(LABELER), topic)

    # The gateway's principal writes them, and may not read them.
    _send(broker.secured(GATEWAY), topic)
    reader = streams.consumer(
        broker.secured(GATEWAY), "rtrl-tests", topic, group_id=kafka_service.kafka.labeler_group, **SHORT
    )
    try:
        with pytest.raises((TopicAuthorizationFailedError, GroupAuthorizationFailedError)):
            reader.poll(timeout_ms=5_000)
            reader.poll(timeout_ms=5_000)
    finally:
        reader.close()


def test_the_labeler_principal_reads_events_as_its_group(kafka_service: Settings) -> None:
    broker = Kafka(kafka_service)
    kafka = broker.secured(LABELER)
    reader = streams.consumer(
        kafka,
        "rtrl-tests",
        kafka.feedback_topic,
        group_id=kafka.labeler_group + "-acl-test",
        auto_offset_reset="earliest",
        **SHORT,
    )
    try:
        with pytest.raises(GroupAuthorizationFailedError):
            reader.poll(timeout_ms=5_000)  # another group than its own: refused
            reader.poll(timeout_ms=5_000)
    finally:
        reader.close()
    own = streams.consumer(
        kafka,
        "rtrl-tests",
        kafka.feedback_topic,
        group_id=kafka.labeler_group,
        auto_offset_reset="earliest",
        **SHORT,
    )
    try:
        for _ in range(10):
            own.poll(timeout_ms=1_000)
            if own.assignment():
                break
        assert own.assignment(), "the labeler's principal never joined its group"
    finally:
        own.close()
