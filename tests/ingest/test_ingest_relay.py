"""How a relayed stream ends (ingest/relay.py), driven as the ASGI server drives it: a client that
reads it all, one that hangs up, and one that stops reading (its sends never complete). Whatever
the ending, the upstream response is closed once, the server's in-flight count and the tenant's
slot come back, and the capture is handed on once, truncated unless the client got it all."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any, cast

import pytest

from ingest.relay import Relay, RelayResponse, Served
from ingest.routing import Server
from ingest.shaping import Capture, Requested
from ingest.slots import TenantSlots
from ingest.streaming import StreamCapture
from serving.aio import AsyncVllmClient, UpstreamResponse

pytestmark = pytest.mark.unit

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}  # what uvicorn's httptools gives
CHUNKS = 6


def sse_lines() -> list[str]:
    """A finished completion stream of CHUNKS tokens, as vLLM sends its lines."""
    lines = []
    for i in range(CHUNKS):
        choice = {
            "index": 0,
            "text": f"t{i}",
            "token_ids": [i],
            "logprobs": {"token_logprobs": [-0.5]},
            "finish_reason": "length" if i == CHUNKS - 1 else None,
        }
        lines += [f"data: {json.dumps({'id': 'c', 'choices': [choice]})}", ""]
    return [*lines, "data: [DONE]", ""]


class Upstream:
    """vLLM's streamed answer: its lines, and whether the gateway closed it."""

    def __init__(self) -> None:
        self.closed = 0

    async def aiter_lines(self) -> AsyncIterator[str]:
        for line in sse_lines():
            await asyncio.sleep(0)
            yield line

    async def aclose(self) -> None:
        self.closed += 1


class Ending:
    """One relayed stream and what its ending left behind."""

    def __init__(self, write_timeout_s: float = 5.0) -> None:
        self.upstream = Upstream()
        self.slots = TenantSlots(4)
        slot = self.slots.take("acme")
        assert slot is not None
        self.server = Server(client=cast(AsyncVllmClient, None), in_flight=1)  # as _call leaves it
        served = Served(self.server, "r1", "acme", "acme:r1", Capture(), False, {}, 1, None)
        self.finished: list[StreamCapture] = []
        self.slow_readers = 0
        relay = Relay(
            served,
            cast(UpstreamResponse, self.upstream),
            Requested(logprobs=False, token_ids=False),
            self._finish,
            slot.release,
        )
        self.response = RelayResponse(
            relay, headers={}, write_timeout_s=write_timeout_s, on_slow_reader=self._slow
        )

    def _finish(self, served: Served, stream: StreamCapture, created_at: datetime) -> None:
        self.finished.append(stream)

    def _slow(self) -> None:
        self.slow_readers += 1

    def run(self, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]) -> None:
        asyncio.run(asyncio.wait_for(self.response(SCOPE, receive, send), timeout=10))

    def assert_released(self) -> StreamCapture:
        assert self.upstream.closed == 1
        assert self.server.in_flight == 0
        assert self.slots.held("acme") == 0
        [stream] = self.finished
        return stream


async def never_disconnects() -> Any:
    await asyncio.Event().wait()


def test_a_client_that_reads_it_all_gets_a_finished_stream() -> None:
    ending, sent = Ending(), []

    async def send(message: Any) -> None:
        sent.append(message)

    ending.run(never_disconnects, send)
    stream = ending.assert_released()
    assert not stream.truncated and stream.chunks == CHUNKS
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert ending.slow_readers == 0


def test_a_client_that_hangs_up_mid_stream_gets_a_truncated_capture() -> None:
    ending, hung_up = Ending(), asyncio.Event()
    bodies = 0

    async def send(message: Any) -> None:
        nonlocal bodies
        bodies += message["type"] == "http.response.body"
        if bodies == 2:
            hung_up.set()
        await asyncio.sleep(0.01)

    async def receive() -> Any:
        await hung_up.wait()
        return {"type": "http.disconnect"}

    ending.run(receive, send)
    stream = ending.assert_released()
    assert stream.truncated and 2 <= stream.chunks < CHUNKS
    assert ending.slow_readers == 0
    assert not stream.upstream_failed  # the client's doing: not an error in a live canary's counts


def test_a_client_that_stops_reading_is_ended_after_the_write_timeout() -> None:
    """The third chunk's send never completes (the client's socket is full): 0.1 s later the
    stream is ended, vLLM's response closed, and the capture truncated with the reason."""
    ending = Ending(write_timeout_s=0.1)
    bodies = 0

    async def send(message: Any) -> None:
        nonlocal bodies
        bodies += message["type"] == "http.response.body"
        if bodies == 3:
            await asyncio.Event().wait()  # what uvicorn's send does while the transport is paused

    ending.run(never_disconnects, send)
    stream = ending.assert_released()
    assert stream.truncated and stream.chunks == 3
    assert stream.problem == "the client took no chunk of the stream for 0.1s; the gateway ended it"
    assert ending.slow_readers == 1
    assert not stream.upstream_failed


def test_a_stream_vllm_cuts_short_is_an_upstream_failure() -> None:
    """vLLM's connection is lost after the second chunk: the client's stream ends, the capture is
    truncated, and the stream counts as an error for a live canary (ingest/canary_traffic.py)."""
    from serving.aio import UpstreamFailed

    ending = Ending()

    async def cut() -> AsyncIterator[str]:
        for line in sse_lines()[:4]:
            yield line
        raise UpstreamFailed("http://vllm: connection lost")

    ending.upstream.aiter_lines = cut  # type: ignore[method-assign]

    async def send(message: Any) -> None:
        pass

    ending.run(never_disconnects, send)
    stream = ending.assert_released()
    assert stream.truncated and stream.upstream_failed and stream.chunks == 2
    assert stream.problem is not None and "upstream stream failed" in stream.problem


def test_a_stream_vllm_ends_without_done_is_an_upstream_failure() -> None:
    ending = Ending()

    async def short() -> AsyncIterator[str]:
        for line in sse_lines()[:4]:
            yield line

    ending.upstream.aiter_lines = short  # type: ignore[method-assign]

    async def send(message: Any) -> None:
        pass

    ending.run(never_disconnects, send)
    stream = ending.assert_released()
    assert stream.truncated and stream.upstream_failed and stream.chunks == 2
