"""Accepted means durable (docs/security.md): with its broker stopped, a gateway answers feedback
202 once the events are fsynced in its spool, and they reach Kafka after the broker returns; with
the spool full, feedback is 503 with Retry-After. Uses a private broker (`private_kafka`) that it
may stop, like tests/ingest/test_ingest_kafka_outage.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from helpers import TopicReader

from schemas.clock import wait_until
from schemas.settings import Settings
from services import down, up
from services.launch import gateway_process
from services.testing import free_ports, private_services
from store import Store

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def private_kafka(services_config: Settings) -> Iterator[Settings]:
    with private_services(
        "rtrl-durable-feedback-", services_config.vllm.model_dir, enabled=("kafka",)
    ) as settings:
        up(settings, ["kafka"])
        yield settings


def gateway_settings(
    services: Settings, private_kafka: Settings, tmp_path: Path, **gateway: object
) -> Settings:
    return services.model_copy(
        update={
            "kafka": private_kafka.kafka,
            "store": services.store.model_copy(update={"url": f"sqlite:///{tmp_path / 'rtrl.db'}"}),
            "gateway": services.gateway.model_copy(
                update={
                    "port": free_ports(1)[0],
                    "spool_dir": tmp_path / "spool",
                    "publish_timeout_s": 2.0,
                    **gateway,
                }
            ),
        }
    )


def tenant_key(settings: Settings) -> str:
    store = Store(settings.store.url)
    store.migrate()
    try:
        return store.create_api_key(role="tenant", tenant="acme", name="durable feedback", rate_per_s=0)[1]
    finally:
        store.close()


@contextmanager
def served(
    services: Settings, private_kafka: Settings, tmp_path: Path, **gateway: object
) -> Iterator[tuple[httpx.Client, str]]:
    """A gateway on the private broker, a client with a tenant's key, and the request id of one
    completion it served (what feedback names)."""
    settings = gateway_settings(services, private_kafka, tmp_path, **gateway)
    key = tenant_key(settings)
    with (
        gateway_process(settings, tmp_path / "gateway.log") as url,
        httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=30) as client,
    ):
        body = {"model": settings.vllm.served_model_name, "prompt": "Q: 3 plus 4?\nA:", "max_tokens": 2}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        yield client, response.headers["x-rtrl-request-id"]


@contextmanager
def broker_down(private_kafka: Settings) -> Iterator[None]:
    """The private broker stopped for the block, started again after it, whatever happened."""
    down(private_kafka, ["kafka"])
    try:
        yield
    finally:
        up(private_kafka, ["kafka"])


def test_feedback_while_the_broker_is_down_is_202_once_spooled_and_arrives_after(
    services: Settings, private_kafka: Settings, tmp_path: Path
) -> None:
    reader = TopicReader(private_kafka.kafka, private_kafka.kafka.feedback_topic)
    try:
        with served(services, private_kafka, tmp_path) as (client, rid):
            with broker_down(private_kafka):
                accepted = client.post(
                    "/v1/feedback", json={"request_id": rid, "kind": "accepted", "event_id": "d-1"}
                )
                assert accepted.status_code == 202, accepted.text
                segments = list((tmp_path / "spool").glob("segment-*.jsonl"))
                assert any(b'"d-1"' in p.read_bytes() or rid.encode() in p.read_bytes() for p in segments)
            (event_id,) = accepted.json()["event_ids"]
            records = reader.wait_for(lambda r: r.key == rid.encode(), count=1, timeout_s=120)
            assert event_id.encode() in records[0].value
            wait_until(
                lambda: not list((tmp_path / "spool").glob("segment-*.jsonl")),
                timeout_s=60,
                what="spool replayed",
            )
    finally:
        reader.close()


def test_feedback_the_full_spool_cannot_take_is_503(
    services: Settings, private_kafka: Settings, tmp_path: Path
) -> None:
    tiny_spool = {"spool_max_bytes": 16, "overflow_max_bytes": 0}
    with served(services, private_kafka, tmp_path, **tiny_spool) as (client, rid):
        with broker_down(private_kafka):
            refused = client.post(
                "/v1/feedback", json={"request_id": rid, "kind": "accepted", "event_id": "d-2"}
            )
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "2"
        assert "spool" in refused.json()["error"]["message"]
        retried: list[int] = []

        def retry() -> bool:  # the broker is back: acknowledged once a producer reconnected
            body = {"request_id": rid, "kind": "accepted", "event_id": "d-2"}
            retried.append(client.post("/v1/feedback", json=body).status_code)
            return retried[-1] == 202

        wait_until(retry, timeout_s=120, what="the retry answered 202")
        assert set(retried) <= {202, 503}
