"""Cycle checkpoints on disk (HF format, safetensors) and the running reward baselines next to them.

A cycle writes ``<checkpoint_dir>/cycle-<id>/``: ``model.safetensors`` with the trained fp32
weights, every non-weight file of the champion's directory (config, generation config, tokenizer,
chat template) copied unchanged, and ``rtrl_checkpoint.json`` with the lineage. vLLM's
``reload_weights`` and ``AutoModelForCausalLM.from_pretrained`` both load it. The directory is
written under a temporary name and renamed, so a crashed save never looks like a checkpoint.

``<checkpoint_dir>/baselines-<reward spec>.json`` holds the per-prompt reward baselines
(trainer/advantages.py) of one reward spec version: rewards of different specs never share a
baseline. A cycle *stages* the baselines it computed (``...cycle-<id>.json``); they are committed
(renamed over the spec's file) only once the cycle's episodes can never train again, i.e. when
the cycle ends promoted or rejected, and discarded when it fails (its episodes go back to the
pool, and a baseline that already holds their rewards would leak them into their own advantages).

`CycleFiles` binds one cycle's id and reward spec to the directory, so that trainer/cycle.py
resolves them once and names a cycle's checkpoint, baselines and optimizer state through it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving import AdapterError
from serving.adapters import ADAPTER_WEIGHTS, adapter_config, is_adapter
from trainer.advantages import BaselineState

if TYPE_CHECKING:
    import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
LINEAGE_FILE = "rtrl_checkpoint.json"


class CheckpointError(RuntimeError):
    """A champion directory that cannot be the base of a cycle, or a checkpoint that did not save."""


def check_source(source_dir: Path, adapter: str = "full") -> None:
    """The champion's directory must be an HF checkpoint (config.json and a tokenizer) or, with
    ``trainer.adapter=lora``, a LoRA adapter."""
    if is_adapter(source_dir) != (adapter == "lora"):
        what = "a LoRA adapter" if is_adapter(source_dir) else "full weights"
        raise CheckpointError(
            f"{source_dir} is {what}, but trainer.adapter={adapter}: a registry's versions are "
            "all adapters or all full weights (docs/lora.md, Choosing the mode)"
        )
    if adapter == "lora":
        try:
            adapter_config(source_dir)
        except AdapterError as exc:
            raise CheckpointError(str(exc)) from None
        return
    if not (source_dir / "config.json").is_file():
        raise CheckpointError(f"{source_dir} has no config.json: not an HF checkpoint")
    if not any((source_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise CheckpointError(f"{source_dir} has no tokenizer files")


def save(state: dict[str, torch.Tensor], out_dir: Path, source_dir: Path, lineage: dict[str, Any]) -> Path:
    """Write the weights + the champion's config/tokenizer + lineage into ``out_dir``; returns it.
    A LoRA adapter (`source_dir` is one) is written the same way, as PEFT's ``adapter_model.safetensors``
    next to the champion's ``adapter_config.json``."""
    from safetensors.torch import save_file

    if out_dir.exists():
        # A retried cycle id (acks_late redelivery) rewrites its own directory from scratch.
        shutil.rmtree(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for path in sorted(source_dir.iterdir()):
        # Not the registry's own marker files (dot files, e.g. a download's ".rtrl-complete").
        if (
            path.is_file()
            and not path.name.startswith(".")
            and not path.name.endswith(WEIGHT_SUFFIXES)
            and path.name not in WEIGHT_INDEXES
        ):
            shutil.copy2(path, tmp / path.name)
    weights = ADAPTER_WEIGHTS if is_adapter(source_dir) else "model.safetensors"
    save_file(state, str(tmp / weights), metadata={"format": "pt"})
    (tmp / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, out_dir)
    return out_dir


def _spec_slug(spec_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in spec_id)


def baselines_path(checkpoint_dir: Path, spec_id: str) -> Path:
    """The committed baselines of reward spec `spec_id` (``name@version``)."""
    return checkpoint_dir / f"baselines-{_spec_slug(spec_id)}.json"


def _staged_path(checkpoint_dir: Path, spec_id: str, cycle_id: int) -> Path:
    return checkpoint_dir / f"baselines-{_spec_slug(spec_id)}.cycle-{cycle_id}.json"


def load_baselines(checkpoint_dir: Path, spec_id: str) -> BaselineState:
    """The committed baselines of `spec_id` (empty before its first committed cycle)."""
    path = baselines_path(checkpoint_dir, spec_id)
    if not path.is_file():
        return BaselineState()
    return BaselineState.from_json(json.loads(path.read_text()))


def stage_baselines(checkpoint_dir: Path, spec_id: str, cycle_id: int, state: BaselineState) -> Path:
    """Write the baselines cycle `cycle_id` computed, to be committed or discarded with the cycle."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    path = _staged_path(checkpoint_dir, spec_id, cycle_id)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state.to_json(), sort_keys=True))
    os.replace(tmp, path)
    return path


def commit_baselines(checkpoint_dir: Path, cycle_id: int) -> list[Path]:
    """Atomically make cycle `cycle_id`'s staged baselines the committed ones; returns those committed."""
    committed = []
    for staged in checkpoint_dir.glob(f"baselines-*.cycle-{cycle_id}.json"):
        target = checkpoint_dir / (staged.name.rsplit(".cycle-", 1)[0] + ".json")
        os.replace(staged, target)
        committed.append(target)
    return committed


def discard_baselines(checkpoint_dir: Path, cycle_id: int) -> None:
    """Drop cycle `cycle_id`'s staged baselines (the committed ones stay as they were)."""
    for staged in checkpoint_dir.glob(f"baselines-*.cycle-{cycle_id}.json"):
        staged.unlink(missing_ok=True)


# ---- optimizer state carried across cycles ---------------------------------------------------------

OPTIMIZER_DIR = "optimizer"
OPTIMIZER_META = "rtrl_optimizer.json"


def optimizer_dir(checkpoint_dir: Path, cycle_id: int) -> Path:
    """Where cycle `cycle_id` keeps its optimizer state (on the worker's disk, not in the registry)."""
    return checkpoint_dir / OPTIMIZER_DIR / f"cycle-{cycle_id}"


def optimizer_meta(directory: Path) -> dict[str, Any] | None:
    """What a saved optimizer state was trained with (None when there is none, or it is unreadable)."""
    try:
        meta = json.loads((directory / OPTIMIZER_META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def write_optimizer_meta(directory: Path, meta: dict[str, Any]) -> None:
    (directory / OPTIMIZER_META).write_text(json.dumps(meta, sort_keys=True))


def prune_optimizer_states(checkpoint_dir: Path, keep: int) -> None:
    """Keep the optimizer states of the `keep` newest cycles: the champion is the newest cycle's
    output after a promotion, or an older one after a rejection or a rollback."""
    root = checkpoint_dir / OPTIMIZER_DIR
    if not root.is_dir():
        return
    cycles = sorted(
        (p for p in root.iterdir() if p.name.startswith("cycle-") and p.name[6:].isdigit()),
        key=lambda p: int(p.name[6:]),
    )
    for old in cycles[:-keep] if keep > 0 else cycles:
        shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class CycleFiles:
    """Where cycle `cycle_id` keeps its files under ``trainer.checkpoint_dir`` (`root`): its
    checkpoint, the baselines it stages under reward spec `spec_id`, its optimizer state and its
    ranks' work directory. Resolved once per cycle."""

    root: Path
    spec_id: str
    cycle_id: int

    @property
    def out_dir(self) -> Path:
        """The cycle's checkpoint (`save`), the directory its registered version is uploaded from."""
        return self.root / f"cycle-{self.cycle_id}"

    @property
    def optimizer_dir(self) -> Path:
        """Where the cycle saves its optimizer state (`optimizer_dir`)."""
        return optimizer_dir(self.root, self.cycle_id)

    @property
    def ranks_dir(self) -> Path:
        """The work directory of a multi-rank cycle's rank processes (trainer/ranks.py)."""
        return self.root / "ranks" / f"cycle-{self.cycle_id}"

    def load_baselines(self) -> BaselineState:
        """The committed baselines of the cycle's reward spec (`load_baselines`)."""
        return load_baselines(self.root, self.spec_id)

    def stage_baselines(self, state: BaselineState) -> Path:
        """Stage the baselines the cycle computed (`stage_baselines`)."""
        return stage_baselines(self.root, self.spec_id, self.cycle_id, state)

    def keep_optimizer_state(self, meta: dict[str, Any], keep: int) -> None:
        """Record what the optimizer state saved to `optimizer_dir` was trained with, and keep the
        `keep` newest cycles' states (`prune_optimizer_states`)."""
        write_optimizer_meta(self.optimizer_dir, meta)
        prune_optimizer_states(self.root, keep)
