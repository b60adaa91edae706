"""One training cycle, top to bottom: lease → select → advantages → DeepSpeed steps → save → register.

Called by the Celery task ``rtrl.train_cycle`` (worker/tasks.py) in the worker process, or
in-process by ``rtrl train now --inline``. The policy trained is exactly the champion's weights
that served the selected samples; the result is a new registered version of
``settings.mlflow.model_name`` with alias ``challenger``, which the task then sends through the
eval gate and the deployer.

`run_cycle` is the list of steps; each step is a function below it, in the order it runs, but
for the training itself (`trainer.training.train`: the optimizer steps, here or on ranks, and the
checkpoint saved). The objectives that are not RL (``rft``, ``dpo``) choose their rows after the
advantages (trainer/objectives.py); one that finds nothing to learn skips the cycle. A spec's
``hindsight`` term then adds its per-token term to the corrected rows (trainer/hindsight.py). The reward
spec is resolved once, when the cycle starts (a ``.json`` spec is read from disk there and nowhere
else in the cycle), and handed to the steps with the cycle's id, champion and files (`_Cycle`).

Guarantees (docs/architecture.md, Contracts: one cycle at a time):
* the store's cycle lease admits one active cycle; the episodes are claimed for the cycle right
  after selection (``mark_used``), so two cycles never learn from the same sample;
* registration is the last step: on any exception (`_undo_on_failure`, on the cycle's ExitStack)
  the cycle is finished as ``failed`` first (which releases its episodes for the next cycle), then
  a version registered by this cycle is deleted (a registration that fails deletes its own
  version, `registry.Registry.register_checkpoint`), then the MLflow run is marked FAILED, each
  even when the one before raised, and the exception propagates; the DeepSpeed engine is closed
  when its steps end, however they end (trainer/training.py);
* the running reward baselines are persisted only once the cycle is registered.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from pydantic import BaseModel, Field

from registry import CHALLENGER, Registry, RegistryUnavailable, flatten
from schemas.clock import utcnow
from schemas.episodes import batch_metrics
from schemas.rewards import RewardSpec, get_spec
from schemas.settings import DapoLoss, Settings, TrainerSettings
from serving.sampler import Row
from store import DatabaseError, Store, TrainingEpisode
from trainer import checkpoint, hindsight, objectives, reference, replay
from trainer.advantages import BaselineState, compute_advantages
from trainer.batch import (
    carries_advantage,
    episode_overlong_penalty,
    episode_prompt_key,
    has_rows,
    rows_of,
    signal_count,
)
from trainer.errors import Abandoned, InsufficientData
from trainer.lease import expire_abandoned
from trainer.ranks import HostsFailed
from trainer.selection import count_trainable, select_trainable
from trainer.steps import StepMetrics
from trainer.training import Training, train

log = logging.getLogger(__name__)

# Failures that say nothing about the batch, which do not count against its episodes
# (docs/security.md, Poisoned episodes): the worker was stopping, or the store, MLflow, the network
# or the disk failed. Celery retries the transient ones (worker/tasks.py), and every retry selects
# the same newest batch: counted, one MLflow outage would quarantine it. A multi-host cycle that
# lost a host (trainer/ranks.py `HostsFailed`) is not the data's fault either, nor a replay file
# that does not fit the model (trainer/replay.py `ReplayUnusable`).
NOT_THE_DATAS = (Abandoned, DatabaseError, RegistryUnavailable, OSError, HostsFailed, replay.ReplayUnusable)


class CycleResult(BaseModel):
    """The outcome of `run_cycle`, JSON-serialisable (it is the Celery task's return value)."""

    cycle_id: int | None = Field(description="Store id of the cycle; None when no cycle was started.")
    status: Literal["busy", "not_enough_data", "registered", "skipped"] = Field(
        description="busy: another cycle holds the lease; not_enough_data: fewer than min_samples episodes; "
        "skipped: too few episodes carry feedback or a judge's grade (trainer.min_signal), nothing trained or "
        "registered."
    )
    champion_version: int | None = Field(description="Registered version the cycle trained from.")
    challenger_version: int | None = Field(None, description="Registered version it produced.")
    episodes: int = Field(0, description="Episodes learnt from.")
    trainable_rows: int = Field(0, description="Trainable segments (rows) across those episodes.")
    tokens: int = Field(0, description="Trainable completion tokens.")
    no_signal_rows: int = Field(
        0, description="Rows left out for a zero advantage (DAPO's dynamic sampling)."
    )
    unreproducible_rows: int = Field(
        0,
        description="Trainable segments left out for their sampling, all reasons together (untrainable_rows).",
    )
    untrainable_rows: dict[str, int] = Field(
        default_factory=dict,
        description="Those segments by reason (schemas/sampling.py untrainable_sampling): "
        "greedy, near_greedy, raw_logprobs.",
    )
    signal_episodes: int | None = Field(
        None,
        description="Episodes whose reward carries user feedback or a judge's grade (trainer.min_signal).",
    )
    mean_reward: float | None = Field(None, description="Mean reward of the batch.")
    reward_std: float | None = Field(
        None, description="Population standard deviation of the batch's rewards."
    )
    advantage_mean: float | None = Field(None, description="Mean advantage over the batch's episodes.")
    advantage_abs_mean: float | None = Field(
        None, description="Mean |advantage| (how much signal the batch carries)."
    )
    data_age_s: float | None = Field(
        None, description="Policy lag: age of the oldest episode learnt from when the cycle started, seconds."
    )
    first_interaction_at: datetime | None = Field(
        None, description="Earliest episode start (data-to-deploy time)."
    )
    train_s: float | None = Field(None, description="Load champion + optimizer steps, seconds.")
    cycle_s: float | None = Field(None, description="Whole cycle, lease to registration, seconds.")
    optimizer_from_cycle: int | None = Field(
        None,
        description="The cycle whose AdamW state this one continued (trainer.carry_optimizer); None: fresh.",
    )
    kl_stopped_at_step: int | None = Field(
        None,
        description="The step at which the trust region (trainer.max_kl) stopped the cycle, its update not "
        "applied; None: every step ran.",
    )
    selection: dict[str, int] = Field(
        default_factory=dict,
        description="What an objective that chooses its rows kept of the batch (trainer/objectives.py): "
        "rft_accepted / rft_left_out episodes under rft, dpo_pairs / dpo_unpaired under dpo; empty for the "
        "policy-gradient losses.",
    )
    hindsight: dict[str, float] = Field(
        default_factory=dict,
        description="What hindsight distillation distilled (trainer/hindsight.py): hindsight_episodes, _rows, "
        "_added_rows, _tokens and hindsight_gap_mean (teacher − student logprob per token); empty without the term.",
    )
    episode_metrics: dict[str, float] = Field(
        default_factory=dict,
        description="The batch's episodes as the labeler measured them (schemas/episodes.py batch_metrics) and, "
        "under a PARL spec, the λ schedule at this cycle (parl_cycle, parl_lambda_parallel, parl_lambda_finish).",
    )
    steps: list[StepMetrics] = Field(default_factory=list)
    mlflow_run_id: str | None = None
    checkpoint_dir: str | None = None


def end_cycle(settings: Settings, store: Store, cycle_id: int, status: str, **fields: Any) -> None:
    """Give a registered cycle its final status and settle its staged baselines.

    promoted / rejected / skipped: its episodes are spent (never selected again), so the baselines
    that include their rewards are committed. failed: its episodes go back to the pool, so its
    baselines are discarded — committed, they would hold those episodes' own rewards when they
    train again (a leak into their advantages). The status is recorded first: a crash in between
    loses a baseline update, never leaks one. A registered cycle's failure (the gate, the swap, a
    stopping worker) does not count against its episodes: they trained and registered a version
    (docs/security.md, Poisoned episodes).
    """
    store.finish_cycle(cycle_id, status, count_failure=False, **fields)
    if status in ("promoted", "rejected", "skipped"):
        checkpoint.commit_baselines(settings.trainer.checkpoint_dir, cycle_id)
    else:
        checkpoint.discard_baselines(settings.trainer.checkpoint_dir, cycle_id)


@dataclass
class _Cycle:
    """The cycle under way, resolved once when it holds the lease and handed to every step: its id,
    the champion it trains from, the reward spec of its episodes, its files, when it started; and
    what it has made in the registry so far, which a failure undoes (`_undo_on_failure`)."""

    id: int
    champion: int
    spec: RewardSpec
    files: checkpoint.CycleFiles
    started: float  # time.monotonic()
    started_at: datetime
    run_id: str | None = None
    version: int | None = None
    tenant: str | None = None  # whose adapter line it trains (schemas/lines.py); None: the global line


@dataclass(frozen=True)
class _Batch:
    """The claimed episodes and what the cycle learns from them."""

    episodes: list[TrainingEpisode]
    advantages: list[float]  # one per episode
    next_baselines: BaselineState  # the baselines with these rewards in: staged, never committed here
    rows: list[Row]
    left_out: dict[str, int]  # trainable segments left out for their sampling, by reason
    learning: int  # episodes with a row (`has_rows`)
    signal: int  # of those, the ones that carry signal (`signal_count`)
    method_metrics: dict[str, float]
    no_signal: int = 0  # rows dropped for a zero advantage (DAPO's dynamic sampling)
    selection: dict[str, int] = field(default_factory=dict)  # what rft / dpo kept (trainer/objectives.py)
    hindsight: dict[str, float] = field(default_factory=dict)  # what was distilled (trainer/hindsight.py)


def run_cycle(
    settings: Settings,
    store: Store,
    registry: Registry,
    *,
    owner: str,
    takeover_suffix: str | None = None,
    stopping: Callable[[], bool] = lambda: False,
    tenant: str | None = None,
) -> CycleResult:
    """One cycle from the champion's own episodes to a registered @challenger (see the module docstring).
    `tenant`: the line it trains (schemas/lines.py; `settings` and `registry` are the line's), None the
    global one. `stopping` is asked before every optimizer step and before the checkpoint is saved:
    once it answers True (the worker got SIGTERM) the cycle raises `Abandoned` and fails, its
    episodes released, nothing registered."""
    cfg, started, started_at = settings.trainer, time.monotonic(), utcnow()

    # ---- lease --------------------------------------------------------------------------------
    _reclaim(settings, store, owner, takeover_suffix)
    expire_abandoned(settings, store)  # a dead worker's cycle releases its episodes before we count
    # rtrl's record of its promotions, not the alias (which anyone who can write MLflow moves).
    champion = store.recorded_champion(registry.model_name, registry.champion, "trainer")
    spec = get_spec(settings.labeler.reward_spec)  # once per cycle: every step below is handed it
    examples = replay.load(cfg.replay)  # a bad replay file fails here, before any episode is claimed
    available = count_trainable(settings, store, champion, spec_id=spec.spec_id, tenant=tenant)
    if available < cfg.min_samples:
        return CycleResult(
            cycle_id=None, status="not_enough_data", champion_version=champion, episodes=available
        )
    ref = reference.resolve(settings, registry, champion)  # trainer.reference: a missing one fails here
    cycle_id = store.acquire_cycle(
        owner, cfg.lease_ttl_s, champion, max_episode_failures=cfg.max_episode_failures, line=tenant
    )
    if cycle_id is None:
        return CycleResult(cycle_id=None, status="busy", champion_version=champion)
    files = checkpoint.CycleFiles(cfg.checkpoint_dir, spec.spec_id, cycle_id)
    cycle = _Cycle(cycle_id, champion, spec, files, started, started_at, tenant=tenant)

    with ExitStack() as cleanup:
        cleanup.push(_undo_on_failure(store, registry, cycle, cfg.max_episode_failures))
        # ---- select, claim, advantages ---------------------------------------------------------
        episodes = _claim(settings, store, cycle)
        batch = _advantages(cfg, cycle, episodes, _method_metrics(cycle.spec, store, episodes))
        if not batch.learning or batch.signal <= cfg.min_signal * batch.learning:
            # Nothing (or almost nothing) to learn: traffic without feedback. Its advantages are not
            # zero once a running baseline exists, but they are the baseline's own noise: training
            # would move the weights by it.
            return _skip(settings, store, cycle, batch)
        selection = objectives.select(cfg.loss, batch.episodes)  # rft / dpo choose rows
        if selection is not None:
            batch = replace(batch, rows=selection.rows, selection=selection.counts)
            if not selection.rows:
                return _skip(settings, store, cycle, batch, reason=selection.empty_reason)
        champion_dir, base_dir = _champion_checkpoint(settings, registry, champion)
        batch = _drop_rows_without_signal(cfg, _distil(cfg, cycle, batch, champion_dir, base_dir))

        # ---- champion weights into DeepSpeed, steps, save ---------------------------------------
        run_id = _start_run(settings, registry, cycle, batch)
        training = train(
            cfg,
            store,
            registry,
            champion=cycle.champion,
            files=cycle.files,
            run_id=run_id,
            rows=batch.rows,
            advantages=batch.advantages,
            episodes=len(batch.episodes),
            champion_dir=champion_dir,
            base_dir=base_dir,
            stopping=stopping,
            replay=replay.batches(cfg, examples, cycle.id, tokenizer_dir=base_dir or champion_dir),
            reference=ref,
        )
        result = _result(cycle, run_id, batch, training)
        _log_lineage(registry, run_id, batch.episodes, result)

        # ---- register (last) ------------------------------------------------------------------------
        _register(cfg, store, registry, cycle, run_id, result, base_dir, batch.next_baselines)
    return result


def _reclaim(settings: Settings, store: Store, owner: str, takeover_suffix: str | None) -> None:
    """A job delivered again (`takeover_suffix`: its previous worker died mid-cycle): fail that
    cycle, its episodes back in the pool, so that it runs again now."""
    if takeover_suffix is None:
        return
    reclaimed = store.reclaim_cycle(
        takeover_suffix,
        reason=f"worker lost; re-run by {owner}",
        max_episode_failures=settings.trainer.max_episode_failures,
    )
    if reclaimed is not None:
        checkpoint.discard_baselines(settings.trainer.checkpoint_dir, reclaimed)
        log.warning("cycle %d was abandoned by a lost worker; re-running it", reclaimed)


def _undo_on_failure(
    store: Store, registry: Registry, cycle: _Cycle, max_episode_failures: int
) -> Callable[[type[BaseException] | None, BaseException | None, TracebackType | None], None]:
    """The cycle's exit callback: on any exception, a half-finished cycle never leaves a version
    behind and its episodes go back to the pool. The cycle is failed first (its episodes free at
    once, before any call to the registry), then its version deleted, then its run FAILED; each
    runs even when one before it raised. The exception propagates.

    The failure counts against the claimed episodes, and those at `max_episode_failures` are
    quarantined instead of released (store/cycles.py `release_claims`), unless it says nothing
    about them (`NOT_THE_DATAS`, or an interrupt)."""

    def undo(_type: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None) -> None:
        if exc is None:
            return
        with ExitStack() as undoing:  # callbacks run last-pushed first, after the store's write
            if cycle.run_id is not None:
                undoing.callback(registry.end_run, cycle.run_id, "FAILED")
            if cycle.version is not None:
                undoing.callback(registry.delete_version, cycle.version)
            quarantined = store.finish_cycle(
                cycle.id,
                "failed",
                error=f"{type(exc).__name__}: {exc}"[:10_000],
                count_failure=isinstance(exc, Exception) and not isinstance(exc, NOT_THE_DATAS),
                max_episode_failures=max_episode_failures,
            )
            if quarantined:
                log.warning(
                    "cycle %d: %d episodes failed %d cycles and are quarantined (rtrl dlq episodes): %s",
                    cycle.id,
                    len(quarantined),
                    max_episode_failures,
                    ", ".join(quarantined[:10]),
                )

    return undo


def _claim(settings: Settings, store: Store, cycle: _Cycle) -> list[TrainingEpisode]:
    """Select the cycle's episodes and claim them (``mark_used``): no other cycle learns from them."""
    cfg = settings.trainer
    episodes = select_trainable(
        settings, store, cycle.champion, spec_id=cycle.spec.spec_id, tenant=cycle.tenant
    )
    if len(episodes) < cfg.min_samples:  # another reader got there between count and select
        raise InsufficientData(f"{len(episodes)} trainable episodes < min_samples {cfg.min_samples}")
    store.mark_used(cycle.id, [e.episode_id for e in episodes])
    return episodes


def _method_metrics(spec: RewardSpec, store: Store, episodes: list[TrainingEpisode]) -> dict[str, float]:
    """What the batch's episodes say about the seed methods (schemas/episodes.py) and, under a PARL
    spec, where its λ schedule is at this cycle (k = the cycles that trained under that spec before it)."""
    out = batch_metrics([(e.metrics, e.components) for e in episodes])
    if spec.parl is not None:
        k = store.trained_cycles(spec.spec_id)
        out["parl_cycle"] = float(k)
        out["parl_lambda_parallel"], out["parl_lambda_finish"] = spec.parl.lambdas(k)
    return out


def _advantages(
    cfg: TrainerSettings, cycle: _Cycle, episodes: list[TrainingEpisode], method_metrics: dict[str, float]
) -> _Batch:
    """The episodes' advantages against the spec's committed baselines (DAPO's overlong penalty
    shaping the rewards first), and the rows they become."""
    baselines = cycle.files.load_baselines()
    shaped = [e.reward for e in episodes]
    if isinstance(cfg.loss, DapoLoss) and cfg.loss.overlong_buffer > 0:
        shaped = [
            r + episode_overlong_penalty(e, cfg.loss.overlong_buffer)
            for r, e in zip(shaped, episodes, strict=True)
        ]
    adv, next_baselines = compute_advantages([episode_prompt_key(e) for e in episodes], shaped, baselines)
    rows, left_out = rows_of(episodes, adv.values)
    if left_out:
        log.warning(
            "cycle %d: segments left out for their sampling: %s (docs/algorithms.md, Greedy and "
            "near-greedy requests; raw_logprobs: serve with vllm.logprobs_mode=processed)",
            cycle.id,
            ", ".join(f"{n} {reason}" for reason, n in sorted(left_out.items())),
        )
    learning = [e for e in episodes if has_rows(e)]
    return _Batch(
        episodes=episodes,
        advantages=adv.values,
        next_baselines=next_baselines,
        rows=rows,
        left_out=left_out,
        learning=len(learning),
        signal=signal_count(learning),
        method_metrics=method_metrics,
    )


def _skip(settings: Settings, store: Store, cycle: _Cycle, batch: _Batch, reason: str = "") -> CycleResult:
    """End a cycle whose batch carries too little signal, or in which the objective found nothing
    to learn (`reason`: rft accepted no episode, dpo formed no pair): nothing trained or registered,
    the episodes spent (a later cycle would see the same rewards), the baselines updated with them."""
    cycle.files.stage_baselines(batch.next_baselines)
    episodes, left_out = batch.episodes, batch.left_out
    result = CycleResult(
        cycle_id=cycle.id,
        status="skipped",
        champion_version=cycle.champion,
        episodes=len(episodes),
        trainable_rows=len(batch.rows),
        signal_episodes=batch.signal,
        untrainable_rows=left_out,
        unreproducible_rows=sum(left_out.values()),
        mean_reward=sum(e.reward for e in episodes) / len(episodes),
        first_interaction_at=min(e.created_at for e in episodes),
        cycle_s=round(time.monotonic() - cycle.started, 3),
        selection=batch.selection,
        episode_metrics=batch.method_metrics,
    )
    if reason:
        log.warning("cycle %d skipped: %s (%s)", cycle.id, reason, batch.selection)
        end_cycle(settings, store, cycle.id, "skipped", metrics=result.model_dump(mode="json"))
        return result
    log.warning(
        "cycle %d skipped: %d of the %d episodes with trainable rows carry feedback or a judge's grade "
        "(trainer.min_signal %g; %d of %d episodes have no trainable row: %s); are users' feedback events "
        "arriving and joining?",
        cycle.id,
        batch.signal,
        batch.learning,
        settings.trainer.min_signal,
        len(episodes) - batch.learning,
        len(episodes),
        left_out or "none left out",
    )
    end_cycle(settings, store, cycle.id, "skipped", metrics=result.model_dump(mode="json"))
    return result


def _distil(
    cfg: TrainerSettings, cycle: _Cycle, batch: _Batch, champion_dir: Path, base_dir: Path | None
) -> _Batch:
    """The batch with the spec's hindsight term in its corrected rows' token advantages (trainer/hindsight.py)."""
    distilled = hindsight.run(cycle.spec.hindsight, cfg, batch.episodes, batch.rows, champion_dir, base_dir)
    return replace(batch, rows=distilled.rows, hindsight=distilled.metrics)


def _drop_rows_without_signal(cfg: TrainerSettings, batch: _Batch) -> _Batch:
    """The batch without its zero-advantage rows under DAPO's dynamic sampling; raises
    InsufficientData when no row is left to train."""
    rows, no_signal = batch.rows, 0
    if isinstance(cfg.loss, DapoLoss) and cfg.loss.dynamic_sampling:
        kept = [r for r in rows if carries_advantage(r)]
        no_signal, rows = len(rows) - len(kept), kept
    if not rows:
        raise InsufficientData(
            f"{len(batch.episodes)} episodes have no trainable completion tokens"
            + (f" with a non-zero advantage ({no_signal} without)" if no_signal else "")
        )
    return replace(batch, rows=rows, no_signal=no_signal)


def _champion_checkpoint(settings: Settings, registry: Registry, champion: int) -> tuple[Path, Path | None]:
    """The champion's checkpoint directory, checked, and for a LoRA champion the base model it is
    an adapter on: the servers' base model, which never changes (docs/lora.md)."""
    adapter = settings.trainer.adapter
    champion_dir = registry.download_checkpoint(champion)
    checkpoint.check_source(champion_dir, adapter)
    base_dir = settings.vllm.model_dir.expanduser().resolve() if adapter == "lora" else None
    return champion_dir, base_dir


def _as_floats(counts: dict[str, int]) -> dict[str, float]:
    """Counts as MLflow metrics."""
    return {key: float(value) for key, value in counts.items()}


def _reward_params(spec: RewardSpec) -> dict[str, str]:
    """The reward spec as MLflow params: its id, PARL's λ schedule, the judge term's weight."""
    params = {"reward.spec": spec.spec_id}
    if spec.parl is not None:
        flatten("reward.parl", spec.parl.model_dump(mode="json"), params)
    if spec.judge is not None:
        params["reward.judge.weight"] = str(spec.judge.weight)
    if spec.hindsight is not None:
        flatten("reward.hindsight", spec.hindsight.model_dump(mode="json", exclude={"template"}), params)
    return params


def _start_run(settings: Settings, registry: Registry, cycle: _Cycle, batch: _Batch) -> str:
    """The cycle's MLflow run (recorded on `cycle` at once: a failure from here on ends it FAILED),
    with the trainer's settings and the reward spec as params, and the batch's method metrics,
    selection and hindsight counts."""
    method_metrics = batch.method_metrics | _as_floats(batch.selection) | batch.hindsight
    run_id = cycle.run_id = registry.start_run(
        f"cycle-{cycle.id}",
        tags={
            "rtrl.kind": "training_cycle",
            "rtrl.cycle_id": str(cycle.id),
            "rtrl.parent_version": str(cycle.champion),
        },
        params=flatten(
            "trainer",
            settings.trainer.model_dump(mode="json"),
            _reward_params(cycle.spec) | {"model_name": registry.model_name},
        ),
    )
    if method_metrics:
        registry.log_metrics(run_id, method_metrics)
    return run_id


def _result(cycle: _Cycle, run_id: str, batch: _Batch, training: Training) -> CycleResult:
    """The registered cycle's result, all but its challenger and its length (`_register` adds them)."""
    rewards = [e.reward for e in batch.episodes]
    first_interaction_at = min(e.created_at for e in batch.episodes)
    return CycleResult(
        cycle_id=cycle.id,
        status="registered",
        champion_version=cycle.champion,
        episodes=len(batch.episodes),
        trainable_rows=len(batch.rows),
        tokens=training.tokens,
        unreproducible_rows=sum(batch.left_out.values()),
        untrainable_rows=batch.left_out,
        signal_episodes=batch.signal,
        no_signal_rows=batch.no_signal,
        mean_reward=sum(rewards) / len(rewards),
        reward_std=statistics.pstdev(rewards),
        advantage_mean=statistics.fmean(batch.advantages),
        advantage_abs_mean=statistics.fmean(abs(a) for a in batch.advantages),
        data_age_s=round((cycle.started_at - first_interaction_at).total_seconds(), 3),
        first_interaction_at=first_interaction_at,
        train_s=training.train_s,
        steps=training.trained.steps,
        mlflow_run_id=run_id,
        checkpoint_dir=str(cycle.files.out_dir),
        optimizer_from_cycle=training.carried_from,
        kl_stopped_at_step=training.trained.kl_stop,
        selection=batch.selection,
        hindsight=batch.hindsight,
        episode_metrics=batch.method_metrics,
    )


def _log_lineage(
    registry: Registry, run_id: str, episodes: list[TrainingEpisode], result: CycleResult
) -> None:
    """The run's lineage: which episodes it learnt from, and the cycle summary."""
    episode_ids = [e.episode_id for e in episodes]
    registry.log_json(
        run_id,
        {
            "episodes.json": sorted(episode_ids),
            "cycle.json": result.model_dump(mode="json", exclude={"steps"}),
        },
    )
    registry.set_run_tag(run_id, "rtrl.episodes", str(len(episode_ids)))


def _register(
    cfg: TrainerSettings,
    store: Store,
    registry: Registry,
    cycle: _Cycle,
    run_id: str,
    result: CycleResult,
    base_dir: Path | None,
    next_baselines: BaselineState,
) -> None:
    """The checkpoint as a new version @challenger (recorded on `cycle` at once: a failure from here
    on deletes it), the cycle ``registered`` with its result, its baselines staged, its run FINISHED."""
    # An adapter's lineage: the base model it is a delta on (the registry's v1 says the same).
    lineage_tags = {} if base_dir is None else {"rtrl.adapter": "lora", "rtrl.base_model": str(base_dir)}
    version = cycle.version = registry.register_checkpoint(
        cycle.files.out_dir,
        run_id=run_id,
        tags={
            "rtrl.cycle_id": str(cycle.id),
            "rtrl.parent_version": str(cycle.champion),
            "rtrl.episodes": str(result.episodes),
            "rtrl.loss": cfg.loss.type,
        }
        | lineage_tags,
    )
    registry.set_alias(CHALLENGER, version)
    result.challenger_version = version
    result.cycle_s = round(time.monotonic() - cycle.started, 3)
    store.finish_cycle(
        cycle.id,
        "registered",
        challenger=version,
        metrics=result.model_dump(mode="json", exclude={"steps"})
        | {"steps": [s.model_dump() for s in result.steps]},
    )
    # Committed by `end_cycle` once the episodes are spent (promoted or rejected), never before.
    cycle.files.stage_baselines(next_baselines)
    registry.end_run(run_id, "FINISHED")
