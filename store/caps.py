"""Caps per episode: what one episode may hold (docs/security.md, Caps per episode and held-out
membership). Part of the labeler's batch write (store/events.py, `write_events`), before the insert.

* segments: an interaction whose episode already has ``Caps.segments`` stored segments (late ones
  included) is a dead letter ``cap: ...``; an episode keeps its first segments, in the order the
  labeler stores them;
* feedback: a feedback event whose episode already has ``Caps.feedback`` feedback rows (joined, late
  or waiting for it by name) is a dead letter ``cap: ...``. Feedback whose episode is not known yet
  (its interaction has not arrived) is counted against its request: at most ``Caps.feedback`` wait
  per (request, tenant), and they join together when the interaction arrives. So a flooded episode
  stops moving its last event, settles by its window, and its feedback is read at most that many
  rows at a time (store/settle_reads.py).

Counted in the database per batch (one grouped count per table): exact on one labeler and on
SQLite. Several PostgreSQL replicas writing one episode's records at the same moment each count what
is committed, so the episode may pass a cap by at most what their concurrent batches hold
(``labeler.max_poll_records`` per other replica), once: their next batches see the committed rows.
An event refused by a cap but stored from this very record before (a batch read again after a
crash) stays a replay, as `_refuse_unknown_tenants` does for tenants.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from schemas.events import FeedbackEvent, InteractionEvent
from store.bulk import among
from store.events import Event, Rejected, SourceRecord, sources_of
from store.models import Feedback, Interaction

Parsed = list[tuple[SourceRecord, Event | Rejected]]
# What a feedback event counts against: ("episode", episode id, tenant) or ("request", request id, tenant).
Key = tuple[str, str, str]


@dataclass(frozen=True)
class Caps:
    """The labeler's caps per episode (``limits.max_segments_per_episode``, ``max_feedback_per_episode``)."""

    segments: int
    feedback: int


def apply_caps(
    session: Session, parsed: Sequence[tuple[SourceRecord, Event | Rejected]], caps: Caps
) -> Parsed:
    """`parsed` with each event past a cap a ``cap`` reject (the module docstring)."""
    reasons = _segments_over(session, parsed, caps.segments) | _feedback_over(session, parsed, caps.feedback)
    if not reasons:
        return list(parsed)
    events = [e for _, e in parsed if not isinstance(e, Rejected)]
    ids = [events[i].event_id for i in reasons]
    stored = {**sources_of(session, Interaction, ids), **sources_of(session, Feedback, ids)}
    out: Parsed = []
    position = 0
    for record, event in parsed:
        if not isinstance(event, Rejected):
            reason = reasons.get(position)
            position += 1
            if reason is not None and stored.get(event.event_id) != record.source:
                out.append((record, Rejected(record, reason, event.event_id)))
                continue
        out.append((record, event))
    return out


def _segments_over(
    session: Session, parsed: Sequence[tuple[SourceRecord, Event | Rejected]], cap: int
) -> dict[int, str]:
    """The interactions past the segment cap, by position among the batch's events, with their reason."""
    events = [e for _, e in parsed if not isinstance(e, Rejected)]
    episodes = sorted({e.episode_id for e in events if isinstance(e, InteractionEvent)})
    if not episodes:
        return {}
    counted = session.execute(
        select(Interaction.episode_id, func.count())
        .where(among(session, Interaction.episode_id, episodes))
        .group_by(Interaction.episode_id)
    )
    have: Counter[str] = Counter({episode_id: n for episode_id, n in counted})
    over: dict[int, str] = {}
    for position, event in enumerate(events):
        if not isinstance(event, InteractionEvent):
            continue
        if have[event.episode_id] >= cap:
            over[position] = (
                f"cap: episode {event.episode_id} has its {cap} segments (limits.max_segments_per_episode)"
            )
        else:
            have[event.episode_id] += 1
    return over


def _feedback_over(
    session: Session, parsed: Sequence[tuple[SourceRecord, Event | Rejected]], cap: int
) -> dict[int, str]:
    """The feedback events past the feedback cap, by position among the batch's events, with their reason."""
    events = [e for _, e in parsed if not isinstance(e, Rejected)]
    feedback = [(p, e) for p, e in enumerate(events) if isinstance(e, FeedbackEvent)]
    if not feedback:
        return {}
    keys, requests_of = _keys(session, events, [e for _, e in feedback])
    have = _stored_feedback(session, keys.values(), requests_of)
    over: dict[int, str] = {}
    for position, event in feedback:
        key = keys[event.event_id]
        if have[key] >= cap:
            what = "episode" if key[0] == "episode" else "request (its episode not known yet)"
            over[position] = f"cap: {what} {key[1]} has its {cap} feedback (limits.max_feedback_per_episode)"
        else:
            have[key] += 1
    return over


def _keys(
    session: Session, events: list[Event], feedback: list[FeedbackEvent]
) -> tuple[dict[str, Key], dict[Key, set[str]]]:
    """What each feedback counts against (by event id), and the requests of the batch's interactions
    of each episode key (whose waiting feedback joins that episode in this batch)."""
    by_request = {(e.request_id, e.tenant): e.episode_id for e in events if isinstance(e, InteractionEvent)}
    unknown = sorted({f.request_id for f in feedback if not f.episode_id} - {r for r, _ in by_request})
    if unknown:
        rows = session.execute(
            select(Interaction.request_id, Interaction.tenant, Interaction.episode_id).where(
                among(session, Interaction.request_id, unknown)
            )
        )
        for row in rows:
            by_request.setdefault((row.request_id, row.tenant), row.episode_id)
    keys: dict[str, Key] = {}
    for f in feedback:
        episode = f.episode_id or by_request.get((f.request_id, f.tenant))
        keys[f.event_id] = ("episode", episode, f.tenant) if episode else ("request", f.request_id, f.tenant)
    requests_of: dict[Key, set[str]] = {}
    for e in events:
        if isinstance(e, InteractionEvent):
            requests_of.setdefault(("episode", e.episode_id, e.tenant), set()).add(e.request_id)
    return keys, requests_of


def _stored_feedback(session: Session, keys: Iterable[Key], requests_of: dict[Key, set[str]]) -> Counter[Key]:
    """Stored feedback per key: an episode's joined rows, the rows waiting that name it, and those
    waiting for the batch's requests of it (they join it now); a request's rows waiting for it."""
    wanted = set(keys)
    episodes = sorted({k[1] for k in wanted if k[0] == "episode"})
    have: Counter[Key] = Counter()
    if episodes:
        for episode_id, tenant, n in session.execute(
            select(Feedback.joined_episode_id, Feedback.tenant, func.count())
            .where(among(session, Feedback.joined_episode_id, episodes))
            .group_by(Feedback.joined_episode_id, Feedback.tenant)
        ):
            have[("episode", str(episode_id), tenant)] += n
        for episode_id, tenant, n in session.execute(
            select(Feedback.episode_id, Feedback.tenant, func.count())
            .where(among(session, Feedback.episode_id, episodes), Feedback.joined_episode_id.is_(None))
            .group_by(Feedback.episode_id, Feedback.tenant)
        ):
            have[("episode", str(episode_id), tenant)] += n
    joining = {r: k for k, requests in requests_of.items() if k in wanted for r in requests}
    requests = sorted({k[1] for k in wanted if k[0] == "request"} | set(joining))
    if requests:
        for request_id, tenant, n in session.execute(
            select(Feedback.request_id, Feedback.tenant, func.count())
            .where(
                among(session, Feedback.request_id, requests),
                Feedback.joined_episode_id.is_(None),
                Feedback.episode_id.is_(None),
            )
            .group_by(Feedback.request_id, Feedback.tenant)
        ):
            have[("request", request_id, tenant)] += n
            episode = joining.get(request_id)
            if episode is not None and episode[2] == tenant:
                have[episode] += n
    return have
