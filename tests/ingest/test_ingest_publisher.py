"""The gateway's publisher without a broker (or with a fake one): what Kafka can never take is
dead-lettered at once, a confirmed record resolves once it is on Kafka or in the spool, and the
caller's thread (the event loop) never writes to disk."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kafka.future import Future as KafkaFuture

import streams
from ingest import publisher as module
from ingest.metrics import GatewayMetrics
from ingest.publisher import NotDurable, Publisher
from ingest.spool import OVERFLOW_FILE, Spool
from schemas.events import DeadLetterRecord
from schemas.settings import GatewaySettings, KafkaSettings, Settings

pytestmark = pytest.mark.unit

TOPIC = "rtrl.feedback.v1"


def publisher(
    tmp_path: Path,
    max_message_bytes: int = 1024 * 1024,
    connect: Callable[[], streams.Producer | None] = lambda: None,
    **gateway: Any,
) -> tuple[Publisher, GatewayMetrics]:
    settings = Settings(
        kafka=KafkaSettings(max_message_bytes=max_message_bytes),
        gateway=GatewaySettings(spool_dir=tmp_path / "spool", **gateway),
    )
    metrics = GatewayMetrics()
    return Publisher(settings, metrics, replay_interval_s=0.05, connect=connect), metrics


def count(metrics: GatewayMetrics, outcome: str, topic: str = TOPIC) -> float:
    sample = metrics.registry.get_sample_value
    return sample("rtrl_gateway_publish_total", {"topic": topic, "outcome": outcome}) or 0.0


class FakeClient:
    """A kafka-python producer's stand-in: acknowledges every record at once, or never."""

    def __init__(self, acknowledge: bool) -> None:
        self.acknowledge = acknowledge
        self.sent: list[bytes] = []

    def send(self, topic: str, key: bytes, value: bytes, headers: object) -> KafkaFuture:
        self.sent.append(key)
        future = KafkaFuture()
        if self.acknowledge:
            future.success({"topic": topic})
        return future

    def flush(self, timeout: float) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        pass


def test_a_record_over_the_kafka_limit_is_dead_lettered_not_spooled(tmp_path: Path) -> None:
    pub, metrics = publisher(tmp_path, max_message_bytes=64 * 1024)
    pub.start()
    big = pub.publish_confirmed(
        "rtrl.interactions.v1", "req-big", "x" * (64 * 1024), "rtrl.interaction.v1", "ev-big"
    )
    pub.publish("rtrl.interactions.v1", "req-small", "{}", "rtrl.interaction.v1", "ev-small")
    with pytest.raises(NotDurable, match="kafka will never take this record"):
        big.result(timeout=10)
    pub.close()
    lines = (tmp_path / "spool" / OVERFLOW_FILE).read_text().splitlines()
    assert len(lines) == 1
    dead = DeadLetterRecord.model_validate_json(lines[0])
    assert dead.original_event_id == "ev-big" and "over kafka.max_message_bytes 65536" in dead.reason
    assert '"key":"req-big"' in dead.payload  # the whole spool record, to requeue by hand
    sample = metrics.registry.get_sample_value
    assert (
        sample("rtrl_gateway_publish_total", {"topic": "rtrl.interactions.v1", "outcome": "undeliverable"})
        == 1
    )
    assert pub.spool.size_bytes == len(pub.spool.read(pub.spool.sealed_segments()[0]).records[0].to_line())
    assert pub.in_flight == 0 and pub.in_flight_age_s == 0.0 and not pub.connected


def test_a_confirmed_record_resolves_when_kafka_acknowledges_it(tmp_path: Path) -> None:
    client = FakeClient(acknowledge=True)
    pub, metrics = publisher(tmp_path, connect=lambda: streams.Producer(client))
    pub.start()
    try:
        assert (
            pub.publish_confirmed(TOPIC, "req-1", "{}", "rtrl.feedback.v1", "ev-1").result(timeout=10)
            == "kafka"
        )
    finally:
        pub.close()
    assert client.sent == [b"req-1"] and count(metrics, "ok") == 1 and pub.spool.empty()


def test_a_confirmed_record_resolves_once_fsynced_in_the_spool(tmp_path: Path) -> None:
    pub, metrics = publisher(tmp_path)  # no broker
    pub.start()
    try:
        done = pub.publish_confirmed(TOPIC, "req-1", "{}", "rtrl.feedback.v1", "ev-1")
        assert done.result(timeout=10) == "spooled"
        assert count(metrics, "spooled") == 1 and pub.spool.size_bytes > 0
    finally:
        pub.close()


def test_a_record_kafka_never_acknowledges_is_confirmed_by_the_spool_in_time(tmp_path: Path) -> None:
    pub, metrics = publisher(
        tmp_path, connect=lambda: streams.Producer(FakeClient(acknowledge=False)), publish_timeout_s=0.2
    )
    pub.start()
    try:
        done = pub.publish_confirmed(TOPIC, "req-1", "{}", "rtrl.feedback.v1", "ev-1")
        assert done.result(timeout=pub.confirm_within_s + 2) == "spooled"  # by the watchdog
    finally:
        pub.close()
    assert count(metrics, "spooled") == 1


@pytest.mark.parametrize(("overflow_max_bytes", "outcome"), [(1024 * 1024, "overflow"), (0, "dropped")])
def test_a_confirmed_record_the_spool_refuses_fails(
    tmp_path: Path, overflow_max_bytes: int, outcome: str
) -> None:
    pub, metrics = publisher(tmp_path, spool_max_bytes=10, overflow_max_bytes=overflow_max_bytes)
    pub.start()
    try:
        done = pub.publish_confirmed(TOPIC, "req-1", "{}", "rtrl.feedback.v1", "ev-1")
        with pytest.raises(NotDurable, match="spool"):
            done.result(timeout=10)
    finally:
        pub.close()
    assert count(metrics, outcome) == 1 and count(metrics, "spooled") == 0
    sample = metrics.registry.get_sample_value
    assert sample("rtrl_gateway_spool_max_bytes") == 10
    assert sample("rtrl_gateway_overflow_max_bytes") == overflow_max_bytes
    assert sample("rtrl_gateway_overflow_bytes") == pub.spool.overflow_bytes
    assert (pub.spool.overflow_bytes > 0) is (outcome == "overflow")


def test_publish_never_writes_on_the_callers_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both queues full: the next record is dropped and its confirmation fails at once; every
    write ran on the disk thread, none on the caller's (the event loop's)."""
    monkeypatch.setattr(module, "QUEUE_SIZE", 2)
    connecting, disk_busy, disk_may_go = threading.Event(), threading.Event(), threading.Event()
    writers: list[str] = []
    append_many = Spool.append_many

    def slow_append_many(self: Spool, records: Any) -> Any:
        writers.append(threading.current_thread().name)
        disk_busy.set()
        disk_may_go.wait(timeout=10)
        return append_many(self, records)

    monkeypatch.setattr(Spool, "append_many", slow_append_many)

    def connect() -> None:  # the sender waits for the first connection attempt
        connecting.wait(timeout=10)

    pub, metrics = publisher(tmp_path, connect=connect)
    pub.start()
    try:
        futures = [
            pub.publish_confirmed(TOPIC, f"req-{i}", "{}", "rtrl.feedback.v1", f"ev-{i}") for i in range(3)
        ]
        assert disk_busy.wait(timeout=10)  # req-2 (the queue holds two) is being written
        futures += [
            pub.publish_confirmed(TOPIC, f"req-{i}", "{}", "rtrl.feedback.v1", f"ev-{i}") for i in range(3, 6)
        ]
        with pytest.raises(NotDurable, match="overloaded"):
            futures[5].result(timeout=0)  # both queues full: refused at once, nothing written
        disk_may_go.set()
        connecting.set()
        assert [f.result(timeout=10) for f in futures[:5]] == ["spooled"] * 5
    finally:
        disk_may_go.set()
        connecting.set()
        pub.close()
    assert set(writers) == {"rtrl-publisher-disk"}
    assert count(metrics, "spooled") == 5 and count(metrics, "dropped") == 1


def test_the_kafka_limit_holds_a_whole_event() -> None:
    from schemas.events import MAX_EVENT_BYTES

    assert KafkaSettings().max_message_bytes > MAX_EVENT_BYTES + 64 * 1024
    with pytest.raises(ValueError, match="greater than or equal"):
        KafkaSettings(max_message_bytes=1000)
