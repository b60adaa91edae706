"""The gateway's publishing when its Kafka broker stops, freezes or refuses a record: every event
the gateway accepted reaches the store exactly once, or a dead letter on disk with its reason.

These tests stop and freeze a private broker of their own (not the session's): `private_kafka`
starts a second single-node Kafka with `services` in its own run dir.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import TopicReader
from sqlalchemy import func, select

import streams
from feedback import labeler
from ingest.metrics import GatewayMetrics
from ingest.publisher import WATCHDOG_GRACE_S, WATCHDOG_TICK_S, Publisher
from ingest.spool import OVERFLOW_FILE
from schemas.clock import wait_until
from schemas.events import DeadLetterRecord
from schemas.settings import Settings
from services import down, services, up
from services.launch import gateway_process
from services.testing import free_ports, private_services
from services.tinymodel import VOCAB_SIZE as TINY_VOCAB_SIZE
from store import Store
from store.models import Interaction

pytestmark = pytest.mark.integration

REQUESTS = 1000
OUTAGE_S = 30.0
PERIOD_S = 0.05  # one request every 50 ms: the outage falls in the middle of the stream
TOPIC_LIMIT = 4096  # the interactions topic's max.message.bytes here: a normal event is ~1.5 KB


@pytest.fixture(scope="module")
def private_kafka(services_config: Settings) -> Iterator[Settings]:
    """A second, private single-node Kafka (with its topics) that these tests may stop and freeze."""
    with private_services(
        "rtrl-kafka-outage-", services_config.vllm.model_dir, enabled=("kafka",)
    ) as settings:
        up(settings, ["kafka"])
        # The tiny model's vocabulary: this test's labeler starts without the model being built.
        vocab = {"vocab_size": TINY_VOCAB_SIZE}
        yield settings.model_copy(update={"labeler": settings.labeler.model_copy(update=vocab)})


def kafka_pid(settings: Settings) -> int:
    (unit,) = services(settings, ["kafka"])
    pid = unit.pid()
    assert pid is not None
    return pid


def publish_count(metrics: GatewayMetrics, topic: str, outcome: str) -> float:
    return (
        metrics.registry.get_sample_value("rtrl_gateway_publish_total", {"topic": topic, "outcome": outcome})
        or 0.0
    )


def test_a_producer_that_stops_making_progress_is_replaced(private_kafka: Settings, tmp_path: Path) -> None:
    """A frozen broker (SIGSTOP: connections open, nothing answered) under a producer that would
    wait ten minutes for it: the watchdog spools its events in time and a new producer delivers them."""
    timeout_s = 1.0
    settings = private_kafka.model_copy(
        update={
            "gateway": private_kafka.gateway.model_copy(
                update={"spool_dir": tmp_path / "spool", "publish_timeout_s": timeout_s}
            )
        }
    )
    topic = settings.kafka.interactions_topic
    producers: list[streams.Producer] = []

    def connect() -> streams.Producer | None:
        if producers:
            return pub._new_producer()  # later producers: the gateway's own
        producers.append(
            streams.Producer(
                streams.producer(  # a producer that never gives up on a record by itself
                    settings.kafka,
                    "rtrl-test-patient",
                    linger_ms=5,
                    request_timeout_ms=300_000,
                    delivery_timeout_ms=600_000,
                    max_block_ms=1000,
                )
            )
        )
        return producers[0]

    metrics = GatewayMetrics()
    pub = Publisher(settings, metrics, replay_interval_s=0.2, connect=connect)
    reader = TopicReader(settings.kafka, topic)
    pub.start()
    try:
        for i in range(5):
            pub.publish(topic, f"before-{i}", "{}", "test", f"before-{i}")
        wait_until(
            lambda: publish_count(metrics, topic, "ok") == 5, timeout_s=30, what="5 events acknowledged"
        )
        pid = kafka_pid(settings)
        os.killpg(pid, signal.SIGSTOP)
        try:
            frozen_at = time.monotonic()
            for i in range(5):
                pub.publish(topic, f"frozen-{i}", "{}", "test", f"frozen-{i}")
            wait_until(
                lambda: publish_count(metrics, topic, "spooled") == 5, timeout_s=30, what="5 events spooled"
            )
            on_disk_after = time.monotonic() - frozen_at
            assert not pub.connected
            assert metrics.registry.get_sample_value("rtrl_gateway_producer_replaced_total") == 1
        finally:
            os.killpg(pid, signal.SIGCONT)
        assert on_disk_after <= timeout_s + WATCHDOG_GRACE_S + WATCHDOG_TICK_S + 0.5
        wait_until(
            lambda: publish_count(metrics, topic, "replayed") == 5, timeout_s=60, what="spool replayed"
        )
        assert pub.connected and pub.spool.empty() and pub.in_flight == 0
        records = reader.wait_for(lambda r: r.key.startswith(b"frozen-"), count=5, timeout_s=30)
    finally:
        pub.close()
        reader.close()
    assert {r.key.decode() for r in records} == {f"frozen-{i}" for i in range(5)}


def stored_request_ids(store: Store, wanted: set[str]) -> list[str]:
    with store.transaction() as session:
        return [rid for rid in session.scalars(select(Interaction.request_id)) if rid in wanted]


def test_kafka_restart_loses_nothing_and_an_oversize_event_blocks_nothing(
    services: Settings, private_kafka: Settings, tmp_path: Path
) -> None:
    """The broker is stopped for 30 s and started again (the same broker) in the middle of 1,000
    requests through the gateway; two events too large for the broker's topic limit, one sent
    before the outage and one during it, are dead-lettered and block nothing behind them."""
    from kafka.admin import ConfigResource, ConfigResourceType

    kafka = private_kafka.kafka
    admin = streams.admin(kafka, "rtrl-tests")
    try:
        admin.alter_configs(
            [
                ConfigResource(
                    ConfigResourceType.TOPIC,
                    kafka.interactions_topic,
                    configs={"max.message.bytes": str(TOPIC_LIMIT)},
                )
            ]
        )
    finally:
        admin.close()
    settings = services.model_copy(
        update={
            "kafka": kafka,
            "store": services.store.model_copy(update={"url": f"sqlite:///{tmp_path / 'rtrl.db'}"}),
            "gateway": services.gateway.model_copy(
                update={
                    "port": free_ports(1)[0],
                    "spool_dir": tmp_path / "spool",
                    "publish_timeout_s": 2.0,
                    "forwarded_fields": (*services.gateway.forwarded_fields, "ignore_eos"),  # the big events
                }
            ),
        }
    )
    store = Store(settings.store.url)
    store.migrate()
    _, key = store.create_api_key(role="tenant", tenant="acme", name="kafka outage test", rate_per_s=0)
    stop = threading.Event()
    consumer = threading.Thread(target=labeler.run, args=(settings, stop), name="labeler")
    consumer.start()

    request = {
        "model": settings.vllm.served_model_name,
        "prompt": "Q: What is 3 plus 4?\nA:",
        "max_tokens": 4,
    }
    # ~300 prompt tokens and 150 sampled tokens with their logprobs: an event of ~6 KB
    big = {**request, "prompt": "Q: " + "qzx jvk " * 38 + "\nA:", "max_tokens": 150, "ignore_eos": True}
    answered: dict[int, str] = {}
    big_ids: list[str] = []
    back = threading.Event()
    back_at: list[float] = []
    failures: list[str] = []
    try:
        with (
            gateway_process(settings, tmp_path / "gateway.log") as gateway,
            httpx.Client(base_url=gateway, headers={"authorization": f"Bearer {key}"}, timeout=60) as client,
        ):

            def send(i: int, body: dict[str, object]) -> None:
                try:
                    response = client.post("/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    failures.append(f"request {i}: {exc!r}")
                    return
                if response.status_code != 200:
                    failures.append(f"request {i}: {response.status_code} {response.text[:200]}")
                    return
                if i < 0:
                    big_ids.append(response.headers["x-rtrl-request-id"])
                else:
                    answered[i] = response.headers["x-rtrl-request-id"]

            def outage() -> None:
                down(private_kafka, ["kafka"])
                send(-1, big)  # spooled while the broker is down; refused by the broker on replay
                time.sleep(OUTAGE_S)
                up(private_kafka, ["kafka"])  # the same broker: its data dir and topics are kept
                back_at.append(time.monotonic())
                back.set()

            chaos = threading.Thread(target=outage, name="outage")
            with ThreadPoolExecutor(max_workers=8) as pool:
                started = time.monotonic()
                for i in range(REQUESTS):
                    if i == 100:
                        send(-1, big)  # refused by the broker on the live path
                    if i == 300:
                        chaos.start()
                    if i == REQUESTS - 150:
                        back.wait(timeout=180)  # at least 150 requests after Kafka's return
                        started = time.monotonic() - i * PERIOD_S
                    time.sleep(max(0.0, started + i * PERIOD_S - time.monotonic()))
                    pool.submit(send, i, request)
            chaos.join()
            assert failures == [] and len(answered) == REQUESTS and len(big_ids) == 2
            assert back_at, "the broker did not come back"
            wanted = set(answered.values())
            # Nothing lost is the point; the bound only catches a labeler that never recovers. Under the
            # full suite's load on 2 cores recovery has taken more than 52 s (cause not found yet).
            deadline_s = 120 - (time.monotonic() - back_at[0])
            wait_until(
                lambda: len(stored_request_ids(store, wanted)) >= REQUESTS,
                timeout_s=max(1.0, deadline_s),
                what="all 1,000 events stored within two minutes of Kafka's return",
            )
            readyz = httpx.get(f"{gateway}/readyz").json()
            assert readyz["kafka_connected"] is True and readyz["spool_bytes"] == 0
        stored = stored_request_ids(store, set(answered.values()) | set(big_ids))
        with store.transaction() as session:
            total = session.scalar(select(func.count()).select_from(Interaction))
    finally:
        stop.set()
        consumer.join(timeout=60)
        store.close()
    assert sorted(stored) == sorted(answered.values())  # each exactly once; the big ones not at all
    assert total == REQUESTS
    dead = [
        DeadLetterRecord.model_validate_json(line)
        for line in (tmp_path / "spool" / OVERFLOW_FILE).read_text().splitlines()
    ]
    assert sorted(json.loads(d.payload)["key"] for d in dead) == sorted(big_ids)
    assert all("MessageSizeTooLarge" in d.reason for d in dead), [d.reason for d in dead]
    assert all(len(json.loads(d.payload)["value"]) > TOPIC_LIMIT for d in dead)


def test_a_labeler_whose_poll_raises_a_connection_error_polls_again_instead_of_dying(
    private_kafka: Settings, tmp_path: Path
) -> None:
    """kafka-python 3.0.12's poll can raise the connection error of a failed metadata refresh
    while the broker restarts (seen in this file's restart test, where it ended the labeler's
    thread; not reproducible on demand, so the error is raised into one poll of a real consumer
    here): the step pauses, reports Kafka not ready, and the next poll reads on."""
    from kafka.errors import KafkaConnectionError

    settings = private_kafka.model_copy(
        update={
            "store": private_kafka.store.model_copy(update={"url": f"sqlite:///{tmp_path / 'rtrl.db'}"}),
            "kafka": private_kafka.kafka.model_copy(
                update={"labeler_group": f"poll-error-{os.getpid()}-{time.time_ns()}"}
            ),
        }
    )
    store = Store(settings.store.url)
    store.migrate()
    paused: list[float] = []
    worker = labeler.Labeler(
        settings, store, labeler.make_consumer(settings), labeler.make_producer(settings), sleep=paused.append
    )
    poll = worker.consumer.poll
    failures = [KafkaConnectionError("111 ECONNREFUSED")]

    def failing_once(**kwargs: object) -> object:
        if failures:
            raise failures.pop()
        return poll(**kwargs)

    try:
        wait_until(
            lambda: worker.step() is not None and worker.consumer.assignment(),
            timeout_s=60,
            what="the labeler in its group",
        )
        worker.consumer.poll = failing_once
        assert worker.step() is None  # raised out of the step (and ended `run`) before
        assert paused == [labeler.POLL_RETRY_S]
        assert worker.readiness.snapshot()[1]["kafka"]["ok"] is False
        wait_until(lambda: worker.step() is not None, timeout_s=10, what="the next polls reading on")
    finally:
        worker.consumer.close(autocommit=False)
        worker.producer.close()
        store.close()
