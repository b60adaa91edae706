"""Token-level policy-gradient losses, picked by ``settings.trainer.loss.type``.

Pure functions of tensors: `LOSSES[type](batch, cfg, norm)` returns the loss of one micro-batch,
already divided by the *whole* batch's normaliser (`Normaliser`), so summing the micro-batch
losses of one optimizer step gives the loss of the step (gradient accumulation without bias), and
token-level sums for the step's metrics.

Three log-probabilities per completion token:
* ``logprobs``: log π_θ, the policy being trained (carries the gradient);
* ``old_logprobs``: log π_old, the same weights before this cycle's first optimizer step (the
  trainer starts from exactly the champion that served the samples, so π_old is the serving policy
  as transformers computes it);
* ``behaviour_logprobs``: log μ, what vLLM reported when it sampled the token. μ and π_old differ
  by kernel numerics, and by policy lag when ``max_policy_lag > 0``; truncated importance
  sampling min(π_old/μ, C) corrects for it (https://fengyao.notion.site/off-policy-rl).

Papers: CISPO, MiniMax-M1 §3.1 https://arxiv.org/abs/2506.13585; PPO-clip
https://arxiv.org/abs/1707.06347; GRPO https://arxiv.org/abs/2402.03300 (its per-sequence length
normalisation); Dr. GRPO https://arxiv.org/abs/2503.20783.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from schemas.settings import LossSettings


@dataclass(frozen=True)
class TokenBatch:
    """One micro-batch of completion tokens, right-aligned to the model's next-token targets."""

    logprobs: torch.Tensor  # (B, T) log π_θ of the sampled tokens, requires grad
    old_logprobs: torch.Tensor  # (B, T) log π_old, no grad
    behaviour_logprobs: torch.Tensor  # (B, T) log μ from the inference engine
    advantages: torch.Tensor  # (B,) one Â per sequence, shared by all its tokens
    mask: torch.Tensor  # (B, T) 1.0 where the token is a trainable completion token, else 0.0


@dataclass(frozen=True)
class Normaliser:
    """Sizes of the whole optimizer-step batch (all micro-batches together)."""

    tokens: int  # Σ_i |o_i|: trainable completion tokens
    sequences: int  # number of trainable sequences


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # () this micro-batch's share of the step loss
    sums: dict[str, float]  # token-level sums: ratio, clipped, kl_k1, is_weight, tokens


LossFn = Callable[[TokenBatch, LossSettings, Normaliser], LossOutput]


def _ratios(batch: TokenBatch, cfg: LossSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """π_θ/π_old, the truncated behaviour weight min(π_old/μ, C), and the clip indicator."""
    log_ratio = batch.logprobs - batch.old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    is_weight = torch.exp(batch.old_logprobs - batch.behaviour_logprobs).clamp(max=cfg.is_cap).detach()  # (B, T)
    clipped = (ratio < 1 - cfg.eps_low) | (ratio > 1 + cfg.eps_high)  # (B, T) bool
    return ratio, is_weight, clipped


def _sums(batch: TokenBatch, ratio: torch.Tensor, is_weight: torch.Tensor, clipped: torch.Tensor) -> dict[str, float]:
    mask = batch.mask
    with torch.no_grad():
        log_ratio = batch.logprobs - batch.old_logprobs
        return {
            "ratio": float((ratio * mask).sum()),
            "clipped": float((clipped.float() * mask).sum()),
            # k1 estimator of KL(π_old ‖ π_θ) on tokens sampled from π_old: E[−log r].
            "kl_k1": float((-log_ratio * mask).sum()),
            "is_weight": float((is_weight * mask).sum()),
            "tokens": float(mask.sum()),
        }


def cispo(batch: TokenBatch, cfg: LossSettings, norm: Normaliser) -> LossOutput:
    """CISPO: J = 1/Σ|o_i| Σ_i Σ_t sg(r̂_{i,t}) Â_i log π_θ(o_{i,t}).

    r̂ = clip(π_θ/π_old, 1 − ε_low, 1 + ε_high) is only a weight (stop-gradient), so every token
    keeps its gradient, unlike PPO-clip which zeroes clipped tokens.
    """
    ratio, is_weight, clipped = _ratios(batch, cfg)
    weight = (ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * is_weight).detach()  # (B, T)
    objective = weight * batch.advantages[:, None] * batch.logprobs  # (B, T)
    loss = -(objective * batch.mask).sum() / max(norm.tokens, 1)
    return LossOutput(loss, _sums(batch, ratio, is_weight, clipped))


def _ppo_objective(batch: TokenBatch, cfg: LossSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ratio, is_weight, clipped = _ratios(batch, cfg)
    adv = batch.advantages[:, None]  # (B, 1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)  # (B, T)
    return is_weight * surrogate, ratio, is_weight, clipped


def ppo(batch: TokenBatch, cfg: LossSettings, norm: Normaliser) -> LossOutput:
    """PPO-clip, token-level mean: J = 1/Σ|o_i| Σ_i Σ_t min(r Â, clip(r, 1−ε_low, 1+ε_high) Â)."""
    objective, ratio, is_weight, clipped = _ppo_objective(batch, cfg)
    loss = -(objective * batch.mask).sum() / max(norm.tokens, 1)
    return LossOutput(loss, _sums(batch, ratio, is_weight, clipped))


def grpo(batch: TokenBatch, cfg: LossSettings, norm: Normaliser) -> LossOutput:
    """GRPO's PPO-clip with its per-sequence length normalisation: J = 1/G Σ_i 1/|o_i| Σ_t (...).

    The advantages are the cycle's (group baseline, no std division); only the normalisation
    differs from `ppo`.
    """
    objective, ratio, is_weight, clipped = _ppo_objective(batch, cfg)
    lengths = batch.mask.sum(dim=1).clamp(min=1)  # (B,)
    per_sequence = (objective * batch.mask).sum(dim=1) / lengths  # (B,)
    loss = -per_sequence.sum() / max(norm.sequences, 1)
    return LossOutput(loss, _sums(batch, ratio, is_weight, clipped))


LOSSES: dict[str, LossFn] = {"cispo": cispo, "ppo": ppo, "grpo": grpo}
