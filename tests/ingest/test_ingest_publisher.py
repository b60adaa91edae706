"""The gateway's publisher without a broker: what Kafka can never take is dead-lettered at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.metrics import GatewayMetrics
from ingest.publisher import Publisher
from ingest.spool import OVERFLOW_FILE
from schemas.events import DeadLetterRecord
from schemas.settings import GatewaySettings, KafkaSettings, Settings

pytestmark = pytest.mark.unit


def publisher(tmp_path: Path, max_message_bytes: int) -> tuple[Publisher, GatewayMetrics]:
    settings = Settings(
        kafka=KafkaSettings(max_message_bytes=max_message_bytes),
        gateway=GatewaySettings(spool_dir=tmp_path / "spool"),
    )
    metrics = GatewayMetrics()
    return Publisher(settings, metrics, connect=lambda: None), metrics


def test_a_record_over_the_kafka_limit_is_dead_lettered_not_spooled(tmp_path: Path) -> None:
    pub, metrics = publisher(tmp_path, max_message_bytes=64 * 1024)
    pub.publish("rtrl.interactions.v1", "req-big", "x" * (64 * 1024), "rtrl.interaction.v1", "ev-big")
    pub.publish("rtrl.interactions.v1", "req-small", "{}", "rtrl.interaction.v1", "ev-small")
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
    assert pub.spool.size_bytes == 0  # nothing that would block a replay
    assert pub.in_flight == 0 and pub.in_flight_age_s == 0.0 and not pub.connected


def test_the_kafka_limit_holds_a_whole_event() -> None:
    from schemas.events import MAX_EVENT_BYTES

    assert KafkaSettings().max_message_bytes > MAX_EVENT_BYTES + 64 * 1024
    with pytest.raises(ValueError, match="greater than or equal"):
        KafkaSettings(max_message_bytes=1000)
