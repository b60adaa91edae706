"""One training cycle, top to bottom: lease → select → advantages → DeepSpeed steps → save → register.

Called by the Celery task ``rtrl.train_cycle`` (trainer/tasks.py) in the worker process, or
in-process by ``rtrl train now --inline``. The policy trained is exactly the champion's weights
that served the selected samples; the result is a new registered version of
``settings.mlflow.model_name`` with alias ``challenger``, which the task then sends through the
eval gate and the deployer.

Guarantees (docs/architecture.md, Contracts: one cycle at a time):
* the store's cycle lease admits one active cycle; the episodes are claimed for the cycle right
  after selection (``mark_used``), so two cycles never learn from the same sample;
* registration is the last step: on any exception the cycle is finished as ``failed`` (which
  releases its episodes for the next cycle), a version registered by this cycle is deleted (a
  registration that fails deletes its own version, `registry.Registry.register_checkpoint`), the
  MLflow run is marked FAILED, and the exception propagates;
* the running reward baselines are persisted only once the cycle is registered.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from registry import CHALLENGER, Registry, flatten
from schemas.clock import utcnow
from schemas.episodes import batch_metrics
from schemas.rewards import JUDGE, get_spec
from schemas.sampling import untrainable_sampling
from schemas.settings import DapoLoss, Settings, TrainerSettings
from serving.sampler import Row, Sampling, micro_batches
from store import Store, TrainingEpisode
from trainer import checkpoint
from trainer.advantages import BaselineState, compute_advantages, overlong_penalty, prompt_key
from trainer.engine import (
    close_engine,
    load_optimizer_state,
    precision,
    save_optimizer_state,
    start_engine,
    state_dict,
)
from trainer.errors import Abandoned, InsufficientData
from trainer.lease import expire_abandoned
from trainer.losses import Normaliser, loss_function
from trainer.ranks import train_on_ranks
from trainer.selection import count_trainable, current_spec_id, select_trainable
from trainer.steps import StepMetrics, mlflow_metrics, run_steps

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

log = logging.getLogger(__name__)

NO_SIGNAL = 1e-9  # |advantage| at or below this carries no signal (DAPO's dynamic sampling)


def carries_signal(episode: TrainingEpisode) -> bool:
    """Whether the episode's reward says anything: user feedback, or a judge's grade. An episode
    settled by the window with neither has reward 0 and learns nothing, whatever its advantage:
    once a running baseline exists every reward differs from it (trainer/advantages.py)."""
    return not episode.no_feedback or JUDGE in episode.components


def signal_count(episodes: list[TrainingEpisode]) -> int:
    """How many of a batch's episodes carry signal (`carries_signal`): what decides whether a cycle
    trains (``trainer.min_signal``), never the advantages."""
    return sum(carries_signal(e) for e in episodes)


def has_rows(episode: TrainingEpisode) -> bool:
    """Whether the episode contributes a row (`rows_of`): a trainable segment with a completion
    whose sampling the trainer may learn from. A greedy episode with feedback trains nothing, so
    its feedback cannot carry a batch of other episodes' noise."""
    return any(seg.trainable and seg.completion_token_ids and untrainable_sampling(seg.sampling) is None
               for seg in episode.segments)  # fmt: skip


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
        0, description="Trainable segments left out for their sampling, all reasons together (untrainable_rows)."
    )
    untrainable_rows: dict[str, int] = Field(
        default_factory=dict, description="Those segments by reason (schemas/sampling.py untrainable_sampling): "
        "greedy, near_greedy, raw_logprobs."
    )
    signal_episodes: int | None = Field(
        None, description="Episodes whose reward carries user feedback or a judge's grade (trainer.min_signal)."
    )
    mean_reward: float | None = Field(None, description="Mean reward of the batch.")
    reward_std: float | None = Field(None, description="Population standard deviation of the batch's rewards.")
    advantage_mean: float | None = Field(None, description="Mean advantage over the batch's episodes.")
    advantage_abs_mean: float | None = Field(None, description="Mean |advantage| (how much signal the batch carries).")
    data_age_s: float | None = Field(
        None, description="Policy lag: age of the oldest episode learnt from when the cycle started, seconds."
    )
    first_interaction_at: datetime | None = Field(None, description="Earliest episode start (data-to-deploy time).")
    train_s: float | None = Field(None, description="Load champion + optimizer steps, seconds.")
    cycle_s: float | None = Field(None, description="Whole cycle, lease to registration, seconds.")
    optimizer_from_cycle: int | None = Field(
        None, description="The cycle whose AdamW state this one continued (trainer.carry_optimizer); None: fresh."
    )
    kl_stopped_at_step: int | None = Field(
        None, description="The step at which the trust region (trainer.max_kl) stopped the cycle, its update not "
        "applied; None: every step ran."
    )
    episode_metrics: dict[str, float] = Field(
        default_factory=dict,
        description="The batch's episodes as the labeler measured them (schemas/episodes.py batch_metrics) and, "
        "under a PARL spec, the λ schedule at this cycle (parl_cycle, parl_lambda_parallel, parl_lambda_finish).",
    )
    steps: list[StepMetrics] = Field(default_factory=list)
    mlflow_run_id: str | None = None
    checkpoint_dir: str | None = None


def rows_of(episodes: list[TrainingEpisode], advantages: list[float]) -> tuple[list[Row], dict[str, int]]:
    """Every trainable segment with a completion becomes a row carrying its episode's advantage and
    how it was sampled; also the segments left out for their sampling, by reason
    (`schemas.sampling.untrainable_sampling`: greedy or near-greedy, or raw logprobs of non-neutral
    sampling)."""
    rows = []
    left_out: dict[str, int] = {}
    for episode, advantage in zip(episodes, advantages, strict=True):
        for seg in episode.segments:
            if not (seg.trainable and seg.completion_token_ids):
                continue
            reason = untrainable_sampling(seg.sampling)
            if reason is not None:
                left_out[reason] = left_out.get(reason, 0) + 1
                continue
            rows.append(
                Row(
                    input_ids=[*seg.prompt_token_ids, *seg.completion_token_ids],
                    prompt_len=len(seg.prompt_token_ids),
                    behaviour_logprobs=list(seg.completion_logprobs),
                    advantage=advantage,
                    sampling=Sampling.of(seg.sampling),
                )
            )
    return rows, left_out


def _skip(
    settings: Settings,
    store: Store,
    cycle_id: int,
    champion: int,
    episodes: list[TrainingEpisode],
    rows: list[Row],
    signal: int,
    baselines: BaselineState,
    started: float,
    method_metrics: dict[str, float],
    left_out: dict[str, int],
) -> CycleResult:
    """End a cycle whose batch carries too little signal: nothing trained or registered, the
    episodes spent (a later cycle would see the same rewards), the baselines updated with them."""
    checkpoint.stage_baselines(settings.trainer.checkpoint_dir, current_spec_id(settings), cycle_id, baselines)
    result = CycleResult(
        cycle_id=cycle_id, status="skipped", champion_version=champion, episodes=len(episodes),
        trainable_rows=len(rows), signal_episodes=signal, untrainable_rows=left_out,
        unreproducible_rows=sum(left_out.values()),
        mean_reward=sum(e.reward for e in episodes) / len(episodes),
        first_interaction_at=min(e.created_at for e in episodes), cycle_s=round(time.monotonic() - started, 3),
        episode_metrics=method_metrics,
    )  # fmt: skip
    learning = len(episodes) - sum(not has_rows(e) for e in episodes)
    log.warning("cycle %d skipped: %d of the %d episodes with trainable rows carry feedback or a judge's grade "
                "(trainer.min_signal %g; %d of %d episodes have no trainable row: %s); are users' feedback events "
                "arriving and joining?", cycle_id, signal, learning, settings.trainer.min_signal,
                len(episodes) - learning, len(episodes), left_out or "none left out")  # fmt: skip
    end_cycle(settings, store, cycle_id, "skipped", metrics=result.model_dump(mode="json"))
    return result


def _optimizer_meta(cfg: TrainerSettings) -> dict[str, Any]:
    """What a saved optimizer state must match to be continued."""
    return {"zero_stage": cfg.zero_stage, "precision": precision(cfg), "adapter": cfg.adapter, "ranks": cfg.ranks}


def _optimizer_source(registry: Registry, champion: int, cfg: TrainerSettings) -> tuple[Path, int] | None:
    """The saved optimizer state of the cycle that produced the champion (and that cycle), when this
    worker kept it and it matches (ZeRO stage, precision, mode, ranks); None: a fresh optimizer."""
    source = registry.version_tags(champion).get("rtrl.cycle_id", "")
    if not source.isdigit():
        return None  # the base model, or a version registered by hand
    directory = checkpoint.optimizer_dir(cfg.checkpoint_dir, int(source))
    meta = checkpoint.optimizer_meta(directory)
    if meta != _optimizer_meta(cfg):
        log.info("v%d: %s; a fresh optimizer", champion,
                 f"no optimizer state of cycle {source} on this worker" if meta is None
                 else f"the optimizer state of cycle {source} is for {meta}, not {_optimizer_meta(cfg)}")  # fmt: skip
        return None
    return directory, int(source)


def _continue_optimizer(
    engine: DeepSpeedEngine, registry: Registry, champion: int, champion_dir: Path, cfg: TrainerSettings,
    accumulation: int, base_dir: Path | None,
) -> tuple[DeepSpeedEngine, int | None]:
    """The engine with the optimizer state of the cycle that produced the champion (`_optimizer_source`),
    or the fresh engine. Never fails the cycle: a state that does not load is logged and a fresh
    engine is used."""
    found = _optimizer_source(registry, champion, cfg)
    if found is None:
        return engine, None
    directory, source = found
    try:
        load_optimizer_state(engine, directory)
    except Exception:  # noqa: BLE001 - a damaged state must not stop training: start fresh instead
        log.exception("v%d: the optimizer state of cycle %s does not load; a fresh optimizer", champion, source)
        close_engine(engine)
        return start_engine(champion_dir, cfg, accumulation=accumulation, base_dir=base_dir), None
    log.info("v%d: continuing the optimizer state of cycle %s", champion, source)
    return engine, source


def _train_on_ranks(
    cfg: TrainerSettings, cycle_id: int, batches: list[Any], norm: Normaliser, mean_advantage: float,
    champion_dir: Path, base_dir: Path | None, out_dir: Path, lineage: dict[str, Any],
    optimizer_from: tuple[Path, int] | None, optimizer_to: Path | None, stopping: Callable[[], bool],
) -> tuple[list[StepMetrics], int | None, int | None]:
    """The steps of a multi-rank cycle (trainer/ranks.py); rank 0 saves the checkpoint to `out_dir`.
    Returns the steps' metrics, the trust region's stop and the cycle whose optimizer continued."""
    result = train_on_ranks(
        cfg, cfg.checkpoint_dir / "ranks" / f"cycle-{cycle_id}", batches=batches, norm=(norm.tokens, norm.sequences),
        mean_advantage=mean_advantage, champion_dir=champion_dir, base_dir=base_dir, out_dir=out_dir, lineage=lineage,
        optimizer_from=None if optimizer_from is None else optimizer_from[0], optimizer_to=optimizer_to,
        stopping=stopping,
    )  # fmt: skip
    steps = [StepMetrics.model_validate(m) for m in result["steps"]]
    carried = optimizer_from[1] if optimizer_from is not None and result["optimizer_carried"] else None
    return steps, result["kl_stop"], carried


def end_cycle(settings: Settings, store: Store, cycle_id: int, status: str, **fields: Any) -> None:
    """Give a registered cycle its final status and settle its staged baselines.

    promoted / rejected / skipped: its episodes are spent (never selected again), so the baselines
    that include their rewards are committed. failed: its episodes go back to the pool, so its
    baselines are discarded — committed, they would hold those episodes' own rewards when they
    train again (a leak into their advantages). The status is recorded first: a crash in between
    loses a baseline update, never leaks one.
    """
    store.finish_cycle(cycle_id, status, **fields)
    if status in ("promoted", "rejected", "skipped"):
        checkpoint.commit_baselines(settings.trainer.checkpoint_dir, cycle_id)
    else:
        checkpoint.discard_baselines(settings.trainer.checkpoint_dir, cycle_id)


def episode_overlong_penalty(episode: TrainingEpisode, buffer: float) -> float:
    """DAPO's overlong penalty of an episode: that of its most overlong trainable segment."""
    return min(
        (overlong_penalty(len(seg.completion_token_ids), seg.sampling.max_tokens, buffer)
         for seg in episode.segments if seg.trainable),
        default=0.0,
    )  # fmt: skip


def episode_prompt_key(episode: TrainingEpisode) -> str:
    """Episodes are grouped by the prompt of their first segment (what the user asked)."""
    if not episode.segments:
        raise ValueError(f"episode {episode.episode_id} has no segments")
    return prompt_key(episode.segments[0].prompt_token_ids)


def _reward_params(settings: Settings) -> dict[str, str]:
    """The reward spec as MLflow params: its id, PARL's λ schedule, the judge term's weight."""
    spec = get_spec(settings.labeler.reward_spec)
    params = {"reward.spec": spec.spec_id}
    if spec.parl is not None:
        flatten("reward.parl", spec.parl.model_dump(mode="json"), params)
    if spec.judge is not None:
        params["reward.judge.weight"] = str(spec.judge.weight)
    return params


def _method_metrics(settings: Settings, store: Store, episodes: list[TrainingEpisode]) -> dict[str, float]:
    """What the batch's episodes say about the seed methods (schemas/episodes.py) and, under a PARL
    spec, where its λ schedule is at this cycle (k = the cycles that trained under that spec before it)."""
    out = batch_metrics([(e.metrics, e.components) for e in episodes])
    spec = get_spec(settings.labeler.reward_spec)
    if spec.parl is not None:
        k = store.trained_cycles(spec.spec_id)
        out["parl_cycle"] = float(k)
        out["parl_lambda_parallel"], out["parl_lambda_finish"] = spec.parl.lambdas(k)
    return out


def run_cycle(
    settings: Settings, store: Store, registry: Registry, *, owner: str, takeover_suffix: str | None = None,
    stopping: Callable[[], bool] = lambda: False,
) -> CycleResult:
    """One cycle from the champion's own episodes to a registered @challenger (see the module docstring).

    `stopping` is asked before every optimizer step and before the checkpoint is saved: once it
    answers True (the worker got SIGTERM) the cycle raises `Abandoned` and fails, its episodes
    released, nothing registered.
    """
    cfg = settings.trainer

    def check_stopping(where: str) -> None:
        if stopping():
            raise Abandoned(f"the worker is stopping; cycle abandoned {where}")

    started, started_at = time.monotonic(), utcnow()

    # ---- lease --------------------------------------------------------------------------------
    if takeover_suffix is not None:
        # This job was delivered again: its previous worker died mid-cycle. Fail that cycle (its
        # episodes go back to the pool) and run it again now.
        reclaimed = store.reclaim_cycle(takeover_suffix, reason=f"worker lost; re-run by {owner}")
        if reclaimed is not None:
            checkpoint.discard_baselines(cfg.checkpoint_dir, reclaimed)
            log.warning("cycle %d was abandoned by a lost worker; re-running it", reclaimed)
    expire_abandoned(settings, store)  # a dead worker's cycle releases its episodes before we count
    champion = registry.champion()
    spec_id = current_spec_id(settings)
    available = count_trainable(settings, store, champion)
    if available < cfg.min_samples:
        return CycleResult(cycle_id=None, status="not_enough_data", champion_version=champion, episodes=available)
    cycle_id = store.acquire_cycle(owner, cfg.lease_ttl_s, champion)
    if cycle_id is None:
        return CycleResult(cycle_id=None, status="busy", champion_version=champion)

    run_id: str | None = None
    version: int | None = None
    try:
        # ---- select and claim -------------------------------------------------------------------
        episodes = select_trainable(settings, store, champion)
        if len(episodes) < cfg.min_samples:  # another reader got there between count and select
            raise InsufficientData(f"{len(episodes)} trainable episodes < min_samples {cfg.min_samples}")
        episode_ids = [e.episode_id for e in episodes]
        store.mark_used(cycle_id, episode_ids)
        rewards = [e.reward for e in episodes]
        method_metrics = _method_metrics(settings, store, episodes)

        # ---- advantages ---------------------------------------------------------------------------
        baselines = checkpoint.load_baselines(cfg.checkpoint_dir, spec_id)
        shaped = rewards
        if isinstance(cfg.loss, DapoLoss) and cfg.loss.overlong_buffer > 0:
            shaped = [r + episode_overlong_penalty(e, cfg.loss.overlong_buffer) for r, e in zip(rewards, episodes, strict=True)]
        adv, next_baselines = compute_advantages([episode_prompt_key(e) for e in episodes], shaped, baselines)
        rows, left_out = rows_of(episodes, adv.values)
        unreproducible = sum(left_out.values())
        if left_out:
            log.warning("cycle %d: segments left out for their sampling: %s (docs/algorithms.md, Greedy and "
                        "near-greedy requests; raw_logprobs: serve with vllm.logprobs_mode=processed)", cycle_id,
                        ", ".join(f"{n} {reason}" for reason, n in sorted(left_out.items())))  # fmt: skip
        learning = [e for e in episodes if has_rows(e)]
        signal = signal_count(learning)
        if not learning or signal <= cfg.min_signal * len(learning):
            # Nothing (or almost nothing) to learn: traffic without feedback. Its advantages are not
            # zero once a running baseline exists, but they are the baseline's own noise: training
            # would move the weights by it.
            return _skip(settings, store, cycle_id, champion, episodes, rows, signal, next_baselines, started,
                         method_metrics, left_out)
        no_signal = 0
        if isinstance(cfg.loss, DapoLoss) and cfg.loss.dynamic_sampling:
            kept = [r for r in rows if abs(r.advantage) > NO_SIGNAL]
            no_signal, rows = len(rows) - len(kept), kept
        if not rows:
            raise InsufficientData(f"{len(episodes)} episodes have no trainable completion tokens"
                                   + (f" with a non-zero advantage ({no_signal} without)" if no_signal else ""))

        # ---- champion weights into DeepSpeed -------------------------------------------------------
        champion_dir = registry.download_checkpoint(champion)
        checkpoint.check_source(champion_dir, cfg.adapter)
        # A LoRA champion is an adapter on the servers' base model, which never changes (docs/lora.md).
        base_dir = settings.vllm.model_dir.expanduser().resolve() if cfg.adapter == "lora" else None
        run_id = registry.start_run(
            f"cycle-{cycle_id}",
            tags={"rtrl.kind": "training_cycle", "rtrl.cycle_id": str(cycle_id), "rtrl.parent_version": str(champion)},
            params=flatten("trainer", settings.trainer.model_dump(mode="json"),
                           _reward_params(settings) | {"model_name": registry.model_name}),
        )
        if method_metrics:
            registry.log_metrics(run_id, method_metrics)
        train_started = time.monotonic()
        pad_id = 0  # padded positions are masked out of attention and loss; any id works
        batches = micro_batches(rows, cfg.micro_batch, pad_id)
        norm = Normaliser(tokens=sum(b.tokens for b in batches), sequences=len(rows))
        loss_fn = loss_function(cfg.loss)
        out_dir = cfg.checkpoint_dir / f"cycle-{cycle_id}"
        lineage = {"cycle_id": cycle_id, "parent_version": champion, "mlflow_run_id": run_id,
                   "episodes": len(episodes), "loss": cfg.loss.type, "adapter": cfg.adapter,
                   "base_model": None if base_dir is None else str(base_dir), "ranks": cfg.ranks}  # fmt: skip
        mean_advantage = sum(adv.values) / len(adv.values)
        saved_optimizer = checkpoint.optimizer_dir(cfg.checkpoint_dir, cycle_id) if cfg.carry_optimizer else None
        if cfg.ranks > 1:
            steps, kl_stop, carried_from = _train_on_ranks(
                cfg, cycle_id, batches, norm, mean_advantage, champion_dir, base_dir, out_dir, lineage,
                _optimizer_source(registry, champion, cfg) if cfg.carry_optimizer else None, saved_optimizer,
                stopping,
            )
            for metrics in steps:
                registry.log_metrics(run_id, mlflow_metrics(metrics), metrics.step)
        else:
            engine = start_engine(champion_dir, cfg, accumulation=len(batches), base_dir=base_dir)
            carried_from = None
            if cfg.carry_optimizer:
                engine, carried_from = _continue_optimizer(engine, registry, champion, champion_dir, cfg,
                                                           len(batches), base_dir)  # fmt: skip
            try:
                def after_step(metrics: StepMetrics) -> None:
                    registry.log_metrics(run_id, mlflow_metrics(metrics), metrics.step)
                    store.heartbeat_cycle(cycle_id, cfg.lease_ttl_s)

                trained = run_steps(engine, batches, cfg, loss_fn, norm, mean_advantage=mean_advantage,
                                    before_step=lambda step: check_stopping(f"before step {step}"),
                                    after_step=after_step)  # fmt: skip
                steps, kl_stop = trained.steps, trained.kl_stop
                if saved_optimizer is not None:
                    save_optimizer_state(engine, saved_optimizer)
                weights = state_dict(engine)
            finally:
                close_engine(engine)
            check_stopping("before saving")
            checkpoint.save(weights, out_dir, champion_dir, lineage)
        if kl_stop is not None:
            log.info("cycle %d: KL(champion ‖ policy) %.4f > trainer.max_kl %g after %d of %d steps: "
                     "stopping there", cycle_id, steps[-1].kl_k3, cfg.max_kl, kl_stop, cfg.steps)  # fmt: skip
        if saved_optimizer is not None:
            checkpoint.write_optimizer_meta(saved_optimizer, _optimizer_meta(cfg))
            checkpoint.prune_optimizer_states(cfg.checkpoint_dir, cfg.keep_optimizer_states)
        train_s = time.monotonic() - train_started

        result = CycleResult(
            cycle_id=cycle_id,
            status="registered",
            champion_version=champion,
            episodes=len(episodes),
            trainable_rows=len(rows),
            tokens=norm.tokens,
            unreproducible_rows=unreproducible,
            untrainable_rows=left_out,
            signal_episodes=signal,
            no_signal_rows=no_signal,
            mean_reward=sum(rewards) / len(rewards),
            reward_std=statistics.pstdev(rewards),
            advantage_mean=statistics.fmean(adv.values),
            advantage_abs_mean=statistics.fmean(abs(a) for a in adv.values),
            data_age_s=round((started_at - min(e.created_at for e in episodes)).total_seconds(), 3),
            first_interaction_at=min(e.created_at for e in episodes),
            train_s=round(train_s, 3),
            steps=steps,
            mlflow_run_id=run_id,
            checkpoint_dir=str(out_dir),
            optimizer_from_cycle=carried_from,
            kl_stopped_at_step=kl_stop,
            episode_metrics=method_metrics,
        )
        # The run's lineage: which episodes it learnt from, and the cycle summary.
        registry.log_json(run_id, {"episodes.json": sorted(episode_ids),
                                   "cycle.json": result.model_dump(mode="json", exclude={"steps"})})
        registry.set_run_tag(run_id, "rtrl.episodes", str(len(episode_ids)))

        # ---- register (last) ------------------------------------------------------------------------
        # An adapter's lineage: the base model it is a delta on (the registry's v1 says the same).
        lineage_tags = {} if base_dir is None else {"rtrl.adapter": "lora", "rtrl.base_model": str(base_dir)}
        version = registry.register_checkpoint(
            out_dir,
            run_id=run_id,
            tags={"rtrl.cycle_id": str(cycle_id), "rtrl.parent_version": str(champion),
                  "rtrl.episodes": str(len(episodes)), "rtrl.loss": cfg.loss.type} | lineage_tags,
        )
        registry.set_alias(CHALLENGER, version)
        result.challenger_version = version
        result.cycle_s = round(time.monotonic() - started, 3)
        store.finish_cycle(
            cycle_id,
            "registered",
            challenger=version,
            metrics=result.model_dump(mode="json", exclude={"steps"}) | {"steps": [s.model_dump() for s in steps]},
        )
        # Committed by `end_cycle` once the episodes are spent (promoted or rejected), never before.
        checkpoint.stage_baselines(cfg.checkpoint_dir, spec_id, cycle_id, next_baselines)
        registry.end_run(run_id, "FINISHED")
        return result
    except BaseException as exc:
        # A half-finished cycle never leaves a version behind; its episodes go back to the pool.
        try:
            store.finish_cycle(cycle_id, "failed", error=f"{type(exc).__name__}: {exc}"[:10_000])
        finally:
            try:
                if version is not None:
                    registry.delete_version(version)
            finally:
                if run_id is not None:
                    registry.end_run(run_id, "FAILED")
        raise
