"""streams' own errors, producer, offsets and partitions without a broker: kafka-python's errors
become streams' (reading as the originals), and offsets go to and from kafka-python's types."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from kafka import errors
from kafka.future import Future
from kafka.structs import OffsetAndMetadata, TopicPartition

import streams
from schemas.settings import KafkaSettings
from streams.clients import _create

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("raised", "kind"),
    [
        (errors.MessageSizeTooLargeError("too big"), streams.RecordTooLarge),
        (errors.RecordListTooLargeError("batch too big"), streams.RecordTooLarge),
        (errors.KafkaTimeoutError("no metadata in 1000 ms"), streams.BrokerTimeout),
        (errors.CommitFailedError("rebalanced"), streams.BrokerError),
    ],
)
def test_a_kafka_error_becomes_its_streams_error_and_reads_as_it(raised: Exception, kind: type) -> None:
    translated = streams.broker_error(raised)
    assert type(translated) is kind and isinstance(translated, streams.StreamsError)
    assert str(translated) == str(raised) and repr(translated) == repr(raised)  # logs and reasons unchanged
    assert translated.cause is raised  # type: ignore[attr-defined]


def test_retriable_is_kafkas_word() -> None:
    assert streams.broker_error(errors.CoordinatorLoadInProgressError()).retriable is True  # type: ignore[attr-defined]
    assert streams.broker_error(errors.GroupAuthorizationFailedError()).retriable is False  # type: ignore[attr-defined]


def test_other_errors_pass_through_unchanged() -> None:
    error = AssertionError("producer closed")
    assert streams.broker_error(error) is error
    with pytest.raises(AssertionError) as caught, streams.kafka_errors():
        raise error
    assert caught.value is error


def test_kafka_errors_raises_the_streams_error_from_the_original() -> None:
    original = errors.KafkaConnectionError("111 ECONNREFUSED")
    with pytest.raises(streams.BrokerError) as caught, streams.kafka_errors():
        raise original
    assert (
        caught.value.__cause__ is original
        and repr(caught.value) == "KafkaConnectionError('111 ECONNREFUSED')"
    )


def test_creating_a_client_turns_unreachable_brokers_and_other_kafka_errors_into_streams_errors() -> None:
    kafka = KafkaSettings(bootstrap_servers="broker-a:9092")

    def factory(error: Exception, **config: Any) -> Any:
        assert config["bootstrap_servers"] == ["broker-a:9092"]  # the connection settings come along
        raise error

    with pytest.raises(streams.BrokersUnreachable, match="cannot reach Kafka at broker-a:9092 .*refused"):
        _create(kafka, factory, errors.KafkaConnectionError("connection refused"))
    with pytest.raises(streams.BrokerError, match="bad option"):
        _create(kafka, factory, errors.KafkaConfigurationError("bad option"))


class FakeClient:
    """What `streams.Producer` calls on a kafka-python producer."""

    def __init__(self, send_error: Exception | None = None, close_error: Exception | None = None) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.send_error = send_error
        self.close_error = close_error
        self.future = Future()
        self.closed: list[float | None] = []
        self._sender = FakeSender()

    def send(self, topic: str, **kwargs: Any) -> Future:
        if self.send_error is not None:
            raise self.send_error
        self.sent.append((topic, kwargs))
        return self.future

    def flush(self, timeout: float) -> None:
        raise errors.KafkaTimeoutError(f"flush not done in {timeout}s")

    def close(self, timeout: float | None = None) -> None:
        self.closed.append(timeout)
        if self.close_error is not None:
            raise self.close_error


class FakeSender:
    def __init__(self) -> None:
        self.forced = False

    def is_alive(self) -> bool:
        return not self.forced

    def force_close(self) -> None:
        self.forced = True

    def join(self, timeout: float) -> None:
        pass


def test_a_producer_sends_the_schema_header_and_hands_errbacks_streams_errors() -> None:
    client = FakeClient()
    delivery = streams.Producer(client).send(
        "rtrl.dlq.v1", key=b"k", value=b"{}", schema="rtrl.dead_letter.v1"
    )
    assert client.sent == [
        ("rtrl.dlq.v1", {"key": b"k", "value": b"{}", "headers": [("schema", b"rtrl.dead_letter.v1")]})
    ]
    acked: list[tuple[int, object]] = []
    failed: list[tuple[int, BaseException]] = []
    delivery.add_callback(lambda ticket, metadata: acked.append((ticket, metadata)), 7)
    delivery.add_errback(lambda ticket, exc: failed.append((ticket, exc)), 7)
    refused = errors.MessageSizeTooLargeError("over max.message.bytes")
    client.future.failure(refused)
    assert acked == [] and len(failed) == 1
    ticket, error = failed[0]
    assert ticket == 7 and isinstance(error, streams.RecordTooLarge) and repr(error) == repr(refused)


class Unanswered:
    """A record's future whose wait runs out (kafka-python's FutureRecordMetadata.get)."""

    def get(self, timeout: float) -> Any:
        raise errors.KafkaTimeoutError(f"Timeout after waiting for {timeout} secs.")


def test_waiting_for_a_delivery_raises_its_streams_error() -> None:
    with pytest.raises(streams.BrokerTimeout, match="Timeout after waiting for 1.5 secs"):
        streams.Delivery(Unanswered()).get(timeout=1.5)


def test_a_producer_raises_streams_errors_from_send_and_flush() -> None:
    too_big = streams.Producer(FakeClient(send_error=errors.MessageSizeTooLargeError("1 MB")))
    with pytest.raises(streams.RecordTooLarge):
        too_big.send("t", key=b"k", value=b"v", schema="s")
    blocked = streams.Producer(FakeClient(send_error=errors.KafkaTimeoutError("no metadata")))
    with pytest.raises(streams.BrokerTimeout):
        blocked.send("t", key=b"k", value=b"v", schema="s")
    with pytest.raises(streams.BrokerTimeout, match="flush not done in 2.0s"):
        streams.Producer(FakeClient()).flush(timeout=2.0)


def test_close_now_forces_a_producer_whose_close_raises_and_never_raises() -> None:
    calm = FakeClient()
    streams.Producer(calm).close_now()
    assert calm.closed == [0] and not calm._sender.forced
    stuck = FakeClient(close_error=errors.KafkaTimeoutError("records pending"))
    streams.Producer(stuck).close_now()
    assert stuck.closed == [0] and stuck._sender.forced


class FakeConsumer:
    def __init__(self, partitions: dict[str, set[int]], commit_error: Exception | None = None) -> None:
        self.partitions = partitions
        self.commit_error = commit_error
        self.committed: list[dict[Any, Any]] = []

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return self.partitions.get(topic)

    def commit(self, offsets: dict[Any, Any]) -> None:
        if self.commit_error is not None:
            raise self.commit_error
        self.committed.append(offsets)


def test_partitions_of_a_topic_in_order_and_none_of_an_unknown_one() -> None:
    consumer = FakeConsumer({"rtrl.interactions.v1": {2, 0, 1}})
    found = streams.partitions_of(consumer, "rtrl.interactions.v1")
    assert found == [TopicPartition("rtrl.interactions.v1", p) for p in (0, 1, 2)]
    assert [(tp.topic, tp.partition) for tp in found] == [
        ("rtrl.interactions.v1", 0),
        ("rtrl.interactions.v1", 1),
        ("rtrl.interactions.v1", 2),
    ]
    assert streams.partitions_of(consumer, "missing") == []


def test_commit_builds_kafkas_offsets_from_plain_keys_and_raises_a_broker_error() -> None:
    consumer = FakeConsumer({})
    streams.commit(consumer, {("a", 0): 5, TopicPartition("b", 1): 9})
    assert consumer.committed == [
        {
            TopicPartition("a", 0): OffsetAndMetadata(5, "", -1),
            TopicPartition("b", 1): OffsetAndMetadata(9, "", -1),
        }
    ]
    failing = FakeConsumer({}, commit_error=errors.CommitFailedError("the group rebalanced"))
    with pytest.raises(streams.BrokerError, match="the group rebalanced"):
        streams.commit(failing, {("a", 0): 5})


class FakeAdmin:
    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)

    def list_group_offsets(self, groups: dict[str, None]) -> dict[str, dict[Any, Any]]:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return {group: answer for group in groups}


def test_committed_offsets_by_plain_keys() -> None:
    admin = FakeAdmin(
        {
            TopicPartition("a", 0): OffsetAndMetadata(12, "", -1),
            TopicPartition("a", 1): OffsetAndMetadata(-1, "", -1),
        }
    )
    assert streams.committed_offsets(admin, "labelers") == {("a", 0): 12, ("a", 1): -1}


def test_committed_offsets_raise_a_broker_error_that_cannot_succeed_at_once() -> None:
    admin = FakeAdmin(errors.GroupAuthorizationFailedError("not allowed"), {})
    with pytest.raises(streams.BrokerError, match="not allowed") as caught:
        streams.committed_offsets(admin, "labelers")
    assert not caught.value.retriable and len(admin.answers) == 1


def test_committed_offsets_raise_the_last_retriable_error_after_the_timeout() -> None:
    loading = errors.CoordinatorLoadInProgressError("loading")
    with pytest.raises(streams.BrokerError) as caught:
        streams.committed_offsets(FakeAdmin(loading), "labelers", timeout_s=0.0)
    assert caught.value.retriable and caught.value.__cause__ is loading


def test_importing_streams_does_not_import_kafka() -> None:
    code = "import sys, streams; print('kafka' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
