"""A streamed Response (``POST /v1/responses`` with ``stream: true``), from vLLM's chat chunks.

`ingest.relay.Relay` relays and captures vLLM's chat stream as for a chat completion (the capture,
truncation and the client going away are handled there, unchanged); with a `ResponsesStream` it
sends the client, instead of each chat chunk, the Responses API events that chunk amounts to, in
the order OpenAI's server sends them and the official ``openai`` client's stream state checks
(``response.created`` first, every item added before its deltas and done before the end):

    response.created, response.in_progress,
    per text:  output_item.added (message), content_part.added (output_text),
               output_text.delta..., output_text.done, content_part.done, output_item.done
    per call:  output_item.added (function_call), function_call_arguments.delta...,
               function_call_arguments.done, output_item.done
    response.completed (status completed, or incomplete when cut by max_output_tokens: then
    response.incomplete), with the whole response and its usage.

vLLM's error mid-stream becomes an ``error`` event, and a stream vLLM ended without finishing a
``response.failed`` event: the client's stream ends with a failure, not silently.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from ingest.responses_api import (
    Echo,
    finished,
    function_call_item,
    message_item,
    response_id,
    skeleton,
    usage,
)


class ResponsesStream:
    """The Responses API events of one streamed chat completion, built chunk by chunk."""

    def __init__(self, echo: Echo, request_id: str, policy_version: str) -> None:
        self.echo = echo
        self.response = skeleton(echo, response_id(request_id), time.time(), "in_progress", echo.model or "")
        self.response["rtrl"] = {"request_id": request_id, "policy_version": policy_version}
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items, in output order
        self.message: int | None = None  # the output index of the message being streamed, if one is open
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.open_calls: list[int] = []
        self.finish_reason: Any = None
        self.usage: Any = None
        self.ended = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    def _lifecycle(self, kind: str) -> bytes:
        return self._event(kind, response=self.response)

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk (already parsed; the first chunk also starts the response)."""
        events = []
        if self.sequence == 0:
            if chunk.get("model"):
                self.response["model"] = str(chunk["model"])
            events += [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            events.append(self.error(str(error.get("message") or "vLLM reported an error mid-stream")))
            return events
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(str(delta["content"]))
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    events += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def _text(self, delta: str) -> list[bytes]:
        events = []
        if self.message is None:
            self.message = len(self.output)
            item = message_item("", "in_progress")
            self.output.append(item)
            part = dict(item["content"][0])
            item["content"] = []
            events.append(self._event("response.output_item.added", output_index=self.message, item=item))
            item["content"].append(part)
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self.message,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            )
        item = self.output[self.message]
        item["content"][0]["text"] += delta
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=self.message,
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return events

    def _close_message(self, status: str) -> list[bytes]:
        if self.message is None:
            return []
        index, self.message = self.message, None
        item = self.output[index]
        part = item["content"][0]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        """One tool-call delta: vLLM names the call (id, function name) in its first delta of an
        index, then streams its arguments."""
        events = self._close_message("completed")  # vLLM streams a message's text before its calls
        function = call.get("function") or {}
        index = call.get("index", 0)
        if index not in self.calls:
            item = function_call_item({"id": call.get("id"), "function": {"name": function.get("name")}})
            item["status"] = "in_progress"
            self.calls[index] = len(self.output)
            self.open_calls.append(len(self.output))
            self.output.append(item)
            events.append(
                self._event("response.output_item.added", output_index=self.calls[index], item=dict(item))
            )
        output_index = self.calls[index]
        item = self.output[output_index]
        if function.get("name") and not item["name"]:
            item["name"] = str(function["name"])
        arguments = function.get("arguments")
        if arguments:
            item["arguments"] += str(arguments)
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=output_index,
                    delta=str(arguments),
                )
            )
        return events

    def done(self) -> list[bytes]:
        """The events that end a finished stream (vLLM's ``[DONE]``): every open item done, then
        ``response.completed`` (``response.incomplete`` when cut by the token limit)."""
        if self.ended:
            return []
        self.ended = True
        status = "incomplete" if self.finish_reason == "length" else "completed"
        events = [] if self.sequence else [self._lifecycle("response.created")]
        if self.message is None and not self.output:
            events += self._text("")  # an empty answer is still a message, as OpenAI's are
        events += self._close_message(status)
        for index in self.open_calls:
            item = self.output[index]
            item["status"] = status
            done = {"item_id": item["id"], "output_index": index}
            events.append(
                self._event("response.function_call_arguments.done", **done, arguments=item["arguments"])
            )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.open_calls = []
        self.response["output"] = self.output
        self.response["usage"] = usage(self.usage)
        finished(self.response, self.finish_reason)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        events.append(self._lifecycle(kind))
        return events

    def error(self, message: str) -> bytes:
        return self._event("error", code="server_error", message=message, param=None)

    def failed(self, problem: str) -> list[bytes]:
        """The events that end a stream vLLM did not finish: ``response.failed`` with the reason."""
        if self.ended:
            return []
        self.ended = True
        events = [] if self.sequence else [self._lifecycle("response.created")]
        self.response["status"] = "failed"
        self.response["output"] = self.output
        self.response["error"] = {"code": "server_error", "message": problem}
        events.append(self._lifecycle("response.failed"))
        return events
