"""The capture gateway's HTTP application. Started by ``rtrl gateway`` (`run`).

Endpoints:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI-compatible, non-streaming. The
  request goes to a vLLM server of the fleet with token ids and sampled-token logprobs added; the
  client gets the upstream body without those extras, an ``rtrl`` object
  (``{"request_id", "policy_version"}``) and an ``x-rtrl-request-id`` header. After the response is
  sent, an `InteractionEvent` stamped with the serving weight version is published to
  ``settings.kafka.interactions_topic``. Upstream errors pass through with their status; no
  reachable server is a 502, an upstream timeout a 504.
- ``POST /v1/feedback``: one `FeedbackEvent` or a list of them; 422 with the reason on bad input,
  202 with the event ids once queued for ``settings.kafka.feedback_topic``.
- ``GET /healthz`` (the process is up), ``GET /readyz`` (a vLLM server answers; also reports
  Kafka and the spool), ``GET /metrics`` (Prometheus).

Capturing never fails or delays the user's response: events are built and handed to the
`ingest.publisher.Publisher` in a background task that runs after the response is sent, and an
event that cannot be built (e.g. the server did not report its version) becomes a
`DeadLetterRecord` on ``settings.kafka.dlq_topic`` with the reason.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import TypeAdapter, ValidationError
from starlette.background import BackgroundTask

from ingest.metrics import GatewayMetrics
from ingest.publisher import Publisher
from ingest.routing import Fleet, Server, UpstreamUnavailable
from ingest.shaping import (
    HEADER_REQUEST_ID,
    Capture,
    Generation,
    RequestError,
    build_interaction,
    extract_chat,
    extract_completion,
    parse_capture,
    prepare_chat_request,
    prepare_completion_request,
    sampling_params,
    shape_chat_response,
    shape_completion_response,
    with_rtrl,
)
from schemas.clock import utcnow
from schemas.events import MAX_EVENT_BYTES, DeadLetterRecord, FeedbackEvent, new_id
from schemas.settings import Settings
from schemas.versions import format_version
from serving import VersionUnknown

log = logging.getLogger(__name__)

MAX_FEEDBACK_EVENTS = 1000
_ONE_FEEDBACK = TypeAdapter(FeedbackEvent)
_MANY_FEEDBACK = TypeAdapter(list[FeedbackEvent])


def _error(status: int, message: str, request_id: str | None = None) -> JSONResponse:
    """An error in the OpenAI shape, so OpenAI clients raise it with the message."""
    kind = "BadRequestError" if status < 500 else "UpstreamError"
    headers = {HEADER_REQUEST_ID: request_id} if request_id else None
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
        headers=headers,
    )


class Gateway:
    """Request handling of one gateway instance (the FastAPI routes call these methods)."""

    def __init__(self, settings: Settings, fleet: Fleet, publisher: Publisher, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.fleet = fleet
        self.publisher = publisher
        self.metrics = metrics

    # ---- generation ---------------------------------------------------------------------------

    async def generate(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        request_id = new_id()
        response = await self._generate(request, request_id, chat)
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def _generate(self, request: Request, request_id: str, chat: bool) -> Response:
        endpoint, path = ("chat", "/v1/chat/completions") if chat else ("completions", "/v1/completions")
        try:
            try:
                body = json.loads(await request.body())
            except ValueError:
                raise RequestError("request body is not valid JSON") from None
            prepare = prepare_chat_request if chat else prepare_completion_request
            forward, requested, body_rtrl = prepare(body)
            capture = parse_capture(request.headers, body_rtrl)
        except RequestError as exc:
            return _error(exc.status_code, str(exc), request_id)

        started = time.perf_counter()
        try:
            server, upstream, before = await self._call(path, forward)
        except UpstreamUnavailable as exc:
            return _error(502, str(exc), request_id)
        except httpx.TimeoutException:
            return _error(504, f"vLLM did not answer within {self.fleet.timeout_s}s", request_id)
        except httpx.HTTPError as exc:
            return _error(502, f"vLLM request failed: {exc!r}", request_id)
        finally:
            self.metrics.upstream_latency.labels(endpoint).observe(time.perf_counter() - started)

        if upstream.status_code != 200:
            # vLLM's own error (bad parameter, prompt too long, ...): the client sees it unchanged.
            return Response(
                upstream.content,
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type"),
                headers={HEADER_REQUEST_ID: request_id},
            )
        created_at = utcnow()
        payload = upstream.json()
        shape = shape_chat_response if chat else shape_completion_response
        # The body names the version the request was served under as far as the gateway knew when
        # it sent it; the event's version (read again after the generation) is the authoritative one.
        client_body = with_rtrl(shape(payload, requested), request_id, "unknown" if before is None else format_version(before))
        task = BackgroundTask(self._capture, server, request_id, capture, chat, forward, payload, before, created_at)
        return JSONResponse(client_body, headers={HEADER_REQUEST_ID: request_id}, background=task)

    async def _call(self, path: str, forward: dict[str, Any]) -> tuple[Server, httpx.Response, int | None]:
        """(server, upstream response, version read before the generation or None if unknown)."""
        refused: list[str] = []
        for server in self.fleet.order():
            try:
                try:
                    before: int | None = await self.fleet.version_before(server)
                except httpx.ConnectError:
                    raise
                except (VersionUnknown, httpx.HTTPError) as exc:
                    # Serve anyway; the event is published with trainable=false (see _capture).
                    log.warning("version before the generation unknown: %r", exc)
                    before = None
                response = await server.client.post(path, forward)
            except httpx.ConnectError as exc:
                # Refused before vLLM saw the request: safe to try the next server.
                self.fleet.mark_down(server)
                refused.append(f"{server.url} ({exc!r})")
                continue
            return server, response, before
        raise UpstreamUnavailable(f"no vLLM server reachable: {'; '.join(refused)}")

    async def _capture(
        self,
        server: Server,
        request_id: str,
        capture: Capture,
        chat: bool,
        forward: dict[str, Any],
        payload: dict[str, Any],
        before: int | None,
        created_at: datetime,
    ) -> None:
        """Read the version after the generation, build and publish the InteractionEvent.

        Runs after the response was sent, so the "after" read costs the user nothing; reading it a
        little later than the generation ended only widens the straddle window (conservative).
        """
        kafka = self.settings.kafka
        try:
            after = await self.fleet.read_version(server)
        except (httpx.HTTPError, VersionUnknown) as exc:
            reason = f"could not build an InteractionEvent: weight version after the generation unknown: {exc!r}"
            self._dead_letter(request_id, reason, payload, forward)
            return
        try:
            generation: Generation = extract_chat(payload) if chat else extract_completion(payload, forward)
            # Straddled a swap (or "before" unknown): the tokens came from one set of weights, but
            # we cannot tell which, so the behaviour logprobs cannot be attributed to a version.
            straddled = before != after
            if straddled:
                self.metrics.straddled.inc()
                log.info("request %s straddled a weight swap (%s -> %s): trainable=false", request_id,
                         "unknown" if before is None else format_version(before), format_version(after))
            event = build_interaction(
                request_id=request_id,
                capture=capture,
                model=str(payload.get("model") or forward.get("model") or "unknown"),
                policy_version=after,
                generation=generation,
                sampling=sampling_params(forward),
                straddled=straddled,
                created_at=created_at,
            )
        except (ValueError, KeyError, TypeError) as exc:  # ValidationError is a ValueError
            self._dead_letter(request_id, f"could not build an InteractionEvent: {exc}", payload, forward)
            return
        self.publisher.publish(
            kafka.interactions_topic, request_id, event.model_dump_json(), event.schema_version, event.event_id
        )

    def _dead_letter(self, request_id: str, reason: str, payload: Any, forward: Any) -> None:
        raw = json.dumps({"request_id": request_id, "request": forward, "response": payload})
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
        response = await self._feedback(request)
        self.metrics.requests.labels("feedback", str(response.status_code)).inc()
        return response

    async def _feedback(self, request: Request) -> Response:
        raw = await request.body()
        if len(raw) > MAX_EVENT_BYTES:
            return _error(413, f"feedback body of {len(raw)} bytes exceeds {MAX_EVENT_BYTES}")
        try:
            if raw.lstrip()[:1] == b"[":
                events = _MANY_FEEDBACK.validate_json(raw, strict=True)
            else:
                events = [_ONE_FEEDBACK.validate_json(raw, strict=True)]
        except ValidationError as exc:
            return JSONResponse({"detail": json.loads(exc.json(include_url=False))}, status_code=422)
        if not 1 <= len(events) <= MAX_FEEDBACK_EVENTS:
            return JSONResponse(
                {"detail": f"send between 1 and {MAX_FEEDBACK_EVENTS} feedback events, got {len(events)}"},
                status_code=422,
            )
        topic = self.settings.kafka.feedback_topic
        for event in events:
            self.publisher.publish(topic, event.request_id, event.model_dump_json(), event.schema_version, event.event_id)
        return JSONResponse({"event_ids": [e.event_id for e in events]}, status_code=202)

    # ---- operations ---------------------------------------------------------------------------

    async def ready(self) -> Response:
        health = await self.fleet.health()
        body = {
            "ready": any(health.values()),
            "vllm": health,
            "kafka_connected": self.publisher.connected,
            "spool_bytes": self.publisher.spool.size_bytes,
        }
        return JSONResponse(body, status_code=200 if body["ready"] else 503)


def create_app(settings: Settings) -> FastAPI:
    """The gateway application; its lifespan owns the HTTP client and the publisher threads."""
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits) as client:
            publisher = Publisher(settings, metrics)
            publisher.start()
            app.state.gateway = Gateway(settings, Fleet(settings.vllm, client), publisher, metrics)
            try:
                yield
            finally:
                publisher.close()

    app = FastAPI(title="rtrl capture gateway", lifespan=lifespan, docs_url=None, redoc_url=None)

    def gateway(request: Request) -> Gateway:
        gw: Gateway = request.app.state.gateway
        return gw

    def route(handler: Callable[[Gateway, Request], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            result: Response = await handler(gateway(request), request)
            return result

        return endpoint

    app.add_api_route("/v1/completions", route(lambda g, r: g.generate(r, chat=False)), methods=["POST"])
    app.add_api_route("/v1/chat/completions", route(lambda g, r: g.generate(r, chat=True)), methods=["POST"])
    app.add_api_route("/v1/feedback", route(lambda g, r: g.feedback(r)), methods=["POST"])
    app.add_api_route("/readyz", route(lambda g, r: g.ready()), methods=["GET"])

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run(settings: Settings) -> None:
    """Serve the gateway on ``settings.gateway.host:port`` until interrupted."""
    import uvicorn

    log.info(
        "rtrl gateway on %s:%d -> %s; kafka %s; spool %s",
        settings.gateway.host, settings.gateway.port, ", ".join(settings.vllm.servers),
        settings.kafka.bootstrap_servers, settings.gateway.spool_dir,
    )
    uvicorn.run(create_app(settings), host=settings.gateway.host, port=settings.gateway.port, log_level="info")
