"""`rtrl simulate` through a real gateway, vLLM server and Kafka broker (the `services` fixture)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from ingest.launch import gateway_process
from schemas.events import FeedbackEvent, InteractionEvent, parse_event
from schemas.settings import Settings, to_env

pytestmark = pytest.mark.integration

N = 6


def end_offsets(consumer: KafkaConsumer, topic: str) -> dict[TopicPartition, int]:
    deadline = time.monotonic() + 30
    while (partitions := consumer.partitions_for_topic(topic)) is None:
        assert time.monotonic() < deadline, f"topic {topic} does not exist"
        time.sleep(0.2)
    offsets: dict[TopicPartition, int] = consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
    return offsets


def read_from(consumer: KafkaConsumer, offsets: dict[TopicPartition, int], want: int, timeout_s: float = 60) -> list:
    consumer.assign(list(offsets))
    for tp, offset in offsets.items():
        consumer.seek(tp, offset)
    records: list = []
    deadline = time.monotonic() + timeout_s
    while len(records) < want and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=500).values():
            records.extend(batch)
    return records


def test_rtrl_simulate_sends_interactions_and_feedback(services: Settings, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = services.model_copy(
        update={"gateway": services.gateway.model_copy(update={"port": port, "spool_dir": tmp_path / "spool"})}
    )
    consumer = KafkaConsumer(bootstrap_servers=settings.kafka.bootstrap_servers, group_id=None, enable_auto_commit=False)
    before_interactions = end_offsets(consumer, settings.kafka.interactions_topic)
    before_feedback = end_offsets(consumer, settings.kafka.feedback_topic)

    report_path = tmp_path / "report.json"
    with gateway_process(settings, tmp_path / "gateway.log") as gateway:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | to_env(settings)
        result = subprocess.run(
            [sys.executable, "-m", "rtrl.cli", "simulate", "--requests", str(N), "--concurrency", "3",
             "--task", "exclaim", "--preference", "rtrl.tasks:exclaim_preference", "--gateway", gateway,
             "--seed", "11", "--json", str(report_path)],
            env=env, capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "acceptance" in result.stdout

    report = json.loads(report_path.read_text())
    assert (report["requests"], report["ok"], report["failed"]) == (N, N, 0)
    assert report["feedback_sent"] >= N and report["feedback_failed"] == 0  # the exclaim user always says something
    assert sum(report["per_version"].values()) == N
    assert 0.0 <= report["acceptance_rate"] <= 1.0
    assert report["acceptance_rate"] == pytest.approx(report["accepted"] / N)

    interactions = [
        parse_event(r.value, InteractionEvent)
        for r in read_from(consumer, before_interactions, N)
    ]
    simulated = [e for e in interactions if e.tenant == "sim"]
    assert len(simulated) == N
    assert {e.policy_version for e in simulated} == set(report["per_version"])
    assert all(e.session_id and e.session_id.startswith("sim-user-") for e in simulated)
    feedback = [parse_event(r.value, FeedbackEvent) for r in read_from(consumer, before_feedback, report["feedback_sent"])]
    sim_feedback = [f for f in feedback if f.tenant == "sim"]
    assert len(sim_feedback) == report["feedback_sent"]
    assert {f.request_id for f in sim_feedback} == {e.request_id for e in simulated}
    accepted = {f.request_id for f in sim_feedback if f.kind == "accepted"}
    assert len(accepted) == report["accepted"]
    consumer.close()
