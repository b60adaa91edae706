"""The optimizer steps of one training cycle, on one rank or on each of several.

`run_steps` is the inner loop of trainer/cycle.py: every step runs forward and backward over the
cycle's micro-batches (π_old from the first step's forward passes), stops at the trust region,
and steps the optimizer once. It runs in the worker process for a world of one, and in each rank
process of a multi-rank cycle (trainer/ranks.py). With more than one rank each rank takes every
world-th micro-batch (`rank_batches`); DeepSpeed averages the ranks' gradients, so each rank's loss
is scaled by the world size to keep the step's loss a sum over all of the cycle's tokens; the
step's sums are all-reduced before the trust-region decision, so every rank decides the same.

With a fixed KL reference (``trainer.loss.ref_kl_coef`` > 0, trainer/reference.py), π_ref's
logprobs of this rank's micro-batches are computed once, without gradient, before the first step,
and every step reports the mean KL(π_θ ‖ π_ref) of its forward passes (``ref_kl_k1``, ``ref_kl_k3``).

The first step also measures how far the trainer's π_old is from the behaviour logprobs μ that vLLM
reported, token by token, before any clipping (`Mismatch`): the check that the trainer reproduces
the sampler (temperature, truncation, penalties) and the engines' numerics agree. It goes into
the first step's metrics, the cycle's MLflow run and the worker's Prometheus gauges.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, Field

from schemas.settings import TrainerSettings
from serving.sampler import MicroBatch, TokenLogprobs, token_logprobs
from trainer.engine import grad_norm_after_step, grad_norm_before_step, optimizer_steps, set_lr, warmup_lr
from trainer.losses import LossFn, LossOutput, Normaliser, TokenBatch, beyond_trust_region
from trainer.reference import Reference
from trainer.reference import logprobs as reference_logprobs
from trainer.replay import ReplayBatches, replay_loss

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


class StepMetrics(BaseModel):
    """What one optimizer step saw, averaged over its trainable tokens."""

    step: int
    loss: float = Field(
        description="The policy objective (the replay term, weight × replay_nll, not included)."
    )
    mean_ratio: float = Field(description="Mean π_θ/π_old over tokens (1.0 on the first step).")
    clip_fraction: float = Field(description="Fraction of tokens whose ratio is outside the clip range.")
    kl_k1: float = Field(description="k1 estimate of KL(π_old ‖ π_θ): mean of −log(π_θ/π_old).")
    kl_k3: float = Field(
        0.0,
        description="k3 estimate of KL(π_old ‖ π_θ): mean of r − 1 − log r, r = π_θ/π_old "
        "(≥ 0; what trainer.max_kl is compared with).",
    )
    ref_kl_k1: float | None = Field(
        None,
        description="k1 estimate of KL(π_θ ‖ π_ref), π_ref the fixed reference (trainer.reference): mean of "
        "log(π_θ/π_ref) over the kl_tokens; at the first step the champion's own distance from it. None "
        "without trainer.loss.ref_kl_coef.",
    )
    ref_kl_k3: float | None = Field(
        None,
        description="k3 estimate of KL(π_θ ‖ π_ref): mean of r − 1 − log r, r = π_ref/π_θ (≥ 0). None without "
        "trainer.loss.ref_kl_coef.",
    )
    is_weight: float = Field(description="Mean truncated behaviour weight min(π_old/μ, C).")
    grad_norm: float | None = Field(description="Global gradient norm before clipping.")
    mean_advantage: float
    tokens: int
    impossible_tokens: int = Field(
        0,
        description="Sampled tokens outside their row's truncation (top-p/top-k/min-p) under π_old or π_θ: "
        "left out of the loss.",
    )
    kl_tokens: int = Field(
        0,
        description="Sampled tokens the KL estimates cover: every trainable completion token, "
        "those outside the nucleus included (tempered logprobs).",
    )
    mismatch: dict[str, float] | None = Field(
        None,
        description="First step only: the raw ratio π_old/μ per token before clipping (`Mismatch`): "
        "tokens, share outside [0.9, 1.1], mean, min, max, mean |log ratio|, share per bin (bin_<lo>_<hi>).",
    )
    lr: float | None = Field(None, description="Learning rate of this step's update (trainer.warmup_steps).")
    replay_nll: float | None = Field(
        None,
        description="Mean token NLL of the cycle's replay completions under this step's weights, before its "
        "update (trainer.replay; None without replay).",
    )
    replay_tokens: int = Field(0, description="Replay completion tokens scored in this step.")
    applied: bool = Field(
        True,
        description="False: the trust region stopped the cycle here (trainer.max_kl); this "
        "step's forward passes were measured and its update was not applied.",
    )


@dataclass(frozen=True)
class Trained:
    """What the steps did: one record per step run, and the step the trust region stopped at."""

    steps: list[StepMetrics]
    kl_stop: int | None


# Bins of the raw ratio π_old/μ reported by `Mismatch` (a token lands in [lo, hi)).
MISMATCH_EDGES = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.01, 1.05, 1.1, 1.25, 2.0, math.inf)
MISMATCH_BAND = (0.9, 1.1)


class Mismatch:
    """The raw, pre-clip ratio π_old/μ of every trainable token of a step, as sums that add up
    across micro-batches and ranks (so the distribution is reported as bins, not quantiles).

    Tokens outside the trainer's truncation under π_old are counted by ``impossible_tokens``
    instead: they have no ratio. A trainer that does not reproduce vLLM's truncation multiplies
    every ratio by the kept mass; with the sampler reproduced, tokens outside [0.9, 1.1] come
    only from the two engines' numerics (docs/algorithms.md, Truncated sampling)."""

    def __init__(self) -> None:
        self.sums = {"tokens": 0.0, "outside": 0.0, "ratio": 0.0, "abs_log": 0.0}
        self.bins = [0.0] * (len(MISMATCH_EDGES) - 1)
        self.low, self.high = math.inf, -math.inf

    def add(self, old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> None:
        with torch.no_grad():
            log_ratio = (old - behaviour)[mask > 0].double()
            if log_ratio.numel() == 0:
                return
            ratio = log_ratio.exp()
            self.sums["tokens"] += float(ratio.numel())
            self.sums["outside"] += float(((ratio < MISMATCH_BAND[0]) | (ratio > MISMATCH_BAND[1])).sum())
            self.sums["ratio"] += float(ratio.sum())
            self.sums["abs_log"] += float(log_ratio.abs().sum())
            self.low, self.high = min(self.low, float(ratio.min())), max(self.high, float(ratio.max()))
            edges = torch.tensor(MISMATCH_EDGES[1:-1], dtype=ratio.dtype, device=ratio.device)
            counts = torch.bincount(torch.bucketize(ratio, edges, right=True), minlength=len(self.bins))
            self.bins = [b + float(c) for b, c in zip(self.bins, counts.tolist(), strict=True)]

    def reduce(self) -> None:
        """Add up every rank's sums (a no-op in a world of one)."""
        if world()[1] == 1:
            return
        keys = sorted(self.sums)
        summed = torch.tensor(
            [self.sums[k] for k in keys] + self.bins, dtype=torch.float64, device=collective_device()
        )
        torch.distributed.all_reduce(summed)
        values = summed.tolist()
        self.sums, self.bins = dict(zip(keys, values[: len(keys)], strict=True)), values[len(keys) :]
        extremes = torch.tensor([-self.low, self.high], dtype=torch.float64, device=collective_device())
        torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
        self.low, self.high = -float(extremes[0]), float(extremes[1])

    def metrics(self) -> dict[str, float]:
        n = self.sums["tokens"]
        if n == 0:
            return {"tokens": 0.0}
        out = {
            "tokens": n,
            "outside_0.9_1.1": self.sums["outside"] / n,
            "ratio_mean": self.sums["ratio"] / n,
            "ratio_min": self.low,
            "ratio_max": self.high,
            "abs_log_ratio_mean": self.sums["abs_log"] / n,
        }
        for (lo, hi), count in zip(itertools.pairwise(MISMATCH_EDGES), self.bins, strict=True):
            out[f"bin_{lo:g}_{hi:g}"] = count / n
        return out


def mlflow_metrics(metrics: StepMetrics) -> dict[str, float]:
    """A step's metrics as MLflow takes them: flat numbers (the mismatch's as ``mismatch_<key>``)."""
    flat = metrics.model_dump(exclude={"step", "mismatch"}, exclude_none=True)
    flat |= {f"mismatch_{key}": value for key, value in (metrics.mismatch or {}).items()}
    return flat


def collective_device() -> torch.device:
    """Where a tensor for a collective must live: NCCL (DeepSpeed's backend on GPUs, also in a world
    of one) reduces CUDA tensors only; gloo and DeepSpeed's CPU backend take CPU tensors."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world() -> tuple[int, int]:
    """(rank, world size) of this process (0, 1 without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def rank_batches(batches: list[MicroBatch], rank: int, size: int) -> list[MicroBatch]:
    """Rank `rank`'s share of the cycle's micro-batches: every `size`-th one from `rank`, padded
    with fully masked copies so that every rank runs the same number (DeepSpeed's ranks step
    together; a masked micro-batch adds nothing to the loss)."""
    mine = batches[rank::size]
    per_rank = -(-len(batches) // size)
    while len(mine) < per_rank:
        mine.append(replace(batches[0], mask=torch.zeros_like(batches[0].mask)))
    return mine


def _all_reduced(totals: dict[str, float]) -> dict[str, float]:
    keys = sorted(totals)
    summed = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=collective_device())
    torch.distributed.all_reduce(summed)
    return dict(zip(keys, summed.tolist(), strict=True))


def run_steps(
    engine: DeepSpeedEngine,
    batches: list[MicroBatch],
    cfg: TrainerSettings,
    loss_fn: LossFn,
    norm: Normaliser,
    *,
    mean_advantage: float,
    replay: ReplayBatches | None = None,
    reference: Reference | None = None,
    before_step: Callable[[int], object] = lambda step: None,
    after_step: Callable[[StepMetrics], object] = lambda metrics: None,
) -> Trained:
    """``cfg.steps`` optimizer steps over `batches` (this rank's share when there are several
    ranks; `norm` counts the whole cycle's tokens and sequences), each with the `replay` term
    (trainer/replay.py; one rank only) and the KL penalty to the fixed `reference`
    (trainer/reference.py). `before_step` may raise to abandon the cycle; `after_step`
    gets each step's metrics (the whole cycle's, on every rank)."""
    steps: list[StepMetrics] = []
    # π_old: the champion's own logprobs, taken from the first step's forward passes (the weights
    # only change at the end of that step); π_ref's before any step, those of a reference that is
    # the champion from the same passes.
    firsts = _Firsts(
        old_logprobs=[None] * len(batches),
        mismatch=Mismatch(),
        refs=None if reference is None else reference_logprobs(engine, batches, reference),
    )
    mismatch = firsts.mismatch
    taken = optimizer_steps(engine)  # a carried optimizer may be past its warm-up
    for step in range(cfg.steps):
        lr = warmup_lr(cfg.learning_rate, taken + step + 1, cfg.warmup_steps)
        before_step(step)
        done = _step(
            engine,
            batches,
            cfg,
            loss_fn,
            norm,
            lr=lr,
            firsts=firsts,
            replay=replay,
        )
        if step == 0:
            mismatch.reduce()
        metrics = _step_metrics(
            step,
            done,
            lr=lr,
            mean_advantage=mean_advantage,
            mismatch=mismatch.metrics() if step == 0 else None,
        )
        steps.append(metrics)
        after_step(metrics)
        if not done.applied:
            return Trained(steps, kl_stop=step)
    return Trained(steps, kl_stop=None)


@dataclass(frozen=True)
class _Firsts:
    """What the steps keep of the cycle's first forward passes: π_old per micro-batch (filled by the
    first step), its mismatch with μ, and π_ref's tempered logprobs per micro-batch (None: no
    reference; a None entry: the reference is the champion, π_old's fill it)."""

    old_logprobs: list[TokenLogprobs | None]
    mismatch: Mismatch
    refs: list[torch.Tensor | None] | None = None


@dataclass(frozen=True)
class _Step:
    """What one step's forward passes summed (the whole step's, all-reduced across ranks), whether
    its update was applied, and the gradient norm of that update."""

    totals: dict[str, float]
    applied: bool
    grad_norm: float | None


def _step(
    engine: DeepSpeedEngine,
    batches: list[MicroBatch],
    cfg: TrainerSettings,
    loss_fn: LossFn,
    norm: Normaliser,
    *,
    lr: float,
    firsts: _Firsts,
    replay: ReplayBatches | None = None,
) -> _Step:
    """One optimizer step: forward and backward over every micro-batch, the replay term's first
    (`_replay_backward`), then, unless the trust region stops the cycle here, one update at
    learning rate `lr`."""
    _, size = world()
    totals = _replay_backward(engine, replay) if replay is not None else {}
    totals |= {
        "loss": 0.0,
        "ratio": 0.0,
        "clipped": 0.0,
        "kl_k1": 0.0,
        "kl_k3": 0.0,
        "kl_tokens": 0.0,
        "is_weight": 0.0,
        "tokens": 0.0,
        "impossible": 0.0,
    }
    if firsts.refs is not None:
        totals |= {"ref_kl_k1": 0.0, "ref_kl_k3": 0.0}
    norm_before: float | None = None
    for k, mb in enumerate(batches):
        mb = mb.to(engine.device)
        out = _micro_batch_loss(engine, mb, k, cfg, loss_fn, norm, firsts, totals)
        last = k == len(batches) - 1
        if last and size > 1:
            totals = _all_reduced(totals)  # the whole step's sums, the same on every rank
        if last and beyond_trust_region(totals, cfg.max_kl):
            # The weights after the steps so far are already max_kl from the champion
            # on this batch: keep them, and apply no more updates (this step's included).
            return _Step(totals, applied=False, grad_norm=None)
        # The loss is already normalised over the whole step: no extra 1/accumulation; DeepSpeed
        # averages the ranks' gradients, so each rank's share counts `size` times.
        engine.backward(out.loss * size if size > 1 else out.loss, scale_wrt_gas=False)
        if last:
            norm_before = grad_norm_before_step(engine)
            set_lr(engine, lr)
        engine.step()  # the optimizer steps on the last micro-batch only
    return _Step(
        totals,
        applied=True,
        grad_norm=norm_before if norm_before is not None else grad_norm_after_step(engine),
    )


def _replay_backward(engine: DeepSpeedEngine, replay: ReplayBatches) -> dict[str, float]:
    """Forward and backward of the replay term over its micro-batches (trainer/replay.py), before
    the policy's: every step then reports its replay NLL, the one the trust region stops included.
    Its gradients add to the policy's in the same accumulation (the engine counts these micro-batches
    too); the trust region's sums never see them."""
    nll = 0.0
    for mb in replay.batches:
        mb = mb.to(engine.device)
        loss, part = replay_loss(token_logprobs(engine, mb).logprobs, mb.mask, replay.weight, replay.tokens)
        nll += part
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()  # a micro-step: the optimizer steps on the policy's last micro-batch
    return {"replay_nll": nll, "replay_tokens": float(replay.tokens)}


def _micro_batch_loss(
    engine: DeepSpeedEngine,
    mb: MicroBatch,
    k: int,
    cfg: TrainerSettings,
    loss_fn: LossFn,
    norm: Normaliser,
    firsts: _Firsts,
    totals: dict[str, float],
) -> LossOutput:
    """Micro-batch `k`'s forward pass and loss, its sums added to `totals`. The first step's pass
    is π_old (kept in `firsts`), measured against the behaviour logprobs, and π_ref when the
    reference is the champion."""
    now = token_logprobs(engine, mb)  # (B, L−1) each
    old, refs = firsts.old_logprobs[k], firsts.refs
    if old is None:
        old = firsts.old_logprobs[k] = TokenLogprobs(
            now.logprobs.detach(), now.possible, now.tempered.detach()
        )
        firsts.mismatch.add(old.logprobs, mb.behaviour_logprobs, mb.mask * old.possible)
        if refs is not None and refs[k] is None:
            refs[k] = old.tempered
    # A token outside the row's truncation under π_old or π_θ has no ratio: it leaves the
    # policy term; the KL terms still see it, through the tempered logprobs.
    mask = mb.mask * (now.possible & old.possible)
    totals["impossible"] += float(mb.mask.sum() - mask.sum())
    out = loss_fn(
        TokenBatch(
            now.logprobs,
            old.logprobs,
            mb.behaviour_logprobs,
            mb.advantages,
            mask,
            tempered=now.tempered,
            old_tempered=old.tempered,
            scored=mb.mask,
            pairs=mb.pairs,
            token_advantages=mb.token_advantages,
            ref_tempered=None if refs is None else refs[k],
        ),
        cfg.loss,
        norm,
    )
    totals["loss"] += float(out.loss.detach())
    for key, value in out.sums.items():
        totals[key] += value
    return out


def _replay_nll(totals: dict[str, float]) -> float | None:
    """The step's mean token NLL of the replay completions; None without replay."""
    if "replay_nll" not in totals:
        return None
    return totals["replay_nll"] / max(totals["replay_tokens"], 1.0)


def _step_metrics(
    step: int, done: _Step, *, lr: float, mean_advantage: float, mismatch: dict[str, float] | None
) -> StepMetrics:
    """A step's record: its sums as means over its tokens (the KL estimates over the tokens they cover)."""
    totals = done.totals
    tokens = max(totals["tokens"], 1.0)
    kl_tokens = max(totals["kl_tokens"], 1.0)
    return StepMetrics(
        step=step,
        loss=totals["loss"],
        mean_ratio=totals["ratio"] / tokens,
        clip_fraction=totals["clipped"] / tokens,
        kl_k1=totals["kl_k1"] / kl_tokens,
        kl_k3=totals["kl_k3"] / kl_tokens,
        kl_tokens=int(totals["kl_tokens"]),
        ref_kl_k1=totals["ref_kl_k1"] / kl_tokens if "ref_kl_k1" in totals else None,
        ref_kl_k3=totals["ref_kl_k3"] / kl_tokens if "ref_kl_k3" in totals else None,
        mismatch=mismatch,
        is_weight=totals["is_weight"] / tokens,
        grad_norm=done.grad_norm,
        mean_advantage=mean_advantage,
        tokens=int(totals["tokens"]),
        impossible_tokens=int(totals["impossible"]),
        lr=lr if done.applied else None,
        replay_nll=_replay_nll(totals),
        replay_tokens=int(totals.get("replay_tokens", 0)),
        applied=done.applied,
    )
