"""``POST /v1/completions`` and ``POST /v1/chat/completions``: a generation relayed to the fleet.

The client's body is checked (`ingest.forwarding`: only the fields, tokens and model this gateway
allows, plus the tenant's prefix-cache salt) and shaped (`ingest.shaping`), sent to a vLLM server
of the fleet (`ingest.routing`) with token ids and sampled-token logprobs added, and the answer relayed without
those extras: a whole body with an ``rtrl`` object, or a stream (`ingest.relay`). The capture
(`ingest.capture`) runs after the response is sent. Upstream errors pass through with their
status; no server in rotation is a 503, no reachable server a 502, an upstream timeout a 504.

Each request holds one of its tenant's slots (`ingest.slots`, ``gateway.max_concurrent_per_tenant``)
from its authentication until its response is made (a whole body) or its stream's relay closes
(`ingest.relay`), whatever ends it; a tenant without a free slot gets 429. No connection to vLLM
within ``gateway.upstream_acquire_timeout_s`` (the pool in use, `serving.aio.new_session`) is a
503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from datetime import datetime
from typing import Any

import orjson
from starlette.background import BackgroundTask, BackgroundTasks
from starlette.requests import Request
from starlette.responses import Response

from ingest.auth import namespaced
from ingest.canary_traffic import Tally
from ingest.capture import publish_interaction
from ingest.gateway import Gateway
from ingest.relay import Relay, RelayResponse, Served
from ingest.responses import FastJSONResponse, error, why_not_json
from ingest.responses_api import Echo, response_body, to_chat
from ingest.responses_stream import ResponsesStream
from ingest.routing import AdapterNotLoaded, Announced, NoServerInRotation, Server, UpstreamUnavailable
from ingest.shaping import (
    HEADER_REQUEST_ID,
    Capture,
    Requested,
    RequestError,
    lora_request,
    parse_capture,
    prepare_chat_request,
    prepare_completion_request,
    shape_chat_response,
    shape_completion_response,
    with_rtrl,
)
from ingest.slots import Slot
from ingest.streaming import StreamCapture
from schemas.clock import utcnow
from schemas.versions import format_version
from serving import ServingError, VersionUnknown
from serving.aio import UpstreamNoConnection, UpstreamRefused, UpstreamResponse, UpstreamTimeout

log = logging.getLogger(__name__)


async def generate(gw: Gateway, request: Request, chat: bool, responses: bool = False) -> Response:
    """``POST /v1/chat/completions`` (`chat`) or ``POST /v1/completions`` for a tenant key; with
    `responses` (and `chat`), ``POST /v1/responses``: the Responses request translated into the
    chat request it amounts to, which takes the chat path from then on, and vLLM's chat answer
    translated back (ingest/responses_api.py)."""
    endpoint = "responses" if responses else "chat" if chat else "completions"
    tally = Tally()  # the handler's start: a live canary's latency counts from here
    caller = gw.authenticate(request, "tenant")
    if isinstance(caller, Response):
        response = caller
    else:
        assert caller.tenant is not None
        slot = gw.admit(caller.tenant)
        if isinstance(slot, Response):
            response = slot
        else:
            relayed = False
            try:
                request_id = gw.ids.new(caller.tenant)
                response = await _generate(gw, request, slot, request_id, chat, tally, responses)
                relayed = isinstance(response, RelayResponse)  # its relay gives the slot back
            finally:  # an answer, an error, the client gone (cancelled): the slot comes back
                if not relayed:
                    slot.release()
    gw.metrics.requests.labels(endpoint, str(response.status_code)).inc()
    if tally.version is not None and not isinstance(response, RelayResponse):  # a stream counts as it ends
        count_when_sent(gw, response, tally)
    return response


def count_when_sent(gw: Gateway, response: Response, tally: Tally) -> None:
    """Count `tally` in the live canary's counts once the response's last byte is sent (before its
    capture task runs, which is not the client's wait)."""
    counting = BackgroundTask(gw.canary_traffic.record, tally)
    response.background = (
        counting if response.background is None else BackgroundTasks([counting, response.background])
    )


async def _generate(
    gw: Gateway, request: Request, slot: Slot, request_id: str, chat: bool, tally: Tally, responses: bool
) -> Response:
    tenant = slot.tenant
    endpoint, path = ("chat", "/v1/chat/completions") if chat else ("completions", "/v1/completions")
    try:
        forward, requested, capture, echo = await _read(gw, request, tenant, chat, responses)
        _reserve_tokens(gw, slot, forward)
        try:
            episode_id = namespaced(tenant, capture.episode_id or request_id)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
    except RequestError as exc:
        retry = {"Retry-After": "1"} if exc.status_code == 429 else None
        return error(exc.status_code, str(exc), request_id, headers=retry)

    stream = forward.get("stream") is True
    started = time.perf_counter()
    tally.version = gw.fleet.canary_version  # None: no canary live, nothing counted
    tried: list[Server] = []
    try:
        server, upstream, before, announced = await _call(
            gw,
            path,
            forward,
            stream,
            capture.session_id,
            sticky_key(tenant, forward, episode_id),
            tried,
            adapter=gw.tenant_adapter(forward),
        )
    except NoServerInRotation as exc:
        return error(503, f"{exc}; retry shortly", request_id, headers={"Retry-After": "1"})
    except AdapterNotLoaded as exc:
        return error(503, f"{exc}; retry shortly", request_id, headers={"Retry-After": "5"})
    except UpstreamUnavailable as exc:
        tally.error = True
        return error(502, str(exc), request_id)
    except UpstreamNoConnection:
        gw.metrics.shed.labels("upstream_connection").inc()
        in_flight = sum(s.in_flight for s in gw.fleet.every)
        return error(
            503,
            f"no connection to vLLM within {gw.settings.gateway.upstream_acquire_timeout_s}s: the gateway has "
            f"{in_flight} requests on its {gw.settings.gateway.upstream_connections} upstream connections "
            "(gateway.upstream_connections), or the server is slow to accept one; retry shortly",
            request_id,
            headers={"Retry-After": "1"},
        )
    except UpstreamTimeout:
        tally.error = True
        return error(504, f"vLLM did not answer within {gw.fleet.timeout_s}s", request_id)
    except ServingError as exc:
        tally.error = True
        return error(502, f"vLLM request failed: {exc}", request_id)
    finally:
        gw.metrics.upstream_latency.labels(endpoint).observe(time.perf_counter() - started)
        tally.arm = "canary" if tried and tried[-1] is gw.fleet.canary else "fleet"

    if upstream.status_code != 200:
        tally.error = upstream.status_code >= 500  # vLLM's own failure; a 4xx is the client's
        return await _passed_through(server, upstream, stream, request_id)
    served = Served(server, request_id, tenant, episode_id, capture, chat, forward, before, announced, tally)
    return _respond(gw, served, upstream, requested, slot, echo)


def _respond(
    gw: Gateway,
    served: Served,
    upstream: UpstreamResponse,
    requested: Requested,
    slot: Slot,
    echo: Echo | None,
) -> Response:
    """The client's response to vLLM's 200 (a relayed stream, or the whole body), its capture
    scheduled after it is sent; `echo`: the client asked through the Responses API."""
    request_id, chat, before = served.request_id, served.chat, served.before
    # The body names the version the request was served under as far as the gateway knew when
    # it sent it; the event's version (read again after the generation) is the authoritative one.
    version = "unknown" if before is None else format_version(before)
    if served.forward.get("stream") is True:
        translate = None if echo is None else ResponsesStream(echo, request_id, version)
        finish = functools.partial(_finish_stream, gw)
        relay = Relay(served, upstream, requested, finish, slot.release, translate)
        return RelayResponse(
            relay,
            headers={HEADER_REQUEST_ID: request_id, "cache-control": "no-cache"},
            write_timeout_s=gw.settings.gateway.stream_write_timeout_s,
            on_slow_reader=gw.metrics.shed.labels("slow_reader").inc,
        )
    created_at = utcnow()
    payload = upstream.json()
    if echo is not None:
        client_body = response_body(payload, echo, request_id, version, created_at.timestamp())
    else:
        shape = shape_chat_response if chat else shape_completion_response
        client_body = with_rtrl(shape(payload, requested), request_id, version)
    task = BackgroundTask(publish_interaction, gw, served, payload, created_at)
    return FastJSONResponse(client_body, headers={HEADER_REQUEST_ID: request_id}, background=task)


async def _passed_through(
    server: Server, upstream: UpstreamResponse, stream: bool, request_id: str
) -> Response:
    """vLLM's own error (bad parameter, prompt too long, ...), as the client sees it: unchanged."""
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


def _reserve_tokens(gw: Gateway, slot: Slot, forward: dict[str, Any]) -> None:
    """Reserve what the request may generate against its tenant's budget of tokens in flight, or refuse it."""
    limit = forward.get("max_completion_tokens", forward.get("max_tokens"))
    n = forward.get("n", 1)
    tokens = (limit if isinstance(limit, int) else gw.settings.vllm.max_model_len) * (
        n if isinstance(n, int) else 1
    )
    if not slot.reserve(max(1, tokens)):
        gw.metrics.shed.labels("tenant_tokens").inc()
        raise RequestError(
            f"this tenant's requests in flight at this gateway already ask for {gw.slots.tokens(slot.tenant)} "
            f"tokens; with this one's {tokens} that is over its budget of {gw.slots.max_tokens} "
            "(gateway.max_inflight_tokens_per_tenant): retry when one has ended, or ask for fewer (max_tokens)",
            status_code=429,
        )


async def _read(
    gw: Gateway, request: Request, tenant: str, chat: bool, responses: bool = False
) -> tuple[dict[str, Any], Requested, Capture, Echo | None]:
    """(the body to forward, what the client asked for, its capture metadata, what a Response
    repeats of its request with `responses`), or RequestError."""
    raw = await request.body()
    try:
        body = orjson.loads(raw)  # strict (no NaN, Infinity or lone surrogates), 5-20x the stdlib
    except orjson.JSONDecodeError:
        raise RequestError(why_not_json(raw)) from None
    echo = None
    if responses:
        body, echo = to_chat(body)  # a Responses request as the chat request it amounts to
    prepare = prepare_chat_request if chat else prepare_completion_request
    # The allow-list, the token budget, the model and the tenant's cache salt (ingest/forwarding.py).
    served = gw.served_name(tenant)  # the tenant's own adapter when it has one (docs/lora.md)
    forward, requested, body_rtrl = prepare(gw.policy.apply(body, chat, tenant, served), gw.sampling_defaults)
    if gw.lora:
        lora_request(forward, served)
    if echo is not None and forward.get("stream") is True:
        forward["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return forward, requested, parse_capture(request.headers, body_rtrl), echo


def _finish_stream(gw: Gateway, served: Served, stream: StreamCapture, created_at: datetime) -> None:
    """After a stream ended however it ended: count a truncation and the live canary's counts, and
    publish its capture."""
    if stream.truncated:
        gw.metrics.truncated.inc()
    if served.tally is not None and served.tally.version is not None:
        served.tally.error = stream.upstream_failed
        gw.canary_traffic.record(served.tally)
    task = asyncio.get_running_loop().create_task(
        publish_interaction(
            gw, served, stream.payload(), created_at, truncated=stream.truncated, problem=stream.problem
        )
    )
    gw.tasks.add(task)
    task.add_done_callback(gw.tasks.discard)


def sticky_key(tenant: str, forward: dict[str, Any], episode_id: str) -> str:
    """What keeps a request on one arm of a live canary: the OpenAI ``user`` field, namespaced by the
    tenant (two tenants' users of one name are two users), else the (namespaced) episode."""
    user = forward.get("user")
    if isinstance(user, str) and user:
        return f"user\0{tenant}\0{user}"
    return f"episode\0{episode_id}"


async def _call(
    gw: Gateway,
    path: str,
    forward: dict[str, Any],
    stream: bool = False,
    session_id: str | None = None,
    sticky: str | None = None,
    tried: list[Server] | None = None,
    *,
    adapter: str | None = None,
) -> tuple[Server, UpstreamResponse, int | None, Announced | None]:
    """(server, upstream response, version before the generation or None if unknown, the
    deployer's announcement for the server when sent). With `stream`, the response's body is
    not read yet: the caller reads and closes it, and takes the request off
    ``server.in_flight`` when done. Each server tried is appended to `tried` (the last one
    answered, or failed). `adapter`: the tenant's own adapter the request goes to
    (`Gateway.tenant_adapter`), whose version is read from the server, never announced."""
    refused: list[str] = []
    missing: list[str] = []  # servers without the tenant's adapter, until the reconciler loads it
    for server in gw.fleet.order(session_id, sticky):
        if tried is not None:
            tried.append(server)
        try:
            # Announcements are the global adapter's; a tenant's own adapter is read from the server.
            announced = server.announced if adapter is None else None
            before: int | None
            if announced is not None:
                before = announced.version  # no request to vLLM (ingest/routing.py)
            else:
                try:
                    if adapter is not None:
                        before = await gw.fleet.adapter_before(server, adapter)
                    else:
                        before = await gw.fleet.version_before(server)
                except UpstreamRefused:
                    raise
                except ServingError as exc:  # VersionUnknown, UpstreamError
                    if adapter is not None and isinstance(exc, VersionUnknown):
                        missing.append(
                            server.url
                        )  # no copy of the tenant's adapter (a restart): the next one
                        continue
                    # Serve anyway; the event is published with trainable=false (ingest/capture.py).
                    log.warning("version before the generation unknown: %r", exc)
                    before = None
            server.in_flight += 1
            gw.metrics.upstream_requests.labels(server.url).inc()
            if server is gw.fleet.canary:
                gw.metrics.canary_requests.inc()
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
            gw.fleet.mark_down(server)
            refused.append(f"{server.url} ({exc!r})")
            continue
        return server, response, before, announced
    if missing and not refused:
        raise AdapterNotLoaded(f"no vLLM server holds adapter {adapter} yet (the fleet reconciler loads it)")
    raise UpstreamUnavailable(f"no vLLM server reachable: {'; '.join(refused + missing)}")
