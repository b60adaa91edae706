"""The capture gateway against the real vLLM server and the real Kafka broker of the `services` fixture.

Each test starts ``rtrl gateway`` as a child process (`rtrl.launch.gateway_process`) on a free port
with its own spool directory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import TopicReader

from rtrl.launch import gateway_process
from rtrl.services.testing import free_ports
from schemas.clock import wait_until
from schemas.events import FeedbackEvent, InteractionEvent, parse_event
from schemas.settings import Settings

pytestmark = pytest.mark.integration

PROMPT = "Q: What is 3 plus 4?\nA:"


def free_port() -> int:
    (port,) = free_ports(1)
    return port


def closed_port() -> int:
    return free_port()  # nothing listens on it once the probe socket is closed


GatewayFactory = Callable[..., AbstractContextManager[str]]


@pytest.fixture
def start_gateway(services: Settings, tmp_path: Path) -> GatewayFactory:
    """`start_gateway(**gateway_overrides, kafka=..., vllm=...)` -> context manager yielding the URL."""

    def start(kafka: str | None = None, servers: tuple[str, ...] | None = None, **gateway: Any) -> AbstractContextManager[str]:
        update: dict[str, Any] = {
            "gateway": services.gateway.model_copy(
                update={"port": free_port(), "spool_dir": tmp_path / "spool", "publish_timeout_s": 2.0, **gateway}
            )
        }
        if kafka is not None:
            update["kafka"] = services.kafka.model_copy(update={"bootstrap_servers": kafka})
        if servers is not None:
            update["vllm"] = services.vllm.model_copy(update={"servers": servers})
        settings = services.model_copy(update=update)
        return gateway_process(settings, tmp_path / f"gateway-{settings.gateway.port}.log")

    return start


@pytest.fixture
def interactions(services: Settings) -> Iterator[TopicReader]:
    reader = TopicReader(services.kafka, services.kafka.interactions_topic)
    yield reader
    reader.close()


@pytest.fixture
def feedback(services: Settings) -> Iterator[TopicReader]:
    reader = TopicReader(services.kafka, services.kafka.feedback_topic)
    yield reader
    reader.close()


def vllm_url(services: Settings) -> str:
    return services.vllm.servers[0].rstrip("/")


def weight_version(services: Settings) -> str:
    version: str = httpx.get(f"{vllm_url(services)}/weight_info").json()["weight_version"]
    return version


def without_volatile(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created", "rtrl")}


def by_key(key: str) -> Callable[[Any], bool]:
    return lambda record: record.key == key.encode()


def test_completion_is_served_unchanged_and_captured(
    services: Settings, start_gateway: GatewayFactory, interactions: TopicReader
) -> None:
    request = {"model": services.vllm.served_model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0,
               "seed": 1234, "stop": ["\n"]}
    headers = {"x-rtrl-session-id": "sess-1", "x-rtrl-tenant": "acme", "x-rtrl-episode-id": "ep-42",
               "x-rtrl-segment-index": "3", "x-rtrl-role": "summary"}
    with start_gateway() as gateway:
        response = httpx.post(f"{gateway}/v1/completions", json=request, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
    body = response.json()
    request_id = response.headers["x-rtrl-request-id"]
    version = weight_version(services)
    assert body["rtrl"] == {"request_id": request_id, "policy_version": version}

    # The client gets exactly what vLLM answers without the gateway (same seed, same sample).
    direct = httpx.post(f"{vllm_url(services)}/v1/completions", json=request, timeout=120).json()
    assert without_volatile(body) == without_volatile(direct)

    # The event carries the tokens and behaviour logprobs vLLM reports when asked for them.
    asked = httpx.post(
        f"{vllm_url(services)}/v1/completions", json={**request, "logprobs": 1, "return_token_ids": True}, timeout=120
    ).json()["choices"][0]
    [record] = interactions.wait_for(by_key(request_id))
    assert dict(record.headers)["schema"] == b"rtrl.interaction.v1"
    event = parse_event(record.value, InteractionEvent)
    assert event.request_id == request_id and event.policy_version == version
    assert event.prompt == PROMPT and event.completion == body["choices"][0]["text"]
    assert event.prompt_token_ids == asked["prompt_token_ids"]
    assert event.completion_token_ids == asked["token_ids"]
    assert event.completion_logprobs == pytest.approx(asked["logprobs"]["token_logprobs"], abs=1e-5)
    assert len(event.completion_token_ids) == body["usage"]["completion_tokens"]
    assert (event.session_id, event.tenant, event.episode_id, event.segment_index) == ("sess-1", "acme", "ep-42", 3)
    assert event.role == "summary" and event.trainable is True
    assert (event.sampling.temperature, event.sampling.max_tokens, event.sampling.seed) == (1.0, 8, 1234)
    assert event.finish_reason == body["choices"][0]["finish_reason"]


def test_chat_completion_is_captured(
    services: Settings, start_gateway: GatewayFactory, interactions: TopicReader
) -> None:
    request = {"model": services.vllm.served_model_name, "messages": [{"role": "user", "content": "What is 2 plus 2?"}],
               "max_tokens": 6, "seed": 7}
    with start_gateway() as gateway:
        response = httpx.post(f"{gateway}/v1/chat/completions", json={**request, "rtrl": {"episode_id": "chat-ep"}},
                              timeout=120)
    direct = httpx.post(f"{vllm_url(services)}/v1/chat/completions", json=request, timeout=120)
    assert response.status_code == direct.status_code, response.text
    if direct.status_code != 200:
        pytest.skip(f"the served model has no chat template: {direct.text[:200]}")
    body = response.json()
    assert without_volatile(body) == without_volatile(direct.json())
    [record] = interactions.wait_for(by_key(response.headers["x-rtrl-request-id"]))
    event = parse_event(record.value, InteractionEvent)
    assert event.episode_id == "chat-ep" and event.completion == body["choices"][0]["message"]["content"]
    assert event.prompt and event.prompt_token_ids
    assert len(event.completion_logprobs) == len(event.completion_token_ids) == body["usage"]["completion_tokens"]


def test_errors(services: Settings, start_gateway: GatewayFactory) -> None:
    with start_gateway() as gateway:
        # vLLM's own refusal passes through with its status and body
        too_long = {"model": services.vllm.served_model_name, "prompt": PROMPT, "max_tokens": 100_000}
        upstream = httpx.post(f"{vllm_url(services)}/v1/completions", json=too_long, timeout=60)
        through = httpx.post(f"{gateway}/v1/completions", json=too_long, timeout=60)
        assert upstream.status_code == through.status_code == 400
        assert through.json()["error"]["message"] == upstream.json()["error"]["message"]
        # the gateway's own refusals are OpenAI-shaped errors
        streamed = httpx.post(f"{gateway}/v1/completions", json={"prompt": PROMPT, "stream": True})
        assert streamed.status_code == 400 and "stream=true is not supported" in streamed.json()["error"]["message"]
        bad_header = httpx.post(f"{gateway}/v1/completions", json={"prompt": PROMPT},
                                headers={"x-rtrl-segment-index": "x"})
        assert bad_header.status_code == 400 and "segment_index" in bad_header.json()["error"]["message"]
    with start_gateway(servers=(f"http://127.0.0.1:{closed_port()}",)) as gateway:
        down = httpx.post(f"{gateway}/v1/completions", json={"prompt": PROMPT}, timeout=30)
        assert down.status_code == 502 and "no vLLM server reachable" in down.json()["error"]["message"]
        assert httpx.get(f"{gateway}/readyz").status_code == 503
        assert httpx.get(f"{gateway}/healthz").status_code == 200


def test_feedback_is_validated_and_published(start_gateway: GatewayFactory, feedback: TopicReader) -> None:
    events = [
        {"request_id": "req-fb-1", "kind": "accepted", "event_id": "fb-ev-1"},
        {"request_id": "req-fb-1", "kind": "task_outcome", "value": 0.5, "created_at": "2025-01-01T00:00:00Z"},
    ]
    with start_gateway() as gateway:
        accepted = httpx.post(f"{gateway}/v1/feedback", json=events)
        single = httpx.post(f"{gateway}/v1/feedback", json={"request_id": "req-fb-2", "kind": "thumbs_down"})
        bad_kind = httpx.post(f"{gateway}/v1/feedback", json={"request_id": "r", "kind": "loved_it"})
        extra = httpx.post(f"{gateway}/v1/feedback", json=[{"request_id": "r", "kind": "accepted", "colour": 1}])
        not_json = httpx.post(f"{gateway}/v1/feedback", content=b"{nope")
        empty = httpx.post(f"{gateway}/v1/feedback", json=[])
    assert accepted.status_code == 202 and accepted.json()["event_ids"][0] == "fb-ev-1"
    assert single.status_code == 202 and len(single.json()["event_ids"]) == 1
    assert bad_kind.status_code == 422 and bad_kind.json()["detail"][0]["loc"] == ["kind"]
    assert extra.status_code == 422 and extra.json()["detail"][0]["type"] == "extra_forbidden"
    assert not_json.status_code == 422 and empty.status_code == 422
    records = feedback.wait_for(lambda r: r.key in (b"req-fb-1", b"req-fb-2"), count=3)
    published = [parse_event(r.value, FeedbackEvent) for r in records]
    assert sorted(e.event_id for e in published) == sorted(accepted.json()["event_ids"] + single.json()["event_ids"])
    assert {(e.kind, e.value) for e in published if e.request_id == "req-fb-1"} == {("accepted", 1.0), ("task_outcome", 0.5)}


def metric(gateway: str, name: str, label: str = "") -> float:
    """Sum of the samples of `name` whose labels contain `label` (e.g. 'outcome="spooled"')."""
    text = httpx.get(f"{gateway}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " ")) and label in line
    )


def test_broker_down_spools_then_a_restarted_gateway_replays(
    services: Settings, start_gateway: GatewayFactory, interactions: TopicReader, tmp_path: Path
) -> None:
    request = {"model": services.vllm.served_model_name, "prompt": PROMPT, "max_tokens": 8, "seed": 5}
    spool = tmp_path / "spool"
    request_ids = []
    # A broker that never answers holds each event for publish_timeout_s before it is spooled; the
    # users' requests (client timeout shorter than that) must not wait for it.
    with start_gateway(kafka=f"127.0.0.1:{closed_port()}", publish_timeout_s=15.0) as gateway:
        for _ in range(3):
            response = httpx.post(f"{gateway}/v1/completions", json=request, timeout=10)
            assert response.status_code == 200, response.text
            request_ids.append(response.headers["x-rtrl-request-id"])
        spooled = lambda: metric(gateway, "rtrl_gateway_publish_total", 'outcome="spooled"') >= 3  # noqa: E731
        wait_until(spooled, timeout_s=60, what="3 events spooled")
        assert metric(gateway, "rtrl_gateway_publish_total", 'outcome="spooled"') == 3
        assert metric(gateway, "rtrl_gateway_spool_bytes") > 0
        assert httpx.get(f"{gateway}/readyz").json()["kafka_connected"] is False
    segments = sorted(spool.glob("segment-*.jsonl"))
    assert segments and sum(len(p.read_bytes().splitlines()) for p in segments) == 3
    assert interactions.wait_for(lambda r: r.key.decode() in request_ids, timeout_s=2) == []

    with start_gateway() as gateway:  # the real broker, the same spool directory
        records = interactions.wait_for(lambda r: r.key.decode() in request_ids, count=3, timeout_s=60)
        wait_until(lambda: not list(spool.glob("segment-*.jsonl")), timeout_s=30, what="spool replayed")
        assert metric(gateway, "rtrl_gateway_publish_total", 'outcome="replayed"') == 3
    assert {parse_event(r.value, InteractionEvent).request_id for r in records} == set(request_ids)
    assert not (spool / "overflow.jsonl").exists()
