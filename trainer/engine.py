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
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.events import SamplingParams
from schemas.sampling import is_greedy
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


@dataclass(frozen=True)
class Sampling:
    """What vLLM did to the logits before drawing a segment's tokens (schemas/sampling.py): the
    trainer applies the same to compute π_old and π_θ, so they compare with the behaviour logprobs.
    Greedy segments are recorded as temperature 1 without truncation, as vLLM reports them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @classmethod
    def of(cls, params: SamplingParams) -> Sampling:
        penalties = cls(repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
                        frequency_penalty=params.frequency_penalty)  # fmt: skip
        if is_greedy(params):  # vLLM applies the penalties to greedy requests too, nothing else
            return penalties
        return replace(penalties, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
                       min_p=params.min_p)  # fmt: skip

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class Row:
    """One trainable segment as the trainer feeds it to the model."""

    input_ids: list[int]  # prompt + completion
    prompt_len: int
    behaviour_logprobs: list[float]  # one per completion token
    advantage: float
    sampling: Sampling = Sampling()


@dataclass(frozen=True)
class MicroBatch:
    """Padded tensors of a few rows, aligned to next-token targets (position t predicts t + 1)."""

    input_ids: torch.Tensor  # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    targets: torch.Tensor  # (B, L−1) input_ids[:, 1:]
    mask: torch.Tensor  # (B, L−1) 1.0 on completion-token targets
    behaviour_logprobs: torch.Tensor  # (B, L−1) log μ at completion targets, 0 elsewhere
    advantages: torch.Tensor  # (B,)
    temperature: torch.Tensor  # (B,) per row, as `Sampling`
    top_p: torch.Tensor  # (B,)
    top_k: torch.Tensor  # (B,) long, 0 = none
    min_p: torch.Tensor  # (B,)
    repetition_penalty: torch.Tensor  # (B,)
    presence_penalty: torch.Tensor  # (B,)
    frequency_penalty: torch.Tensor  # (B,)
    prompt_len: torch.Tensor  # (B,) long

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())

    def to(self, device: Any) -> MicroBatch:
        """The same micro-batch on `device` (the engine's)."""
        return MicroBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def collate(rows: list[Row], pad_id: int) -> MicroBatch:
    """Right-pad rows into one micro-batch."""
    width = max(len(r.input_ids) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width - 1))
    behaviour = torch.zeros((n, width - 1))
    for i, row in enumerate(rows):
        length = len(row.input_ids)
        completion = length - row.prompt_len
        if row.prompt_len < 1 or completion != len(row.behaviour_logprobs):
            raise ValueError(f"row {i}: prompt {row.prompt_len}, completion {completion}, "
                             f"{len(row.behaviour_logprobs)} behaviour logprobs")
        input_ids[i, :length] = torch.tensor(row.input_ids)
        attention[i, :length] = 1
        # Completion token k sits at position prompt_len + k and is predicted from position − 1.
        start = row.prompt_len - 1
        mask[i, start : start + completion] = 1.0
        behaviour[i, start : start + completion] = torch.tensor(row.behaviour_logprobs)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        targets=input_ids[:, 1:],
        mask=mask,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        temperature=torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float32),
        top_p=torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float32),
        top_k=torch.tensor([r.sampling.top_k for r in rows], dtype=torch.long),
        min_p=torch.tensor([r.sampling.min_p for r in rows], dtype=torch.float32),
        repetition_penalty=torch.tensor([r.sampling.repetition_penalty for r in rows], dtype=torch.float32),
        presence_penalty=torch.tensor([r.sampling.presence_penalty for r in rows], dtype=torch.float32),
        frequency_penalty=torch.tensor([r.sampling.frequency_penalty for r in rows], dtype=torch.float32),
        prompt_len=torch.tensor([r.prompt_len for r in rows], dtype=torch.long),
    )


def micro_batches(rows: list[Row], size: int, pad_id: int) -> list[MicroBatch]:
    """Rows sorted by length (less padding) and cut into micro-batches of at most ``size``."""
    ordered = sorted(rows, key=lambda r: len(r.input_ids))
    return [collate(ordered[i : i + size], pad_id) for i in range(0, len(ordered), size)]


def apply_penalties(logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
    """(B, L−1, V) logits with each row's penalties applied as vLLM applies them before sampling
    (vllm/model_executor/layers/utils.py `apply_penalties`): position t predicts token t + 1, and
    the tokens generated so far are the completion tokens at positions prompt_len..t. Repetition
    penalty p on every token seen in the prompt or generated so far (a positive logit divided by
    p, a negative one multiplied); then minus frequency x its count in the output so far and minus
    presence where that count is > 0. Rows without penalties are left as they are; the scaling
    factors are taken on detached values, the gradient flows through the logits."""
    if not bool((batch.repetition_penalty != 1).any() | (batch.presence_penalty != 0).any()
                | (batch.frequency_penalty != 0).any()):  # fmt: skip
        return logits
    rows, positions, vocab = logits.shape
    with torch.no_grad():
        index = torch.arange(batch.input_ids.shape[1], device=logits.device)[None, :]  # (1, L)
        generated = (index >= batch.prompt_len[:, None]) & (batch.attention_mask > 0)  # (B, L)
        one_hot = logits.new_zeros(rows, batch.input_ids.shape[1], vocab)
        one_hot.scatter_(-1, batch.input_ids.unsqueeze(-1).clamp(max=vocab - 1), generated.unsqueeze(-1).float())
        counts = one_hot.cumsum(dim=1)[:, :positions]  # (B, L−1, V) output tokens up to position t
        prompt = one_hot.new_zeros(rows, vocab)
        in_prompt = (index < batch.prompt_len[:, None]) & (batch.attention_mask > 0)
        prompt.scatter_add_(-1, batch.input_ids.clamp(max=vocab - 1), in_prompt.float())
        seen = (counts > 0) | (prompt[:, None, :] > 0)  # (B, L−1, V)
        p = batch.repetition_penalty[:, None, None]
        scale = torch.where(seen, torch.where(logits > 0, 1 / p, p), torch.ones_like(logits))
        shift = batch.frequency_penalty[:, None, None] * counts + batch.presence_penalty[:, None, None] * (counts > 0)
    return logits * scale - shift


def processed_log_softmax(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities of (B, T, V) logits as vLLM's sampler draws from them, per row: divided by
    the temperature, then min-p, top-k and top-p truncation (a truncated token gets −inf), then
    log-softmax. The same steps and tie rules as vllm/v1/sample (sampler.py, topk_topp_sampler.py,
    logits_processor/builtin.py MinP): top-k keeps every logit ≥ the k-th largest; top-p drops the
    least likely tokens while their cumulative probability stays ≤ 1 − p, always keeping the
    most likely. The truncation masks are taken on detached values; the gradient flows through
    the logits of the kept tokens."""
    logits = logits.float() / temperature[:, None, None]
    vocab = logits.shape[-1]
    if bool((min_p > 0).any()):
        with torch.no_grad():
            probs = logits.softmax(dim=-1)
            drop = probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None, None]
        logits = logits.masked_fill(drop, float("-inf"))
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        with torch.no_grad():
            ascending, order = logits.sort(dim=-1)
            k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # (B,)
            kth = ascending.gather(-1, (vocab - k)[:, None, None].expand(*ascending.shape[:2], 1))
            drop = ascending < kth
            if bool((top_p < 1).any()):
                cumulative = ascending.masked_fill(drop, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
                tail = cumulative <= (1 - top_p)[:, None, None]
                tail[..., -1] = False  # the most likely token always stays
                drop |= tail
            drop = torch.zeros_like(drop).scatter(-1, order, drop)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def token_logprobs(model: Any, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π_θ(target_t | tokens ≤ t) under each row's sampling (`apply_penalties`, then
    `processed_log_softmax`), and
    where that is possible), both (B, L−1). A target the row's truncation excludes has
    probability 0: its logprob is returned as 0 with `possible` False, so that it can be masked
    out of a loss without producing NaN. The logprobs carry the gradient."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, L, V)
    penalised = apply_penalties(logits[:, :-1].float(), batch)
    logp = processed_log_softmax(penalised, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    chosen = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)  # (B, L−1)
    possible = torch.isfinite(chosen.detach())
    return torch.where(possible, chosen, torch.zeros_like(chosen)), possible


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
            raise ValueError("trainer.offload=cpu needs trainer.zero_stage >= 1 (ZeRO partitions what it offloads)")
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
            "params": {"lr": cfg.learning_rate, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                       "torch_adam": cfg.offload == "none"},
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
    from transformers import AutoModelForCausalLM

    if not torch.distributed.is_initialized() and os.environ.get("WORLD_SIZE", "1") == "1":
        # A world of one: the rendezvous port is private to this process, so take one that is free
        # now. An inherited MASTER_PORT may be the parent's own process group (a test run that
        # trains in-process and then starts a worker), which fails with EADDRINUSE. (The ranks of
        # a multi-rank cycle rendezvous at the port their launcher gave them: trainer/ranks.py.)
        os.environ["MASTER_PORT"] = str(_free_port())
    torch.manual_seed(cfg.seed)
    model: torch.nn.Module
    if base_dir is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(model_dir), is_trainable=True)
    model.train()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config(cfg, cfg.micro_batch, accumulation),
    )
    return engine


OPTIMIZER_TAG = "state"


def save_optimizer_state(engine: DeepSpeedEngine, directory: Path) -> None:
    """The engine's optimizer state (and its module weights, which DeepSpeed saves with it) under
    `directory`, for the next cycle that trains from these weights (`load_optimizer_state`)."""
    engine.save_checkpoint(str(directory), tag=OPTIMIZER_TAG, save_latest=False)


def load_optimizer_state(engine: DeepSpeedEngine, directory: Path, lr: float) -> None:
    """Continue the optimizer saved by `save_optimizer_state` (Adam's moments and step count),
    with this cycle's learning rate. The module weights saved alongside are the ones the engine
    was built from (the cycle that saved them produced this champion). Raises on any mismatch."""
    path, _ = engine.load_checkpoint(
        str(directory), tag=OPTIMIZER_TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
        load_module_strict=True,
    )  # fmt: skip
    if path is None:
        raise FileNotFoundError(f"no optimizer state under {directory}")
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


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
        full = {name: t.detach().to("cpu", torch.float32).contiguous().clone() for name, t in model.state_dict().items()}
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
