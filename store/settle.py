"""Join feedback to episodes and settle episodes with a reward. Runs inside the labeler's batch
transaction (`store.Store.labelling`), so a batch's rows, joins and rewards commit together.

Rules (docs/runbooks/labeler.md has the operator's view):

* An episode opens with its first segment (InteractionEvent). Its policy is the *oldest* policy
  among its segments, so max-policy-lag selection is conservative for episodes that straddle a
  hot-swap.
* Feedback joins by ``episode_id`` when the sender gave one, else by ``request_id`` through the
  interaction that carries it, and only within the same tenant (a request id of another tenant
  never joins). Feedback that arrives before its interaction waits unjoined and joins when the
  interaction arrives; still unjoined after the settle window it is reported as orphaned
  (``Store.stats``) - kept, never dropped.
* An episode settles when feedback of a terminal kind of the reward spec joins it
  (``terminal_feedback``), or when ``settle_window_s`` passes after its last joined event
  (``window``) with the reward of what arrived - reward 0 and component ``no_feedback`` if nothing.
* After settlement nothing changes the reward: late feedback is stored with ``late = true`` and
  late segments likewise (they are excluded from training, as the reward never judged them).
  Re-labelling needs a new reward spec version, not a silent edit.

Concurrency (several labeler replicas on one PostgreSQL store, READ COMMITTED):

* An episode is created with ``INSERT .. ON CONFLICT DO NOTHING``, so two replicas that receive
  segments of one episode at once both go on (the second waits for the first to commit).
* Every change to an episode - extending it, joining feedback to it, settling it on terminal
  feedback - happens under its row lock (``SELECT .. FOR UPDATE``, taken in episode id order so
  that replicas queue instead of deadlocking) and is decided on the row and the unjoined feedback
  as committed once the lock is held. So an episode settles once, and feedback joins either
  before it settles (and is in the reward) or after (``late``), never in between.
* The window settle locks the expired episodes with ``SKIP LOCKED``: an episode that a replica is
  joining to or settling right now is left for a later pass (by then it is settled, or its last
  event is new). Two replicas' window passes settle disjoint sets.
* A deadlock the database still detects (a rare cross order, e.g. a second round of locks) rolls
  the batch back and the labeler retries it (`store.DatabaseUnavailable`).
* What the locks cannot see is a row another replica has not committed yet. An interaction and
  feedback about it are therefore read by one replica, in order: both are keyed by ``request_id``
  and both topics have the same partition count, so with the range assignor (kafka-python's
  default) partition p of both topics belongs to the same consumer (docs/runbooks/labeler.md,
  Replicas). Segments of one episode may be on any partition: the locks above order them.
  SQLite has a single writer (``BEGIN IMMEDIATE``), so none of this arises there and the lock
  clauses are not emitted.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from schemas.events import FeedbackEvent, InteractionEvent
from schemas.rewards import RewardSpec, score
from schemas.versions import parse_version
from store.events import insert_ignoring
from store.models import Episode, Feedback, Interaction

# Settle at most this many expired episodes per pass, so one pass cannot make a huge transaction.
WINDOW_BATCH = 1000


def eval_bucket(episode_id: str) -> int:
    """0..99, from SHA-256 of the episode id: the same on every replica and in every run. Episodes
    whose bucket is below ``gate.ope.holdout_percent`` are the eval gate's held-out traffic and
    are never trained on (`Store.select_heldout`, `Store.select_episodes`)."""
    return int.from_bytes(hashlib.sha256(episode_id.encode()).digest()[:8], "big") % 100


@dataclass(frozen=True)
class Settled:
    """One episode settled (for the labeler's metrics)."""

    policy_version: str
    reward: float
    reason: str
    latency_s: float  # from the episode's first event to its settlement
    unfinished: bool = False  # a trainable segment was cut off by max_tokens (schemas/rewards.py)


@dataclass
class SettleReport:
    joined: int = 0
    late_feedback: int = 0
    late_segments: int = 0
    settled_terminal: int = 0
    settled_window: int = 0
    settled: list[Settled] = field(default_factory=list)


def join_and_settle(
    session: Session,
    dialect: str,
    spec: RewardSpec,
    now: datetime,
    interactions: list[InteractionEvent],
    feedback: list[FeedbackEvent],
) -> SettleReport:
    """Open/extend episodes for new segments, join waiting feedback, settle on terminal feedback.

    Every episode it changes is locked first (see the module docstring, Concurrency)."""
    report = SettleReport()
    if not interactions and not feedback:
        return report
    touched: set[str] = set()

    # ---- episodes for the new segments: created unless there (another replica may race us to it) --
    segments_by_episode: dict[str, list[InteractionEvent]] = defaultdict(list)
    for event in interactions:
        segments_by_episode[event.episode_id].append(event)
    if segments_by_episode:
        new_rows: list[dict[str, Any]] = []
        for episode_id in sorted(segments_by_episode):  # one order for every replica: no deadlock
            segments = segments_by_episode[episode_id]
            oldest = min(segments, key=lambda s: parse_version(s.policy_version))
            new_rows.append({
                "episode_id": episode_id,
                "tenant": segments[0].tenant,
                "policy_version": oldest.policy_version,
                "policy_number": parse_version(oldest.policy_version),
                "status": "open",
                "first_event_at": min(s.created_at for s in segments),
                "last_event_at": now,
                "eval_bucket": eval_bucket(episode_id),
            })  # fmt: skip
        session.execute(insert_ignoring(dialect, Episode, ["episode_id"]), new_rows)  # executemany: see store/events.py

    # ---- lock the episodes this batch touches, then read what waits for them ------------------------
    # Which episode a waiting feedback joins is only known after reading it, so: read, lock what it
    # names, read again (what another replica committed meanwhile), until nothing new is named.
    # SQLite has one writer at a time (BEGIN IMMEDIATE): one read suffices there.
    episodes: dict[str, Episode] = {}
    asked: set[str] = set()
    while True:
        pending, by_request = _waiting_feedback(session, interactions, feedback, set(segments_by_episode))
        targets = {f.episode_id or by_request.get((f.request_id, f.tenant)) for f in pending}
        wanted = (set(segments_by_episode) | {t for t in targets if t}) - asked
        if not wanted:
            break
        asked |= wanted
        episodes.update(_lock_episodes(session, wanted))
        if dialect != "postgresql":
            break

    # ---- extend the episodes of the new segments (or mark the segments late) --------------------------
    for episode_id, segments in sorted(segments_by_episode.items()):
        episode = episodes.get(episode_id)
        if episode is None:
            continue  # deleted by retention since the insert above: the segments stay stored, unlabelled
        if episode.status == "settled":
            session.execute(
                update(Interaction)
                .where(Interaction.event_id.in_([s.event_id for s in segments]))
                .values(late=True)
            )
            report.late_segments += len(segments)
            continue
        oldest = min(segments, key=lambda s: parse_version(s.policy_version))
        if parse_version(oldest.policy_version) < episode.policy_number:
            episode.policy_version = oldest.policy_version
            episode.policy_number = parse_version(oldest.policy_version)
        episode.first_event_at = min(episode.first_event_at, min(s.created_at for s in segments))
        episode.last_event_at = now
        touched.add(episode_id)
    session.flush()

    # ---- join feedback that was waiting for these requests / episodes --------------------------------
    for row in pending:
        target = row.episode_id or by_request.get((row.request_id, row.tenant))
        episode = episodes.get(target) if target else None
        if episode is None or episode.tenant != row.tenant:
            continue  # its interaction has not arrived (yet): stays unjoined, orphaned after the window
        row.joined_episode_id = episode.episode_id
        if episode.status == "settled":
            row.late = True
            report.late_feedback += 1
        else:
            episode.last_event_at = now
            touched.add(episode.episode_id)
            report.joined += 1
    session.flush()

    # ---- settle episodes that received terminal feedback -------------------------------------------
    if touched:
        terminal = {
            episode_id
            for episode_id in session.scalars(
                select(Feedback.joined_episode_id).where(
                    Feedback.joined_episode_id.in_(sorted(touched)),
                    Feedback.late.is_(False),
                    Feedback.kind.in_([k.value for k in spec.terminal]),
                )
            )
            if episode_id is not None
        }
        report.settled += settle(
            session, spec, now, [episodes[e] for e in sorted(terminal)], "terminal_feedback"
        )
        report.settled_terminal += len(terminal)
    return report


def settle_expired(session: Session, spec: RewardSpec, now: datetime, window_s: float) -> list[Settled]:
    """Settle open episodes whose last event is older than the window (at most WINDOW_BATCH); returns them.

    On PostgreSQL the episodes are locked, skipping those another transaction holds (a replica
    joining to or settling them now): they are settled by a later pass if still expired then."""
    expired = session.scalars(
        select(Episode)
        .where(Episode.status == "open", Episode.last_event_at < now - timedelta(seconds=window_s))
        .order_by(Episode.last_event_at)
        .limit(WINDOW_BATCH)
        .with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)
    ).all()
    return settle(session, spec, now, list(expired), "window")


def settle(
    session: Session, spec: RewardSpec, now: datetime, episodes: list[Episode], reason: str
) -> list[Settled]:
    """Score each episode from its joined, non-late feedback (oldest first) and mark it settled."""
    if not episodes:
        return []
    signals: dict[str, list[Feedback]] = defaultdict(list)
    rows = session.scalars(
        select(Feedback)
        .where(Feedback.joined_episode_id.in_([e.episode_id for e in episodes]), Feedback.late.is_(False))
        .order_by(Feedback.created_at, Feedback.event_id)
    )
    for row in rows:
        assert row.joined_episode_id is not None
        signals[row.joined_episode_id].append(row)
    unfinished = set(session.scalars(
        select(Interaction.episode_id).where(
            Interaction.episode_id.in_([e.episode_id for e in episodes]), Interaction.trainable.is_(True),
            Interaction.finish_reason == "length", Interaction.late.is_(False),
        )
    ))  # fmt: skip
    for episode in episodes:
        result = score(spec, signals[episode.episode_id], unfinished=episode.episode_id in unfinished)
        episode.status = "settled"
        episode.settled_at = now
        episode.settle_reason = reason
        episode.reward = result.reward
        episode.reward_components = result.components
        episode.reward_spec = result.spec_id
    session.flush()
    return [
        Settled(
            e.policy_version,
            float(e.reward or 0.0),
            reason,
            max(0.0, (now - e.first_event_at).total_seconds()),
            e.episode_id in unfinished,
        )
        for e in episodes
    ]


def _waiting_feedback(
    session: Session, interactions: list[InteractionEvent], feedback: list[FeedbackEvent], episode_ids: set[str]
) -> tuple[list[Feedback], dict[tuple[str, str], str]]:
    """Unjoined feedback for the batch's requests and episodes (as committed now, oldest first), and
    the episode of each (request, tenant) such feedback names without an episode id."""
    request_ids = {e.request_id for e in interactions} | {f.request_id for f in feedback}
    episode_ids = episode_ids | {f.episode_id for f in feedback if f.episode_id}
    pending = session.scalars(
        select(Feedback)
        .where(
            Feedback.joined_episode_id.is_(None),
            or_(Feedback.request_id.in_(sorted(request_ids)), Feedback.episode_id.in_(sorted(episode_ids))),
        )
        .order_by(Feedback.created_at, Feedback.event_id)
        .execution_options(populate_existing=True)
    ).all()
    by_request = {
        (row.request_id, row.tenant): row.episode_id
        for row in session.execute(
            select(Interaction.request_id, Interaction.tenant, Interaction.episode_id).where(
                Interaction.request_id.in_(sorted({f.request_id for f in pending if f.episode_id is None}))
            )
        )
    }
    return list(pending), by_request


def _lock_episodes(session: Session, ids: set[str]) -> dict[str, Episode]:
    """The episodes `ids` as committed now, locked until the transaction ends (in episode id order,
    so replicas locking overlapping sets queue instead of deadlocking). No lock on SQLite, where the
    transaction already holds the database's only write lock."""
    query = (
        select(Episode)
        .where(Episode.episode_id.in_(sorted(ids)))
        .order_by(Episode.episode_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    return {e.episode_id: e for e in session.scalars(query)}
