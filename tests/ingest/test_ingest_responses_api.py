"""OpenAI's Responses API over vLLM's chat completions (ingest/responses_api.py,
ingest/responses_stream.py): requests translated field by field and refused with a 400 naming the
field, vLLM's chat answers and streams translated back into what the official ``openai`` client
parses (its pydantic types, and its own stream state on the gateway's exact bytes), the relay's
guarantees kept for a Responses stream, and the capture of a Responses call the chat one's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any, cast

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from ingest.forwarding import RequestPolicy
from ingest.relay import Relay, Served
from ingest.responses_api import MAX_INPUT_ITEMS, Echo, response_body, to_chat
from ingest.responses_stream import ResponsesStream
from ingest.routing import Server
from ingest.shaping import (
    Capture,
    Requested,
    RequestError,
    build_interaction,
    extract_chat,
    parse_capture,
    prepare_chat_request,
)
from ingest.streaming import StreamCapture
from schemas.clock import utcnow
from schemas.events import SamplingParams
from serving import ServingError
from serving.aio import AsyncVllmClient, UpstreamResponse

pytestmark = pytest.mark.unit

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
POLICY = RequestPolicy(
    fields=frozenset({"model", "messages", "max_tokens", "temperature", "top_p", "seed", "stream"})
    | frozenset({"stream_options", "user", "tools", "tool_choice", "parallel_tool_calls"}),
    max_tokens=512,
    default_max_tokens=256,
    max_top_logprobs=5,
    model="tiny",
    salt_key=b"k" * 32,
)
WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


# ---- requests --------------------------------------------------------------------------------


def test_every_field_is_translated_into_the_chat_request() -> None:
    chat, echo = to_chat(
        {
            "model": "tiny",
            "instructions": "Answer briefly.",
            "input": [
                {"role": "developer", "content": "Use metric units."},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Weather in "},
                        {"type": "input_text", "text": "Oslo?"},
                    ],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Checking."}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "weather",
                    "arguments": '{"city":"Oslo"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "4 C, rain"},
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "weather"},
            "parallel_tool_calls": False,
            "max_output_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "stream": True,
            "metadata": {"run": "7"},
            "user": "u1",
            "store": True,
            "rtrl": {"episode_id": "ep"},
        }
    )
    assert chat == {
        "model": "tiny",
        "temperature": 0.7,
        "top_p": 0.9,
        "user": "u1",
        "stream": True,
        "parallel_tool_calls": False,
        "rtrl": {"episode_id": "ep"},
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "system", "content": "Use metric units."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "4 C, rain"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {k: v for k, v in WEATHER.items() if k != "type"},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "max_tokens": 64,
    }
    assert echo.metadata == {"run": "7"} and echo.max_output_tokens == 64
    assert echo.tools == [WEATHER] and echo.parallel_tool_calls is False


def test_a_string_input_is_one_user_message_and_a_bare_call_makes_an_assistant_message() -> None:
    assert to_chat({"input": "hi"})[0] == {"messages": [{"role": "user", "content": "hi"}]}
    chat, _ = to_chat(
        {
            "input": [
                {"role": "user", "content": "go"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            ]
        }
    )
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }


def test_the_translated_request_takes_the_chat_path() -> None:
    """Through the forwarding policy and `prepare_chat_request` as a chat request is: token ids and
    logprobs asked of vLLM, the tenant's salt, the budget."""
    chat, _ = to_chat(
        {"model": "tiny", "input": "hi", "max_output_tokens": 8, "tools": [WEATHER], "stream": True}
    )
    forward, requested, body_rtrl = prepare_chat_request(POLICY.apply(chat, True, "acme"))
    assert forward["logprobs"] is True and forward["return_token_ids"] is True and forward["max_tokens"] == 8
    assert forward["cache_salt"] == POLICY.cache_salt("acme") and requested == Requested(False, False, False)
    with pytest.raises(RequestError, match="max_tokens=4096 is over"):  # the chat check, on max_output_tokens
        POLICY.apply(to_chat({"input": "hi", "max_output_tokens": 4096})[0], True, "acme")
    with pytest.raises(RequestError, match="model 'gpt-4o' is not served"):
        POLICY.apply(to_chat({"input": "hi", "model": "gpt-4o"})[0], True, "acme")


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "'previous_response_id'.*whole conversation"),
        ({"input": "hi", "conversation": "conv_1"}, "'conversation'.*no server-side state"),
        ({"input": "hi", "background": True}, "'background'"),
        ({"input": "hi", "prompt": {"id": "p"}}, "'prompt'"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, "'reasoning'"),
        ({"input": "hi", "top_logprobs": 2}, "'top_logprobs'"),
        ({"input": "hi", "max_tool_calls": 2}, "'max_tool_calls'"),
        ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "'text'.*json_object"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, r"tools\[0\] is a 'web_search' tool"),
        ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "'file_search'"),
        ({"input": "hi", "tools": [{"type": "code_interpreter"}]}, "'code_interpreter'"),
        ({"input": "hi", "tools": [{"type": "computer_use_preview"}]}, "'computer_use_preview'"),
        ({"input": "hi", "tools": [{"type": "function"}]}, r"tools\[0\].name"),
        ({"input": "hi", "tools": [{**WEATHER, "parameters": "x"}]}, "parameters must be a JSON schema"),
        ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice must be"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            "'input_image' part",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "'input_file' part",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "'reasoning' item"),
        ({"input": [{"role": "tool", "content": "x"}]}, r"input\[0\].role"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
            "arguments must be a string",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, r"input\[0\].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, r"input\[0\].output"),
        ({"input": [5]}, r"input\[0\] must be an object"),
        ({"input": [{"role": ["user"], "content": "x"}]}, r"input\[0\].role"),
        ({"input": "hi", "text": {"format": "json"}}, "'text'.*'json'"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}, "'input_text' part"),
        ({"input": [{"role": "user", "content": ["plain"]}]}, "'str' part"),
        ({"input": {"role": "user"}}, "input must be a list"),
        ({"input": []}, "input must not be empty"),
        ({}, "input is required"),
        ({"input": "hi", "instructions": ["x"]}, "instructions must be a string"),
        ({"input": "hi", "metadata": {"a": 1}}, "metadata must be an object of strings"),
        ({"input": "hi", "tools": {"type": "function"}}, "tools must be a list"),
        ({"input": "hi", "frobnicate": 1}, "'frobnicate' is not a field of /v1/responses"),
        ({"input": ["x"] * (MAX_INPUT_ITEMS + 1)}, f"at most {MAX_INPUT_ITEMS}"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_what_rtrl_cannot_honour_is_a_400_naming_it(body: Any, names: str) -> None:
    with pytest.raises(RequestError, match=names) as raised:
        to_chat(body)
    assert raised.value.status_code == 400


def test_wrong_types_reaching_the_chat_checks_are_400s() -> None:
    with pytest.raises(RequestError, match="stream must be true or false"):
        prepare_chat_request(POLICY.apply(to_chat({"input": "hi", "stream": "yes"})[0], True, "acme"))
    for limit in ("8", 0, True, 1.5):
        with pytest.raises(RequestError, match="max_output_tokens must be a positive integer"):
            to_chat({"input": "hi", "max_output_tokens": limit})
    _, _, body_rtrl = prepare_chat_request(
        POLICY.apply(to_chat({"input": "hi", "rtrl": {"tenant": "x"}})[0], True, "a")
    )
    with pytest.raises(RequestError, match="tenant comes from the API key"):
        parse_capture({}, body_rtrl)


def test_store_and_the_ignored_fields_are_accepted_and_nothing_is_stored() -> None:
    body = {"input": "hi", "store": True, "include": [], "truncation": "disabled", "background": False}
    chat, echo = to_chat({**body, "service_tier": "auto", "prompt_cache_key": "k", "stream_options": {}})
    assert chat == {"messages": [{"role": "user", "content": "hi"}]}
    assert response_body(chat_answer("ok"), echo, "r.1", "v1", 1.0)["store"] is False


# ---- responses -------------------------------------------------------------------------------


def chat_answer(
    content: str | None, tool_calls: list[Any] | None = None, finish: str = "stop"
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": tool_calls or []},
                "logprobs": {"content": [{"token": "o", "logprob": -0.1}, {"token": "k", "logprob": -0.2}]},
                "token_ids": [11, 12],
                "finish_reason": finish,
            }
        ],
        "prompt_token_ids": [1, 2, 3],
        "prompt_text": "<user>hi</user>",
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def test_a_chat_answer_is_a_response_the_official_types_accept() -> None:
    body = response_body(chat_answer("Hello!"), Echo(model="tiny", metadata={"a": "b"}), "abc.def", "v3", 1.0)
    response = Response.model_validate(body)
    assert (
        response.id == "resp_abc.def" and response.status == "completed" and response.output_text == "Hello!"
    )
    assert response.usage is not None and (response.usage.input_tokens, response.usage.output_tokens) == (
        3,
        2,
    )
    assert response.usage.total_tokens == 5 and response.metadata == {"a": "b"}
    assert body["rtrl"] == {"request_id": "abc.def", "policy_version": "v3"}


def test_tool_calls_are_function_call_items_and_a_cut_answer_is_incomplete() -> None:
    call = {
        "id": "call_9",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
    }
    response = Response.model_validate(
        response_body(chat_answer(None, [call]), Echo(tools=[WEATHER]), "r", "v", 1.0)
    )
    [item] = response.output
    assert item.type == "function_call" and (item.call_id, item.name, item.arguments) == (
        "call_9",
        "weather",
        '{"city":"Oslo"}',
    )
    cut = Response.model_validate(response_body(chat_answer("Hel", finish="length"), Echo(), "r", "v", 1.0))
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.output_text == "Hel"


# ---- streams ---------------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": {"content": [{"token": "t", "logprob": -0.5}]},
        "token_ids": [7],
        "finish_reason": finish,
    }
    return {"id": "chatcmpl-1", "model": "tiny", "choices": [choice], **extra}


TEXT_CHUNKS = [
    chunk({"role": "assistant", "content": ""}, prompt_token_ids=[1, 2], prompt_text="p"),
    chunk({"content": "Hel"}),
    chunk({"content": "lo"}, finish="stop"),
    {
        "id": "chatcmpl-1",
        "model": "tiny",
        "choices": [],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2},
    },
]
CALL_CHUNKS = [
    chunk({"role": "assistant", "content": "Let me check."}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": ""},
                }
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}, finish="tool_calls"),
]


def events_of(chunks: list[dict[str, Any]], done: bool = True) -> bytes:
    stream = ResponsesStream(Echo(model="tiny", tools=[WEATHER]), "abc.def", "v1")
    out = b"".join(b"".join(stream.chunk(c)) for c in chunks)
    return out + b"".join(stream.done() if done else stream.failed("vLLM went away"))


def parsed(raw: bytes) -> list[Any]:
    """The events as the wire carries them (``event:`` names their ``type``), each validated."""
    events = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_a_text_stream_is_the_event_sequence_openai_sends() -> None:
    events = parsed(events_of(TEXT_CHUNKS))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == final.output_text
        == "Hello"
    )
    assert final.usage.input_tokens == 2 and final.usage.total_tokens == 4 and final.status == "completed"


def test_a_tool_call_stream_closes_the_message_then_streams_the_arguments() -> None:
    events = parsed(events_of(CALL_CHUNKS))
    kinds = [e.type for e in events]
    assert kinds[kinds.index("response.output_item.done") + 1 :] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    message, call = events[-1].response.output
    assert message.type == "message" and call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == ("call_1", "weather", '{"city":"Oslo"}')


def test_a_stream_vllm_fails_ends_with_response_failed() -> None:
    events = parsed(events_of(TEXT_CHUNKS[:2], done=False))
    assert events[-1].type == "response.failed" and events[-1].response.error.message == "vLLM went away"
    errored = parsed(events_of([TEXT_CHUNKS[0], {"error": {"message": "engine dead"}}], done=False))
    assert [e.type for e in errored][-2:] == ["error", "response.failed"]


def official_client(raw: bytes, content_type: str = "text/event-stream") -> openai.OpenAI:
    """The official client reading `raw` as the gateway's answer (no network)."""
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, content=raw, headers={"content-type": content_type})
    )
    return openai.OpenAI(
        api_key="k", base_url="http://gateway/v1", http_client=httpx.Client(transport=transport)
    )


@pytest.mark.parametrize("chunks", [TEXT_CHUNKS, CALL_CHUNKS])
def test_the_official_client_parses_the_stream(chunks: list[dict[str, Any]]) -> None:
    raw = events_of(chunks)
    created = list(official_client(raw).responses.create(model="tiny", input="hi", stream=True))
    assert created[-1].type == "response.completed"
    with official_client(raw).responses.stream(
        model="tiny", input="hi", tools=[cast(Any, WEATHER)]
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == created[-1].response.output_text


def test_the_official_client_parses_the_body() -> None:
    raw = json.dumps(response_body(chat_answer("Hi there"), Echo(model="tiny"), "r", "v", 1.0)).encode()
    response = official_client(raw, "application/json").responses.create(model="tiny", input="hi")
    assert response.output_text == "Hi there" and response.status == "completed"


# ---- the relay and the capture ---------------------------------------------------------------


class Upstream:
    """vLLM's streamed chat answer as the relay reads it: its lines, then an optional failure."""

    def __init__(self, chunks: list[dict[str, Any]], done: bool = True, fail: bool = False) -> None:
        self.lines = [line for c in chunks for line in (f"data: {json.dumps(c)}", "")]
        self.lines += ["data: [DONE]", ""] if done else []
        self.fail, self.closed = fail, 0

    async def aiter_lines(self) -> AsyncIterator[str]:
        for line in self.lines:
            await asyncio.sleep(0)
            yield line
        if self.fail:
            raise ServingError("connection reset")

    async def aclose(self) -> None:
        self.closed += 1


def relayed(upstream: Upstream) -> tuple[bytes, StreamCapture]:
    server = Server("http://vllm", cast(AsyncVllmClient, None))
    server.in_flight = 1
    served = Served(server, "abc.def", "acme", "acme:abc.def", Capture(), True, {"stream": True}, 3, None)
    finished: list[StreamCapture] = []

    def finish(_: Served, stream: StreamCapture, __: datetime) -> None:
        finished.append(stream)

    responses = ResponsesStream(Echo(model="tiny"), "abc.def", "v3")
    relay = Relay(
        served, cast(UpstreamResponse, upstream), Requested(False, False), finish, responses=responses
    )

    async def read() -> bytes:
        return b"".join([part async for part in relay.chunks()])

    raw = asyncio.run(read())
    assert upstream.closed == 1 and server.in_flight == 0 and len(finished) == 1
    return raw, finished[0]


def test_a_relayed_responses_stream_is_captured_as_the_chat_stream() -> None:
    raw, stream = relayed(Upstream(TEXT_CHUNKS))
    assert parsed(raw)[-1].type == "response.completed" and b"[DONE]" not in raw
    assert not stream.truncated and stream.payload()["choices"][0]["message"]["content"] == "Hello"
    assert stream.prompt_token_ids == [1, 2] and stream.token_ids == [7, 7, 7]


def test_a_relayed_responses_stream_vllm_cuts_short_fails_and_is_truncated() -> None:
    for upstream in (Upstream(TEXT_CHUNKS[:2], done=False, fail=True), Upstream(TEXT_CHUNKS[:2], done=False)):
        raw, stream = relayed(upstream)
        assert parsed(raw)[-1].type == "response.failed"
        assert stream.truncated and stream.upstream_failed


def test_tool_results_are_prompt_tokens_never_completion_tokens() -> None:
    """A function_call_output goes to a ``tool`` message of the prompt; the event's completion (the
    only tokens trained on) is what the model sampled after it."""
    chat, _ = to_chat(
        {
            "input": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Oslo"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "TOOL-RESULT 4 C"},
            ]
        }
    )
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "TOOL-RESULT 4 C"}
    answer = chat_answer("It is 4 C.")
    answer["prompt_text"] = "<user>Weather in Oslo?</user><tool>TOOL-RESULT 4 C</tool>"
    event = build_interaction(
        request_id="r1",
        tenant="acme",
        episode_id="acme:r1",
        capture=Capture(),
        model="tiny",
        policy_version=1,
        generation=extract_chat(answer),
        sampling=SamplingParams(),
        straddled=False,
        created_at=utcnow(),
    )
    assert "TOOL-RESULT" in event.prompt and "TOOL-RESULT" not in event.completion
    assert event.prompt_token_ids == [1, 2, 3] and event.completion_token_ids == [11, 12]
