"""Feedback as clients send it to ``POST /v1/feedback``, and what the gateway admits of it.

`FeedbackIn` is the HTTP body (one object or a list of at most `MAX_FEEDBACK_EVENTS`): like a
`schemas.FeedbackEvent`, but ``event_id`` and ``created_at`` may be left out (the gateway, the
events' producer, fills them in) and ``tenant`` may only repeat the key's own. `admit` checks a
batch against the caller and turns it into wire events, all or nothing:

* 403 when an item names another tenant;
* 404 when an item's ``request_id`` was not issued to the caller's tenant (the signature of
  `ingest.auth.RequestIds`), so a tenant cannot even learn whether another's request id exists;
* 422 when ``created_at`` is outside the accepted window (``settings.limits``), a scored value is
  outside the reward spec's range, or an ``episode_id`` is too long for the tenant's namespace.

Episode ids are namespaced by tenant (`ingest.auth.namespaced`) exactly as the interactions' are.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from ingest.auth import RequestIds, namespaced
from schemas.events import FeedbackEvent, FeedbackKind, FeedbackValue, Id, event_time_problem, new_id
from schemas.rewards import RewardSpec
from schemas.settings import LimitsSettings

MAX_FEEDBACK_EVENTS = 1000


class FeedbackIn(BaseModel):
    """One feedback signal as a client sends it (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: Id | None = Field(None, description="Your idempotency key; send the same one when you retry.")
    request_id: Id = Field(description="The request the feedback is about (x-rtrl-request-id).")
    episode_id: Id | None = Field(
        None, description="The episode, when the feedback is about the whole episode."
    )
    tenant: Id | None = Field(None, description="Optional; must be the API key's tenant.")
    kind: FeedbackKind
    value: FeedbackValue = Field(1.0, description="Score for task_outcome / judge_score.")
    created_at: datetime | None = Field(None, description="When it happened (with a timezone); default: now.")

    @field_validator("created_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("created_at must carry a timezone (use UTC)")
        return value


ONE = TypeAdapter(FeedbackIn)
MANY = TypeAdapter(list[FeedbackIn])


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
        problem = problem or spec.value_problem(item.kind, item.value)
        try:
            episode_id = None if item.episode_id is None else namespaced(tenant, item.episode_id)
        except ValueError as exc:
            problem = problem or str(exc)
        if problem is not None:
            by_status.setdefault(422, []).append(f"{where}: {problem}")
            continue
        events.append(
            FeedbackEvent(
                event_id=item.event_id or new_id(),
                request_id=item.request_id,
                episode_id=episode_id,
                tenant=tenant,
                kind=item.kind,
                value=item.value,
                created_at=created_at,
            )
        )
    for status in (403, 404, 422):  # the gravest refusal decides the status
        if status in by_status:
            return Refused(status, [p for s in (403, 404, 422) for p in by_status.get(s, [])])
    return events
