"""A streamed generation on its way from vLLM to the client, and what the gateway remembers of it.

`Served` is one generation (streamed or not) as the capture (`ingest.capture`) needs it. `Relay`
relays vLLM's server-sent events to the client while capturing them (`ingest.streaming`), and
`RelayResponse` is its response: together they make sure a stream's capture is handed on exactly
once, however the stream ends.

A client that stops reading must not hold vLLM's connection: when the client does not take a chunk,
the server's send waits (uvicorn pauses writing once the socket's buffers are full), and the relay
with it, and its upstream connection and tenant slot stay held for as long as the client keeps
the connection open (issue 37: one tenant's unread streams took every connection of the pool).
`RelayResponse` gives every send ``gateway.stream_write_timeout_s``; past it the stream is ended:
the relay closes (upstream connection closed, so vLLM aborts the generation; slot given back), the
capture is truncated, as for a client that hung up, and the client's connection is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import anyio
from starlette.responses import StreamingResponse

from ingest.canary_traffic import Tally
from ingest.responses_stream import ResponsesStream
from ingest.routing import Announced, Server
from ingest.shaping import Capture, Requested
from ingest.streaming import DONE, StreamCapture, shape_chunk, sse, sse_json
from schemas.clock import utcnow
from schemas.versions import format_version
from serving import ServingError
from serving.aio import UpstreamResponse, loads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """One generation on its way through the gateway: where it went and what to capture of it."""

    server: Server
    request_id: str
    tenant: str
    episode_id: str  # in the tenant's namespace
    capture: Capture
    chat: bool
    forward: dict[str, Any]  # the body sent to vLLM
    before: int | None  # the server's version before the generation (None: unknown)
    announced: Announced | None  # the deployer's announcement when it was sent (ingest/routing.py)
    tally: Tally | None = None  # its part in a live canary's counts (ingest/canary_traffic.py)


class Relay:
    """One streamed generation on its way from vLLM to the client (ingest/streaming.py): `chunks`
    relays vLLM's server-sent events while capturing them; `close` gives the upstream connection
    back, takes the request off the server's in-flight count and hands the capture to `finish`,
    exactly once, however the stream ends: finished, vLLM gone, the client gone mid-stream (its
    disconnect cancels `chunks`), the client gone before the first chunk (`chunks` never runs;
    `RelayResponse` closes it then, and the empty capture is dead-lettered with the reason), or
    the client too slow to read (`RelayResponse` ends it). `release` (the tenant's slot,
    `ingest.slots`) is called then too. With `responses`, the client gets the Responses API's
    events the chat chunks amount to (ingest/responses_stream.py) instead of the chunks."""

    def __init__(
        self,
        served: Served,
        upstream: UpstreamResponse,
        requested: Requested,
        finish: Callable[[Served, StreamCapture, datetime], None],
        release: Callable[[], None] = lambda: None,
        responses: ResponsesStream | None = None,
    ) -> None:
        self.served = served
        self.responses = responses
        self.upstream = upstream
        self.requested = requested
        self.stream = StreamCapture(served.chat)
        self.created_at = utcnow()
        self._finish = finish
        self._release = release
        self._closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        served, stream = self.served, self.stream
        version = "unknown" if served.before is None else format_version(served.before)
        try:
            async for line in self.upstream.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data = line[5:].strip()
                if data == DONE:
                    stream.done = True
                    for event in self._done():
                        yield event
                    continue
                try:
                    chunk = loads(data)
                except ValueError:
                    stream.problem = stream.problem or f"unreadable stream chunk: {data[:200]!r}"
                    stream.upstream_failed = True
                    if self.responses is None:
                        yield sse(data)
                    continue
                stream.add(chunk)
                if self.responses is not None:
                    for event in self.responses.chunk(chunk) if isinstance(chunk, dict) else []:
                        yield event
                    continue
                if isinstance(chunk, dict) and "error" not in chunk:
                    shape_chunk(chunk, self.requested, served.chat)
                    if stream.chunks == 1:
                        chunk["rtrl"] = {"request_id": served.request_id, "policy_version": version}
                yield sse_json(chunk)
                # Let the event loop run between chunks. When vLLM is ahead of the client, the
                # upstream lines are already buffered, every await above returns at once, and the
                # whole stream would be relayed without the loop ever handling the client's hang-up
                # (seen on a loaded 2-core machine: streams relayed in full to clients long gone,
                # captured as finished instead of truncated) or serving other requests meanwhile.
                await asyncio.sleep(0)
        except ServingError as exc:  # vLLM went away mid-stream: the client sees the stream end
            stream.problem = stream.problem or f"upstream stream failed: {exc}"
            stream.upstream_failed = True
            log.warning("request %s: upstream stream failed: %s", served.request_id, exc)
            for event in self.responses.failed(stream.problem) if self.responses else []:
                yield event
        else:
            # vLLM's stream ended without [DONE]: its failure (a client's hang-up cancels this instead).
            stream.upstream_failed = stream.upstream_failed or not stream.done
            if self.responses is not None and stream.upstream_failed:
                for event in self.responses.failed(stream.problem or "vLLM ended the stream unfinished"):
                    yield event
        finally:
            with anyio.CancelScope(shield=True):  # runs even when the client's disconnect cancelled us
                await self.close()

    def _done(self) -> list[bytes]:
        """What ends a stream vLLM finished: ``[DONE]``, or the Responses API's last events (a
        failure when vLLM reported one mid-stream)."""
        if self.responses is None:
            return [sse(DONE)]
        problem = self.stream.problem
        return self.responses.done() if problem is None else self.responses.failed(problem)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.served.server.in_flight -= 1
        try:
            await self.upstream.aclose()
        finally:
            self._release()
            if self.stream.chunks == 0 and self.stream.problem is None:
                self.stream.problem = "the client went away before the stream started"
            self._finish(self.served, self.stream, self.created_at)


class SlowReader(Exception):
    """The client did not take a chunk of its stream within the write timeout."""


class RelayResponse(StreamingResponse):
    """A `Relay`'s event stream to the client; closes the relay when the response ends, even if
    its body never started (a client that disconnected at once), and ends it when a send to the
    client has waited `write_timeout_s` (`on_slow_reader` is called then; see the module
    docstring)."""

    def __init__(
        self,
        relay: Relay,
        headers: dict[str, str],
        write_timeout_s: float = 30.0,
        on_slow_reader: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(relay.chunks(), media_type="text/event-stream", headers=headers)
        self.relay = relay
        self.write_timeout_s = write_timeout_s
        self._on_slow_reader = on_slow_reader

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SlowReader:
            # The response stays incomplete: returning without finishing it makes the server drop
            # the connection (uvicorn logs "ASGI callable returned without completing response").
            stream = self.relay.stream
            stream.problem = stream.problem or (
                f"the client took no chunk of the stream for {self.write_timeout_s}s; the gateway ended it"
            )
            self._on_slow_reader()
            log.info("request %s: %s", self.relay.served.request_id, stream.problem)
        finally:
            with anyio.CancelScope(shield=True):
                await self.relay.close()

    async def stream_response(self, send: Any) -> None:
        """Starlette's, with a watch on each send: one that has waited `write_timeout_s` is
        cancelled and raises `SlowReader`. A timer per send would cost ~10 us a chunk (measured);
        the watch is one timer per quarter of the timeout, so a stuck send is ended between 1 and
        1.25 times the timeout after it began."""
        loop = asyncio.get_running_loop()
        timeout_s, every_s = self.write_timeout_s, self.write_timeout_s / 4
        sending_since: float | None = None
        timer: asyncio.TimerHandle | None = None

        async def watched(message: Any) -> None:
            nonlocal sending_since
            sending_since = loop.time()
            await send(message)
            sending_since = None

        with anyio.CancelScope() as stuck:

            def watch() -> None:
                nonlocal timer
                if sending_since is not None and loop.time() - sending_since >= timeout_s:
                    stuck.cancel()  # the task is waiting in that send: the cancellation lands there
                else:
                    timer = loop.call_later(every_s, watch)

            timer = loop.call_later(every_s, watch)
            try:
                await super().stream_response(watched)
            finally:
                if timer is not None:
                    timer.cancel()
        if stuck.cancelled_caught:
            raise SlowReader
