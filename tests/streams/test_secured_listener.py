"""The local broker's SASL/SCRAM listener with ACLs (streams/acls.py, services/kafka.py): who can
reach it cannot forge events unless it is the component allowed to write them."""

from __future__ import annotations

import uuid

import pytest
from helpers import send_as
from kafka.errors import GroupAuthorizationFailedError, TopicAuthorizationFailedError
from pydantic import SecretStr

import streams
from schemas.settings import Settings
from services.kafka import Kafka
from streams.acls import GATEWAY, LABELER

pytestmark = pytest.mark.integration

SHORT = {"bootstrap_timeout_ms": 5_000}


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
        send_as(anonymous, topic)

    # A known principal with the wrong password: authentication fails.
    wrong = broker.secured(GATEWAY).model_copy(update={"sasl_password": SecretStr("not-" + uuid.uuid4().hex)})
    with pytest.raises((streams.BrokersUnreachable, streams.BrokerError)):
        send_as(wrong, topic)

    # The labeler's principal may read events but not write them.
    with pytest.raises(TopicAuthorizationFailedError):
        send_as(broker.secured(LABELER), topic)

    # The gateway's principal writes them, and may not read them.
    send_as(broker.secured(GATEWAY), topic)
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
