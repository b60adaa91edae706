"""The gateway's client of its vLLM servers: async, on aiohttp.

The gateway makes one upstream call per user request, so the client's own cost is paid on every
request. aiohttp's client costs about a quarter of httpx's async client per call (0.2-0.3 ms of CPU
against 1.0-1.2 ms, measured side by side on the machine of docs/platform.md), and it sends a
small request's headers and body in one write, which wakes vLLM once instead of twice.

Errors are the serving package's, so the gateway decides on them without knowing the transport:

* `UpstreamRefused`: the connection was not made; vLLM never saw the request (safe to send it to
  another server);
* `UpstreamNoConnection`: no connection within the pool's acquire timeout (every connection of the
  pool in use, or the server slow to accept one); vLLM never saw the request, and another server
  would wait for the same pool;
* `UpstreamTimeout`: no byte for ``timeout_s`` (connecting, or between two reads of a body);
* `UpstreamFailed`: anything else on the way (a reset, a malformed answer, a stream cut short).

A `UpstreamResponse` is returned whatever vLLM's status; its body is read whole (`post`) or left
for the caller to read line by line and close (`open_stream`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from serving.client import PROBE_TIMEOUT_S, adapter_versions_of, weight_version_of
from serving.errors import ServingError


class UpstreamError(ServingError):
    """A call to a vLLM server that did not get an answer."""


class UpstreamRefused(UpstreamError):
    """The server refused the connection (or could not be reached): it never saw the request."""


class UpstreamNoConnection(UpstreamError):
    """No connection within the pool's acquire timeout (`new_session`): the request never left."""


class UpstreamTimeout(UpstreamError):
    """The server sent nothing for the client's timeout."""


class UpstreamFailed(UpstreamError):
    """The call failed after the connection was made (reset, malformed answer, stream cut short)."""


def _upstream_error(url: str, exc: BaseException) -> UpstreamError:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # before TimeoutError: it is one too
        return UpstreamNoConnection(f"{url}: no connection in time ({exc!r})")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamRefused(f"{url}: {exc}")
    if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError is one too
        return UpstreamTimeout(f"{url}: no answer in time ({exc!r})")
    return UpstreamFailed(f"{url}: {exc!r}")


_JSON_HEADERS = {"content-type": "application/json"}


def loads(raw: bytes | str) -> Any:
    """JSON from vLLM, parsed with orjson (5x the stdlib on a completion, docs/internals.md); what
    orjson refuses but the stdlib reads (NaN, Infinity, lone surrogates) is read by the stdlib, so
    an odd answer parses as it always did. Raises ValueError for what is not JSON at all."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def new_session(max_connections: int = 1024, acquire_timeout_s: float | None = None) -> aiohttp.ClientSession:
    """The gateway's connection pool to every vLLM server (one per gateway process; close it).

    At most `max_connections` at once (``gateway.upstream_connections``); a call waits at most
    `acquire_timeout_s` for one (a free one of the pool, or a new one made: aiohttp's ``connect``
    timeout covers both, ``sock_connect`` only the latter), then raises `UpstreamNoConnection`.
    Without it a call would wait for a free connection as long as it takes (issue 37: streams no
    one reads held every connection, and the gateway hung for everyone).
    """
    return aiohttp.ClientSession(
        # Idle connections are dropped before vLLM's own keep-alive timeout (5 s) closes them, so
        # a request never goes out on a connection the server is closing.
        connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, keepalive_timeout=4.0),
        # No cookies, no decompression surprises: vLLM's answers are small JSON or event streams.
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        # The pool's acquire timeout; `AsyncVllmClient` carries it into its own per-call timeouts.
        timeout=aiohttp.ClientTimeout(total=None, connect=acquire_timeout_s),
    )


class UpstreamResponse:
    """vLLM's answer: status, content type, and its body (read whole, or as a stream of lines)."""

    def __init__(self, url: str, response: aiohttp.ClientResponse, body: bytes | None) -> None:
        self._url = url
        self._response = response
        self.status_code = response.status
        self.content_type = response.headers.get("content-type")
        self.content = body if body is not None else b""

    def json(self) -> Any:
        return loads(self.content)

    async def aread(self) -> bytes:
        """The rest of a streamed body."""
        try:
            self.content = await self._response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _upstream_error(self._url, exc) from exc
        return self.content

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The lines of a streamed body, without their line ends."""
        try:
            async for line in self._response.content:
                yield line.decode().rstrip("\r\n")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _upstream_error(self._url, exc) from exc

    async def aclose(self) -> None:
        """Give the connection back (a stream read to its end) or drop it (one left half-read)."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class AsyncVllmClient:
    """One vLLM server for the gateway, on the gateway's `new_session` pool (the caller closes it).

    `timeout_s` bounds connecting and each wait for data, not a whole generation or stream; the
    session's ``connect`` timeout (`new_session`) bounds the wait for a connection of the pool.
    """

    def __init__(self, base_url: str, http: aiohttp.ClientSession, *, timeout_s: float) -> None:
        self.url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = http
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=http.timeout.connect, sock_connect=timeout_s, sock_read=timeout_s
        )
        self._probe_timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)

    async def health(self) -> bool:
        try:
            async with self._http.get(f"{self.url}/health", timeout=self._probe_timeout) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def weight_version(self) -> int | None:
        """The policy version the server reports (None: never given one). Raises UpstreamError and
        VersionUnknown."""
        try:
            async with self._http.get(f"{self.url}/weight_info", timeout=self._probe_timeout) as response:
                text = await response.text()
                status = response.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _upstream_error(self.url, exc) from exc
        return weight_version_of(self.url, status, text)

    async def adapter_versions(self) -> dict[str, int | None]:
        """The LoRA adapters the server holds, with the version each was loaded from
        (`serving.client.adapter_versions_of`). Raises UpstreamError."""
        try:
            async with self._http.get(f"{self.url}/v1/models", timeout=self._probe_timeout) as response:
                if response.status != 200:
                    raise UpstreamError(f"{self.url}/v1/models -> HTTP {response.status}")
                body = loads(await response.read())
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _upstream_error(self.url, exc) from exc
        return adapter_versions_of(body)

    async def post(self, path: str, body: dict[str, Any]) -> UpstreamResponse:
        """POST a JSON body (an OpenAI request) and return vLLM's answer, read whole, whatever its
        status. Raises UpstreamError."""
        try:
            async with self._http.post(
                f"{self.url}{path}", data=orjson.dumps(body), headers=_JSON_HEADERS, timeout=self._timeout
            ) as response:
                return UpstreamResponse(self.url, response, await response.read())
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _upstream_error(self.url, exc) from exc

    async def open_stream(self, path: str, body: dict[str, Any]) -> UpstreamResponse:
        """POST a JSON body and return vLLM's answer with its body unread (``stream: true``); the
        caller reads it with ``aiter_lines`` (or ``aread``) and must ``aclose`` it. Raises
        UpstreamError."""
        try:
            response = await self._http.post(
                f"{self.url}{path}", data=orjson.dumps(body), headers=_JSON_HEADERS, timeout=self._timeout
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _upstream_error(self.url, exc) from exc
        return UpstreamResponse(self.url, response, None)
