"""The DeepSpeed side of a training cycle: batches of token rows, the engine, log π_θ of sampled tokens.

Used by trainer/cycle.py inside the long-lived Celery worker process (one process, no launcher):
DeepSpeed reads its rank and rendezvous from the environment, so `_single_process_env` sets
DS_ACCELERATOR / RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT before deepspeed is
imported or initialised (docs/platform.md, DeepSpeed on CPU). The process group is created once
per process; each cycle builds a fresh engine on the champion's weights and `close_engine` frees
it, so the next cycle's `deepspeed.initialize` in the same worker starts clean.

A *row* is one trainable segment: prompt + completion token ids, the behaviour logprobs of the
completion tokens and the advantage of its episode. Non-trainable segments (PARL sub-agents) never
become rows, so their tokens carry no gradient.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.settings import TrainerSettings


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _single_process_env() -> None:
    """Make this process rank 0 of a world of 1 on the CPU accelerator (unless told otherwise), with
    DeepSpeed's JIT-built ops in this installation's own cache (see `prebuild_ops`)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # A free port per process: two workers (or a test and a worker) on one host must not collide.
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


# Before torch/transformers: transformers imports deepspeed when it is installed.
_single_process_env()

import torch  # noqa: E402

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def precision(cfg: TrainerSettings) -> str:
    """fp32 or bf16 for this cycle (``trainer.precision``; auto = bf16 when DeepSpeed's accelerator
    is a GPU, ``DS_ACCELERATOR=cuda``; the trainer defaults to the CPU accelerator)."""
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16" if os.environ.get("DS_ACCELERATOR") == "cuda" else "fp32"


def ds_config(cfg: TrainerSettings, micro_batch: int, accumulation: int) -> dict[str, Any]:
    """DeepSpeed config: precision, ZeRO stage and offload from the settings; AdamW (torch's
    implementation unless the optimizer state is offloaded, which needs DeepSpeed's CPU Adam)."""
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.offload == "cpu":
        if cfg.zero_stage == 0:
            raise ValueError(
                "trainer.offload=cpu needs trainer.zero_stage >= 1 (ZeRO partitions what it offloads)"
            )
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if cfg.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    bf16 = precision(cfg) == "bf16"
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        # DeepSpeed checks micro-batch x accumulation x data-parallel ranks (trainer/ranks.py).
        "train_batch_size": micro_batch * accumulation * int(os.environ.get("WORLD_SIZE", "1")),
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.learning_rate,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.0,
                "torch_adam": cfg.offload == "none",
            },
        },
        "zero_optimization": zero,
        "fp16": {"enabled": False},
        "bf16": {"enabled": bf16},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def start_engine(
    model_dir: Path, cfg: TrainerSettings, accumulation: int, base_dir: Path | None = None
) -> DeepSpeedEngine:
    """Load the HF checkpoint in fp32 and wrap it in a DeepSpeed engine for one cycle. With
    `base_dir`, `model_dir` is a LoRA adapter on that base: the base is frozen and only the
    adapter's matrices train (``trainer.adapter=lora``, docs/lora.md)."""
    _single_process_env()
    import deepspeed

    if not torch.distributed.is_initialized() and os.environ.get("WORLD_SIZE", "1") == "1":
        # A world of one: the rendezvous port is private to this process, so take one that is free
        # now. An inherited MASTER_PORT may be the parent's own process group (a test run that
        # trains in-process and then starts a worker), which fails with EADDRINUSE. (The ranks of
        # a multi-rank cycle rendezvous at the port their launcher gave them: trainer/ranks.py.)
        os.environ["MASTER_PORT"] = str(_free_port())
    torch.manual_seed(cfg.seed)
    model = load_model(model_dir, base_dir, trainable=True)
    model.train()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config(cfg, cfg.micro_batch, accumulation),
    )
    return engine


def load_model(model_dir: Path, base_dir: Path | None, *, trainable: bool) -> torch.nn.Module:
    """A checkpoint as the trainer loads it, in fp32 on CPU: full weights from `model_dir`, or with
    `base_dir` the LoRA adapter in `model_dir` on that base (its matrices trainable if `trainable`).
    The policy of a cycle (`start_engine`), the hindsight teacher and the fixed KL reference
    (trainer/hindsight.py, trainer/reference.py) all load through it."""
    from transformers import AutoModelForCausalLM

    if base_dir is None:
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return model
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    adapter: torch.nn.Module = PeftModel.from_pretrained(base, str(model_dir), is_trainable=trainable)
    return adapter


OPTIMIZER_TAG = "state"


def save_optimizer_state(engine: DeepSpeedEngine, directory: Path) -> None:
    """The engine's optimizer state (and its module weights, which DeepSpeed saves with it) under
    `directory`, for the next cycle that trains from these weights (`load_optimizer_state`)."""
    engine.save_checkpoint(str(directory), tag=OPTIMIZER_TAG, save_latest=False)


def load_optimizer_state(engine: DeepSpeedEngine, directory: Path) -> None:
    """Continue the optimizer saved by `save_optimizer_state` (Adam's moments and step count; each
    step's learning rate is set by trainer/steps.py `run_steps`). The module weights saved alongside are the ones the engine
    was built from (the cycle that saved them produced this champion). Raises on any mismatch."""
    path, _ = engine.load_checkpoint(
        str(directory),
        tag=OPTIMIZER_TAG,
        load_optimizer_states=True,
        load_lr_scheduler_states=False,
        load_module_strict=True,
    )
    if path is None:
        raise FileNotFoundError(f"no optimizer state under {directory}")


def _torch_optimizer(engine: DeepSpeedEngine) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's wrappers (ZeRO keeps the real one as ``.optimizer``)."""
    optimizer: Any = engine.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"no torch optimizer under {type(engine.optimizer).__name__}")
    return optimizer


def optimizer_steps(engine: DeepSpeedEngine) -> int:
    """Steps the engine's optimizer has taken over its life (carried ones included): Adam's own
    step count, 0 for a fresh optimizer."""
    counts = [state["step"] for state in _torch_optimizer(engine).state.values() if "step" in state]
    return int(max(float(c) for c in counts)) if counts else 0


def set_lr(engine: DeepSpeedEngine, lr: float) -> None:
    """The learning rate of the engine's next optimizer step."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


def warmup_lr(lr: float, step: int, warmup_steps: int) -> float:
    """The learning rate of the optimizer's `step`-th step (1-based) under a linear warm-up of
    `warmup_steps` (``trainer.warmup_steps``; 0: none)."""
    return lr if warmup_steps <= 0 else lr * min(1.0, step / warmup_steps)


def close_engine(engine: DeepSpeedEngine) -> None:
    """Free the engine's model and optimizer state; the process group stays for the next cycle."""
    engine.destroy()
    del engine
    gc.collect()


def state_dict(engine: DeepSpeedEngine) -> dict[str, torch.Tensor]:
    """Full fp32 weights on CPU, gathered from ZeRO-3 partitions when needed. Owned copies. For a
    LoRA engine only the adapter's weights, named as PEFT saves them."""
    import deepspeed

    model = engine.module
    params = list(model.parameters())
    gather = (
        deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        if engine.zero_optimization_stage() == 3
        else contextlib.nullcontext()
    )
    with gather:
        full = {
            name: t.detach().to("cpu", torch.float32).contiguous().clone()
            for name, t in model.state_dict().items()
        }
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        return dict(get_peft_model_state_dict(model, state_dict=full))
    return full


def grad_norm_before_step(engine: DeepSpeedEngine) -> float | None:
    """Global gradient norm of the accumulated gradients, before clipping, at stage 0.

    Call after the last backward of a step and before `engine.step()`. DeepSpeed's own
    `get_global_grad_norm` answers only where ZeRO computes the norm (stages 1-3); stage 0 keeps
    plain `.grad` tensors, so the norm is taken here. None at stages 1-3.
    """
    if engine.zero_optimization_stage() != 0:
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else None


def grad_norm_after_step(engine: DeepSpeedEngine) -> float | None:
    """DeepSpeed's global gradient norm of the last optimizer step (ZeRO stages 1-3)."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def prebuild_ops() -> None:
    """Compile (or load) DeepSpeed's CPU shared-memory comm op, one process of this host at a time.

    `deepspeed.initialize` builds it on first use (minutes on a loaded 2-core machine), so
    infra/install.sh and every `rtrl worker` at start-up call this first. The op lives in this
    installation's own cache, ``TORCH_EXTENSIONS_DIR`` (default ``<venv>/torch-extensions``): in
    the shared ``~/.cache/torch_extensions`` each checkout rebuilt it against its own paths.

    torch guards a build with a ``lock`` file in the op's directory and waits, without end, for it
    to disappear; a worker killed while building or loading the op leaves it behind. This runs
    under an flock (released by the kernel when its holder dies), so a ``lock`` file found then is
    such a leftover: it is removed before the build.
    """
    import fcntl
    import logging

    from deepspeed.comm.torch import build_shm_op

    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    root.mkdir(parents=True, exist_ok=True)
    with (root / "rtrl-build.lock").open("a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            for stale in root.glob("*/lock"):  # <root>/<op>/lock
                logging.getLogger(__name__).warning("removing %s, left by a build that was killed", stale)
                stale.unlink(missing_ok=True)
            build_shm_op()
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
