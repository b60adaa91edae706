"""The capture gateway's HTTP application. Started by ``rtrl gateway`` (`run`).

Every call to the API routes carries ``Authorization: Bearer <key>`` (what OpenAI clients send as
their api key): a tenant key for completions and feedback, an admin key for ``/metrics``
(`ingest.auth`; ``gateway.auth = open`` turns keys off for local experiments). Missing or unknown
keys are 401, the wrong kind of key 403, a key over its rate 429 with ``Retry-After``; bodies over
the route's limit are 413 before they are read (`ingest.limits`).

Endpoints:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI-compatible, streaming or not.
  The request goes to a vLLM server of the fleet with token ids and sampled-token logprobs added;
  the client gets the upstream body without those extras, an ``rtrl`` object
  (``{"request_id", "policy_version"}``; in the first chunk of a stream) and an
  ``x-rtrl-request-id`` header. After the response is sent (a stream: when it ends, however it
  ends, `ingest.streaming`), an `InteractionEvent` stamped with the serving weight version and the
  key's tenant is published to ``settings.kafka.interactions_topic``. Upstream errors pass through
  with their status; no reachable server is a 502, an upstream timeout a 504.
- ``POST /v1/feedback``: one feedback object or a list of them (`ingest.intake`): 202 with the
  event ids once queued for ``settings.kafka.feedback_topic``; 403/404 for another tenant's
  requests, 422 with the reason on bad input.
- ``GET /healthz`` (the process is up), ``GET /readyz`` (a vLLM server answers; also reports
  Kafka, the spool and the keys), ``GET /metrics`` (Prometheus; admin key).

Capturing never fails or delays the user's response: events are built and handed to the
`ingest.publisher.Publisher` in a background task that runs after the response is sent, and an
event that cannot be built (e.g. the server did not report its version) becomes a
`DeadLetterRecord` on ``settings.kafka.dlq_topic`` with the reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import anyio
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ingest import intake
from ingest.auth import OPEN_CALLER, Caller, KeyCache, RateLimiter, RequestIds, namespaced, request_id_secret
from ingest.limits import BodyLimit
from ingest.metrics import GatewayMetrics
from ingest.publisher import Publisher
from ingest.redaction import Redacted, Redactor, redact_json
from ingest.routing import VERIFY_EVERY_S, Announced, Fleet, NoServerInRotation, Server, UpstreamUnavailable
from ingest.shaping import (
    HEADER_REQUEST_ID,
    Capture,
    Generation,
    Requested,
    RequestError,
    build_interaction,
    extract_chat,
    extract_completion,
    lora_request,
    parse_capture,
    prepare_chat_request,
    prepare_completion_request,
    sampling_params,
    shape_chat_response,
    shape_completion_response,
    with_rtrl,
)
from ingest.streaming import DONE, StreamCapture, shape_chunk, sse, sse_json
from schemas.clock import utcnow
from schemas.events import MAX_EVENT_BYTES, DeadLetterRecord, InteractionEvent
from schemas.rewards import RewardSpec, get_spec
from schemas.sampling import served_defaults, unreproducible
from schemas.settings import Settings
from schemas.versions import format_version
from serving import ServingError
from serving.aio import UpstreamRefused, UpstreamResponse, UpstreamTimeout, loads, new_session
from store import Store

log = logging.getLogger(__name__)

_ERROR_TYPES = {401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
                413: "BadRequestError", 429: "RateLimitError"}  # fmt: skip


def _error(
    status: int, message: str, request_id: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error in the OpenAI shape, so OpenAI clients raise it with the message."""
    kind = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "UpstreamError")
    headers = dict(headers or {})
    if request_id:
        headers[HEADER_REQUEST_ID] = request_id
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
        headers=headers,
    )


class FastJSONResponse(JSONResponse):
    """A JSON response rendered by orjson (a completion's body in about 1/20 of the stdlib's time;
    a NaN becomes null instead of an error)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _why_not_json(raw: bytes) -> str:
    """Why orjson refused a request body, in words that do not depend on orjson's version: the
    stdlib (on this error path only) tells nesting too deep (orjson stops at 1,024 levels) from
    the rest."""
    try:
        json.loads(raw)
    except RecursionError:
        return "request body is nested too deeply"
    except ValueError:
        pass
    return "request body is not valid JSON"


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


class Relay:
    """One streamed generation on its way from vLLM to the client (ingest/streaming.py): `chunks`
    relays vLLM's server-sent events while capturing them; `close` gives the upstream connection
    back, takes the request off the server's in-flight count and hands the capture to `finish`,
    exactly once, however the stream ends: finished, vLLM gone, the client gone mid-stream (its
    disconnect cancels `chunks`), or the client gone before the first chunk (`chunks` never runs;
    `RelayResponse` closes it then, and the empty capture is dead-lettered with the reason)."""

    def __init__(
        self,
        served: Served,
        upstream: UpstreamResponse,
        requested: Requested,
        finish: Callable[[Served, StreamCapture, datetime], None],
    ) -> None:
        self.served = served
        self.upstream = upstream
        self.requested = requested
        self.stream = StreamCapture(served.chat)
        self.created_at = utcnow()
        self._finish = finish
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
                    yield sse(DONE)
                    continue
                try:
                    chunk = loads(data)
                except ValueError:
                    stream.problem = stream.problem or f"unreadable stream chunk: {data[:200]!r}"
                    yield sse(data)
                    continue
                stream.add(chunk)
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
            log.warning("request %s: upstream stream failed: %s", served.request_id, exc)
        finally:
            with anyio.CancelScope(shield=True):  # runs even when the client's disconnect cancelled us
                await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.served.server.in_flight -= 1
        try:
            await self.upstream.aclose()
        finally:
            if self.stream.chunks == 0 and self.stream.problem is None:
                self.stream.problem = "the client went away before the stream started"
            self._finish(self.served, self.stream, self.created_at)


class RelayResponse(StreamingResponse):
    """A `Relay`'s event stream to the client; closes the relay when the response ends, even if
    its body never started (a client that disconnected at once)."""

    def __init__(self, relay: Relay, headers: dict[str, str]) -> None:
        super().__init__(relay.chunks(), media_type="text/event-stream", headers=headers)
        self.relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.relay.close()


class Gateway:
    """Request handling of one gateway instance (the routes of `create_app` call these methods)."""

    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        publisher: Publisher,
        metrics: GatewayMetrics,
        keys: KeyCache | None,
        ids: RequestIds,
        spec: RewardSpec,
        redactor: Redactor,
        sampling_defaults: Mapping[str, Any],
    ) -> None:
        self.settings = settings
        self.sampling_defaults = sampling_defaults  # written into requests (schemas/sampling.py)
        self.lora = settings.trainer.adapter == "lora"  # the adapter's name, no prompt logprobs (ingest/shaping.py)
        self.redactor = redactor
        self.fleet = fleet
        self.publisher = publisher
        self.metrics = metrics
        self.keys = keys  # None in open mode
        self.ids = ids
        self.spec = spec
        self.limiter = RateLimiter(settings.gateway.rate_limit_per_s, settings.gateway.rate_limit_burst)
        self._tasks: set[asyncio.Task[None]] = set()  # captures of streams, held until they finish

    # ---- who is calling -----------------------------------------------------------------------

    def authenticate(self, request: Request, role: str | None) -> Caller | Response:
        """The caller of `request` when its key is valid, of `role` (any when None) and within its
        rate; else the error response."""
        if self.keys is None:
            return OPEN_CALLER
        if not self.keys.loaded:
            self.metrics.auth.labels("keys_not_loaded").inc()
            return _error(503, "the gateway has not loaded its API keys yet (is the store up?)", headers={"Retry-After": "5"})
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            self.metrics.auth.labels("missing_key").inc()
            return _error(401, "missing API key: send Authorization: Bearer <key> (`rtrl keys create`)",
                          headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        caller = self.keys.lookup(key.strip())
        if caller is None:
            self.metrics.auth.labels("invalid_key").inc()
            return _error(401, "invalid or revoked API key", headers={"WWW-Authenticate": "Bearer"})
        if role is not None and caller.role != role:
            self.metrics.auth.labels("wrong_role").inc()
            return _error(403, f"this route needs a {role} key; this is a {caller.role} key")
        wait_s = self.limiter.take(caller)
        if wait_s is not None:
            self.metrics.auth.labels("rate_limited").inc()
            return _error(429, "rate limit of this API key reached", headers={"Retry-After": str(max(1, math.ceil(wait_s)))})
        self.metrics.auth.labels("ok").inc()
        return caller

    # ---- generation ---------------------------------------------------------------------------

    async def generate(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        caller = self.authenticate(request, "tenant")
        if isinstance(caller, Response):
            response = caller
        else:
            assert caller.tenant is not None
            response = await self._generate(request, caller.tenant, self.ids.new(caller.tenant), chat)
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def _generate(self, request: Request, tenant: str, request_id: str, chat: bool) -> Response:
        endpoint, path = ("chat", "/v1/chat/completions") if chat else ("completions", "/v1/completions")
        try:
            raw = await request.body()
            try:
                body = orjson.loads(raw)  # strict (no NaN, Infinity or lone surrogates), 5-20x the stdlib
            except orjson.JSONDecodeError:
                raise RequestError(_why_not_json(raw)) from None
            prepare = prepare_chat_request if chat else prepare_completion_request
            forward, requested, body_rtrl = prepare(body, self.sampling_defaults)
            if self.lora:
                lora_request(forward, self.settings.vllm.served_model_name)
            capture = parse_capture(request.headers, body_rtrl)
            try:
                episode_id = namespaced(tenant, capture.episode_id or request_id)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        except RequestError as exc:
            return _error(exc.status_code, str(exc), request_id)

        stream = forward.get("stream") is True
        started = time.perf_counter()
        try:
            server, upstream, before, announced = await self._call(path, forward, stream, capture.session_id)
        except NoServerInRotation as exc:
            return _error(503, f"{exc}; retry shortly", request_id, headers={"Retry-After": "1"})
        except UpstreamUnavailable as exc:
            return _error(502, str(exc), request_id)
        except UpstreamTimeout:
            return _error(504, f"vLLM did not answer within {self.fleet.timeout_s}s", request_id)
        except ServingError as exc:
            return _error(502, f"vLLM request failed: {exc}", request_id)
        finally:
            self.metrics.upstream_latency.labels(endpoint).observe(time.perf_counter() - started)

        if upstream.status_code != 200:
            # vLLM's own error (bad parameter, prompt too long, ...): the client sees it unchanged.
            if stream:
                try:
                    await upstream.aread()
                finally:
                    await upstream.aclose()
                    server.in_flight -= 1
            return Response(
                upstream.content,
                status_code=upstream.status_code,
                media_type=upstream.content_type,
                headers={HEADER_REQUEST_ID: request_id},
            )
        served = Served(server, request_id, tenant, episode_id, capture, chat, forward, before, announced)
        if stream:
            relay = Relay(served, upstream, requested, self._finish_stream)
            return RelayResponse(relay, headers={HEADER_REQUEST_ID: request_id, "cache-control": "no-cache"})
        created_at = utcnow()
        payload = upstream.json()
        shape = shape_chat_response if chat else shape_completion_response
        # The body names the version the request was served under as far as the gateway knew when
        # it sent it; the event's version (read again after the generation) is the authoritative one.
        client_body = with_rtrl(shape(payload, requested), request_id, "unknown" if before is None else format_version(before))
        task = BackgroundTask(self._capture, served, payload, created_at)
        return FastJSONResponse(client_body, headers={HEADER_REQUEST_ID: request_id}, background=task)

    def _finish_stream(self, served: Served, stream: StreamCapture, created_at: datetime) -> None:
        """After a stream ended however it ended: count a truncation and publish its capture."""
        if stream.truncated:
            self.metrics.truncated.inc()
        task = asyncio.get_running_loop().create_task(
            self._capture(served, stream.payload(), created_at, truncated=stream.truncated, problem=stream.problem)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(
        self, path: str, forward: dict[str, Any], stream: bool = False, session_id: str | None = None
    ) -> tuple[Server, UpstreamResponse, int | None, Announced | None]:
        """(server, upstream response, version before the generation or None if unknown, the
        deployer's announcement for the server when sent). With `stream`, the response's body is
        not read yet: the caller reads and closes it, and takes the request off
        ``server.in_flight`` when done."""
        refused: list[str] = []
        for server in self.fleet.order(session_id):
            try:
                announced = server.announced
                before: int | None
                if announced is not None:
                    before = announced.version  # no request to vLLM (ingest/routing.py)
                else:
                    try:
                        before = await self.fleet.version_before(server)
                    except UpstreamRefused:
                        raise
                    except ServingError as exc:  # VersionUnknown, UpstreamError
                        # Serve anyway; the event is published with trainable=false (see _capture).
                        log.warning("version before the generation unknown: %r", exc)
                        before = None
                server.in_flight += 1
                self.metrics.upstream_requests.labels(server.url).inc()
                try:
                    if stream:
                        response = await server.client.open_stream(path, forward)
                    else:
                        response = await server.client.post(path, forward)
                except BaseException:
                    server.in_flight -= 1
                    raise
                if not stream:
                    server.in_flight -= 1
            except UpstreamRefused as exc:
                # Refused before vLLM saw the request: safe to try the next server.
                self.fleet.mark_down(server)
                refused.append(f"{server.url} ({exc!r})")
                continue
            return server, response, before, announced
        raise UpstreamUnavailable(f"no vLLM server reachable: {'; '.join(refused)}")

    async def _capture(
        self,
        served: Served,
        payload: dict[str, Any],
        created_at: datetime,
        truncated: bool = False,
        problem: str | None = None,
    ) -> None:
        """Establish the version that generated it, build and publish the InteractionEvent.

        The version is the deployer's announcement when that proves it (`Fleet.attributed`), else a
        read of the server after the generation. Runs after the response was sent, so a read costs
        the user nothing; reading a little later than the generation ended only widens the
        straddle window (conservative).
        """
        kafka = self.settings.kafka
        request_id, forward, before = served.request_id, served.forward, served.before
        unreproducible_by = unreproducible(forward)
        if unreproducible_by is not None:
            self.metrics.untrainable.labels(unreproducible_by).inc()
        after = self.fleet.attributed(served.server, served.announced)
        if after is not None:
            self.metrics.version_source.labels("announced").inc()
        else:
            self.metrics.version_source.labels("read").inc()
            try:
                after = await self.fleet.read_version(served.server)
            except ServingError as exc:  # UpstreamError, VersionUnknown
                reason = f"could not build an InteractionEvent: weight version after the generation unknown: {exc!r}"
                self._dead_letter(request_id, reason, payload, forward)
                return
        try:
            generation: Generation = extract_chat(payload) if served.chat else extract_completion(payload, forward)
            # Straddled a swap (or "before" unknown): the tokens came from one set of weights, but
            # we cannot tell which, so the behaviour logprobs cannot be attributed to a version.
            straddled = before != after
            if straddled:
                self.metrics.straddled.inc()
                log.info("request %s straddled a weight swap (%s -> %s): trainable=false", request_id,
                         "unknown" if before is None else format_version(before), format_version(after))
            event = build_interaction(
                request_id=request_id,
                tenant=served.tenant,
                episode_id=served.episode_id,
                capture=served.capture,
                model=str(payload.get("model") or forward.get("model") or "unknown"),
                policy_version=after,
                generation=generation,
                sampling=sampling_params(forward, self.settings.vllm.logprobs_mode),
                straddled=straddled,
                created_at=created_at,
                truncated=truncated,
                untrainable_reason=unreproducible_by,
            )
        except (ValueError, KeyError, TypeError) as exc:  # ValidationError is a ValueError
            reason = f"could not build an InteractionEvent: {exc}"
            if problem is not None:
                reason += f" (the stream: {problem})"
            self._dead_letter(request_id, reason, payload, forward)
            return
        if self.redactor.detectors:
            if self.redactor.cheap(len(event.prompt) + len(event.completion)):
                event = self._redacted(event)  # a hop to a thread would cost more than the regexes
            else:
                event = await asyncio.to_thread(self._redacted, event)  # large texts: off the event loop
        self.publisher.publish(
            kafka.interactions_topic, request_id, event.model_dump_json(), event.schema_version, event.event_id
        )

    def _redacted(self, event: InteractionEvent) -> InteractionEvent:
        """`event` with its text masked by the configured detectors, and what they found recorded."""
        try:
            prompt, completion = self.redactor(event.prompt), self.redactor(event.completion)
        except Exception:  # noqa: BLE001 - a plugged-in detector failed: mask everything, lose nothing
            log.exception("redaction of request %s failed: its text is masked whole", event.request_id)
            prompt = completion = Redacted("[REDACTED:redaction_failed]", frozenset({"redaction_failed"}))
        kinds = sorted(prompt.kinds | completion.kinds)
        if not kinds:
            return event
        for kind in kinds:
            self.metrics.redacted.labels(kind).inc()
        return event.model_copy(update={"prompt": prompt.text, "completion": completion.text, "redacted": kinds})

    def _dead_letter(self, request_id: str, reason: str, payload: Any, forward: Any) -> None:
        try:  # every string redacted before it is serialized (escapes like \n would hide a match)
            raw = json.dumps(redact_json(self.redactor, {"request_id": request_id, "request": forward, "response": payload}))
        except Exception:  # noqa: BLE001 - a plugged-in detector failed: keep no text at all
            log.exception("redaction of dead letter %s failed: its payload is dropped", request_id)
            raw = json.dumps({"request_id": request_id, "payload": "[REDACTED:redaction_failed]"})
        if len(raw) > MAX_EVENT_BYTES:
            raw = raw[:MAX_EVENT_BYTES]
            reason += " (payload truncated)"
        record = DeadLetterRecord(source="gateway", reason=reason[:10_000], payload=raw)
        self.metrics.publish.labels(self.settings.kafka.dlq_topic, "dead_letter").inc()
        log.warning("request %s dead-lettered: %s", request_id, reason)
        self.publisher.publish(
            self.settings.kafka.dlq_topic, request_id, record.model_dump_json(), record.schema_version, record.event_id
        )

    # ---- feedback -----------------------------------------------------------------------------

    async def feedback(self, request: Request) -> Response:
        caller = self.authenticate(request, "tenant")
        if isinstance(caller, Response):
            response = caller
        else:
            assert caller.tenant is not None
            response = await self._feedback(request, caller.tenant)
        self.metrics.requests.labels("feedback", str(response.status_code)).inc()
        return response

    async def _feedback(self, request: Request, tenant: str) -> Response:
        raw = await request.body()  # its size is bounded by the BodyLimit middleware
        try:
            if raw.lstrip()[:1] == b"[":
                items = intake.MANY.validate_json(raw, strict=True)
            else:
                items = [intake.ONE.validate_json(raw, strict=True)]
        except ValidationError as exc:
            return JSONResponse({"detail": json.loads(exc.json(include_url=False))}, status_code=422)
        if not 1 <= len(items) <= intake.MAX_FEEDBACK_EVENTS:
            return JSONResponse(
                {"detail": f"send between 1 and {intake.MAX_FEEDBACK_EVENTS} feedback events, got {len(items)}"},
                status_code=422,
            )
        events = intake.admit(items, tenant, self.ids, self.spec, self.settings.limits, utcnow())
        if isinstance(events, intake.Refused):
            if events.status in (403, 404):
                self.metrics.auth.labels("foreign_tenant" if events.status == 403 else "foreign_request").inc()
            return JSONResponse({"detail": events.problems}, status_code=events.status)
        topic = self.settings.kafka.feedback_topic
        for event in events:
            self.publisher.publish(topic, event.request_id, event.model_dump_json(), event.schema_version, event.event_id)
        return JSONResponse({"event_ids": [e.event_id for e in events]}, status_code=202)

    # ---- operations ---------------------------------------------------------------------------

    async def ready(self) -> Response:
        health = await self.fleet.health()
        body = {
            "ready": any(health.values()) and (self.keys is None or self.keys.loaded),
            "vllm": health,
            "auth": self.settings.gateway.auth,
            "keys_loaded": None if self.keys is None else self.keys.loaded,
            "out_of_rotation": sorted(self.fleet.out),
            "kafka_connected": self.publisher.connected,
            "publish_in_flight": self.publisher.in_flight,
            "publish_oldest_in_flight_s": round(self.publisher.in_flight_age_s, 3),
            "spool_bytes": self.publisher.spool.size_bytes,
        }
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    async def whoami(self, request: Request) -> Response:
        """The tenant and role of the caller's key (200), or why the key is refused."""
        caller = self.authenticate(request, None)
        if isinstance(caller, Response):
            return caller
        return JSONResponse({"tenant": caller.tenant, "role": caller.role, "auth": self.settings.gateway.auth})

    async def metrics_page(self, request: Request) -> Response:
        caller = self.authenticate(request, "admin") if self.keys is not None else OPEN_CALLER
        if isinstance(caller, Response):
            return caller
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


SWITCH_INTERVAL_S = 0.0005
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/feedback")


def _in_flight_of(server: Server) -> Callable[[], float]:
    return lambda: server.in_flight


async def follow_rotation(fleet: Fleet, store: Store, every_s: float) -> None:
    """Keep `fleet` up to date with the servers the deployer took out of rotation and the versions
    it announced. While the store cannot be read, the last rotation read stays in force (said once
    in the log); announcements age out by themselves (`Fleet.attributed`), and versions are then
    read from the servers."""
    failing = False
    while True:
        read_at = time.monotonic()
        try:
            rows = await asyncio.to_thread(store.rotation)
        except Exception as exc:  # noqa: BLE001 - a store outage must not stop routing
            if not failing:
                log.warning("cannot read the servers' rotation from the store (%r); keeping the last one read", exc)
            failing = True
        else:
            before = fleet.out
            fleet.update(rows, read_at)
            if fleet.out != before:
                log.info("servers out of rotation: %s", ", ".join(sorted(fleet.out)) or "none")
            failing = False
        await asyncio.sleep(every_s)


async def verify_announcements(fleet: Fleet, metrics: GatewayMetrics) -> None:
    """Check every `VERIFY_EVERY_S` that each server serves the version announced for it."""
    while True:
        await asyncio.sleep(VERIFY_EVERY_S)
        for server in fleet.servers:
            try:
                problem = await fleet.verify(server)
            except Exception:  # noqa: BLE001 - the check must outlive any one failure
                log.exception("checking the announced version of %s", server.url)
                continue
            if problem is not None:
                metrics.version_mismatch.labels(server.url).inc()
                log.error("%s; its generations are attributed by reading its version until the deployer "
                          "announces it again (`rtrl deploy bootstrap` re-checks the fleet)", problem)  # fmt: skip


def create_app(settings: Settings) -> Starlette:
    """The gateway application; its lifespan owns the HTTP client, the store, the key cache and the
    publisher threads."""
    metrics = GatewayMetrics()
    spec = get_spec(settings.labeler.reward_spec)  # a bad spec name fails now, not on the first feedback
    redactor = Redactor(settings.gateway.redaction)  # so does a detector that cannot be loaded
    sampling_defaults = served_defaults(settings)  # and an unreadable generation_config.json
    log.info("sampling defaults written into requests that leave them out: %s",
             sampling_defaults or "none (vLLM's neutral ones)")
    ids = RequestIds(request_id_secret(
        None if settings.gateway.request_id_secret is None else settings.gateway.request_id_secret.get_secret_value(),
        settings.services.run_dir,
    ))  # fmt: skip
    if settings.gateway.auth == "open":
        log.warning("GATEWAY AUTH IS OPEN: no API keys, every caller is tenant %r. For local experiments only; "
                    "set RTRL_GATEWAY__AUTH=keys and create keys with `rtrl keys create`.", OPEN_CALLER.tenant)  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = Store(settings.store.url)  # keys (unless open) and the servers' rotation
        keys = None if settings.gateway.auth == "open" else KeyCache(store, settings.gateway.keys_refresh_s)
        async with new_session() as client:
            publisher = Publisher(settings, metrics)
            publisher.start()
            if keys is not None:
                keys.start()
                metrics.keys_age.set_function(lambda: min(keys.age_s, 1e9))
            fleet = Fleet(settings.vllm, client, settings.gateway.rotation_refresh_s)
            for server in fleet.servers:
                metrics.in_flight.labels(server.url).set_function(_in_flight_of(server))
            metrics.in_rotation.set_function(lambda: len(fleet.in_rotation))
            rotation = asyncio.create_task(follow_rotation(fleet, store, settings.gateway.rotation_refresh_s))
            verifier = asyncio.create_task(verify_announcements(fleet, metrics))
            app.state.gateway = Gateway(
                settings, fleet, publisher, metrics, keys, ids, spec, redactor, sampling_defaults
            )
            try:
                yield
            finally:
                rotation.cancel()
                verifier.cancel()
                publisher.close()
                if keys is not None:
                    keys.close()
                store.close()

    def gateway(request: Request) -> Gateway:
        gw: Gateway = request.app.state.gateway
        return gw

    def route(path: str, method: str, handler: Callable[[Gateway, Request], Any]) -> Route:
        async def endpoint(request: Request) -> Response:
            result: Response = await handler(gateway(request), request)
            return result

        return Route(path, endpoint, methods=[method])

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def no_route(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return _error(status, f"{request.method} {request.url.path} is not a route of the rtrl gateway; it serves "
                              f"POST {', '.join(ROUTES)} and GET /healthz, /readyz, /metrics, /v1/whoami")  # fmt: skip

    gw = settings.gateway
    # Plain Starlette: FastAPI's dependency solving and its exit-stack middleware cost every request
    # time for features these routes do not use.
    return Starlette(
        routes=[
            route("/v1/completions", "POST", lambda g, r: g.generate(r, chat=False)),
            route("/v1/chat/completions", "POST", lambda g, r: g.generate(r, chat=True)),
            route("/v1/feedback", "POST", lambda g, r: g.feedback(r)),
            route("/readyz", "GET", lambda g, r: g.ready()),
            route("/metrics", "GET", lambda g, r: g.metrics_page(r)),
            route("/v1/whoami", "GET", lambda g, r: g.whoami(r)),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        middleware=[Middleware(
            BodyLimit,
            limits={"/v1/completions": gw.max_request_bytes, "/v1/chat/completions": gw.max_request_bytes,
                    "/v1/feedback": gw.max_feedback_bytes},
            on_refused=lambda path: metrics.body_refused.labels(path).inc(),
        )],
        exception_handlers={404: no_route, 405: no_route},
        lifespan=lifespan,
    )  # fmt: skip


def run(settings: Settings) -> None:
    """Serve the gateway on ``settings.gateway.host:port`` until interrupted."""
    import uvicorn

    # The event loop shares the GIL with the publisher's threads (kafka-python's sender among
    # them). Each socket call of the loop releases the GIL, and by default it takes up to 5 ms to
    # get it back from a busy thread: a latency tax on every request. Switch more often.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    log.info(
        "rtrl gateway on %s:%d -> %s; kafka %s; spool %s; auth %s",
        settings.gateway.host, settings.gateway.port, ", ".join(settings.vllm.servers),
        settings.kafka.bootstrap_servers, settings.gateway.spool_dir, settings.gateway.auth,
    )
    uvicorn.run(create_app(settings), host=settings.gateway.host, port=settings.gateway.port, log_level="info",
                access_log=settings.gateway.access_log)
