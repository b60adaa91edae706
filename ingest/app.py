"""The capture gateway's HTTP application. Started by ``rtrl gateway`` (`run`).

Every call to the API routes carries ``Authorization: Bearer <key>`` (what OpenAI clients send as
their api key): a tenant key for completions and feedback, an admin key for ``/metrics``
(`ingest.gateway.Gateway.authenticate`, `ingest.auth`; ``gateway.auth = open`` turns keys off for
local experiments). Missing or unknown keys are 401, the wrong kind of key 403, a key over its
rate 429 with ``Retry-After``; bodies over the route's limit are 413 before they are read
(`ingest.limits`). A tenant with ``gateway.max_concurrent_per_tenant`` completion requests or
streams in flight gets 429 with ``Retry-After`` for the next (`ingest.slots`); a request that gets no
connection to vLLM within ``gateway.upstream_acquire_timeout_s`` a 503; a stream whose client
takes no chunk for ``gateway.stream_write_timeout_s`` is ended (`ingest.relay`).

Endpoints, one module per role:

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (`ingest.completions`):
  OpenAI-compatible, streaming or not. The request goes to a vLLM server of the fleet with token
  ids and sampled-token logprobs added; the client gets the upstream body without those extras,
  an ``rtrl`` object (``{"request_id", "policy_version"}``; in the first chunk of a stream) and an
  ``x-rtrl-request-id`` header. After the response is sent (a stream: when it ends, however it
  ends, `ingest.relay`), an `InteractionEvent` stamped with the serving weight version and the
  key's tenant is published to ``settings.kafka.interactions_topic`` (`ingest.capture`). Upstream
  errors pass through with their status; no reachable server is a 502, an upstream timeout a 504.
- ``POST /v1/responses`` (`ingest.responses_api`, `ingest.responses_stream`): OpenAI's Responses
  API, translated into the chat completion it amounts to, which takes the chat path above (and is
  captured as that chat completion would be); vLLM's answer translated back into a Response object
  or its stream of events. What rtrl cannot honour (server-side state, built-in tools, images) is a
  400 naming the field.
- ``POST /v1/feedback`` (`ingest.feedback_route`): one feedback object or a list of them
  (`ingest.intake`): 202 with the stored event ids once they are on ``settings.kafka.feedback_topic``
  or fsynced in the spool, else 503 with ``Retry-After``
  (a client's ``event_id`` is its tenant's idempotency key: the stored id is derived from both);
  403/404 for another tenant's requests, 422 with the reason on bad input, before parsing for a
  body with more events or values than a valid one can have.
- ``GET /v1/models``, ``GET /v1/models/{id}`` (`ingest.served_models`): the served model name
  (the adapter's with ``trainer.adapter = lora``), from the settings, for any valid key.
- ``GET /healthz`` (the process is up), ``GET /readyz`` (a vLLM server answers; also reports
  Kafka, the spool and the keys), ``GET /metrics`` (Prometheus; admin key), ``GET /v1/whoami``
  (`ingest.operations`).

Capturing never fails or delays the user's response: events are built and handed to the
`ingest.publisher.Publisher` in a background task that runs after the response is sent, and an
event that cannot be built (e.g. the server did not report its version) becomes a
`DeadLetterRecord` on ``settings.kafka.dlq_topic`` with the reason.

The application's lifespan owns what the routes share (`ingest.gateway.Gateway`): the HTTP client
of the fleet, the store, the key cache, the publisher threads, and two background tasks that
follow the deployer (`follow_rotation`, `verify_announcements`).

Graceful shutdown (SIGTERM, docs/security.md, Accepted means durable): uvicorn stops accepting and
waits up to ``gateway.shutdown_grace_s`` for the requests in flight (a completion's capture runs
inside its request, a feedback request waits for its events to be durable); the lifespan then
waits up to as long again for the captures of streams (`finish_captures`), and closes the
publisher in a worker thread: what Kafka takes within ``publish_timeout_s`` is sent, the rest
spooled. Give the process that long (the manifests' terminationGracePeriodSeconds).

``gateway.workers`` > 1 runs this application in that many processes on one port, under a
supervisor that forwards SIGTERM to each (`ingest.prefork`); each worker drains as above.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import streams
from ingest import completions, feedback_route, operations, served_models
from ingest.auth import OPEN_CALLER, KeyCache, RequestIds, request_id_secret
from ingest.canary_traffic import FLUSH_EVERY_S, CanaryCounts
from ingest.forwarding import RequestPolicy
from ingest.gateway import Gateway
from ingest.limits import BodyLimit
from ingest.metrics import REFRESH_EVERY_S, GatewayMetrics
from ingest.publisher import Publisher
from ingest.redaction import Redactor
from ingest.responses import error
from ingest.routing import VERIFY_EVERY_S, Fleet, Server
from ingest.spool import adopt_spools
from schemas.rewards import get_spec
from schemas.sampling import served_defaults
from schemas.settings import Settings
from serving.aio import new_session
from store import Store

if TYPE_CHECKING:
    import uvicorn  # imported when the gateway runs (`run`), not when the app is built

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/feedback")

Handler = Callable[[Gateway, Request], Awaitable[Response]]
Connect = Callable[[], streams.Producer | None]
Lifespan = Callable[[Starlette], AbstractAsyncContextManager[None]]


def _in_flight_of(server: Server) -> Callable[[], float]:
    return lambda: server.in_flight


async def follow_rotation(
    fleet: Fleet, store: Store, every_s: float, traffic: CanaryFlush | None = None
) -> None:
    """Keep `fleet` up to date with the servers the deployer took out of rotation and the versions
    it announced, and flush a live canary's counts (`traffic`, ingest/canary_traffic.py). While the
    store cannot be read, the last rotation read stays in force (said once in the log);
    announcements age out by themselves (`Fleet.attributed`), and versions are then read from the
    servers; the counts wait for the next flush."""
    failing = False
    while True:
        if traffic is not None:
            traffic.tick(store)
        read_at = time.monotonic()
        try:
            rows = await asyncio.to_thread(store.rotation)
        except Exception as exc:  # noqa: BLE001 - a store outage must not stop routing
            if not failing:
                log.warning(
                    "cannot read the servers' rotation from the store (%r); keeping the last one read", exc
                )
            failing = True
        else:
            before = fleet.out
            fleet.update(rows, read_at)
            if fleet.out != before:
                log.info("servers out of rotation: %s", ", ".join(sorted(fleet.out)) or "none")
            failing = False
        await asyncio.sleep(every_s)


class CanaryFlush:
    """Flushes a gateway's canary counts (`CanaryCounts.flush`) from the rotation refresh, at most every
    `FLUSH_EVERY_S`, in a task of its own (a store write that waits must not hold up the rotation
    reads); a store outage is logged once, counted, and the counts go with a later flush."""

    def __init__(self, counts: CanaryCounts, metrics: GatewayMetrics) -> None:
        self.counts, self.metrics, self.failing = counts, metrics, False
        self.task: asyncio.Task[None] | None = None
        self.last = -math.inf

    def tick(self, store: Store) -> None:
        """Start a flush when one is due and none is under way."""
        now = time.monotonic()
        if (self.task is None or self.task.done()) and now - self.last >= FLUSH_EVERY_S:
            self.last = now
            self.task = asyncio.create_task(self.flush(store))

    async def flush(self, store: Store) -> None:
        try:
            written = await self.counts.flush(store)
        except Exception as exc:  # noqa: BLE001 - a store outage must not stop routing; counts stay in memory
            if not self.failing:
                log.warning("cannot write the live canary's counts to the store (%r); keeping them", exc)
            self.failing = True
            self.metrics.canary_flush.labels("failed").inc()
        else:
            self.failing = False
            if written:
                self.metrics.canary_flush.labels("ok").inc()


async def finish_captures(tasks: set[asyncio.Task[None]], grace_s: float) -> int:
    """Wait up to `grace_s` for the capture tasks still running (streams' captures, `Gateway.tasks`)
    so their events reach the publisher before it closes; cancel the rest. Returns how many were
    cancelled (logged: their events are lost)."""
    if not tasks:
        return 0
    _, pending = await asyncio.wait(set(tasks), timeout=grace_s)
    for task in pending:
        task.cancel()
    if pending:
        log.error("shutdown: %d captures still running after %gs were cancelled", len(pending), grace_s)
    return len(pending)


async def verify_announcements(fleet: Fleet, metrics: GatewayMetrics) -> None:
    """Check every `VERIFY_EVERY_S` that each server serves the version announced for it."""
    while True:
        await asyncio.sleep(VERIFY_EVERY_S)
        for server in fleet.every:
            try:
                problem = await fleet.verify(server)
            except Exception:  # noqa: BLE001 - the check must outlive any one failure
                log.exception("checking the announced version of %s", server.url)
                continue
            if problem is not None:
                metrics.version_mismatch.labels(server.url).inc()
                log.error(
                    "%s; its generations are attributed by reading its version until the deployer "
                    "announces it again (`rtrl deploy bootstrap` re-checks the fleet)",
                    problem,
                )


async def refresh_metrics(metrics: GatewayMetrics) -> None:
    """In a worker of several (`ingest.prefork`), write the gauges read from functions into this
    worker's metrics file every `REFRESH_EVERY_S`, so a scrape answered by another worker sees them
    (`GatewayMetrics.bind`); nothing to do in one process."""
    while metrics.multiprocess:
        metrics.refresh()
        await asyncio.sleep(REFRESH_EVERY_S)


def create_app(settings: Settings, connect: Connect | None = None) -> Starlette:
    """The gateway application; its lifespan owns the HTTP client, the store, the key cache and the
    publisher threads. `connect` makes the publisher's Kafka producers (default: one for
    ``settings.kafka``; tests pass one that returns None, no broker, so events are spooled)."""
    metrics = GatewayMetrics()
    spec = get_spec(settings.labeler.reward_spec)  # a bad spec name fails now, not on the first feedback
    redactor = Redactor(settings.gateway.redaction)  # so does a detector that cannot be loaded
    sampling_defaults = served_defaults(settings)  # and an unreadable generation_config.json
    log.info(
        "sampling defaults written into requests that leave them out: %s",
        sampling_defaults or "none (vLLM's neutral ones)",
    )
    secret = request_id_secret(
        None
        if settings.gateway.request_id_secret is None
        else settings.gateway.request_id_secret.get_secret_value(),
        settings.services.run_dir,
    )
    ids = RequestIds(secret)
    policy = RequestPolicy.from_settings(settings, secret)  # its cache salts are keyed by the same secret
    if settings.gateway.max_concurrent_per_tenant == 0:
        log.warning(
            "no cap on the requests a tenant may have in flight (RTRL_GATEWAY__MAX_CONCURRENT_PER_TENANT=0): "
            "one tenant can take all %d upstream connections",
            settings.gateway.upstream_connections,
        )
    if settings.gateway.auth == "open":
        log.warning(
            "GATEWAY AUTH IS OPEN: no API keys, every caller is tenant %r. For local experiments only; "
            "set RTRL_GATEWAY__AUTH=keys and create keys with `rtrl keys create`.",
            OPEN_CALLER.tenant,
        )

    def gateway(fleet: Fleet, publisher: Publisher, keys: KeyCache | None) -> Gateway:
        return Gateway(
            settings, fleet, publisher, metrics, keys, ids, spec, redactor, sampling_defaults, policy
        )

    return _application(settings, metrics, _lifespan(settings, metrics, gateway, connect))


def _lifespan(
    settings: Settings,
    metrics: GatewayMetrics,
    gateway: Callable[[Fleet, Publisher, KeyCache | None], Gateway],
    connect: Connect | None,
) -> Lifespan:
    """The application's lifespan: builds the `Gateway` in ``app.state.gateway`` with the services
    it uses, runs the background tasks, and closes it all on shutdown."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = Store(settings.store.url)  # keys (unless open) and the servers' rotation
        keys = None if settings.gateway.auth == "open" else KeyCache(store, settings.gateway.keys_refresh_s)
        gw = settings.gateway
        async with new_session(gw.upstream_connections, gw.upstream_acquire_timeout_s) as client:
            publisher = Publisher(settings, metrics, connect=connect)
            publisher.start()
            if keys is not None:
                keys.start()
                metrics.bind(metrics.keys_age, lambda: min(keys.age_s, 1e9))
            fleet = Fleet(
                settings.vllm, client, settings.gateway.rotation_refresh_s, settings.gate.canary.share
            )
            for server in fleet.every:
                metrics.bind(metrics.in_flight.labels(server.url), _in_flight_of(server))
            metrics.bind(metrics.in_rotation, lambda: len(fleet.in_rotation))
            metrics.bind(metrics.canary_live, lambda: 1 if fleet.canary_live else 0)
            app.state.gateway = gw_state = gateway(fleet, publisher, keys)
            flush = CanaryFlush(gw_state.canary_traffic, metrics)
            rotation = asyncio.create_task(
                follow_rotation(fleet, store, settings.gateway.rotation_refresh_s, flush)
            )
            verifier = asyncio.create_task(verify_announcements(fleet, metrics))
            refresher = asyncio.create_task(refresh_metrics(metrics))
            try:
                yield
            finally:
                rotation.cancel()
                verifier.cancel()
                refresher.cancel()
                await finish_captures(gw_state.tasks, gw.shutdown_grace_s)
                if flush.task is not None:
                    await asyncio.wait([flush.task])
                await flush.flush(store)  # what was counted since the last flush
                await asyncio.to_thread(publisher.close)  # joins threads, fsyncs: off the event loop
                if keys is not None:
                    keys.close()
                store.close()

    return lifespan


def route(path: str, method: str, handler: Handler) -> Route:
    """A route whose handler gets the application's `Gateway` with the request."""

    async def endpoint(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        return await handler(gw, request)

    return Route(path, endpoint, methods=[method])


async def no_route(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    return error(
        status,
        f"{request.method} {request.url.path} is not a route of the rtrl gateway; it serves "
        f"POST {', '.join(ROUTES)} and GET /v1/models, /healthz, /readyz, /metrics, /v1/whoami",
    )


def _application(settings: Settings, metrics: GatewayMetrics, lifespan: Lifespan) -> Starlette:
    gw = settings.gateway
    # Plain Starlette: FastAPI's dependency solving and its exit-stack middleware cost every request
    # time for features these routes do not use.
    return Starlette(
        routes=[
            route("/v1/completions", "POST", lambda g, r: completions.generate(g, r, chat=False)),
            route("/v1/chat/completions", "POST", lambda g, r: completions.generate(g, r, chat=True)),
            route(
                "/v1/responses", "POST", lambda g, r: completions.generate(g, r, chat=True, responses=True)
            ),
            route("/v1/feedback", "POST", feedback_route.feedback),
            route("/v1/models", "GET", served_models.list_models),
            route("/v1/models/{model_id:path}", "GET", served_models.get_model),
            route("/readyz", "GET", lambda g, r: operations.ready(g)),
            route("/metrics", "GET", operations.metrics_page),
            route("/v1/whoami", "GET", operations.whoami),
            Route("/healthz", operations.healthz, methods=["GET"]),
        ],
        middleware=[
            Middleware(
                BodyLimit,
                limits={
                    "/v1/completions": gw.max_request_bytes,
                    "/v1/chat/completions": gw.max_request_bytes,
                    "/v1/responses": gw.max_request_bytes,
                    "/v1/feedback": gw.max_feedback_bytes,
                },
                on_refused=lambda path: metrics.body_refused.labels(path).inc(),
            )
        ],
        exception_handlers={404: no_route, 405: no_route},
        lifespan=lifespan,
    )


def run(settings: Settings) -> None:
    """Serve the gateway on ``settings.gateway.host:port`` until interrupted: in this process, or
    with ``gateway.workers`` > 1 in that many worker processes under a supervisor (`ingest.prefork`)."""
    gw = settings.gateway
    log.info(
        "rtrl gateway on %s:%d -> %s; kafka %s; spool %s; auth %s; %d worker(s)",
        gw.host,
        gw.port,
        ", ".join(settings.vllm.servers),
        settings.kafka.bootstrap_servers,
        gw.spool_dir,
        gw.auth,
        gw.workers,
    )
    # Spools a run with another worker count left (ingest/spool.py, adopt_spools) are moved before
    # any publisher opens its own.
    if gw.workers == 1:
        for spool in adopt_spools(gw.spool_dir, 1):
            log.warning("moved the spool left in %s into %s", spool, gw.spool_dir)
    sock = listening_socket(
        uvicorn_config(settings, None), gw.socket_send_buffer_bytes, gw.client_stall_timeout_s
    )
    if gw.workers == 1:
        serve(settings, sock)
        return
    from ingest import prefork

    status = prefork.supervise(settings, sock)
    if status:
        sys.exit(status)


def uvicorn_config(settings: Settings, app: Starlette | None) -> uvicorn.Config:
    """uvicorn's settings for the gateway (`app` None: only to bind the socket)."""
    import uvicorn

    return uvicorn.Config(
        app or Starlette(),
        host=settings.gateway.host,
        port=settings.gateway.port,
        log_level="info",
        access_log=settings.gateway.access_log,
        # SIGTERM: stop accepting, let requests in flight (and their captures) finish for this long.
        timeout_graceful_shutdown=math.ceil(settings.gateway.shutdown_grace_s),
    )


def serve(settings: Settings, sock: socket.socket) -> None:
    """Run the gateway application on the listening socket `sock` until SIGTERM or SIGINT (one
    process, or one worker of several)."""
    import uvicorn

    # The event loop shares the GIL with the publisher's threads (kafka-python's sender among
    # them). Each socket call of the loop releases the GIL, and by default it takes up to 5 ms to
    # get it back from a busy thread: a latency tax on every request. Switch more often.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.Server(uvicorn_config(settings, create_app(settings))).run(sockets=[sock])


def listening_socket(
    config: uvicorn.Config, send_buffer_bytes: int, stall_timeout_s: float = 0
) -> socket.socket:
    """uvicorn's listening socket for `config`; accepted connections inherit its options
    (docs/security.md, Slow readers and stream floods):

    * a `send_buffer_bytes` kernel send buffer (0: the kernel's autotuning). Autotuned, a
      connection whose client does not read absorbed ~3 MB of a stream (measured) before the
      gateway's send blocked and ``gateway.stream_write_timeout_s`` started counting;
    * TCP_USER_TIMEOUT of `stall_timeout_s` (0: none): the kernel aborts a connection whose client
      has taken no byte for that long. Without it, a client that never reads kept its socket and
      the data buffered for it after its stream was ended, for as long as it kept the connection.
    """
    sock: socket.socket = config.bind_socket()
    if send_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)  # Linux
    if stall_timeout_s and user_timeout is not None:
        sock.setsockopt(socket.IPPROTO_TCP, user_timeout, int(stall_timeout_s * 1000))
    return sock
