"""``POST /v1/responses`` through ``rtrl gateway`` against the session's real vLLM server and Kafka
broker (the `services` fixture): the official ``openai`` client's ``client.responses.create``, with
and without streaming, answered and captured as the equivalent chat completion is (the same
tokens and behaviour logprobs as vLLM's own chat answer to the translated request).

One gateway serves both calls (one start-up for the module).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import TopicReader

from schemas.events import InteractionEvent, parse_event
from schemas.settings import Settings
from services.launch import gateway_process
from services.testing import free_ports
from store import Store

pytestmark = pytest.mark.integration

INSTRUCTIONS = "Answer with a number."
QUESTION = "What is 2 plus 5?"


@pytest.fixture(scope="module")
def gateway(services: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(the URL of a gateway of the session's services, a tenant key of tenant ``acme``)."""
    store = Store(services.store.url)
    try:
        _, key = store.create_api_key(role="tenant", tenant="acme", name="responses api tests")
    finally:
        store.close()
    tmp = tmp_path_factory.mktemp("responses-gateway")
    (port,) = free_ports(1)
    settings = services.model_copy(
        update={
            "gateway": services.gateway.model_copy(
                update={"port": port, "spool_dir": tmp / "spool", "publish_timeout_s": 2.0}
            )
        }
    )
    with gateway_process(settings, tmp / "gateway.log") as url:
        yield url, key


@pytest.fixture
def interactions(services: Settings) -> Iterator[TopicReader]:
    reader = TopicReader(services.kafka, services.kafka.interactions_topic)
    yield reader
    reader.close()


def direct_chat(services: Settings, seed: int) -> dict[str, Any]:
    """vLLM's own answer to the chat request the gateway translates the Responses request into,
    with the token ids and logprobs the gateway asks for."""
    body = {
        "model": services.vllm.served_model_name,
        "messages": [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": seed,
        "logprobs": True,
        "return_token_ids": True,
    }
    response = httpx.post(
        f"{services.vllm.servers[0].rstrip('/')}/v1/chat/completions", json=body, timeout=120
    )
    if response.status_code != 200:
        pytest.skip(f"the served model has no chat template: {response.text[:200]}")
    answer: dict[str, Any] = response.json()
    return answer


def captured(interactions: TopicReader, response_id: str) -> InteractionEvent:
    request_id = response_id.removeprefix("resp_")
    [record] = interactions.wait_for(lambda r: r.key == request_id.encode())
    return parse_event(record.value, InteractionEvent)


def assert_captured_as_chat(event: InteractionEvent, text: str, direct: dict[str, Any]) -> None:
    choice = direct["choices"][0]
    assert event.completion == text == choice["message"]["content"]
    assert event.prompt_token_ids == direct["prompt_token_ids"]
    assert event.completion_token_ids == choice["token_ids"]
    assert event.completion_logprobs == pytest.approx(
        [e["logprob"] for e in choice["logprobs"]["content"]], abs=1e-5
    )
    assert INSTRUCTIONS in event.prompt and QUESTION in event.prompt
    assert not event.truncated and event.trainable


def test_responses_from_the_official_client_are_served_and_captured(
    services: Settings, gateway: tuple[str, str], interactions: TopicReader
) -> None:
    from openai import OpenAI

    url, key = gateway
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    request: dict[str, Any] = {
        "model": services.vllm.served_model_name,
        "instructions": INSTRUCTIONS,
        "input": QUESTION,
        "max_output_tokens": 8,
        "temperature": 1.0,
    }

    # Not streamed: a Response object, captured with the episode named in the header.
    response = client.responses.create(
        **request, extra_body={"seed": 11}, extra_headers={"x-rtrl-episode-id": "responses-ep"}
    )
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output_text and response.usage is not None
    event = captured(interactions, response.id)
    assert event.episode_id == "acme:responses-ep" and event.tenant == "acme"
    assert_captured_as_chat(event, response.output_text, direct_chat(services, 11))
    assert response.usage.output_tokens == len(event.completion_token_ids)
    assert response.usage.input_tokens == len(event.prompt_token_ids)

    # Streamed: the event sequence, the deltas adding up to the final text, the same capture.
    events = list(client.responses.create(**request, extra_body={"seed": 13}, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == final.output_text and deltas
    assert final.usage is not None and final.usage.output_tokens > 0
    stream_event = captured(interactions, final.id)
    assert_captured_as_chat(stream_event, deltas, direct_chat(services, 13))
