"""Which vLLM server serves a request, and with which weight version.

Servers come from ``settings.vllm.servers`` (never the staging server, which only the eval gate
and the deployer use); each is reached through a `serving.AsyncVllmClient` on the gateway's
connection pool. Requests go round robin, or, when they name a session (``x-rtrl-session-id``),
to the session's own server (rendezvous hashing over the servers in rotation, so a session stays on
one server, and so on one version while a canary runs, and moves only when its server leaves). A
server that refuses connections is skipped for `DOWN_FOR_S` seconds and the request goes to the
next one (a refused connection never reached vLLM, so retrying it elsewhere cannot duplicate a
generation).

Rotation: the deployer takes a server out of rotation in the store before it drains and pauses it
for a swap, and puts it back once the swap is verified (`deployer.rollout.out_of_rotation`). The
gateway reads that every ``gateway.rotation_refresh_s`` (`Fleet.set_out`) and never sends a
request to a server out of rotation, so no request waits for a paused server; with every server
out, requests are answered 503 with ``Retry-After`` at once (`NoServerInRotation`).

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
import hashlib
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


class NoServerInRotation(IngestError):
    """Every serving vLLM server is out of rotation (being swapped or drained)."""


@dataclass
class Server:
    """One serving vLLM server and what the gateway knows about it."""

    client: AsyncVllmClient
    down_until: float = 0.0
    in_flight: int = 0  # requests the gateway has on it now
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
        self.out: frozenset[str] = frozenset()  # urls the deployer took out of rotation
        self._turn = itertools.count()

    def set_out(self, urls: frozenset[str]) -> None:
        """The servers out of rotation, as last read from the store."""
        self.out = urls

    @property
    def in_rotation(self) -> list[Server]:
        return [s for s in self.servers if s.url not in self.out]

    def order(self, session_id: str | None = None) -> list[Server]:
        """Servers to try for the next request: those in rotation, the session's own first (else
        round robin), servers recently down last. Raises NoServerInRotation when none is in."""
        serving = self.in_rotation
        if not serving:
            raise NoServerInRotation(f"every vLLM server is out of rotation ({', '.join(sorted(self.out))})")
        if session_id is not None:
            rotated = sorted(serving, key=lambda s: _affinity(session_id, s.url), reverse=True)
        else:
            start = next(self._turn) % len(serving)
            rotated = serving[start:] + serving[:start]
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


def _affinity(session_id: str, url: str) -> bytes:
    """Rendezvous-hash weight of a (session, server) pair: the highest wins the session."""
    return hashlib.blake2b(f"{session_id}\0{url}".encode(), digest_size=8).digest()
