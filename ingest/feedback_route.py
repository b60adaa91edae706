"""``POST /v1/feedback``: one feedback object or a list of them (`ingest.intake`).

202 ``{"event_ids": [...]}`` once every event is durable: acknowledged by Kafka on
``settings.kafka.feedback_topic``, or fsynced in the gateway's spool (`Publisher.publish_confirmed`;
awaited on the event loop, never blocking it). When that does not happen within
`Publisher.confirm_within_s` (publish_timeout_s + 1.25 s), or an event went to the overflow file
or nowhere (spool full), the answer is 503 with ``Retry-After`` and the reason in one line: the
client retries with the same ``event_id``s, and the events that did land are deduplicated
downstream (docs/security.md, Accepted means durable). The ids are those the events are stored
under, in the order sent. A client's ``event_id`` is its tenant's idempotency key, so
the id returned for it is `intake.scoped_event_id` of (tenant, key), not the key itself; the same
key sent again by the same tenant gets the same id (and is deduplicated downstream). Items without
a key get fresh ids. 403/404 for another tenant's requests, 422 with the reason on bad input.

No body can hold the event loop (docs/security.md, Feedback bodies): `intake.precheck` refuses
bodies with more events or values than a valid one can have before anything is parsed, which
bounds the rest; a body of more than `INLINE_VALUES` values is then parsed and admitted in a
worker thread, one at a time per gateway (`Gateway.feedback_parsing`), so a flood of big bodies
waits its turn there while the loop serves everyone else. So is a body whose text (a correction, an
edit) is too long to redact on the loop: the text is masked like a prompt (`ingest.redaction`)
before the event is published.
"""

from __future__ import annotations

import asyncio
import logging
import math
from concurrent.futures import Future

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ingest import intake
from ingest.gateway import Gateway
from ingest.redaction import Redacted
from ingest.responses import error
from schemas.clock import utcnow
from schemas.events import MAX_CORRECTION_CHARS, FeedbackEvent

# Bodies of up to this many values (a few events) are parsed on the event loop: well under 1 ms,
# less than the hop to a thread.
INLINE_VALUES = 256

log = logging.getLogger(__name__)

Admitted = list[tuple[FeedbackEvent, str]]  # each event with its wire JSON


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
    counts = intake.counts(raw)
    if isinstance(counts, str):
        return JSONResponse({"detail": counts}, status_code=422)
    wait_s = gw.feedback_rate.take(tenant, max(1, counts.events))  # its events, exactly (`intake.counts`)
    if wait_s is not None:
        gw.metrics.shed.labels("feedback_rate").inc()
        return JSONResponse(
            {
                "detail": f"this tenant sends more than {gw.settings.gateway.feedback_events_per_s:g} feedback events "
                "a second (gateway.feedback_events_per_s); retry after Retry-After seconds"
            },
            status_code=429,
            headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
        )
    # Redacting a long text costs more than the hop to a thread (`Redactor.cheap`; a text's characters
    # are fewer than the body's bytes). A body without text has nothing to redact; one with a JSON
    # escape may spell the key `"\u0074ext"`, which the parser reads as `text`, so it is counted as one.
    redacts = bool(gw.redactor.detectors) and (b'"text"' in raw or b"\\u" in raw)
    if counts.values <= INLINE_VALUES and not (redacts and not gw.redactor.cheap(len(raw))):
        admitted = _admit(gw, raw, tenant)
    else:
        admitted = await anyio.to_thread.run_sync(_admit, gw, raw, tenant, limiter=gw.feedback_parsing)
    if isinstance(admitted, Response):
        return admitted
    topic = gw.settings.kafka.feedback_topic
    confirmations = [
        gw.publisher.publish_confirmed(topic, event.request_id, value, event.schema_version, event.event_id)
        for event, value in admitted
    ]
    problem = await not_durable(confirmations, gw.publisher.confirm_within_s)
    if problem is not None:
        retry_s = max(1, math.ceil(gw.settings.gateway.publish_timeout_s))
        return error(
            503,
            f"feedback not stored: {problem}; retry with the same event_id values",
            headers={"Retry-After": str(retry_s)},
        )
    return JSONResponse({"event_ids": [event.event_id for event, _ in admitted]}, status_code=202)


async def not_durable(confirmations: list[Future[str]], timeout_s: float) -> str | None:
    """None once every confirmation says its event is on Kafka or in the spool; else why not (the
    first failure's reason, or the timeout). Waits on the event loop without blocking it."""
    if all(c.done() and c.exception() is None for c in confirmations):
        return None
    waiting = [asyncio.wrap_future(c) for c in confirmations]
    _, pending = await asyncio.wait(waiting, timeout=timeout_s)
    for future in pending:
        future.cancel()  # stop waiting here; the event still settles in the publisher
    failures = [str(f.exception()) for f in waiting if not f.cancelled() and f.exception() is not None]
    if failures:
        return failures[0]
    if pending:
        return (
            f"{len(pending)} of {len(waiting)} events were not on Kafka or in the spool within {timeout_s:g}s"
        )
    return None


def _admit(gw: Gateway, raw: bytes, tenant: str) -> Admitted | Response:
    """The events of a body that passed `intake.precheck`, with their wire JSON, or the refusal.
    Runs in a worker thread for big bodies: it touches nothing but `gw`'s immutable parts and its
    metrics (thread-safe)."""
    items = intake.parse(raw)
    if isinstance(items, intake.Invalid):
        return JSONResponse({"detail": items.errors, "error_count": items.error_count}, status_code=422)
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
    if gw.redactor.detectors:
        events = [_redacted(gw, event) if event.text is not None else event for event in events]
    return [(event, event.model_dump_json()) for event in events]


def _redacted(gw: Gateway, event: FeedbackEvent) -> FeedbackEvent:
    """`event` with its text masked by the gateway's detectors, as a prompt is (ingest/capture.py): a
    correction is the user's own words, as likely as a prompt to hold an address or a key."""
    assert event.text is not None
    try:
        redacted = gw.redactor(event.text)
    except Exception:  # noqa: BLE001 - a plugged-in detector failed: mask everything, lose nothing else
        log.exception("redaction of feedback %s failed: its text is masked whole", event.event_id)
        redacted = Redacted("[REDACTED:redaction_failed]", frozenset({"redaction_failed"}))
    if not redacted.kinds:
        return event
    for kind in sorted(redacted.kinds):
        gw.metrics.redacted.labels(kind).inc()
    # A mask can be longer than what it hides: cut back to the wire's limit, or the labeler would
    # dead-letter the event for a length the client did not send.
    return event.model_copy(update={"text": redacted.text[:MAX_CORRECTION_CHARS]})
