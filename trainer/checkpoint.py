"""Cycle checkpoints on disk (HF format, safetensors) and the running reward baselines next to them.

A cycle writes ``<checkpoint_dir>/cycle-<id>/``: ``model.safetensors`` with the trained fp32
weights, every non-weight file of the champion's directory (config, generation config, tokenizer,
chat template) copied unchanged, and ``rtrl_checkpoint.json`` with the lineage. vLLM's
``reload_weights`` and ``AutoModelForCausalLM.from_pretrained`` both load it. The directory is
written under a temporary name and renamed, so a crashed save never looks like a checkpoint.

``<checkpoint_dir>/baselines.json`` holds the per-prompt reward baselines (trainer/advantages.py);
the cycle rewrites it atomically after its model version is registered.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.advantages import BaselineState

if TYPE_CHECKING:
    import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
LINEAGE_FILE = "rtrl_checkpoint.json"
BASELINES_FILE = "baselines.json"


class CheckpointError(RuntimeError):
    """A champion directory that cannot be the base of a cycle, or a checkpoint that did not save."""


def check_source(source_dir: Path) -> None:
    """The champion's directory must be an HF checkpoint: config.json and a tokenizer."""
    if not (source_dir / "config.json").is_file():
        raise CheckpointError(f"{source_dir} has no config.json: not an HF checkpoint")
    if not any((source_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise CheckpointError(f"{source_dir} has no tokenizer files")


def save(state: dict[str, torch.Tensor], out_dir: Path, source_dir: Path, lineage: dict[str, Any]) -> Path:
    """Write the weights + the champion's config/tokenizer + lineage into ``out_dir``; returns it."""
    from safetensors.torch import save_file

    if out_dir.exists():
        # A retried cycle id (acks_late redelivery) rewrites its own directory from scratch.
        shutil.rmtree(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for path in sorted(source_dir.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name not in WEIGHT_INDEXES:
            shutil.copy2(path, tmp / path.name)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, out_dir)
    return out_dir


def load_baselines(checkpoint_dir: Path) -> BaselineState:
    path = checkpoint_dir / BASELINES_FILE
    if not path.is_file():
        return BaselineState()
    return BaselineState.from_json(json.loads(path.read_text()))


def save_baselines(checkpoint_dir: Path, state: BaselineState) -> Path:
    """Atomically replace baselines.json."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_dir / BASELINES_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state.to_json(), sort_keys=True))
    os.replace(tmp, path)
    return path
