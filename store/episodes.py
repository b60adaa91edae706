"""The trainer's data: which episodes a cycle may train on, read with their segments, and claimed.

``select_episodes`` then ``mark_used``: selection only reads; ``mark_used`` claims the episodes for
the cycle in one conditional UPDATE and fails (claiming none) if any is already claimed, so an
episode is never used by two cycles. A failed cycle gives its claims back
(`CycleStore.finish_cycle`, store/cycles.py), but an episode claimed by
``trainer.max_episode_failures`` failed cycles is quarantined (``quarantined_at`` set): neither
selection nor ``mark_used`` takes it until `release_quarantined` (``rtrl dlq episodes --release``).
``select_heldout`` reads the eval gate's held-out traffic, which never trains, and
``heldout_prompts`` the prompts of it that the gate's traffic suite replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import exists, func, or_, select, update
from sqlalchemy.orm import Session, aliased

from schemas.events import SamplingParams
from schemas.rewards import JUDGE, NO_FEEDBACK
from store.base import StoreBase
from store.cycles import served_versions
from store.errors import EpisodesUnavailable, LeaseLost
from store.models import ACTIVE_CYCLE_STATUSES, Cycle, Episode, Feedback, Interaction, Tenant


@dataclass(frozen=True)
class TrainingSegment:
    """One model call of an episode, as the trainer needs it (no torch here)."""

    prompt: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    trainable: bool
    role: str
    policy_version: int
    sampling: SamplingParams = field(
        default_factory=SamplingParams
    )  # how it was sampled (schemas/sampling.py)
    request_id: str = ""  # the model call's id: what a Correction of it names


@dataclass(frozen=True)
class QuarantinedEpisode:
    """An episode taken out of training after too many failed cycles (`EpisodeStore.quarantined`)."""

    episode_id: str
    tenant: str
    failed_cycles: int
    quarantined_at: datetime
    reason: str  # the error of the cycle that quarantined it, truncated


@dataclass(frozen=True)
class HeldoutPrompt:
    """The prompt of a held-out episode's first model call, as logged (`EpisodeStore.heldout_prompts`)."""

    episode_id: str
    tenant: str
    prompt: str  # as sent to the model: a chat request's is the chat-templated text
    created_at: datetime  # the episode's first event


@dataclass(frozen=True)
class Correction:
    """What a user wrote about one model call of an episode: a correction (the corrected answer or a
    hint) or an edit's text (schemas/events.py, `TEXT_KINDS`), redacted by the gateway."""

    request_id: str  # the model call it is about (TrainingEpisode.segments hold that call's tokens)
    kind: str  # correction | edited
    text: str
    created_at: datetime  # the sender's clock


@dataclass(frozen=True)
class TrainingEpisode:
    """A settled, labelled episode: its reward and its segments ordered by segment_index."""

    episode_id: str
    reward: float
    policy_version: int
    created_at: datetime
    segments: list[TrainingSegment]
    no_feedback: bool = False  # settled by the window with no signal at all (reward component no_feedback)
    components: dict[str, float] = field(default_factory=dict)  # the reward's components (schemas/rewards.py)
    metrics: dict[str, Any] = field(default_factory=dict)  # what its structure says (schemas/episodes.py)
    # What users wrote about its calls, oldest first; feedback that came after it settled is left out,
    # as it is of the reward (`Feedback.late`).
    corrections: tuple[Correction, ...] = ()


class EpisodeStore(StoreBase):
    """Trainable and held-out episodes, and their claims by cycles (see the module docstring)."""

    def _trainable(
        self,
        champion_number: int,
        max_lag: int,
        spec_id: str | None,
        settle_window_s: float | None,
        holdout_percent: int = 0,
        tenant: str | None = None,
    ) -> Any:
        condition = (
            (Episode.status == "settled")
            & Episode.used_in_cycle.is_(None)
            & Episode.quarantined_at.is_(None)
            & self._within_lag(champion_number, max_lag, tenant)
            & _tenant_trains()
            & on_line(tenant)
        )
        if spec_id is not None:  # rewards of different spec versions never share a batch
            condition &= Episode.reward_spec == spec_id
        if holdout_percent > 0:  # the eval gate's held-out traffic (`select_heldout`) never trains
            condition &= Episode.eval_bucket.is_(None) | (Episode.eval_bucket >= holdout_percent)
        if settle_window_s is not None:
            # Every episode becomes trainable by the same rule whatever its outcome: the settle window
            # after its last event. Terminal feedback (a rejection) settles an episode early, a plain
            # acceptance waits for the window; selecting on settlement alone would over-sample the
            # early-settling outcomes into the newest batch.
            condition &= Episode.last_event_at <= self.clock() - timedelta(seconds=settle_window_s)
        return condition

    def _within_lag(self, champion_number: int, max_lag: int, tenant: str | None = None) -> Any:
        """The champion's episodes and those of the `max_lag` versions served most recently before
        it (`served_versions`): a challenger that never served is not a version of lag. On a store
        the deployer never announced a version in, and for a tenant's line (the announcements are
        the global adapter's versions), the lag counts version numbers."""
        if max_lag == 0:
            return Episode.policy_number == champion_number
        served = [] if tenant is not None else [v for v in served_versions(self) if v != champion_number]
        if not served:
            return Episode.policy_number.between(champion_number - max_lag, champion_number)
        return Episode.policy_number.in_([champion_number, *served[:max_lag]])

    def count_trainable(
        self,
        champion_number: int,
        max_lag: int,
        *,
        spec_id: str | None = None,
        settle_window_s: float | None = None,
        holdout_percent: int = 0,
        tenant: str | None = None,
    ) -> int:
        """Settled, unused episodes whose policy is at most ``max_lag`` versions behind the champion;
        with `spec_id`, labelled under that reward spec only; with `settle_window_s`, only those
        whose last event is at least that old; never the held-out buckets below `holdout_percent`
        (the trainer passes all three); of the line of `tenant` (`on_line`: None, the global line)."""
        with self.transaction() as session:
            query = (
                select(func.count())
                .select_from(Episode)
                .where(
                    self._trainable(
                        champion_number, max_lag, spec_id, settle_window_s, holdout_percent, tenant
                    )
                )
            )
            return int(session.scalar(query) or 0)

    def select_episodes(
        self,
        champion_number: int,
        max_lag: int,
        limit: int,
        *,
        spec_id: str | None = None,
        settle_window_s: float | None = None,
        holdout_percent: int = 0,
        tenant: str | None = None,
    ) -> list[TrainingEpisode]:
        """The newest ``limit`` trainable episodes (as `count_trainable`, `tenant` included) with
        their segments (late segments excluded)."""
        with self.transaction() as session:
            episodes = session.scalars(
                select(Episode)
                .where(
                    self._trainable(
                        champion_number, max_lag, spec_id, settle_window_s, holdout_percent, tenant
                    )
                )
                .order_by(Episode.first_event_at.desc(), Episode.episode_id)
                .limit(limit)
            ).all()
            return self._with_segments(session, list(episodes))

    def select_heldout(
        self,
        limit: int,
        *,
        spec_id: str,
        holdout_percent: int,
        rated_only: bool = False,
        tenant: str | None = None,
    ) -> list[TrainingEpisode]:
        """The newest ``limit`` settled episodes of the eval gate's held-out buckets (below
        `holdout_percent`, never trained on), labelled under `spec_id`, of tenants that train, with
        their segments: the logged traffic the gate's off-policy estimate reweights. `rated_only`:
        only those whose reward carries a signal (user feedback or a judge's grade: no
        ``no_feedback`` component, or a ``judge`` one; schemas/rewards.py `carries_signal`). Of
        the line of `tenant` only (`on_line`)."""
        if holdout_percent <= 0:
            return []
        rated = (
            [
                or_(
                    Episode.reward_components[NO_FEEDBACK].as_float().is_(None),
                    Episode.reward_components[JUDGE].as_float().is_not(None),
                )
            ]
            if rated_only
            else []
        )
        with self.transaction() as session:
            episodes = session.scalars(
                select(Episode)
                .where(
                    Episode.status == "settled",
                    Episode.reward_spec == spec_id,
                    Episode.eval_bucket < holdout_percent,
                    Episode.used_in_cycle.is_(None),
                    Episode.quarantined_at.is_(None),
                    _tenant_trains(),
                    on_line(tenant),
                    *rated,
                )
                .order_by(Episode.first_event_at.desc(), Episode.episode_id)
                .limit(limit)
            ).all()
            return self._with_segments(session, list(episodes))

    def count_heldout(self, *, spec_id: str, holdout_percent: int, tenant: str | None = None) -> int:
        """Settled episodes of the held-out buckets labelled under `spec_id`, of the line of `tenant`
        (as `select_heldout`)."""
        if holdout_percent <= 0:
            return 0
        with self.transaction() as session:
            query = (
                select(func.count())
                .select_from(Episode)
                .where(
                    Episode.status == "settled",
                    Episode.reward_spec == spec_id,
                    Episode.eval_bucket < holdout_percent,
                    Episode.used_in_cycle.is_(None),
                    Episode.quarantined_at.is_(None),
                    on_line(tenant),
                )
            )
            return int(session.scalar(query) or 0)

    def heldout_prompts(
        self, limit: int, *, holdout_percent: int, tenant: str | None = None
    ) -> list[HeldoutPrompt]:
        """The prompts of the newest held-out episodes, at most `limit` distinct ones, newest first.

        Held out as in `select_heldout` (bucket below `holdout_percent`, never claimed by a cycle, not
        quarantined, of tenants that train, of the line of `tenant`) but settled or not: a prompt needs no reward. Each is its
        episode's first segment (the lowest segment index that is not late) as logged, so a chat
        request's is the chat-templated text the model saw; a prompt text that recurs is kept once,
        with its newest episode. The eval gate's traffic suite draws from these (deployer/traffic.py).
        """
        if holdout_percent <= 0 or limit <= 0:
            return []
        earlier = aliased(Interaction)
        first_segment = ~exists(
            select(earlier.event_id).where(
                earlier.episode_id == Interaction.episode_id,
                earlier.late.is_(False),
                earlier.segment_index < Interaction.segment_index,
            )
        )
        query = (
            select(Episode.episode_id, Episode.tenant, Episode.first_event_at, Interaction.prompt)
            .join(Interaction, Interaction.episode_id == Episode.episode_id)
            .where(
                Episode.eval_bucket < holdout_percent,
                Episode.used_in_cycle.is_(None),
                Episode.quarantined_at.is_(None),
                _tenant_trains(),
                on_line(tenant),
                Interaction.late.is_(False),
                first_segment,
            )
            .order_by(Episode.first_event_at.desc(), Episode.episode_id)
            .execution_options(yield_per=256)  # read until `limit` distinct prompts, not every row
        )
        found: dict[str, HeldoutPrompt] = {}
        with self.transaction() as session:
            result = session.execute(query)
            try:
                for episode_id, tenant, created_at, prompt in result:
                    if prompt not in found:
                        found[prompt] = HeldoutPrompt(episode_id, tenant, prompt, created_at)
                        if len(found) == limit:
                            break
            finally:
                result.close()
        return list(found.values())

    def _with_segments(self, session: Session, episodes: list[Episode]) -> list[TrainingEpisode]:
        """`episodes` as TrainingEpisodes with their segments (late segments excluded)."""
        ids = [e.episode_id for e in episodes]
        segments: dict[str, list[TrainingSegment]] = {i: [] for i in ids}
        redacted_ok = set(
            session.scalars(
                select(Tenant.tenant).where(
                    Tenant.tenant.in_({e.tenant for e in episodes}), Tenant.train_redacted.is_(True)
                )
            )
        )
        rows = session.scalars(
            select(Interaction)
            .where(Interaction.episode_id.in_(ids), Interaction.late.is_(False))
            .order_by(Interaction.episode_id, Interaction.segment_index)
        ).all()
        corrections = _corrections(session, ids)
        for row in rows:
            # Redacted text still lives in the token ids: such a segment trains only where allowed.
            trainable = row.trainable and (not row.redacted or row.tenant in redacted_ok)
            segments[row.episode_id].append(
                TrainingSegment(
                    prompt=row.prompt,
                    prompt_token_ids=list(row.prompt_token_ids),
                    completion_token_ids=list(row.completion_token_ids),
                    completion_logprobs=list(row.completion_logprobs),
                    trainable=trainable,
                    role=row.role,
                    policy_version=row.policy_number,
                    sampling=SamplingParams.model_validate(row.sampling or {}),
                    request_id=row.request_id,
                )
            )
        return [
            TrainingEpisode(
                episode_id=e.episode_id,
                reward=float(e.reward if e.reward is not None else 0.0),
                policy_version=e.policy_number,
                created_at=e.first_event_at,
                segments=segments[e.episode_id],
                no_feedback=NO_FEEDBACK in (e.reward_components or {}),
                components=dict(e.reward_components or {}),
                metrics=dict(e.metrics or {}),
                corrections=tuple(corrections.get(e.episode_id, ())),
            )
            for e in episodes
        ]

    def mark_used(self, cycle_id: int, episode_ids: Sequence[str]) -> None:
        """Claim episodes for an active cycle, all or none; raises EpisodesUnavailable or LeaseLost.

        Records on the cycle the reward spec its episodes were labelled under (``cycles.reward_spec``;
        None when they mix specs, which the trainer's selection never does, and then the cycle counts
        for none): what PARL's λ schedule counts (`settle.trained_cycles`), kept when retention prunes
        the episodes."""
        wanted = sorted(set(episode_ids))
        with self.transaction() as session:
            cycle = session.get(Cycle, cycle_id, with_for_update=True)
            if cycle is None or cycle.status not in ACTIVE_CYCLE_STATUSES:
                raise LeaseLost(f"cycle {cycle_id} is not active")
            if cycle.lease_expires_at <= self.clock():
                raise LeaseLost(
                    f"the lease of cycle {cycle_id} expired at {cycle.lease_expires_at.isoformat()}"
                )
            claimed = session.execute(
                update(Episode)
                .where(
                    Episode.episode_id.in_(wanted),
                    Episode.used_in_cycle.is_(None),
                    Episode.status == "settled",
                    Episode.quarantined_at.is_(None),
                )
                .values(used_in_cycle=cycle_id)
            ).rowcount  # type: ignore[attr-defined]
            if claimed != len(wanted):
                # Raising rolls the whole UPDATE back: no episode is claimed.
                raise EpisodesUnavailable(
                    f"cycle {cycle_id}: only {claimed} of {len(wanted)} episodes are settled, unused and not quarantined"
                )
            cycle.episode_ids = [*(cycle.episode_ids or []), *wanted]
            specs = set(
                session.scalars(
                    select(Episode.reward_spec)
                    .where(Episode.status == "settled", Episode.used_in_cycle == cycle_id)
                    .distinct()
                )
            )
            cycle.reward_spec = specs.pop() if len(specs) == 1 else None

    # ---- quarantine ------------------------------------------------------------------------------

    def quarantined(self, limit: int) -> list[QuarantinedEpisode]:
        """Episodes quarantined after too many failed cycles (store/cycles.py `release_claims`),
        the newest first."""
        with self.transaction() as session:
            rows = session.scalars(
                select(Episode)
                .where(Episode.quarantined_at.is_not(None))
                .order_by(Episode.quarantined_at.desc(), Episode.episode_id)
                .limit(limit)
            ).all()
            return [
                QuarantinedEpisode(
                    episode_id=e.episode_id,
                    tenant=e.tenant,
                    failed_cycles=e.failed_cycles,
                    quarantined_at=e.quarantined_at,  # type: ignore[arg-type]  # not None: the WHERE
                    reason=e.quarantine_reason or "",
                )
                for e in rows
            ]

    def release_quarantined(self, episode_ids: Sequence[str]) -> list[str]:
        """Put quarantined episodes back in the pool with no failure counted (an operator judged them
        innocent, or fixed what broke them): ``trainer.max_episode_failures`` more failed cycles
        quarantine one again. Returns the ids released; an id not quarantined is left out."""
        with self.transaction() as session:
            wanted = Episode.episode_id.in_(sorted(set(episode_ids))) & Episode.quarantined_at.is_not(None)
            released = list(
                session.scalars(select(Episode.episode_id).where(wanted).order_by(Episode.episode_id))
            )
            session.execute(
                update(Episode)
                .where(wanted)
                .values(quarantined_at=None, quarantine_reason=None, failed_cycles=0)
            )
            return released


def _corrections(session: Session, episode_ids: list[str]) -> dict[str, list[Correction]]:
    """The texts joined to `episode_ids` (one query for the batch), by episode, oldest first."""
    found: dict[str, list[Correction]] = {}
    if not episode_ids:
        return found
    rows = session.execute(
        select(
            Feedback.joined_episode_id, Feedback.request_id, Feedback.kind, Feedback.text, Feedback.created_at
        )
        .where(
            Feedback.joined_episode_id.in_(episode_ids),
            Feedback.late.is_(False),
            Feedback.text.is_not(None),
        )
        .order_by(Feedback.joined_episode_id, Feedback.created_at, Feedback.event_id)
    )
    for episode_id, request_id, kind, text, created_at in rows:
        if episode_id is not None and text is not None:  # both are, by the WHERE
            found.setdefault(episode_id, []).append(Correction(request_id, kind, text, created_at))
    return found


def _tenant_trains() -> Any:
    """A tenant switched off (`Tenant.trains` false) does not train; a tenant without a row does."""
    return ~exists(select(Tenant.tenant).where(Tenant.tenant == Episode.tenant, Tenant.trains.is_(False)))


def on_line(tenant: str | None) -> Any:
    """The episodes of one line (schemas/lines.py): a tenant's line trains on its own episodes only;
    the global line (None) on every tenant's but those with an adapter of their own (a tenant without
    a row has none), so one episode never trains two adapters (docs/lora.md, An adapter per tenant)."""
    if tenant is not None:
        return Episode.tenant == tenant
    return ~exists(select(Tenant.tenant).where(Tenant.tenant == Episode.tenant, Tenant.adapter.is_(True)))
