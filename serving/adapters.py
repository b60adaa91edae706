"""LoRA adapters in PEFT's on-disk format, as vLLM loads them at run time (``trainer.adapter=lora``).

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's
``save_pretrained`` layout) and, for a version rtrl trained, ``rtrl_checkpoint.json``. It is a
delta on one base model: every adapter rtrl serves is on ``vllm.model_dir``, the checkpoint the
servers start on, and the fleet's base weights never change in LoRA mode (docs/lora.md).

`write_identity_adapter` makes the adapter a LoRA fleet starts from: A drawn as PEFT draws it
(Kaiming-uniform), B zero, so A·B = 0 and the adapter leaves the base model's outputs exactly as
they are, while a cycle that trains it has a gradient on B. It builds the module shapes on the
meta device: no base weights are read, whatever the model's size.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from serving.errors import AdapterError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def base_model_name(served_model_name: str) -> str:
    """The name a LoRA server serves its base model under: the served name is the adapter's (vLLM
    refuses an adapter named like a base model), so clients reach the base only by asking for it."""
    return f"{served_model_name}-base"


# The values vLLM accepts for --max-lora-rank (vllm/config/lora.py MaxLoRARanks).
SERVER_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def server_max_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that fits adapters of rank `rank`."""
    for allowed in SERVER_MAX_RANKS:
        if rank <= allowed:
            return allowed
    raise AdapterError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank {SERVER_MAX_RANKS[-1]}")


def is_adapter(path: Path) -> bool:
    """True for a PEFT LoRA adapter directory, False for a full HF checkpoint (or anything else)."""
    return (path / ADAPTER_CONFIG).is_file()


def adapter_config(path: Path) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``; AdapterError when it is missing or not a LoRA config."""
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path}: no readable {ADAPTER_CONFIG} ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}/{ADAPTER_CONFIG} is not a LoRA adapter config (peft_type must be LORA)")
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{path} has no {ADAPTER_WEIGHTS}")
    return config


def check_servable(path: Path, max_rank: int) -> None:
    """Raise AdapterError unless the fleet (started with ``--max-lora-rank max_rank``) can load it."""
    rank = int(adapter_config(path).get("r", 0))
    if not 0 < rank <= max_rank:
        raise AdapterError(
            f"{path}: LoRA rank {rank} is above the servers' --max-lora-rank {max_rank} "
            "(trainer.lora.rank sets both; restart the servers after changing it)"
        )


def identity_matches(path: Path, *, rank: int, alpha: int, target_modules: tuple[str, ...]) -> bool:
    """Whether the adapter at `path` has this rank, alpha and target modules (an identity adapter
    written for other settings is written again)."""
    try:
        config = adapter_config(path)
    except AdapterError:
        return False
    return (
        int(config.get("r", 0)) == rank
        and int(config.get("lora_alpha", 0)) == alpha
        and sorted(config.get("target_modules") or []) == sorted(target_modules)
    )


def write_identity_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int,
    alpha: int,
    dropout: float,
    target_modules: tuple[str, ...],
    seed: int = 0,
) -> Path:
    """Write an adapter on `base_dir` whose product A·B is zero (see the module docstring) into
    `out_dir` (replaced; written aside and renamed, so a crash never leaves half an adapter)."""
    import torch
    from accelerate import init_empty_weights
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    base_dir = base_dir.expanduser().resolve()
    config = AutoConfig.from_pretrained(str(base_dir))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_dir),
    )
    try:
        peft_model = get_peft_model(model, lora)
    except ValueError as exc:  # e.g. no module matches target_modules
        raise AdapterError(f"cannot put LoRA on {base_dir}: {exc}") from None
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, meta in sorted(get_peft_model_state_dict(peft_model).items()):
        if ".lora_B." in name:
            weights[name] = torch.zeros(meta.shape, dtype=torch.float32)
        else:  # lora_A: PEFT's default init, kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = 1.0 / math.sqrt(meta.shape[1])
            weights[name] = (torch.rand(meta.shape, generator=generator) * 2 - 1) * bound
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lora.save_pretrained(str(tmp))
    save_file(weights, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
