"""A cycle's training: the optimizer steps from the champion's weights, in this process or on
``trainer.ranks`` rank processes (trainer/ranks.py), the checkpoint saved to the cycle's
``out_dir``, and the optimizer state kept for the next cycle (``trainer.carry_optimizer``).

`train` is the step of `trainer.cycle.run_cycle` between the start of the cycle's MLflow run and
its result: run_cycle hands it the claimed batch's rows and advantages and the cycle's champion and
files, and keeps the lease, the bookkeeping and the registration. The DeepSpeed engine is closed
when its steps end, however they end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry import Registry
from schemas.settings import TrainerSettings
from serving.sampler import MicroBatch, Row
from store import Store
from trainer import checkpoint, objectives
from trainer.engine import close_engine, save_optimizer_state, start_engine, state_dict
from trainer.errors import Abandoned
from trainer.losses import Normaliser, loss_function
from trainer.optimizer_state import carried_state, continue_optimizer, state_meta
from trainer.ranks import train_on_ranks
from trainer.reference import Reference
from trainer.replay import ReplayBatches
from trainer.steps import StepMetrics, Trained, mlflow_metrics, run_steps

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Training:
    """What the steps did, and where the optimizer came from."""

    trained: Trained
    carried_from: int | None  # the cycle whose optimizer state continued; None: fresh
    tokens: int
    train_s: float


def train(
    cfg: TrainerSettings,
    store: Store,
    registry: Registry,
    *,
    champion: int,
    files: checkpoint.CycleFiles,
    run_id: str,
    rows: list[Row],
    advantages: list[float],
    episodes: int,
    champion_dir: Path,
    base_dir: Path | None,
    stopping: Callable[[], bool],
    replay: ReplayBatches | None = None,
    reference: Reference | None = None,
) -> Training:
    """The optimizer steps on `rows` (from `episodes` episodes, one advantage each) from the
    weights of `champion`, with the `replay` term (trainer/replay.py) and the KL penalty to the fixed
    `reference` (trainer/reference.py) beside them, on this process
    or on ``trainer.ranks`` rank processes (without replay: the settings refuse both), the
    checkpoint saved to the cycle's ``out_dir``, and the optimizer state kept for the next cycle
    (``trainer.carry_optimizer``)."""
    train_started = time.monotonic()
    pad_id = 0  # padded positions are masked out of attention and loss; any id works
    # Cut by length, and by pair under DPO (trainer/objectives.py).
    batches, norm = objectives.batches(cfg.loss, rows, cfg.micro_batch, pad_id)
    lineage = {
        "cycle_id": files.cycle_id,
        "parent_version": champion,
        "mlflow_run_id": run_id,
        "episodes": episodes,
        "loss": cfg.loss.type,
        "adapter": cfg.adapter,
        "base_model": None if base_dir is None else str(base_dir),
        "ranks": cfg.ranks,
        "nodes": cfg.nodes,
        # What the replay term trained beside the episodes (trainer/replay.py): None without replay.
        "replay": None
        if replay is None
        else {"path": str(cfg.replay.path), "weight": replay.weight, "rows": replay.rows},
        # The fixed KL reference (trainer/reference.py): None without trainer.loss.ref_kl_coef.
        "reference": None
        if reference is None
        else {"version": reference.version, "ref_kl_coef": cfg.loss.ref_kl_coef},
    }
    work = _Work(
        champion=champion,
        files=files,
        batches=batches,
        norm=norm,
        mean_advantage=sum(advantages) / len(advantages),
        champion_dir=champion_dir,
        base_dir=base_dir,
        lineage=lineage,
        stopping=stopping,
        replay=replay,
        reference=reference,
    )
    if cfg.ranks > 1 or cfg.nodes > 1:
        if replay is not None:
            raise ValueError("trainer.replay runs on one rank of one host (trainer.ranks=1, trainer.nodes=1)")
        trained, carried_from = _train_on_ranks(cfg, registry, work)
        for metrics in trained.steps:
            registry.log_metrics(run_id, mlflow_metrics(metrics), metrics.step)
    else:
        trained, carried_from = _train_here(cfg, store, registry, run_id, work)
    if trained.kl_stop is not None:
        log.info(
            "cycle %d: KL(champion ‖ policy) %.4f > trainer.max_kl %g after %d of %d steps: stopping there",
            files.cycle_id,
            trained.steps[-1].kl_k3,
            cfg.max_kl,
            trained.kl_stop,
            cfg.steps,
        )
    if cfg.carry_optimizer:
        files.keep_optimizer_state(state_meta(cfg), cfg.keep_optimizer_states)
    return Training(trained, carried_from, norm.tokens, round(time.monotonic() - train_started, 3))


@dataclass(frozen=True)
class _Work:
    """What either way of training takes: the micro-batches and their normaliser, the champion whose
    weights they start from, the cycle's files, the checkpoint's lineage and when to give up."""

    champion: int
    files: checkpoint.CycleFiles
    batches: list[MicroBatch]
    norm: Normaliser
    mean_advantage: float
    champion_dir: Path
    base_dir: Path | None
    lineage: dict[str, Any]
    stopping: Callable[[], bool]
    replay: ReplayBatches | None = None
    reference: Reference | None = None


def _train_here(
    cfg: TrainerSettings, store: Store, registry: Registry, run_id: str, work: _Work
) -> tuple[Trained, int | None]:
    """The steps of a cycle in this process (a world of one), each logged to the run and renewing
    the lease; the engine is closed once they end, however they end. Returns the steps and the
    cycle whose optimizer continued."""
    files = work.files

    def check_stopping(where: str) -> None:
        if work.stopping():
            raise Abandoned(f"the worker is stopping; cycle abandoned {where}")

    def after_step(metrics: StepMetrics) -> None:
        registry.log_metrics(run_id, mlflow_metrics(metrics), metrics.step)
        store.heartbeat_cycle(files.cycle_id, cfg.lease_ttl_s)

    with ExitStack() as engine_open:
        # The replay term's micro-batches accumulate into the same optimizer step (trainer/steps.py).
        accumulation = len(work.batches) + (len(work.replay.batches) if work.replay is not None else 0)
        engine = start_engine(work.champion_dir, cfg, accumulation=accumulation, base_dir=work.base_dir)
        carried_from = None
        if cfg.carry_optimizer:
            engine, carried_from = continue_optimizer(
                engine, registry, work.champion, work.champion_dir, cfg, accumulation, work.base_dir
            )
        engine_open.callback(close_engine, engine)
        trained = run_steps(
            engine,
            work.batches,
            cfg,
            loss_function(cfg.loss),
            work.norm,
            mean_advantage=work.mean_advantage,
            replay=work.replay,
            reference=work.reference,
            before_step=lambda step: check_stopping(f"before step {step}"),
            after_step=after_step,
        )
        if cfg.carry_optimizer:
            save_optimizer_state(engine, files.optimizer_dir)
        weights = state_dict(engine)
    check_stopping("before saving")
    checkpoint.save(weights, files.out_dir, work.champion_dir, work.lineage)
    return trained, carried_from


def _train_on_ranks(cfg: TrainerSettings, registry: Registry, work: _Work) -> tuple[Trained, int | None]:
    """The steps of a multi-rank cycle (trainer/ranks.py); rank 0 saves the checkpoint to the
    cycle's ``out_dir``. Returns the steps and the cycle whose optimizer continued."""
    optimizer_from = carried_state(registry, work.champion, cfg) if cfg.carry_optimizer else None
    result = train_on_ranks(
        cfg,
        work.files.ranks_dir,
        batches=work.batches,
        norm=(work.norm.tokens, work.norm.sequences),
        mean_advantage=work.mean_advantage,
        champion_dir=work.champion_dir,
        base_dir=work.base_dir,
        out_dir=work.files.out_dir,
        lineage=work.lineage,
        optimizer_from=None if optimizer_from is None else optimizer_from[0],
        optimizer_to=work.files.optimizer_dir if cfg.carry_optimizer else None,
        reference=work.reference,
        stopping=work.stopping,
    )
    steps = [StepMetrics.model_validate(m) for m in result["steps"]]
    carried = optimizer_from[1] if optimizer_from is not None and result["optimizer_carried"] else None
    return Trained(steps, result["kl_stop"]), carried
