"""The optimizer state carried across cycles (``trainer.carry_optimizer``).

A cycle saves its AdamW state on the worker's disk (trainer/checkpoint.py, ``optimizer/cycle-<id>``,
with what it was trained with); the next cycle continues it when its champion is that cycle's
output and the state matches (ZeRO stage, precision, mode, ranks, hosts), else starts a fresh optimizer.
Used by trainer/cycle.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry import Registry
from schemas.settings import TrainerSettings
from trainer import checkpoint
from trainer.engine import close_engine, load_optimizer_state, precision, start_engine

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

log = logging.getLogger(__name__)


def state_meta(cfg: TrainerSettings) -> dict[str, Any]:
    """What a saved optimizer state must match to be continued."""
    return {
        "zero_stage": cfg.zero_stage,
        "precision": precision(cfg),
        "adapter": cfg.adapter,
        "ranks": cfg.ranks,
        # Only when several: the states that single-host workers kept before trainer.nodes still match.
        **({"nodes": cfg.nodes} if cfg.nodes > 1 else {}),
    }


def carried_state(registry: Registry, champion: int, cfg: TrainerSettings) -> tuple[Path, int] | None:
    """The saved optimizer state of the cycle that produced the champion (and that cycle), when this
    worker kept it and it matches (ZeRO stage, precision, mode, ranks); None: a fresh optimizer."""
    source = registry.version_tags(champion).get("rtrl.cycle_id", "")
    if not source.isdigit():
        return None  # the base model, or a version registered by hand
    directory = checkpoint.optimizer_dir(cfg.checkpoint_dir, int(source))
    meta = checkpoint.optimizer_meta(directory)
    if meta != state_meta(cfg):
        log.info(
            "v%d: %s; a fresh optimizer",
            champion,
            f"no optimizer state of cycle {source} on this worker"
            if meta is None
            else f"the optimizer state of cycle {source} is for {meta}, not {state_meta(cfg)}",
        )
        return None
    return directory, int(source)


def continue_optimizer(
    engine: DeepSpeedEngine,
    registry: Registry,
    champion: int,
    champion_dir: Path,
    cfg: TrainerSettings,
    accumulation: int,
    base_dir: Path | None,
) -> tuple[DeepSpeedEngine, int | None]:
    """The engine with the optimizer state of the cycle that produced the champion (`carried_state`),
    or the fresh engine. Never fails the cycle: a state that does not load is logged and a fresh
    engine is used."""
    found = carried_state(registry, champion, cfg)
    if found is None:
        return engine, None
    directory, source = found
    try:
        load_optimizer_state(engine, directory)
    except Exception:  # noqa: BLE001 - a damaged state must not stop training: start fresh instead
        log.exception(
            "v%d: the optimizer state of cycle %s does not load; a fresh optimizer", champion, source
        )
        close_engine(engine)
        return start_engine(champion_dir, cfg, accumulation=accumulation, base_dir=base_dir), None
    log.info("v%d: continuing the optimizer state of cycle %s", champion, source)
    return engine, source
