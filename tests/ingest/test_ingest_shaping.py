"""Request/response shaping and capture-header parsing of the gateway (ingest/shaping.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from ingest.auth import namespaced
from ingest.shaping import (
    Capture,
    Requested,
    RequestError,
    build_interaction,
    extract_chat,
    extract_completion,
    lora_request,
    parse_capture,
    prepare_chat_request,
    prepare_completion_request,
    sampling_params,
    shape_chat_response,
    shape_completion_response,
    trainable_for,
    with_rtrl,
)
from schemas.events import Role

pytestmark = pytest.mark.unit

# What vLLM answers to /v1/completions with logprobs=0 and return_token_ids=true (trimmed).
UPSTREAM_COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": "rtrl-tiny",
    "choices": [
        {
            "index": 0,
            "text": " 7!",
            "logprobs": {
                "text_offset": [0, 2],
                "token_logprobs": [-0.5, -0.25],
                "tokens": [" 7", "!"],
                "top_logprobs": [{" 7": -0.5}, {"!": -0.25}],
            },
            "finish_reason": "stop",
            "stop_reason": "\n",
            "token_ids": [41, 5],
            "prompt_logprobs": None,
            "prompt_token_ids": [1, 2, 3],
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}

UPSTREAM_CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "rtrl-tiny",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi!"},
            "logprobs": {
                "content": [
                    {"token": "Hi", "logprob": -1.0, "top_logprobs": []},
                    {"token": "!", "logprob": -2.0, "top_logprobs": []},
                ]
            },
            "finish_reason": "stop",
            "token_ids": [9, 5],
        }
    ],
    "prompt_token_ids": [1, 7, 8],
    "prompt_text": "<user>hello</user>",
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


def test_completion_request_adds_capture_fields_and_removes_rtrl() -> None:
    body = {"model": "m", "prompt": "Q: 1+1?\nA:", "max_tokens": 4, "rtrl": {"episode_id": "ep1"}}
    forward, requested, rtrl = prepare_completion_request(body)
    assert forward == {
        "model": "m",
        "prompt": "Q: 1+1?\nA:",
        "max_tokens": 4,
        "logprobs": 0,
        "return_token_ids": True,
    }
    assert requested == Requested(logprobs=False, token_ids=False)
    assert rtrl == {"episode_id": "ep1"}
    assert "rtrl" in body  # the client's dict is not mutated


def test_completion_request_keeps_what_the_client_asked_for() -> None:
    forward, requested, _ = prepare_completion_request(
        {"prompt": ["p"], "logprobs": 3, "return_token_ids": True}
    )
    assert forward["logprobs"] == 3
    assert requested == Requested(logprobs=True, token_ids=True)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "p", "stream": "yes"}, "stream must be true or false"),
        ({"prompt": "p", "n": 2}, "n=2 is not supported"),
        ({"prompt": ["a", "b"]}, "prompt must be one string"),
        ({"prompt": [1, 2, 3]}, "prompt must be one string"),
        ([1], "must be a JSON object"),
    ],
)
def test_completion_request_refusals(body: object, message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        prepare_completion_request(body)
    assert info.value.status_code == 400


@pytest.mark.parametrize("body", [{"prompt_logprobs": 0}, {"prompt_logprobs": 1}, {"echo": True}])
def test_a_lora_fleet_is_never_asked_for_prompt_logprobs(body: dict[str, object]) -> None:
    """vLLM's CPU LoRA path kills the engine on prompt logprobs (echo + logprobs asks for them too)."""
    forward, _, _ = prepare_completion_request({"prompt": "hi", **body})
    with pytest.raises(RequestError, match="not served while the fleet serves LoRA adapters"):
        lora_request(forward, "rtrl-tiny")


def test_a_lora_fleet_serves_the_adapter_under_the_served_name_only() -> None:
    forward, _, _ = prepare_completion_request({"prompt": "hi", "echo": False})
    lora_request(forward, "rtrl-tiny")
    assert forward["model"] == "rtrl-tiny"  # left out: vLLM would answer with the base model
    chat, _, _ = prepare_chat_request({"messages": [{"role": "user", "content": "hi"}], "model": "rtrl-tiny"})
    lora_request(chat, "rtrl-tiny")
    for name in ("rtrl-tiny-base", "other"):
        with pytest.raises(RequestError, match="is not served here") as info:
            lora_request({"model": name, "prompt": "hi"}, "rtrl-tiny")
        assert info.value.status_code == 404


def test_chat_request_adds_capture_fields() -> None:
    forward, requested, _ = prepare_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    assert forward["logprobs"] is True and forward["top_logprobs"] == 0
    assert forward["return_token_ids"] is True and forward["return_prompt_text"] is True
    assert requested == Requested(logprobs=False, token_ids=False, prompt_text=False)
    with pytest.raises(RequestError, match="messages must be a non-empty list"):
        prepare_chat_request({"messages": []})


def test_completion_response_strips_only_what_the_gateway_added() -> None:
    shaped = shape_completion_response(UPSTREAM_COMPLETION, Requested(logprobs=False, token_ids=False))
    choice = shaped["choices"][0]
    assert choice["logprobs"] is None and choice["token_ids"] is None and choice["prompt_token_ids"] is None
    assert choice["text"] == " 7!" and choice["stop_reason"] == "\n"
    assert shaped["usage"] == UPSTREAM_COMPLETION["usage"]
    # the upstream body is left alone (the event is built from it afterwards)
    assert UPSTREAM_COMPLETION["choices"][0]["token_ids"] == [41, 5]  # type: ignore[index]

    kept = shape_completion_response(UPSTREAM_COMPLETION, Requested(logprobs=True, token_ids=True))
    assert kept == UPSTREAM_COMPLETION


def test_chat_response_strips_only_what_the_gateway_added() -> None:
    shaped = shape_chat_response(UPSTREAM_CHAT, Requested(logprobs=False, token_ids=False))
    assert shaped["choices"][0]["logprobs"] is None and shaped["choices"][0]["token_ids"] is None
    assert shaped["prompt_token_ids"] is None and shaped["prompt_text"] is None
    assert shaped["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}


def test_with_rtrl() -> None:
    assert with_rtrl({"id": "x"}, "r1", "v2") == {
        "id": "x",
        "rtrl": {"request_id": "r1", "policy_version": "v2"},
    }


def test_extract_completion() -> None:
    generation = extract_completion(UPSTREAM_COMPLETION, {"prompt": "Q: 3+4?\nA:"})
    assert generation.prompt == "Q: 3+4?\nA:"
    assert generation.prompt_token_ids == [1, 2, 3]
    assert generation.completion == " 7!"
    assert generation.completion_token_ids == [41, 5]
    assert generation.completion_logprobs == [-0.5, -0.25]
    assert generation.finish_reason == "stop"


def test_extract_completion_with_echo_takes_the_sampled_tail() -> None:
    upstream = {
        "choices": [
            {
                "text": "Q: A 7!",
                "logprobs": {"token_logprobs": [None, -0.1, -0.5, -0.25]},
                "token_ids": [41, 5],
                "prompt_token_ids": [1, 2],
                "finish_reason": "length",
            }
        ]
    }
    generation = extract_completion(upstream, {"prompt": "Q: A", "echo": True})
    assert generation.completion == " 7!"
    assert generation.completion_logprobs == [-0.5, -0.25]


def test_extract_completion_without_logprobs_is_an_error() -> None:
    with pytest.raises(ValueError, match="no token_logprobs"):
        extract_completion({"choices": [{"text": "x", "logprobs": None, "token_ids": [1]}]}, {"prompt": "p"})


def test_extract_chat() -> None:
    generation = extract_chat(UPSTREAM_CHAT)
    assert generation.prompt == "<user>hello</user>"
    assert generation.prompt_token_ids == [1, 7, 8]
    assert generation.completion == "Hi!"
    assert generation.completion_token_ids == [9, 5]
    assert generation.completion_logprobs == [-1.0, -2.0]


def test_extract_chat_of_a_tool_call_records_the_call() -> None:
    # vLLM parsed the model's text into tool_calls and left content null: the event says what was called.
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "lookup", "arguments": '{"item": "red box"}'},
    }
    [choice] = UPSTREAM_CHAT["choices"]  # type: ignore[index]
    upstream = {
        **UPSTREAM_CHAT,
        "choices": [
            {
                **choice,
                "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                "finish_reason": "tool_calls",
            }
        ],
    }
    generation = extract_chat(upstream)
    assert generation.completion == '[{"name": "lookup", "arguments": "{\\"item\\": \\"red box\\"}"}]'
    assert generation.completion_token_ids == [9, 5] and generation.finish_reason == "tool_calls"


def test_parse_capture_from_headers_and_body() -> None:
    headers = {
        "X-RTRL-Session-Id": "s1",
        "x-rtrl-episode-id": "ep-7",
        "x-rtrl-segment-index": "2",
        "x-rtrl-role": "summary",
        "x-rtrl-trainable": "TRUE",
        "authorization": "ignored",
    }
    assert parse_capture(headers) == Capture(
        session_id="s1", episode_id="ep-7", segment_index=2, role=Role.summary, trainable=True
    )
    assert parse_capture({}, {"episode_id": "ep-7", "segment_index": 3, "trainable": False}) == Capture(
        episode_id="ep-7", segment_index=3, trainable=False
    )
    # the same value both ways is fine
    assert parse_capture({"x-rtrl-episode-id": "e"}, {"episode_id": "e"}).episode_id == "e"
    # a PARL sub-agent names itself; it is frozen unless it says otherwise (and it may not)
    sub = parse_capture({"x-rtrl-role": "subagent", "x-rtrl-agent": "searcher-2"})
    assert (sub.agent, sub.role) == ("searcher-2", Role.subagent) and not trainable_for(sub)


@pytest.mark.parametrize(
    ("headers", "body", "message"),
    [
        ({"x-rtrl-segment-index": "-1"}, None, "segment_index must be an integer in"),
        ({"x-rtrl-segment-index": "two"}, None, "segment_index must be an integer"),
        ({"x-rtrl-role": "boss"}, None, "role must be one of"),
        ({"x-rtrl-trainable": "maybe"}, None, "trainable must be true or false"),
        ({"x-rtrl-episode-id": "has space"}, None, "not a valid id"),
        ({"x-rtrl-agent": "a" * 201}, None, "rtrl agent .* is not a valid id"),
        ({}, {"agent": ["a"]}, "rtrl agent .* is not a valid id"),
        ({}, {"colour": "red"}, "unknown rtrl field 'colour'"),
        ({}, ["episode_id"], "must be an object"),
        (
            {"x-rtrl-episode-id": "a"},
            {"episode_id": "b"},
            "'a' in the x-rtrl-episode-id header but 'b' in the body",
        ),
        ({"x-rtrl-role": "subagent", "x-rtrl-trainable": "true"}, None, "trainable must be false"),
        ({"x-rtrl-tenant": "acme"}, None, "the tenant comes from the API key"),
        ({}, {"tenant": "acme"}, "the tenant comes from the API key"),
    ],
)
def test_parse_capture_refusals(headers: dict[str, str], body: object, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        parse_capture(headers, body)


def test_sampling_params() -> None:
    params = sampling_params(
        {"temperature": 0.7, "max_tokens": 16, "stop": "\n", "seed": 3, "top_k": 5, "min_p": 0.1}
    )
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 1.0, 5, 0.1)
    assert (params.max_tokens, params.seed, params.stop) == (16, 3, ["\n"])
    assert params.logprobs_mode == "processed"
    assert sampling_params({"max_completion_tokens": 8}).max_tokens == 8
    assert sampling_params({}, "raw").logprobs_mode == "raw"


def test_the_models_sampling_defaults_are_written_into_the_forwarded_request() -> None:
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    forward, _, _ = prepare_completion_request({"prompt": "p", "temperature": 0.2}, defaults)
    assert (forward["temperature"], forward["top_p"], forward["top_k"]) == (0.2, 0.8, 20)
    forward, _, _ = prepare_chat_request(
        {"messages": [{"role": "user", "content": "hi"}], "top_k": None}, defaults
    )
    assert (forward["temperature"], forward["top_p"], forward["top_k"]) == (0.7, 0.8, 20)
    # What is recorded is what was forwarded, so what vLLM sampled with.
    assert sampling_params(forward).model_dump(include={"temperature", "top_p", "top_k"}) == defaults


def _event(capture: Capture, straddled: bool):  # type: ignore[no-untyped-def]
    return build_interaction(
        request_id="req1",
        tenant="acme",
        episode_id=namespaced("acme", capture.episode_id or "req1"),
        capture=capture,
        model="rtrl-tiny",
        policy_version=3,
        generation=extract_completion(UPSTREAM_COMPLETION, {"prompt": "Q"}),
        sampling=sampling_params({}),
        straddled=straddled,
        created_at=datetime(2025, 1, 1, tzinfo=UTC),
    )


def test_build_interaction_defaults_episode_to_request() -> None:
    event = _event(Capture(), straddled=False)
    assert event.episode_id == "acme:req1" and event.segment_index == 0 and event.tenant == "acme"
    assert event.policy_version == "v3" and event.trainable is True
    assert event.completion_logprobs == [-0.5, -0.25]


def test_a_completion_with_a_nul_or_a_lone_surrogate_is_captured_not_dead_lettered() -> None:
    """vLLM's JSON can carry a lone surrogate (a byte-level tokenizer's output), which orjson refuses
    and the stdlib reads (serving.aio.loads); with a NUL, the event is built with U+FFFD in their
    place, its token ids exact, and its JSON is UTF-8 for Kafka (docs/internals.md, Text of an
    interaction)."""
    import json

    from serving.aio import loads

    raw = json.dumps(UPSTREAM_COMPLETION).replace('" 7!"', '"\\u0000 7\\ud800!"').encode()
    upstream = loads(raw)
    generation = extract_completion(upstream, {"prompt": "Q\x00"})
    event = build_interaction(
        request_id="req1",
        tenant="acme",
        episode_id="acme:req1",
        capture=Capture(),
        model="rtrl-tiny",
        policy_version=3,
        generation=generation,
        sampling=sampling_params({}),
        straddled=False,
        created_at=datetime(2025, 1, 1, tzinfo=UTC),
    )
    assert (event.prompt, event.completion) == ("Q\ufffd", "\ufffd 7\ufffd!")
    assert (event.prompt_token_ids, event.completion_token_ids) == ([1, 2, 3], [41, 5])
    assert json.loads(event.model_dump_json().encode("utf-8"))["completion"] == "\ufffd 7\ufffd!"


def test_sampling_the_trainer_cannot_reproduce_is_captured_untrainable_with_its_reason() -> None:
    event = build_interaction(
        request_id="req1",
        tenant="acme",
        episode_id="acme:req1",
        capture=Capture(),
        model="rtrl-tiny",
        policy_version=3,
        generation=extract_completion(UPSTREAM_COMPLETION, {"prompt": "Q"}),
        sampling=sampling_params({"presence_penalty": 0.5}),
        straddled=False,
        created_at=datetime(2025, 1, 1, tzinfo=UTC),
        untrainable_reason="penalty",
    )
    assert (event.trainable, event.untrainable_reason) == (False, "penalty")
    with pytest.raises(ValueError, match="untrainable_reason"):
        type(event).model_validate(event.model_dump() | {"trainable": True})


def test_build_interaction_trainable_rules() -> None:
    assert _event(Capture(), straddled=True).trainable is False
    assert _event(Capture(role=Role.subagent), straddled=False).trainable is False
    assert _event(Capture(trainable=False), straddled=False).trainable is False
    multi = _event(Capture(episode_id="ep", segment_index=4, role=Role.orchestrator), straddled=False)
    assert (multi.episode_id, multi.segment_index, multi.role, multi.trainable) == (
        "acme:ep",
        4,
        Role.orchestrator,
        True,
    )
