"""The vLLM servers behind the gateway: which one serves a request, and with which weight version.

Servers come from ``settings.vllm.servers`` (never the staging server, which only the eval gate
and the deployer use). Requests go round robin; a server that refuses connections is skipped for
`DOWN_FOR_S` seconds and the request goes to the next one (a refused connection never reached
vLLM, so retrying it elsewhere cannot duplicate a generation).

Weight versions: each server answers ``GET /weight_info`` with ``{"weight_version": "v3"}``
(vLLM started with ``VLLM_SERVER_DEV_MODE=1``; the deployer sets it with
``/update_weight_version``). The gateway reads the version before and after each generation:
"before" may be the server's cached value if it was read less than `VERSION_CACHE_S` ago (the
previous request's "after" read under load), "after" is always a fresh read, made after the
response was sent. A swap pauses the
server (``/pause?mode=wait``) so one generation never spans two sets of weights, but a request
that read "before" ahead of a swap can be generated after it; when before != after the gateway
cannot tell which weights produced it. See `ingest.app` for what it does then.

Caveat: the check assumes a version string is not reused within one request's window. A rollback
that sets the previous version again within `VERSION_CACHE_S` plus a generation's latency could
hide a straddle; the deployer's swap (pause, reload, verify, resume) takes longer than that.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ingest import IngestError
from schemas.settings import VllmSettings

DOWN_FOR_S = 2.0
VERSION_CACHE_S = 1.0
PROBE_TIMEOUT_S = 2.0


class UpstreamUnavailable(IngestError):
    """No vLLM server accepted the connection."""


class VersionUnknown(IngestError):
    """A server did not report its weight version."""


@dataclass
class Server:
    url: str
    down_until: float = 0.0
    version: str | None = None
    version_read_at: float = field(default=-1e18)


class Fleet:
    """Round-robin client of the serving vLLM servers, with their weight versions."""

    def __init__(self, vllm: VllmSettings, client: httpx.AsyncClient) -> None:
        urls = [u.rstrip("/") for u in vllm.servers]
        if not urls:
            raise IngestError("settings.vllm.servers is empty: the gateway has nothing to serve from")
        staging = (vllm.staging_server or "").rstrip("/")
        if staging and staging in urls:
            raise IngestError(f"the staging server {staging} must not serve users; remove it from vllm.servers")
        self.servers = [Server(u) for u in urls]
        self.timeout_s = vllm.request_timeout_s
        self._client = client
        self._turn = itertools.count()

    def order(self) -> list[Server]:
        """Servers to try for the next request: round robin, servers recently down last."""
        start = next(self._turn) % len(self.servers)
        rotated = self.servers[start:] + self.servers[:start]
        now = time.monotonic()
        return [s for s in rotated if s.down_until <= now] + [s for s in rotated if s.down_until > now]

    def mark_down(self, server: Server) -> None:
        server.down_until = time.monotonic() + DOWN_FOR_S

    async def read_version(self, server: Server) -> str:
        """A fresh ``/weight_info`` read (refreshes the cache). Raises httpx.ConnectError, VersionUnknown."""
        response = await self._client.get(f"{server.url}/weight_info", timeout=PROBE_TIMEOUT_S)
        if response.status_code != 200:
            raise VersionUnknown(
                f"{server.url}/weight_info answered {response.status_code} "
                "(is the server started with VLLM_SERVER_DEV_MODE=1?)"
            )
        version = response.json().get("weight_version")
        if not isinstance(version, str) or not version:
            raise VersionUnknown(f"{server.url}/weight_info has no weight_version: {response.text[:200]}")
        server.version, server.version_read_at = version, time.monotonic()
        return version

    async def version_before(self, server: Server) -> str:
        """The version before a generation: the cached one if fresh enough, else a fresh read."""
        if server.version is not None and time.monotonic() - server.version_read_at < VERSION_CACHE_S:
            return server.version
        return await self.read_version(server)

    async def post(self, server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self._client.post(f"{server.url}{path}", json=body, timeout=self.timeout_s)

    async def health(self) -> dict[str, bool]:
        """``GET /health`` of every server, concurrently: url -> healthy."""

        async def probe(server: Server) -> bool:
            try:
                response = await self._client.get(f"{server.url}/health", timeout=PROBE_TIMEOUT_S)
            except httpx.HTTPError:
                return False
            return response.status_code == 200

        results = await asyncio.gather(*(probe(s) for s in self.servers))
        return {s.url: ok for s, ok in zip(self.servers, results, strict=True)}
