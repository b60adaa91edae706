"""Which vLLM server serves a request, and with which weight version.

Servers come from ``settings.vllm.servers`` (never the staging server, which only the eval gate
and the deployer use); each is reached through a `serving.AsyncVllmClient` on the gateway's
connection pool. Requests go round robin; a server that refuses connections is skipped for
`DOWN_FOR_S` seconds and the request goes to the next one (a refused connection never reached
vLLM, so retrying it elsewhere cannot duplicate a generation).

Weight versions: each server answers ``GET /weight_info`` with the version the deployer set
(``"v3"``). The gateway reads the version before and after each generation: "before" may be the
server's cached value if it was read less than `VERSION_CACHE_S` ago (the previous request's
"after" read under load), "after" is always a fresh read, made after the response was sent. A
swap pauses the server (``/pause?mode=wait``) so one generation never spans two sets of weights,
but a request that read "before" ahead of a swap can be generated after it; when before != after
the gateway cannot tell which weights produced it. See `ingest.app` for what it does then.

Caveat: the check assumes a version is not reused within one request's window. A rollback that
sets the previous version again within `VERSION_CACHE_S` plus a generation's latency could hide a
straddle; the deployer's swap (pause, reload, verify, resume) takes longer than that.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import httpx

from ingest.errors import IngestError
from schemas.settings import VllmSettings
from serving import AsyncVllmClient, VersionUnknown

DOWN_FOR_S = 2.0
VERSION_CACHE_S = 1.0


class UpstreamUnavailable(IngestError):
    """No vLLM server accepted the connection."""


@dataclass
class Server:
    """One serving vLLM server and what the gateway knows about it."""

    client: AsyncVllmClient
    down_until: float = 0.0
    version: int | None = None
    version_read_at: float = field(default=-1e18)

    @property
    def url(self) -> str:
        return self.client.url


class Fleet:
    """Round-robin choice among the serving vLLM servers, with their weight versions."""

    def __init__(self, vllm: VllmSettings, http: httpx.AsyncClient) -> None:
        urls = [u.rstrip("/") for u in vllm.servers]
        if not urls:
            raise IngestError("settings.vllm.servers is empty: the gateway has nothing to serve from")
        staging = (vllm.staging_server or "").rstrip("/")
        if staging and staging in urls:
            raise IngestError(f"the staging server {staging} must not serve users; remove it from vllm.servers")
        self.timeout_s = vllm.request_timeout_s
        self.servers = [Server(AsyncVllmClient(u, http, timeout_s=vllm.request_timeout_s)) for u in urls]
        self._turn = itertools.count()

    def order(self) -> list[Server]:
        """Servers to try for the next request: round robin, servers recently down last."""
        start = next(self._turn) % len(self.servers)
        rotated = self.servers[start:] + self.servers[:start]
        now = time.monotonic()
        return [s for s in rotated if s.down_until <= now] + [s for s in rotated if s.down_until > now]

    def mark_down(self, server: Server) -> None:
        server.down_until = time.monotonic() + DOWN_FOR_S

    async def read_version(self, server: Server) -> int:
        """A fresh version read (refreshes the cache). Raises httpx errors and VersionUnknown."""
        version = await server.client.weight_version()
        if version is None:
            raise VersionUnknown(f"{server.url} was never given a weight version (run `rtrl deploy bootstrap`)")
        server.version, server.version_read_at = version, time.monotonic()
        return version

    async def version_before(self, server: Server) -> int:
        """The version before a generation: the cached one if fresh enough, else a fresh read."""
        if server.version is not None and time.monotonic() - server.version_read_at < VERSION_CACHE_S:
            return server.version
        return await self.read_version(server)

    async def health(self) -> dict[str, bool]:
        """``GET /health`` of every server, concurrently: url -> healthy."""
        results = await asyncio.gather(*(s.client.health() for s in self.servers))
        return {s.url: ok for s, ok in zip(self.servers, results, strict=True)}
