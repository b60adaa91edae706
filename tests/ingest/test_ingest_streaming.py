"""Capturing a stream (ingest/streaming.py) from chunks in the shape vLLM streams them."""

from __future__ import annotations

import pytest

from ingest.shaping import Requested, extract_chat, extract_completion
from ingest.streaming import StreamCapture, shape_chunk

pytestmark = pytest.mark.unit

NOTHING = Requested(logprobs=False, token_ids=False)


def completion_chunks() -> list[dict[str, object]]:
    first = {
        "id": "c",
        "object": "text_completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": " 7",
                "logprobs": {"token_logprobs": [-0.5], "tokens": [" 7"]},
                "finish_reason": None,
                "prompt_token_ids": [1, 2, 3],
                "token_ids": [40],
            }
        ],
    }
    second = {
        "id": "c",
        "object": "text_completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "!",
                "logprobs": {"token_logprobs": [-1.25], "tokens": ["!"]},
                "finish_reason": "stop",
                "token_ids": [41],
            }
        ],
    }
    usage = {
        "id": "c",
        "object": "text_completion",
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    return [first, second, usage]


def test_a_completion_stream_amounts_to_the_non_streaming_response() -> None:
    capture = StreamCapture(chat=False)
    for chunk in completion_chunks():
        capture.add(chunk)
    assert capture.truncated  # no [DONE] yet
    capture.done = True
    assert not capture.truncated
    generation = extract_completion(capture.payload(), {"prompt": "Q: 3+4?\nA:"})
    assert (generation.completion, generation.completion_token_ids, generation.completion_logprobs) == (
        " 7!",
        [40, 41],
        [-0.5, -1.25],
    )
    assert generation.prompt_token_ids == [1, 2, 3] and generation.finish_reason == "stop"
    assert capture.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_a_chat_stream_amounts_to_the_non_streaming_response() -> None:
    capture = StreamCapture(chat=True)
    capture.add(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": [1, 2],
            "prompt_text": "<s>Q",
        }
    )
    capture.add(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "Hi"},
                    "token_ids": [9],
                    "logprobs": {"content": [{"token": "Hi", "logprob": -0.1}]},
                    "finish_reason": None,
                }
            ]
        }
    )
    capture.add(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {},
                    "token_ids": [1],
                    "finish_reason": "stop",
                    "logprobs": {"content": [{"token": "</s>", "logprob": -0.2}]},
                }
            ]
        }
    )
    capture.done = True
    generation = extract_chat(capture.payload())
    assert (generation.prompt, generation.prompt_token_ids, generation.completion) == ("<s>Q", [1, 2], "Hi")
    assert (generation.completion_token_ids, generation.completion_logprobs) == ([9, 1], [-0.1, -0.2])
    assert not capture.truncated


@pytest.mark.parametrize(
    ("chunks", "done", "problem"),
    [
        (completion_chunks()[:1], False, None),  # the client went away mid-generation
        (completion_chunks()[:1], True, None),  # [DONE] without a finish reason
        ([*completion_chunks()[:1], {"error": {"message": "engine dead"}}], True, "error mid-stream"),
        ([*completion_chunks(), ["not", "an", "object"]], True, "not a JSON object"),
    ],
)
def test_a_stream_that_did_not_finish_is_truncated(
    chunks: list[object], done: bool, problem: str | None
) -> None:
    capture = StreamCapture(chat=False)
    for chunk in chunks:
        capture.add(chunk)
    capture.done = done
    assert capture.truncated
    assert (capture.problem is None) if problem is None else (problem in (capture.problem or ""))


def test_chunks_lose_what_the_client_did_not_ask_for() -> None:
    chunk = completion_chunks()[0]
    shape_chunk(chunk, NOTHING, chat=False)
    assert chunk["choices"] == [{"index": 0, "text": " 7", "logprobs": None, "finish_reason": None}]  # type: ignore[comparison-overlap]
    kept = completion_chunks()[0]
    shape_chunk(kept, Requested(logprobs=True, token_ids=True), chat=False)
    assert kept == completion_chunks()[0]
    chat = {
        "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [3], "logprobs": {"content": []}}],
        "prompt_token_ids": [1],
        "prompt_text": "p",
    }
    shape_chunk(chat, NOTHING, chat=True)
    assert chat == {"choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None}]}
