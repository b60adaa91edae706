"""Feedback as clients send it to ``POST /v1/feedback``, and what the gateway admits of it.

`FeedbackIn` is the HTTP body (one object or a list of at most `MAX_FEEDBACK_EVENTS`): like a
`schemas.FeedbackEvent`, but ``event_id`` and ``created_at`` may be left out (the gateway, the
events' producer, fills them in) and ``tenant`` may only repeat the key's own. A body is read in
three steps, each bounded by the one before (docs/security.md, Feedback bodies):

* `precheck`: two byte counts (about 1 ms per MiB, in C) refuse a body with more events or values
  than a valid one can have, before anything is parsed;
* `parse`: strict pydantic validation; its refusal shows the first `MAX_ERRORS_SHOWN` errors,
  without the input they are about, and how many there were;
* `admit` checks a batch against the caller and turns it into wire events, all or nothing:

* 403 when an item names another tenant;
* 404 when an item's ``request_id`` was not issued to the caller's tenant (the signature of
  `ingest.auth.RequestIds`), so a tenant cannot even learn whether another's request id exists;
* 422 when ``created_at`` is outside the accepted window (``settings.limits``), a scored value is
  outside the reward spec's range, an ``episode_id`` is too long for the tenant's namespace, or
  ``text`` does not fit the kind (a correction without it, an accepted with it: `schemas.events.text_problem`).

Episode ids are namespaced by tenant (`ingest.auth.namespaced`) exactly as the interactions' are,
and so are idempotency keys: a client's ``event_id`` becomes `scoped_event_id` of (tenant, key), so a
retry by the same tenant is deduplicated downstream and no tenant can claim another's keys
(docs/security.md, Idempotency keys). Feedback without a key gets a fresh id (`new_id`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from ingest.auth import RequestIds, namespaced
from schemas.events import (
    MAX_CORRECTION_CHARS,
    FeedbackEvent,
    FeedbackKind,
    FeedbackValue,
    Id,
    UserText,
    event_time_problem,
    new_id,
    text_problem,
)
from schemas.rewards import RewardSpec
from schemas.settings import LimitsSettings

MAX_FEEDBACK_EVENTS = 1000
MAX_ERRORS_SHOWN = 10  # validation errors a 422 lists; it says how many there were
# The namespace of `scoped_event_id`. Fixed for good: changing it would stop retries sent across the
# change from being recognised as retries.
EVENT_ID_NAMESPACE = uuid.UUID("5f0c6a52-8f0e-4d38-9f5e-2d1a7c1b6e3a")


class FeedbackIn(BaseModel):
    """One feedback signal as a client sends it (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: Id | None = Field(
        None,
        description="Your idempotency key; send the same one when you retry. It is your tenant's: the "
        "event is stored under an id derived from (tenant, key), which the 202 returns.",
    )
    request_id: Id = Field(description="The request the feedback is about (x-rtrl-request-id).")
    episode_id: Id | None = Field(
        None, description="The episode, when the feedback is about the whole episode."
    )
    tenant: Id | None = Field(None, description="Optional; must be the API key's tenant.")
    kind: FeedbackKind
    value: FeedbackValue = Field(1.0, description="Score for task_outcome / judge_score.")
    created_at: datetime | None = Field(None, description="When it happened (with a timezone); default: now.")
    text: UserText | None = Field(
        None,
        description="What the user wrote: required on correction (the corrected answer or a hint), allowed on "
        f"edited; at most {MAX_CORRECTION_CHARS} characters. Redacted like prompts before it leaves the gateway.",
    )

    @field_validator("created_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("created_at must carry a timezone (use UTC)")
        return value


ONE = TypeAdapter(FeedbackIn)
MANY = TypeAdapter(list[FeedbackIn])
# The most values a valid body can have: each event has at most one per field, and a comma may also
# stand in a time's fraction (``00:00:00,5``), one more per event (`precheck`).
MAX_FEEDBACK_VALUES = MAX_FEEDBACK_EVENTS * (len(FeedbackIn.model_fields) + 1)


# The most strings a valid body can have: each event's keys and string values (the text's own quotes
# are escaped, `structure`). More is refused before the body is split on them.
MAX_FEEDBACK_STRINGS = MAX_FEEDBACK_EVENTS * 2 * len(FeedbackIn.model_fields)


@dataclass(frozen=True)
class Counts:
    """What `precheck` counted of a body: its events (``{``) and an upper bound on its values."""

    events: int
    values: int


def structure(raw: bytes) -> bytes | str:
    """`raw` without the contents of its JSON strings, or why it cannot be a valid body. Only a
    ``text`` (a correction, an edit) may hold ``{`` or ``,`` in a valid body, so only a body that
    names ``"text"`` is cut (a key or value ``"text"`` cannot hide inside a string: its quotes would
    be escaped). A few passes in C, about 5 ms per MiB: escaped backslashes and quotes dropped,
    then the pieces between quotes kept one in two. A body with more strings than a valid one can
    hold is refused before it is split."""
    if b'"text"' not in raw:
        return raw
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    quotes = plain.count(b'"')
    if quotes > 2 * MAX_FEEDBACK_STRINGS:
        return (
            f"a feedback body of at most {MAX_FEEDBACK_EVENTS} events has at most {MAX_FEEDBACK_STRINGS} "
            f"strings; this body has {quotes // 2} (its quotes, counted before parsing)"
        )
    return b"".join(plain.split(b'"')[::2])


def counts(raw: bytes) -> Counts | str:
    """How many events and values the body `raw` holds at most, or why it is refused before it is
    parsed. Two byte counts outside strings (`structure`): in a body that can be valid no other
    string holds a ``{`` or a ``,`` (ids are ``[A-Za-z0-9_.:@/+=-]``, kinds are words, times ISO
    8601), so ``{`` counts its events exactly and ``,`` its values less one. A string holding them
    only raises the count, of a body that validation would refuse anyway. Without this, 349,000
    empty items (``[{},{},...]``, under 1 MiB) cost the event loop seconds of validation and error
    rendering, for every tenant."""
    outside = structure(raw)
    if isinstance(outside, str):
        return outside
    events = outside.count(b"{")
    if events > MAX_FEEDBACK_EVENTS:
        return (
            f"send between 1 and {MAX_FEEDBACK_EVENTS} feedback events per request; this body has "
            f"{events} (its '{{' characters, counted before parsing)"
        )
    values = outside.count(b",") + 1
    if values > MAX_FEEDBACK_VALUES:
        return (
            f"a feedback body of at most {MAX_FEEDBACK_EVENTS} events has at most {MAX_FEEDBACK_VALUES} "
            f"values; this body has {values} (its commas plus one, counted before parsing)"
        )
    return Counts(events, values)


def precheck(raw: bytes) -> str | None:
    """Why the body `raw` is refused before it is parsed, else None (`counts`)."""
    found = counts(raw)
    return found if isinstance(found, str) else None


def values_in(raw: bytes) -> int:
    """An upper bound on the values in `raw` (the cost of `parse`): its commas outside strings plus one."""
    found = counts(raw)
    return MAX_FEEDBACK_VALUES + 1 if isinstance(found, str) else found.values


@dataclass(frozen=True)
class Invalid:
    """A body that failed validation: the first `MAX_ERRORS_SHOWN` errors and how many there were."""

    errors: list[dict[str, Any]]
    error_count: int


def parse(raw: bytes) -> list[FeedbackIn] | Invalid:
    """The items of a body that passed `precheck` (a list of one for a single object), or why not.
    The errors leave out the input they are about: a refused 1 MiB string is not sent back."""
    try:
        if raw.lstrip()[:1] == b"[":
            return MANY.validate_json(raw, strict=True)
        return [ONE.validate_json(raw, strict=True)]
    except ValidationError as exc:
        # .json() renders 10,000 errors in a third of the time .errors() takes (ctx may hold exceptions).
        errors = json.loads(exc.json(include_url=False, include_input=False))
        return Invalid(errors[:MAX_ERRORS_SHOWN], exc.error_count())


def scoped_event_id(tenant: str, key: str) -> str:
    """The stored event id of a tenant's idempotency key: a uuid5 of (tenant, key), as 32 hex digits
    (`new_id`'s form; a uuid5 never equals a uuid4, so it never meets a fresh id). The same key from
    the same tenant always gives the same id, from two tenants two ids."""
    return uuid.uuid5(EVENT_ID_NAMESPACE, f"{tenant}\0{key}").hex


@dataclass(frozen=True)
class Refused:
    """Why a batch was not admitted: the HTTP status and one message per refused item."""

    status: int
    problems: list[str]


def admit(
    items: list[FeedbackIn],
    tenant: str,
    ids: RequestIds,
    spec: RewardSpec,
    limits: LimitsSettings,
    now: datetime,
) -> list[FeedbackEvent] | Refused:
    """The wire events of a batch from `tenant`, or why it is refused (nothing of it is published)."""
    by_status: dict[int, list[str]] = {}
    events: list[FeedbackEvent] = []
    for i, item in enumerate(items):
        where = f"feedback[{i}]"
        if item.tenant is not None and item.tenant != tenant:
            by_status.setdefault(403, []).append(
                f"{where}: tenant {item.tenant!r} is not this API key's tenant"
            )
            continue
        if not ids.belongs_to(item.request_id, tenant):
            by_status.setdefault(404, []).append(
                f"{where}: no request {item.request_id!r} for this API key's tenant"
            )
            continue
        created_at = item.created_at or now
        problem = event_time_problem(created_at, now, limits.max_future_skew_s, limits.max_event_age_s)
        problem = problem or spec.value_problem(item.kind, item.value) or text_problem(item.kind, item.text)
        try:
            episode_id = None if item.episode_id is None else namespaced(tenant, item.episode_id)
        except ValueError as exc:
            problem = problem or str(exc)
        if problem is not None:
            by_status.setdefault(422, []).append(f"{where}: {problem}")
            continue
        events.append(
            FeedbackEvent(
                event_id=new_id() if item.event_id is None else scoped_event_id(tenant, item.event_id),
                request_id=item.request_id,
                episode_id=episode_id,
                tenant=tenant,
                kind=item.kind,
                value=item.value,
                created_at=created_at,
                text=item.text,
            )
        )
    for status in (403, 404, 422):  # the gravest refusal decides the status
        if status in by_status:
            return Refused(status, [p for s in (403, 404, 422) for p in by_status.get(s, [])])
    return events
