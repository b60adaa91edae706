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
  An episode of several segments (PARL, self-summarization, self-editing; docs/methods.md) ends
  when the client says so: ``episode_end`` feedback, or terminal feedback that names the episode
  (``episode_id``); terminal feedback about one of its requests joins it without ending it. The
  window is its timeout. (An episode of one call - its only segment so far is segment 0 - ends on
  terminal feedback about that call, as always.)
* Settling measures the episode's structure (schemas/episodes.py, stored as ``episodes.metrics``)
  and gives it one reward, with PARL's shaping when the spec has it (its λ where the cycles trained
  under that spec have taken the schedule, `trained_cycles`). Under a spec with a judge
  term the episode first closes as ``judging`` (nothing joins it any more) and settles once the
  judge has graded it, or could not (`awaiting_judge`, `settle_judged`; feedback/judging.py).
* After it closes nothing changes the reward: late feedback is stored with ``late = true`` and
  late segments likewise (they are excluded from training, as the reward never judged them).
  Re-labelling needs a new reward spec version, not a silent edit.

Concurrency (several labeler replicas on one PostgreSQL store, READ COMMITTED):

* An episode is created with ``INSERT .. ON CONFLICT DO NOTHING``, so two replicas that receive
  segments of one episode at once both go on (the second waits for the first to commit).
* Every change to an episode - extending it, joining feedback to it, settling it on terminal
  feedback - happens under its row lock and is decided on the row and the unjoined feedback as
  committed once the lock is held. The lock is the insert's, for an episode the batch creates (no
  other transaction sees the row before the commit), else ``SELECT .. FOR UPDATE``, taken in
  episode id order so that replicas queue instead of deadlocking. The waiting feedback is read
  after the locks are taken, and read again after any further lock its rows call for. So an
  episode settles once, and feedback joins either before it settles (and is in the reward) or
  after (``late``), never in between.
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
* One case the partitioning cannot order: feedback that names a multi-call episode (an
  ``episode_id``) and whose own call is not stored (yet), written while another replica's
  transaction creates that episode. Each misses the other's row and the feedback is stored
  unjoined although its episode exists. Every window pass (`join_stranded`, before the window
  settle) looks for such feedback of the last two windows and joins it through `join_and_settle`,
  under the same locks: in the reward when the episode is still open, else ``late``.
  SQLite has a single writer (``BEGIN IMMEDIATE``), so none of this arises there and the lock
  clauses are not emitted.
"""

from __future__ import annotations

import hmac
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import Table, exists, func, or_, select, update
from sqlalchemy.orm import Session

from schemas.episodes import episode_metrics, is_parl
from schemas.events import CONTROL_KINDS, InteractionEvent
from schemas.rewards import RewardResult, RewardSpec, Shaping, judge_disagrees, score
from schemas.versions import parse_version
from store.bulk import among, insert_rows, update_rows
from store.episode_rows import EPISODE_COLUMNS, EPISODES, EpisodeRow, lock_episodes, save_rows
from store.models import Cycle, Episode, Feedback, Interaction
from store.settle_reads import (
    WINDOW_BATCH,
    read_segments,
    read_signals,
    segment_shapes,
    within_text_budget,
)

FEEDBACK: Table = Feedback.__table__  # type: ignore[assignment]

# Of the expired episodes of a pass (at most WINDOW_BATCH), those whose text (read to compare each
# call's context with the next, schemas/episodes.py) stays within this many characters (the first always).
WINDOW_TEXT_CHARS = 32 * 1024 * 1024


def eval_bucket(episode_id: str, key: bytes) -> int:
    """0..99, from HMAC-SHA256 of the episode id keyed by `key` (``labeler.holdout_secret``): the
    same on every replica and in every run that shares the key, and unknown to a client, who chooses
    its episode ids but so cannot choose which are held out. Episodes whose bucket is below
    ``gate.ope.holdout_percent`` are the eval gate's held-out traffic and are never trained on
    (`Store.select_heldout`, `Store.select_episodes`). Stored when the episode opens: a new key
    moves only episodes opened after it (docs/security.md, Caps per episode and held-out membership)."""
    if not key:
        raise ValueError("the held-out key is empty (labeler.holdout_secret)")
    return int.from_bytes(hmac.digest(key, episode_id.encode(), "sha256")[:8], "big") % 100


@dataclass(frozen=True)
class Settled:
    """One episode settled (for the labeler's metrics)."""

    policy_version: str
    reward: float
    reason: str
    latency_s: float  # from the episode's first event to its settlement
    unfinished: bool = False  # a trainable segment was cut off by max_tokens (schemas/rewards.py)
    judge: str | None = None  # under a judged spec: "scored", or "unavailable" (labelled without the judge)
    judge_disagrees: bool | None = (
        None  # the judge's grade against the feedback's outcome (schemas/rewards.py)
    )


@dataclass
class SettleReport:
    joined: int = 0
    late_feedback: int = 0
    late_segments: int = 0
    settled_terminal: int = 0
    settled_window: int = 0
    settled: list[Settled] = field(default_factory=list)


class _FeedbackKey(Protocol):
    """What joining reads of a feedback: a FeedbackEvent of the batch, or a stored row."""

    @property
    def request_id(self) -> str: ...
    @property
    def episode_id(self) -> str | None: ...
    @property
    def tenant(self) -> str: ...


def join_and_settle(
    session: Session,
    dialect: str,
    spec: RewardSpec,
    now: datetime,
    interactions: list[InteractionEvent],
    feedback: Sequence[_FeedbackKey],
    holdout_key: bytes | None = None,
) -> SettleReport:
    """Open/extend episodes for new segments, join waiting feedback, settle on terminal feedback.
    `holdout_key` (`eval_bucket`) is needed when `interactions` may open episodes.

    Every episode it changes is locked first (see the module docstring, Concurrency)."""
    report = SettleReport()
    if not interactions and not feedback:
        return report
    segments_by_episode: dict[str, list[InteractionEvent]] = defaultdict(list)
    for event in interactions:
        segments_by_episode[event.episode_id].append(event)
    episodes = _open_episodes(session, segments_by_episode, now, holdout_key)
    # The episode of each (request, tenant): the batch's own interaction's (the last, should two of
    # the batch carry one), else the stored interaction's, looked up for what needs it.
    by_request: dict[tuple[str, str], str | None] = {
        (e.request_id, e.tenant): e.episode_id for e in interactions
    }
    pending = _lock_and_read_waiting(
        session, dialect, interactions, feedback, segments_by_episode, episodes, by_request
    )
    touched = _extend_episodes(session, segments_by_episode, episodes, now, report)
    touched |= _join_waiting(session, pending, by_request, episodes, now, report)
    if touched:
        _settle_terminal(session, spec, now, [episodes[e] for e in sorted(touched)], report)
    save_rows(session, episodes.values())
    return report


def _open_episodes(
    session: Session,
    segments_by_episode: dict[str, list[InteractionEvent]],
    now: datetime,
    holdout_key: bytes | None,
) -> dict[str, EpisodeRow]:
    """Create the episodes of the new segments unless they are there (another replica may race us
    to it); returns those this transaction created."""
    if not segments_by_episode:
        return {}
    if holdout_key is None:
        raise ValueError("opening episodes needs the held-out key (labeler.holdout_secret)")
    new_rows: list[dict[str, Any]] = []
    for episode_id in sorted(segments_by_episode):  # one order for every replica: no deadlock
        segments = segments_by_episode[episode_id]
        oldest = min(segments, key=lambda s: parse_version(s.policy_version))
        new_rows.append(
            {
                "episode_id": episode_id,
                "tenant": segments[0].tenant,
                "policy_version": oldest.policy_version,
                "policy_number": parse_version(oldest.policy_version),
                "status": "open",
                "first_event_at": min(s.created_at for s in segments),
                "last_event_at": now,
                "eval_bucket": eval_bucket(episode_id, holdout_key),
            }
        )
    created = insert_rows(session, EPISODES, new_rows, conflict=["episode_id"], returning="episode_id")
    # An episode this transaction inserted is what it inserted, and its row stays locked by the
    # insert until the commit (no other transaction sees it before): it needs no read or lock.
    return {row["episode_id"]: EpisodeRow.new(row) for row in new_rows if row["episode_id"] in created}


def _lock_and_read_waiting(
    session: Session,
    dialect: str,
    interactions: list[InteractionEvent],
    feedback: Sequence[_FeedbackKey],
    segments_by_episode: dict[str, list[InteractionEvent]],
    episodes: dict[str, EpisodeRow],
    by_request: dict[tuple[str, str], str | None],
) -> list[Any]:
    """Lock the episodes this batch touches (added to `episodes`), then read the feedback that
    waits for them (returned; `by_request` learns the stored requests it names)."""
    _add_stored_requests(session, by_request, feedback)
    request_ids = sorted({e.request_id for e in interactions} | {f.request_id for f in feedback})
    episode_ids = sorted(set(segments_by_episode) | {f.episode_id for f in feedback if f.episode_id})
    wanted: set[str | None] = {*segments_by_episode, *(_target(f, by_request) for f in feedback)}
    asked = set(episodes)
    pending: list[Any] | None = None
    # Which episode a waiting feedback joins is only known after reading it, so: lock what the batch
    # names, read what waits (as committed once the locks are held), lock what that names in turn,
    # read again, until nothing new is named. SQLite has one writer at a time (BEGIN IMMEDIATE):
    # one read suffices there.
    while True:
        new = {e for e in wanted if e is not None} - asked
        if new:
            asked |= new
            episodes.update(lock_episodes(session, new))
        if pending is not None and (not new or dialect != "postgresql"):
            return pending  # the last read came after the last locks (or needs no repeating: SQLite)
        pending = _waiting_feedback(session, request_ids, episode_ids)
        _add_stored_requests(session, by_request, pending)  # e.g. waiting feedback of another tenant
        wanted = {_target(f, by_request) for f in pending}


def _extend_episodes(
    session: Session,
    segments_by_episode: dict[str, list[InteractionEvent]],
    episodes: dict[str, EpisodeRow],
    now: datetime,
    report: SettleReport,
) -> set[str]:
    """Extend the open episodes of the new segments, or mark the segments late; the episodes extended."""
    touched: set[str] = set()
    late_segments: list[str] = []
    for episode_id, segments in sorted(segments_by_episode.items()):
        episode = episodes.get(episode_id)
        if episode is None:
            continue  # deleted by retention since the insert above: the segments stay stored, unlabelled
        if episode.status != "open":  # settled, or closed and waiting for its judge
            late_segments += [s.event_id for s in segments]
            report.late_segments += len(segments)
            continue
        oldest = min(segments, key=lambda s: parse_version(s.policy_version))
        if parse_version(oldest.policy_version) < episode.policy_number:
            episode.set(
                policy_version=oldest.policy_version, policy_number=parse_version(oldest.policy_version)
            )
        episode.set(
            first_event_at=min(episode.first_event_at, min(s.created_at for s in segments)), last_event_at=now
        )
        touched.add(episode_id)
    if late_segments:
        session.execute(
            update(Interaction).where(among(session, Interaction.event_id, late_segments)).values(late=True)
        )
    return touched


def _join_waiting(
    session: Session,
    pending: list[Any],
    by_request: dict[tuple[str, str], str | None],
    episodes: dict[str, EpisodeRow],
    now: datetime,
    report: SettleReport,
) -> set[str]:
    """Join the feedback that was waiting for these requests / episodes; the open episodes it joined."""
    touched: set[str] = set()
    joins: list[dict[str, Any]] = []
    for row in pending:
        target = _target(row, by_request)
        episode = episodes.get(target) if target else None
        if episode is None or episode.tenant != row.tenant:
            continue  # its interaction has not arrived (yet): stays unjoined, orphaned after the window
        late = episode.status != "open"
        joins.append({"event_id": row.event_id, "joined_episode_id": episode.episode_id, "late": late})
        if late:
            report.late_feedback += 1
        else:
            episode.set(last_event_at=now)
            touched.add(episode.episode_id)
            report.joined += 1
    update_rows(session, FEEDBACK, "event_id", joins)  # before the settling reads, which see the joins
    return touched


def _settle_terminal(
    session: Session, spec: RewardSpec, now: datetime, touched: list[EpisodeRow], report: SettleReport
) -> None:
    """Settle the `touched` episodes that received terminal feedback."""
    # episode_end ends any episode; other terminal feedback ends an episode of one call, or an
    # episode of several when it names the episode (the module docstring).
    by_id = {e.episode_id: e for e in touched}
    signals = read_signals(session, sorted(by_id))
    ending_kinds = {k.value for k in spec.terminal | CONTROL_KINDS}
    control = {k.value for k in CONTROL_KINDS}
    ending = {e for e, rows in signals.items() if any(r.kind in ending_kinds for r in rows)}
    terminal = {
        e
        for e in ending
        if any(r.kind in control or (r.kind in ending_kinds and r.episode_id is not None) for r in signals[e])
    }
    segments_of = read_segments(session, sorted(ending))
    # An episode of one call: its only (non-late) segment is segment 0.
    terminal |= {e for e in ending - terminal if [s.segment_index for s in segments_of.get(e, [])] == [0]}
    report.settled += settle(
        session,
        spec,
        now,
        [by_id[e] for e in sorted(terminal)],
        "terminal_feedback",
        segments_of=segments_of,
        signals=signals,
    )
    report.settled_terminal += len(terminal)


def join_stranded(
    session: Session, dialect: str, spec: RewardSpec, now: datetime, window_s: float
) -> SettleReport:
    """Join feedback stored unjoined although the episode it names exists (at most WINDOW_BATCH,
    ingested in the last two windows): what two replicas writing the feedback and creating its
    episode at once leave behind (the module docstring, Concurrency). The labeler's window pass
    runs it before `settle_expired`. Only PostgreSQL has concurrent writers; on SQLite it reads
    nothing."""
    if dialect != "postgresql":
        return SettleReport()
    stranded = session.execute(
        select(Feedback.request_id, Feedback.episode_id, Feedback.tenant)
        .where(
            Feedback.joined_episode_id.is_(None),
            Feedback.episode_id.is_not(None),
            Feedback.ingested_at >= now - timedelta(seconds=2 * window_s),
            exists().where(
                EPISODES.c.episode_id == Feedback.episode_id, EPISODES.c.tenant == Feedback.tenant
            ),
        )
        .order_by(Feedback.ingested_at)
        .limit(WINDOW_BATCH)
    ).all()
    return join_and_settle(session, dialect, spec, now, [], stranded) if stranded else SettleReport()


def settle_expired(
    session: Session, spec: RewardSpec, now: datetime, window_s: float, episode_ids: list[str] | None = None
) -> list[Settled]:
    """Settle open episodes whose last event is older than the window (at most WINDOW_BATCH, and of
    those the first whose text fits WINDOW_TEXT_CHARS, `within_text_budget`); returns them.
    `episode_ids`: only these (the labeler's pass one episode at a time, feedback/labeler.py).

    On PostgreSQL the episodes are locked, skipping those another transaction holds (a replica
    joining to or settling them now): they are settled by a later pass if still expired then."""
    query = (
        select(*(EPISODES.c[name] for name in EPISODE_COLUMNS))
        .where(EPISODES.c.status == "open", EPISODES.c.last_event_at < now - timedelta(seconds=window_s))
        .order_by(EPISODES.c.last_event_at)
        .limit(WINDOW_BATCH)
        .with_for_update(skip_locked=True)
    )
    if episode_ids is not None:
        query = query.where(among(session, EPISODES.c.episode_id, episode_ids))
    expired = [EpisodeRow.of(row) for row in session.execute(query)]
    segments_of = read_segments(session, [e.episode_id for e in expired])
    expired = within_text_budget(expired, segments_of, WINDOW_TEXT_CHARS)
    settled = settle(session, spec, now, expired, "window", segments_of=segments_of)
    save_rows(session, expired)
    return settled


def settle(
    session: Session,
    spec: RewardSpec,
    now: datetime,
    episodes: list[EpisodeRow],
    reason: str,
    *,
    segments_of: dict[str, list[Any]] | None = None,
    signals: dict[str, list[Any]] | None = None,
) -> list[Settled]:
    """Close each episode: measure its segments and score it from its joined, non-late feedback
    (oldest first), or, under a judged spec, leave it ``judging`` for `settle_judged` (not returned).
    `segments_of` (`read_segments`) and `signals` (`read_signals`) are what the caller read of these
    episodes already in this transaction; read here when None. The caller writes the changes (`save_rows`)."""
    if not episodes:
        return []
    ids = [e.episode_id for e in episodes]
    shapes = segment_shapes(session, ids, read_segments(session, ids) if segments_of is None else segments_of)
    cycle = trained_cycles(session, spec.spec_id) if spec.parl is not None else 0
    scored: list[EpisodeRow] = []
    for episode in episodes:
        segments = shapes.get(episode.episode_id, [])
        metrics: dict[str, Any] = episode_metrics(segments)
        metrics["unfinished"] = int(any(s.trainable and s.finish_reason == "length" for s in segments))
        if spec.parl is not None and is_parl(segments):
            metrics["cycle"] = cycle
            metrics["lambda_parallel"], metrics["lambda_finish"] = spec.parl.lambdas(cycle)
        episode.set(metrics=metrics, settled_at=now, settle_reason=reason)
        if spec.judge is not None:
            episode.set(status="judging")  # closed: what joins now is late; the judge settles it
        else:
            scored.append(episode)
    if signals is None:
        signals = read_signals(session, [e.episode_id for e in scored])
    return [_score(episode, spec, signals.get(episode.episode_id, []), None, now) for episode in scored]


def trained_cycles(session: Session, spec_id: str) -> int:
    """Training cycles that trained a version (registered, then promoted or rejected) on episodes
    labelled under the reward spec `spec_id` (``name@version``): where that spec's PARL λ schedule is
    for the episodes settled now (schemas/rewards.py, ParlShaping). Cycles under other specs do not
    move it, so a switch to a PARL spec starts at λ(0).

    What a cycle trained under is recorded on it when it claims its episodes (``cycles.reward_spec``,
    `Store.mark_used`; migration 0010 filled it in for the cycles before it), so pruning the
    episodes later keeps the count."""
    query = (
        select(func.count())
        .select_from(Cycle)
        .where(Cycle.status.in_(("registered", "promoted", "rejected")), Cycle.reward_spec == spec_id)
    )
    return int(session.scalar(query) or 0)


@dataclass(frozen=True)
class ToJudge:
    """An episode waiting for its judge: its first prompt and everything the model wrote in it, in
    segment order, nothing pruned (schemas/rewards.py, JudgeTerm)."""

    episode_id: str
    prompt: str
    trajectory: str


def awaiting_judge(session: Session, limit: int) -> list[ToJudge]:
    """At most `limit` episodes waiting for the judge, those closed first first."""
    ids = list(
        session.scalars(
            select(Episode.episode_id)
            .where(Episode.status == "judging")
            .order_by(Episode.settled_at, Episode.episode_id)
            .limit(limit)
        )
    )
    if not ids:
        return []
    parts: dict[str, list[tuple[str, str, str | None, str]]] = defaultdict(list)
    for row in session.execute(
        select(
            Interaction.episode_id,
            Interaction.prompt,
            Interaction.role,
            Interaction.agent,
            Interaction.completion,
        )
        .where(among(session, Interaction.episode_id, ids), Interaction.late.is_(False))
        .order_by(Interaction.episode_id, Interaction.segment_index)
    ):
        parts[row.episode_id].append((row.prompt, row.role, row.agent, row.completion))
    out = []
    for episode_id in ids:
        segments = parts.get(episode_id, [])
        if len(segments) == 1:
            lines = [segments[0][3].strip()]
        else:  # which call wrote what: the judge reads the whole trajectory
            lines = [
                f"[{role}{'' if agent is None else ' ' + agent}] {completion.strip()}"
                for _, role, agent, completion in segments
            ]
        out.append(ToJudge(episode_id, segments[0][0] if segments else "", "\n".join(lines)))
    return out


def settle_judged(
    session: Session, spec: RewardSpec, now: datetime, grades: dict[str, float | None]
) -> list[Settled]:
    """Settle the judging episodes of `grades` with the judge's grade, or without the judge term and
    flagged ``judge_unavailable`` where the grade is None. Episodes another replica settled first
    are left alone (locked, then checked)."""
    if not grades:
        return []
    episodes = [e for e in lock_episodes(session, set(grades)).values() if e.status == "judging"]
    signals = read_signals(session, [e.episode_id for e in episodes])
    settled = [
        _score(e, spec, signals[e.episode_id], grades[e.episode_id], now, judged=True) for e in episodes
    ]
    save_rows(session, episodes)
    return settled


def _score(
    episode: EpisodeRow,
    spec: RewardSpec,
    signals: list[Any],
    grade: float | None,
    now: datetime,
    judged: bool = False,
) -> Settled:
    """Give a closed episode its reward (its metrics measured) and mark it settled."""
    metrics = dict(episode.metrics or {})
    # An episode closed for its judge before use was measured has no `subagents_used`: none counts.
    shaping = Shaping(
        parl=(metrics["subagents"], metrics.get("subagents_used", 0))
        if "lambda_parallel" in metrics
        else None,
        cycle=int(metrics.get("cycle", 0)),
        judge=grade,
        judge_unavailable=judged and grade is None,
    )
    result: RewardResult = score(spec, signals, unfinished=bool(metrics.get("unfinished")), shaping=shaping)
    disagrees = judge_disagrees(result.components, grade) if judged else None
    if judged:
        metrics["judge"] = grade
        metrics["judge_disagrees"] = disagrees
        episode.set(metrics=metrics)
    episode.set(
        status="settled",
        reward=result.reward,
        reward_components=result.components,
        reward_spec=result.spec_id,
    )
    return Settled(
        episode.policy_version,
        float(result.reward),
        episode.settle_reason or "window",
        max(0.0, (now - episode.first_event_at).total_seconds()),
        bool(metrics.get("unfinished")),
        judge=None if not judged else ("scored" if grade is not None else "unavailable"),
        judge_disagrees=disagrees,
    )


def _target(feedback: Any, by_request: dict[tuple[str, str], str | None]) -> str | None:
    """The episode a feedback joins: the one it names, else the one of its (request, tenant)."""
    return feedback.episode_id or by_request.get((feedback.request_id, feedback.tenant))


def _add_stored_requests(
    session: Session, by_request: dict[tuple[str, str], str | None], feedback: Iterable[Any]
) -> None:
    """Add to `by_request` the stored interactions' episode of each (request, tenant) that a
    feedback without an episode id of `feedback` names and `by_request` lacks (None: no
    interaction carries it, so it is not looked up again)."""
    keys = {(f.request_id, f.tenant) for f in feedback if not f.episode_id} - by_request.keys()
    if not keys:
        return
    rows = session.execute(
        select(Interaction.request_id, Interaction.tenant, Interaction.episode_id).where(
            among(session, Interaction.request_id, sorted({request for request, _ in keys}))
        )
    )
    for row in rows:
        by_request.setdefault((row.request_id, row.tenant), row.episode_id)
    for key in keys:
        by_request.setdefault(key, None)


def _waiting_feedback(session: Session, request_ids: list[str], episode_ids: list[str]) -> list[Any]:
    """Unjoined feedback about `request_ids` or naming `episode_ids`, as committed now, oldest first."""
    return list(
        session.execute(
            select(Feedback.event_id, Feedback.request_id, Feedback.episode_id, Feedback.tenant)
            .where(
                Feedback.joined_episode_id.is_(None),
                or_(
                    among(session, Feedback.request_id, request_ids),
                    among(session, Feedback.episode_id, episode_ids),
                ),
            )
            .order_by(Feedback.created_at, Feedback.event_id)
        ).all()
    )
