"""Routes for operators: ``GET /healthz``, ``GET /readyz``, ``GET /metrics``, ``GET /v1/whoami``."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ingest.auth import OPEN_CALLER
from ingest.gateway import Gateway


async def healthz(request: Request) -> Response:
    """The process is up."""
    return JSONResponse({"status": "ok"})


async def ready(gw: Gateway) -> Response:
    """200 when a vLLM server of the fleet answers (and the keys are loaded); reports the canary server,
    Kafka, the spool and the keys too."""
    health = await gw.fleet.health()
    canary = gw.fleet.canary
    # Only the fleet makes the gateway ready: the canary serves a share of users, and they go to the
    # fleet when it is down.
    fleet = {url: ok for url, ok in health.items() if canary is None or url != canary.url}
    body = {
        "ready": any(fleet.values()) and (gw.keys is None or gw.keys.loaded),
        "vllm": fleet,
        "canary": None
        if canary is None
        else {"url": canary.url, "live": gw.fleet.canary_live, "healthy": health[canary.url]},
        "auth": gw.settings.gateway.auth,
        "keys_loaded": None if gw.keys is None else gw.keys.loaded,
        "out_of_rotation": sorted(gw.fleet.out),
        "kafka_connected": gw.publisher.connected,
        "publish_in_flight": gw.publisher.in_flight,
        "publish_oldest_in_flight_s": round(gw.publisher.in_flight_age_s, 3),
        "spool_bytes": gw.publisher.spool.size_bytes,
    }
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


async def whoami(gw: Gateway, request: Request) -> Response:
    """The tenant and role of the caller's key (200), or why the key is refused."""
    caller = gw.authenticate(request, None)
    if isinstance(caller, Response):
        return caller
    return JSONResponse({"tenant": caller.tenant, "role": caller.role, "auth": gw.settings.gateway.auth})


async def metrics_page(gw: Gateway, request: Request) -> Response:
    """The gateway's Prometheus metrics, for an admin key (every worker's, merged, when there are
    several: `ingest.metrics`)."""
    caller = gw.authenticate(request, "admin") if gw.keys is not None else OPEN_CALLER
    if isinstance(caller, Response):
        return caller
    return Response(gw.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
