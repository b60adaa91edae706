"""Streamed completions (``stream: true``): relay vLLM's server-sent events, capture them on the way.

vLLM streams ``data: <chunk JSON>`` events and ends with ``data: [DONE]``. The gateway asked it for
token ids and logprobs (`ingest.shaping.prepare_*_request`), so every chunk carries the sampled
tokens' ids and behaviour logprobs; the first also the prompt's token ids (and, for chat, the
rendered prompt). `StreamCapture` accumulates those from each chunk, and `shape_chunk` then
removes from the chunk what the client did not ask for, in place, before it is relayed. The first
relayed chunk also carries the gateway's ``rtrl`` object (request id, serving version); the
request id is in the ``x-rtrl-request-id`` header as well. Usage reaches the client exactly when
it asked for it (``stream_options.include_usage``), as vLLM sends it.

When the stream ends, `StreamCapture.payload` is the response a non-streaming call would have
returned (as far as the capture needs it), so the event is built by the same
`ingest.shaping.extract_*` code. A stream that did not end with a finish reason and ``[DONE]``
(the client went away, vLLM failed mid-stream) is *truncated*: the event says so and is never
trained on, because its completion is only a prefix of what the policy produced.
"""

from __future__ import annotations

from typing import Any

import orjson

from ingest.shaping import Requested

DONE = "[DONE]"


class StreamCapture:
    """What one streamed choice produced, accumulated chunk by chunk."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.completion_logprobs: list[Any] = []  # completions: floats; chat: {"token", "logprob", ...}
        self.prompt_token_ids: list[int] | None = None
        self.prompt_text: str | None = None
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.done = False  # [DONE] seen
        self.chunks = 0
        self.problem: str | None = None  # an error event or an unreadable chunk in the stream
        # vLLM failed it (an error event, an unreadable chunk, the stream cut): not the client's doing
        self.upstream_failed = False

    def add(self, chunk: Any) -> None:
        """Take what the capture needs from one parsed chunk (before `shape_chunk` changes it)."""
        self.chunks += 1
        if not isinstance(chunk, dict):
            self.problem = self.problem or f"stream chunk is not a JSON object: {chunk!r:.200}"
            self.upstream_failed = True
            return
        if "error" in chunk:
            self.problem = self.problem or f"vLLM reported an error mid-stream: {chunk['error']!r:.500}"
            self.upstream_failed = True
            return
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        if self.chat:
            if chunk.get("prompt_token_ids") is not None:
                self.prompt_token_ids = list(chunk["prompt_token_ids"])
            if chunk.get("prompt_text") is not None:
                self.prompt_text = str(chunk["prompt_text"])
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                self.problem = (
                    self.problem or f"unexpected choice index {choice.get('index')!r} in the stream"
                )
                continue
            if self.chat:
                content = (choice.get("delta") or {}).get("content")
                entries = (choice.get("logprobs") or {}).get("content")
            else:
                content = choice.get("text")
                entries = (choice.get("logprobs") or {}).get("token_logprobs")
                if choice.get("prompt_token_ids") is not None:
                    self.prompt_token_ids = list(choice["prompt_token_ids"])
            if content:
                self.text.append(str(content))
            if entries:
                self.completion_logprobs.extend(entries)
            if choice.get("token_ids"):
                self.token_ids.extend(choice["token_ids"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    @property
    def truncated(self) -> bool:
        """True unless the generation finished (a finish reason, then [DONE]) without a problem."""
        return not (self.done and self.finish_reason is not None and self.problem is None)

    def payload(self) -> dict[str, Any]:
        """The non-streaming response this stream amounts to, in the shape `extract_*` read."""
        if self.chat:
            return {
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(self.text)},
                        "logprobs": {"content": self.completion_logprobs},
                        "token_ids": self.token_ids,
                        "finish_reason": self.finish_reason,
                    }
                ],
                "prompt_token_ids": self.prompt_token_ids,
                "prompt_text": self.prompt_text,
                "usage": self.usage,
            }
        return {
            "choices": [
                {
                    "index": 0,
                    "text": "".join(self.text),
                    "logprobs": {"token_logprobs": self.completion_logprobs},
                    "token_ids": self.token_ids,
                    "prompt_token_ids": self.prompt_token_ids,
                    "finish_reason": self.finish_reason,
                }
            ],
            "usage": self.usage,
        }


def shape_chunk(chunk: dict[str, Any], requested: Requested, chat: bool) -> dict[str, Any]:
    """Remove from a chunk, in place, the fields the gateway (not the client) asked vLLM for, as
    vLLM streams them when not asked: ``logprobs`` null, the token-id and prompt fields absent."""
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if not requested.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
        if not requested.token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
    if chat:
        if not requested.token_ids:
            chunk.pop("prompt_token_ids", None)
        if not requested.prompt_text:
            chunk.pop("prompt_text", None)
    return chunk


def sse(data: str) -> bytes:
    """One server-sent event carrying `data`."""
    return f"data: {data}\n\n".encode()


def sse_json(chunk: Any) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"
