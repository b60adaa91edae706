"""``POST /v1/feedback``: one feedback object or a list of them (`ingest.intake`).

202 with the event ids once queued for ``settings.kafka.feedback_topic``; 403/404 for another
tenant's requests, 422 with the reason on bad input.
"""

from __future__ import annotations

import json

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ingest import intake
from ingest.gateway import Gateway
from schemas.clock import utcnow


async def feedback(gw: Gateway, request: Request) -> Response:
    """``POST /v1/feedback`` for a tenant key."""
    caller = gw.authenticate(request, "tenant")
    if isinstance(caller, Response):
        response = caller
    else:
        assert caller.tenant is not None
        response = await _feedback(gw, request, caller.tenant)
    gw.metrics.requests.labels("feedback", str(response.status_code)).inc()
    return response


async def _feedback(gw: Gateway, request: Request, tenant: str) -> Response:
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
    events = intake.admit(items, tenant, gw.ids, gw.spec, gw.settings.limits, utcnow())
    if isinstance(events, intake.Refused):
        if events.status in (403, 404):
            gw.metrics.auth.labels("foreign_tenant" if events.status == 403 else "foreign_request").inc()
        return JSONResponse({"detail": events.problems}, status_code=events.status)
    topic = gw.settings.kafka.feedback_topic
    for event in events:
        gw.publisher.publish(
            topic, event.request_id, event.model_dump_json(), event.schema_version, event.event_id
        )
    return JSONResponse({"event_ids": [e.event_id for e in events]}, status_code=202)
