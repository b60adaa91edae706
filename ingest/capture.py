"""The capture of a served generation: its `InteractionEvent`, published after the response.

Capturing never fails or delays the user's response: it runs after the response was sent (a
stream: when it ends, however it ends, `ingest.relay`). The event is stamped with the weight
version that generated it and the key's tenant, its text redacted (`ingest.redaction`), and
handed to the `ingest.publisher.Publisher` for ``settings.kafka.interactions_topic``. An event
that cannot be built (e.g. the server did not report its version) becomes a `DeadLetterRecord`
on ``settings.kafka.dlq_topic`` with the reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime
from typing import Any

from ingest.gateway import Gateway
from ingest.redaction import Redacted, redact_json
from ingest.relay import Served
from ingest.shaping import Generation, build_interaction, extract_chat, extract_completion, sampling_params
from schemas.events import MAX_EVENT_BYTES, DeadLetterRecord, InteractionEvent
from schemas.sampling import unreproducible
from schemas.versions import format_version
from serving import ServingError

log = logging.getLogger(__name__)


async def publish_interaction(
    gw: Gateway,
    served: Served,
    payload: dict[str, Any],
    created_at: datetime,
    truncated: bool = False,
    problem: str | None = None,
) -> None:
    """Establish the version that generated `served`, build and publish its InteractionEvent.

    The version is the deployer's announcement when that proves it (`Fleet.attributed`), else a
    read of the server after the generation. Runs after the response was sent, so a read costs
    the user nothing; reading a little later than the generation ended only widens the
    straddle window (conservative).
    """
    kafka = gw.settings.kafka
    request_id, forward, before = served.request_id, served.forward, served.before
    unreproducible_by = unreproducible(forward)
    if unreproducible_by is not None:
        gw.metrics.untrainable.labels(unreproducible_by).inc()
    after = gw.fleet.attributed(served.server, served.announced)
    if after is not None:
        gw.metrics.version_source.labels("announced").inc()
    else:
        gw.metrics.version_source.labels("read").inc()
        try:
            adapter = gw.tenant_adapter(forward)
            if adapter is not None:  # a tenant's own adapter: its version, not the server's label
                after = await gw.fleet.read_adapter(served.server, adapter)
            else:
                after = await gw.fleet.read_version(served.server)
        except ServingError as exc:  # UpstreamError, VersionUnknown
            reason = (
                f"could not build an InteractionEvent: weight version after the generation unknown: {exc!r}"
            )
            dead_letter(gw, request_id, reason, payload, forward)
            return
    try:
        generation: Generation = (
            extract_chat(payload) if served.chat else extract_completion(payload, forward)
        )
        # Straddled a swap (or "before" unknown): the tokens came from one set of weights, but
        # we cannot tell which, so the behaviour logprobs cannot be attributed to a version.
        straddled = before != after
        if straddled:
            gw.metrics.straddled.inc()
            log.info(
                "request %s straddled a weight swap (%s -> %s): trainable=false",
                request_id,
                "unknown" if before is None else format_version(before),
                format_version(after),
            )
        event = build_interaction(
            request_id=request_id,
            tenant=served.tenant,
            episode_id=served.episode_id,
            capture=served.capture,
            model=str(payload.get("model") or forward.get("model") or "unknown"),
            policy_version=after,
            generation=generation,
            sampling=sampling_params(forward, gw.settings.vllm.logprobs_mode),
            straddled=straddled,
            created_at=created_at,
            truncated=truncated,
            untrainable_reason=unreproducible_by,
        )
    except (ValueError, KeyError, TypeError) as exc:  # ValidationError is a ValueError
        reason = f"could not build an InteractionEvent: {exc}"
        if problem is not None:
            reason += f" (the stream: {problem})"
        dead_letter(gw, request_id, reason, payload, forward)
        return
    if gw.redactor.detectors:
        if gw.redactor.cheap(len(event.prompt) + len(event.completion)):
            event = _redacted(gw, event)  # a hop to a thread would cost more than the regexes
        else:
            event = await asyncio.to_thread(_redacted, gw, event)  # large texts: off the event loop
    gw.publisher.publish(
        kafka.interactions_topic, request_id, event.model_dump_json(), event.schema_version, event.event_id
    )


def _redacted(gw: Gateway, event: InteractionEvent) -> InteractionEvent:
    """`event` with its text masked by the configured detectors, and what they found recorded."""
    try:
        prompt, completion = gw.redactor(event.prompt), gw.redactor(event.completion)
    except Exception:  # noqa: BLE001 - a plugged-in detector failed: mask everything, lose nothing
        log.exception("redaction of request %s failed: its text is masked whole", event.request_id)
        prompt = completion = Redacted("[REDACTED:redaction_failed]", frozenset({"redaction_failed"}))
    kinds = sorted(prompt.kinds | completion.kinds)
    if not kinds:
        return event
    for kind in kinds:
        gw.metrics.redacted.labels(kind).inc()
    return event.model_copy(update={"prompt": prompt.text, "completion": completion.text, "redacted": kinds})


def dead_letter(gw: Gateway, request_id: str, reason: str, payload: Any, forward: Any) -> None:
    """Publish a `DeadLetterRecord` of a generation that could not be captured, its text redacted."""
    try:  # every string redacted before it is serialized (escapes like \n would hide a match)
        raw = json.dumps(
            redact_json(gw.redactor, {"request_id": request_id, "request": forward, "response": payload})
        )
    except Exception:  # noqa: BLE001 - a plugged-in detector failed: keep no text at all
        log.exception("redaction of dead letter %s failed: its payload is dropped", request_id)
        raw = json.dumps({"request_id": request_id, "payload": "[REDACTED:redaction_failed]"})
    if len(raw) > MAX_EVENT_BYTES:
        raw = raw[:MAX_EVENT_BYTES]
        reason += " (payload truncated)"
    record = DeadLetterRecord(source="gateway", reason=reason[:10_000], payload=raw)
    gw.metrics.publish.labels(gw.settings.kafka.dlq_topic, "dead_letter").inc()
    log.warning("request %s dead-lettered: %s", request_id, reason)
    gw.publisher.publish(
        gw.settings.kafka.dlq_topic,
        request_id,
        record.model_dump_json(),
        record.schema_version,
        record.event_id,
    )
