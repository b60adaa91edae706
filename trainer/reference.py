"""The fixed reference π_ref of the loss' ``ref_kl_coef`` penalty, KL(π_θ ‖ π_ref) (docs/algorithms.md,
Keeping what the model knows).

The champion's penalty (``kl_coef``) pulls each cycle back toward the version it started from, so
every promotion moves its own reference: small drifts, each within the gate's margin, add up over
cycles. π_ref stays put: the version ``trainer.reference`` names, the registry's first (the base,
as ``gate.anchor`` reads ``base``) unless a number is given.

`resolve` runs in the worker, in trainer/cycle.py before the cycle takes the lease: a reference
that is not registered, or whose checkpoint is not one the cycle's mode can load, fails the cycle
there with `ReferenceMissing`, naming the setting, before any episode is claimed. How a rank then
gets π_ref's logprobs (`logprobs`, called by trainer/steps.py `run_steps` before the first optimizer
step; on several ranks each rank for its own micro-batches, trainer/ranks.py), by `Reference.source`:

* ``champion``: the reference is the version the cycle trains from, so π_ref is π_old, the first
  step's own forward passes: nothing loaded, nothing computed twice (every cycle from the base);
* ``adapter_off``: a LoRA cycle whose reference is the registry's base version, the identity adapter
  (``rtrl.base=true``: A·B = 0, docs/lora.md): the engine's own model with its adapter disabled
  (peft's ``disable_adapter``), no second model;
* ``weights``: any other: the reference's checkpoint loaded once per cycle, frozen, in fp32 on CPU
  (trainer/engine.py `load_model`, as the policy), every micro-batch scored without gradient, then
  freed. On CPU so that it never competes with the engine for accelerator memory: a full pass of a
  large model on CPU is slow, one pass per cycle.

The logprobs are the *tempered* ones under each row's own sampling (penalties and temperature, no
truncation; `serving.sampler.TokenLogprobs`), the same as the champion's penalty uses: finite for
every sampled token, those the reference would have truncated included.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from registry import Registry
from schemas.settings import Settings
from serving.sampler import MicroBatch, token_logprobs
from trainer import checkpoint
from trainer.engine import load_model
from trainer.errors import TrainerError

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

log = logging.getLogger(__name__)

Source = Literal["champion", "adapter_off", "weights"]


class ReferenceMissing(TrainerError):
    """``trainer.reference`` names no registered version, or one whose checkpoint the cycle cannot
    load; raised before the cycle takes the lease, so no episode is claimed or charged."""


@dataclass(frozen=True)
class Reference:
    """The cycle's π_ref: its version, how the ranks get its logprobs (see the module docstring),
    and for ``weights`` its checkpoint (an adapter on `base_dir` in a LoRA cycle)."""

    version: int
    source: Source
    directory: Path | None = None
    base_dir: Path | None = None

    def to_job(self) -> dict[str, Any]:
        """As a multi-rank cycle's job carries it (trainer/ranks.py: JSON)."""
        return {
            "version": self.version,
            "source": self.source,
            "directory": None if self.directory is None else str(self.directory),
            "base_dir": None if self.base_dir is None else str(self.base_dir),
        }

    @classmethod
    def from_job(cls, job: dict[str, Any] | None) -> Reference | None:
        if job is None:
            return None
        return cls(
            version=int(job["version"]),
            source=job["source"],
            directory=None if job["directory"] is None else Path(job["directory"]),
            base_dir=None if job["base_dir"] is None else Path(job["base_dir"]),
        )


def reference_version(settings: Settings, registry: Registry) -> int:
    """The version ``trainer.reference`` names: base = the first registered one."""
    named = settings.trainer.reference
    versions = registry.versions()
    version: int | None = int(named) if named != "base" else versions[0] if versions else None
    if version is None or version not in versions:
        raise ReferenceMissing(
            f"trainer.reference={named} names "
            + ("no version" if version is None else f"v{version}")
            + f", which is not registered under {registry.model_name!r}: trainer.loss.ref_kl_coef="
            f"{settings.trainer.loss.ref_kl_coef:g} needs it (set trainer.reference to a registered version, "
            "or ref_kl_coef to 0)"
        )
    return version


def resolve(settings: Settings, registry: Registry, champion: int) -> Reference | None:
    """The cycle's reference (None when ``ref_kl_coef`` is 0: nothing is looked up); its checkpoint
    downloaded and checked when the ranks must load it. Raises `ReferenceMissing`."""
    cfg = settings.trainer
    if cfg.loss.ref_kl_coef == 0:
        return None
    version = reference_version(settings, registry)
    if version == champion:
        return Reference(version, "champion")
    if cfg.adapter == "lora" and registry.version_tags(version).get("rtrl.base") == "true":
        return Reference(version, "adapter_off")
    directory = registry.download_checkpoint(version)
    try:
        checkpoint.check_source(directory, cfg.adapter)
    except checkpoint.CheckpointError as exc:
        raise ReferenceMissing(f"trainer.reference={cfg.reference} (v{version}): {exc}") from None
    base_dir = settings.vllm.model_dir.expanduser().resolve() if cfg.adapter == "lora" else None
    return Reference(version, "weights", directory, base_dir)


def logprobs(
    engine: DeepSpeedEngine, batches: list[MicroBatch], reference: Reference
) -> list[torch.Tensor | None]:
    """π_ref's tempered logprobs of each micro-batch's targets, (B, L−1) on the engine's device, no
    gradient; under ``champion`` a None for each (π_old's, the first step's, take their place)."""
    if reference.source == "champion":
        return [None] * len(batches)
    log.info(
        "KL reference v%d: %d micro-batches scored (%s)",
        reference.version,
        len(batches),
        "adapter disabled" if reference.source == "adapter_off" else f"{reference.directory} on CPU",
    )
    if reference.source == "adapter_off":
        model = engine.module
        if not hasattr(model, "disable_adapter"):
            raise ReferenceMissing(
                f"the reference v{reference.version} is a LoRA base, but the policy has no adapter"
            )
        with torch.no_grad(), model.disable_adapter():
            return [token_logprobs(model, mb.to(engine.device)).tempered for mb in batches]
    assert reference.directory is not None  # `resolve` gives ``weights`` its checkpoint
    frozen = load_model(reference.directory, reference.base_dir, trainable=False).eval()
    try:
        with torch.no_grad():
            return [token_logprobs(frozen, mb.to("cpu")).tempered.to(engine.device) for mb in batches]
    finally:
        del frozen
        gc.collect()
