"""Token-level policy-gradient losses, picked by ``settings.trainer.loss`` (a tagged union on ``type``).

Pure functions of tensors: `LOSSES[type](batch, cfg, norm)` returns the loss of one micro-batch,
already divided by the *whole* batch's normaliser (`Normaliser`), so summing the micro-batch
losses of one optimizer step gives the loss of the step (gradient accumulation without bias), and
token-level sums for the step's metrics.

Three log-probabilities per completion token:
* ``logprobs``: log π_θ, the policy being trained (carries the gradient);
* ``old_logprobs``: log π_old, the same weights before this cycle's first optimizer step (the
  trainer starts from exactly the champion that served the samples, so π_old is the serving policy
  as transformers computes it);
* ``behaviour_logprobs``: log μ, what vLLM reported when it sampled the token (processed: after
  temperature and truncation, schemas/sampling.py). μ and π_old differ by kernel numerics, and by
  policy lag when ``max_policy_lag > 0``; truncated importance sampling min(π_old/μ, C) corrects
  for it (https://fengyao.notion.site/off-policy-rl), per token, or per sequence for GSPO.

π_old and π_θ are computed under each row's own sampling (`serving.sampler.token_logprobs`), and
tokens that are impossible under it (outside the nucleus of π_old or π_θ) are already out of
``mask``: they have no ratio and no gradient through the truncated distribution.

Every loss may add β·KL(π_θ ‖ π_old), the k1 or k3 estimator (http://joschu.net/blog/kl-approx.html)
on the sampled tokens, normalised like its policy term: π_old is the champion the cycle started
from, so the penalty keeps one cycle's update near the policy that serves. And β_ref·KL(π_θ ‖ π_ref)
(``ref_kl_coef``), the same estimator, to a fixed version (``trainer.reference``, the base:
``ref_tempered``, trainer/reference.py), which does not move with each promotion, so the small
drifts the champion's penalty allows cannot add up over cycles. The KL penalties and the
trust region's measurement (`beyond_trust_region`) use the *tempered* logprobs (penalties and
temperature, no truncation) on every sampled token, ``scored``: a token pushed out of the nucleus
is the largest move of all, and with truncated logprobs its log-ratio would be infinite
(docs/algorithms.md, Truncated sampling).

An advantage is one per sequence, shared by its tokens, unless the batch carries one per token
(`TokenBatch.token_advantages`: hindsight distillation's term, trainer/hindsight.py); the token-level
losses then weigh each token by its own, GSPO each sequence by the mean of its tokens'.

Log-ratios are masked before they are exponentiated: a masked position (padding, a token outside
the nucleus) may hold any value, and exp of it may overflow to inf, and inf · 0 is NaN.

Papers and defaults (schemas/settings/losses.py holds the defaults, docs/algorithms.md the reasoning):
CISPO, MiniMax-M1 §3.1 https://arxiv.org/abs/2506.13585; PPO-clip
https://arxiv.org/abs/1707.06347; GRPO https://arxiv.org/abs/2402.03300; DAPO
https://arxiv.org/abs/2503.14476; Dr. GRPO https://arxiv.org/abs/2503.20783; GSPO
https://arxiv.org/abs/2507.18071. Two objectives are not policy gradients (docs/algorithms.md,
Objectives): rejection-sampling fine-tuning (RFT, https://arxiv.org/abs/2308.01825) and DPO
(https://arxiv.org/abs/2305.18290); trainer/objectives.py decides which rows they see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    # Tempered logprobs (no truncation: finite for every token) of π_θ and π_old, and the mask of
    # every sampled completion token, in or out of the nucleus: for the KL terms. None: the above.
    tempered: torch.Tensor | None = None  # (B, T), requires grad
    old_tempered: torch.Tensor | None = None  # (B, T)
    scored: torch.Tensor | None = None  # (B, T)
    # DPO's pair of each row (`serving.sampler.Row.pair`, −1: none), its side the sign of its
    # advantage; None for every other loss.
    pairs: torch.Tensor | None = None  # (B,) long
    # One Â per completion token (hindsight distillation adds a term per token: trainer/hindsight.py);
    # None: `advantages`, shared by all of a sequence's tokens.
    token_advantages: torch.Tensor | None = None  # (B, T)
    # Tempered logprobs of the fixed reference π_ref (trainer/reference.py), no grad; None: no
    # reference (a loss with ref_kl_coef > 0 then refuses the batch).
    ref_tempered: torch.Tensor | None = None  # (B, T)

    def token_advantage(self) -> torch.Tensor:
        """Â of each token: (B, T) when the batch has per-token advantages, else (B, 1), broadcast."""
        if self.token_advantages is None:
            return self.advantages[:, None]
        return self.token_advantages

    def sequence_advantage(self) -> torch.Tensor:
        """(B,) one Â per sequence for a sequence-level loss (GSPO): the mean of its tokens' Â over the
        trainable tokens, the row's own where it has none."""
        if self.token_advantages is None:
            return self.advantages
        lengths = self.mask.sum(dim=1)  # (B,)
        mean = (self.token_advantages * self.mask).sum(dim=1) / lengths.clamp(min=1)
        return torch.where(lengths > 0, mean, self.advantages)

    def kl_log_ratio(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log(π_old/π_θ) of the tempered logprobs, 0 off the scored tokens; the scored mask)."""
        scored = self.mask if self.scored is None else self.scored
        new = self.logprobs if self.tempered is None else self.tempered
        old = self.old_logprobs if self.old_tempered is None else self.old_tempered
        return _masked(old - new, scored), scored

    def ref_kl_log_ratio(self) -> torch.Tensor:
        """log(π_ref/π_θ) of the tempered logprobs, 0 off the scored tokens (`kl_log_ratio`'s, to π_ref)."""
        if self.ref_tempered is None:
            raise ValueError(
                "trainer.loss.ref_kl_coef > 0 needs the reference's logprobs (TokenBatch.ref_tempered: "
                "trainer/reference.py)"
            )
        scored = self.mask if self.scored is None else self.scored
        new = self.logprobs if self.tempered is None else self.tempered
        return _masked(self.ref_tempered - new, scored)


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` where `mask` is set, 0 elsewhere: before exp, so a masked position cannot give inf · 0."""
    return torch.where(mask > 0, values, torch.zeros_like(values))


@dataclass(frozen=True)
class Normaliser:
    """Sizes of the whole optimizer-step batch (all micro-batches together)."""

    tokens: int  # Σ_i |o_i|: trainable completion tokens
    sequences: int  # number of trainable sequences; under DPO, of preference pairs


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # () this micro-batch's share of the step loss
    # token-level sums: ratio, clipped, is_weight, tokens; kl_k1, kl_k3 (and ref_kl_k1, ref_kl_k3 with a
    # reference) over kl_tokens
    sums: dict[str, float]


LossFn = Callable[[TokenBatch, Any, Normaliser], LossOutput]


def _token_ratios(batch: TokenBatch, cfg: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """π_θ/π_old, the truncated behaviour weight min(π_old/μ, C), and the clip indicator, per token."""
    ratio = torch.exp(_masked(batch.logprobs - batch.old_logprobs, batch.mask))  # (B, T)
    is_weight = torch.exp(_masked(batch.old_logprobs - batch.behaviour_logprobs, batch.mask))
    is_weight = is_weight.clamp(max=cfg.is_cap).detach()  # (B, T)
    clipped = (ratio < 1 - cfg.eps_low) | (ratio > 1 + cfg.eps_high)  # (B, T) bool
    return ratio, is_weight, clipped


def _estimate(log_r: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from log r = log(π_ref/π_θ) on the sampled tokens.

    k1 = log π_θ − log π_ref (unbiased, can be negative per token); k3 = r − 1 − log r
    (unbiased, always ≥ 0, lower variance; GRPO's choice).
    """
    if estimator == "k1":
        return -log_r
    return torch.exp(log_r) - 1 - log_r


def _kl(batch: TokenBatch, cfg: Any) -> torch.Tensor:
    """Per-token KL penalty on the sampled tokens (tempered logprobs, every scored token:
    `TokenBatch.kl_log_ratio`), 0 off them: β·KL(π_θ ‖ π_old) + β_ref·KL(π_θ ‖ π_ref), each by
    ``kl_estimator`` (`_estimate`); zeros when both weights are 0."""
    penalty = torch.zeros_like(batch.logprobs)
    if cfg.kl_coef != 0:
        log_r, _ = batch.kl_log_ratio()  # (B, T) log(π_old/π_θ)
        penalty = penalty + cfg.kl_coef * _estimate(log_r, cfg.kl_estimator)
    if cfg.ref_kl_coef != 0:
        penalty = penalty + cfg.ref_kl_coef * _estimate(batch.ref_kl_log_ratio(), cfg.kl_estimator)
    return penalty


def _kl_penalty(batch: TokenBatch, cfg: Any, norm: Normaliser) -> torch.Tensor:
    """The token mean of `_kl` over every scored token of the step."""
    if cfg.kl_coef == 0 and cfg.ref_kl_coef == 0:
        return torch.zeros((), device=batch.logprobs.device)
    _, scored = batch.kl_log_ratio()
    return _token_mean(_kl(batch, cfg), scored, norm)


def _sums(
    batch: TokenBatch, ratio: torch.Tensor, is_weight: torch.Tensor, clipped: torch.Tensor
) -> dict[str, float]:
    """Token sums of a micro-batch. ``ratio`` is the loss's own (a sequence's for GSPO); the KL
    estimates measure the policy itself, token by token, whatever the loss moves: they are what the
    trust region compares with ``max_kl``."""
    mask = batch.mask
    with torch.no_grad():
        log_r, scored = batch.kl_log_ratio()  # log(π_old/π_θ)
        sums = _ref_kl_sums(batch, scored) if batch.ref_tempered is not None else {}
        return sums | {
            "ratio": float((ratio * mask).sum()),
            "clipped": float((clipped.float() * mask).sum()),
            # Estimators of KL(π_old ‖ π_θ) on tokens sampled from π_old, with r = π_θ/π_old:
            # k1 = −log r (unbiased, noisy, can be negative), k3 = r − 1 − log r (unbiased, ≥ 0).
            "kl_k1": float((log_r * scored).sum()),
            "kl_k3": float(((torch.exp(-log_r) - 1 + log_r) * scored).sum()),
            "kl_tokens": float(scored.sum()),
            "is_weight": float((is_weight * mask).sum()),
            "tokens": float(mask.sum()),
        }


def _ref_kl_sums(batch: TokenBatch, scored: torch.Tensor) -> dict[str, float]:
    """Token sums of the estimates of KL(π_θ ‖ π_ref) the penalty uses, r = π_ref/π_θ: k1 = −log r,
    k3 = r − 1 − log r, over the scored tokens (``kl_tokens``): how far the policy is from the
    reference, the champion's own drift included at the first step."""
    ref_log_r = batch.ref_kl_log_ratio()  # log(π_ref/π_θ)
    return {
        "ref_kl_k1": float((-ref_log_r * scored).sum()),
        "ref_kl_k3": float(((torch.exp(ref_log_r) - 1 - ref_log_r) * scored).sum()),
    }


def beyond_trust_region(sums: dict[str, float], max_kl: float | None) -> bool:
    """Whether a step's token sums (`LossOutput.sums`, added up over its micro-batches) put the
    policy more than `max_kl` from π_old, by the k3 estimate per scored token (None: no trust region)."""
    tokens = sums.get("kl_tokens", sums["tokens"])
    return max_kl is not None and tokens > 0 and sums["kl_k3"] / tokens > max_kl


def _token_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    """Σ over the step's tokens / Σ_i |o_i| (every token weighs the same)."""
    return (per_token * mask).sum() / max(norm.tokens, 1)


def _sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    """1/G Σ_i 1/|o_i| Σ_t (every sequence weighs the same, whatever its length)."""
    lengths = mask.sum(dim=1).clamp(min=1)  # (B,)
    return ((per_token * mask).sum(dim=1) / lengths).sum() / max(norm.sequences, 1)


def cispo(batch: TokenBatch, cfg: Any, norm: Normaliser) -> LossOutput:
    """CISPO: J = 1/Σ|o_i| Σ_i Σ_t sg(r̂_{i,t}) Â_i log π_θ(o_{i,t}).

    r̂ = clip(π_θ/π_old, 1 − ε_low, 1 + ε_high) is only a weight (stop-gradient), so every token
    keeps its gradient, unlike PPO-clip which zeroes clipped tokens.
    """
    ratio, is_weight, clipped = _token_ratios(batch, cfg)
    weight = (ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * is_weight).detach()  # (B, T)
    objective = weight * batch.token_advantage() * batch.logprobs  # (B, T)
    loss = _token_mean(-objective, batch.mask, norm) + _kl_penalty(batch, cfg, norm)
    return LossOutput(loss, _sums(batch, ratio, is_weight, clipped))


def _clipped_surrogate(
    batch: TokenBatch, cfg: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w · min(r Â, clip(r, 1 − ε_low, 1 + ε_high) Â) per token, with w the truncated IS weight."""
    ratio, is_weight, clipped = _token_ratios(batch, cfg)
    adv = batch.token_advantage()  # (B, T), or (B, 1) when every token has its sequence's
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)  # (B, T)
    return is_weight * surrogate, ratio, is_weight, clipped


def ppo(batch: TokenBatch, cfg: Any, norm: Normaliser) -> LossOutput:
    """PPO-clip, token-level mean: J = 1/Σ|o_i| Σ_i Σ_t min(r Â, clip(r, 1−ε_low, 1+ε_high) Â)."""
    objective, ratio, is_weight, clipped = _clipped_surrogate(batch, cfg)
    loss = _token_mean(-objective, batch.mask, norm) + _kl_penalty(batch, cfg, norm)
    return LossOutput(loss, _sums(batch, ratio, is_weight, clipped))


def grpo(batch: TokenBatch, cfg: Any, norm: Normaliser) -> LossOutput:
    """GRPO: PPO-clip with its per-sequence length normalisation, J = 1/G Σ_i 1/|o_i| Σ_t (...),
    and its KL penalty (k3, β = 0.04 by default).

    The advantages are the cycle's (trainer/advantages.py: group baseline, no std division);
    only the normalisation and the default KL differ from `ppo`.
    """
    objective, ratio, is_weight, clipped = _clipped_surrogate(batch, cfg)
    _, scored = batch.kl_log_ratio()
    loss = _sequence_mean(-objective, batch.mask, norm) + _sequence_mean(_kl(batch, cfg), scored, norm)
    return LossOutput(loss, _sums(batch, ratio, is_weight, clipped))


def dapo(batch: TokenBatch, cfg: Any, norm: Normaliser) -> LossOutput:
    """DAPO's objective: PPO-clip with a higher upper clip (ε_high 0.28, "clip-higher") and a
    token-level mean over the step. Its dynamic sampling (rows without signal leave the batch)
    and overlong shaping (a soft length penalty in the reward) happen before the loss, in the
    cycle (trainer/cycle.py)."""
    return ppo(batch, cfg, norm)


def dr_grpo(batch: TokenBatch, cfg: Any, norm: Normaliser) -> LossOutput:
    """Dr. GRPO: GRPO without its length bias, J = 1/(G · L) Σ_i Σ_t (...), with L a constant
    (``norm_tokens``, the generation budget) instead of each sequence's own length."""
    objective, ratio, is_weight, clipped = _clipped_surrogate(batch, cfg)
    _, scored = batch.kl_log_ratio()
    per_token = -objective * batch.mask + _kl(batch, cfg) * scored
    loss = per_token.sum() / (max(norm.sequences, 1) * cfg.norm_tokens)
    return LossOutput(loss, _sums(batch, ratio, is_weight, clipped))


def gspo(batch: TokenBatch, cfg: Any, norm: Normaliser) -> LossOutput:
    """GSPO: one importance ratio per sequence, s_i = (π_θ(o_i)/π_old(o_i))^(1/|o_i|), clipped as
    in PPO (ε 3e-4 / 4e-4: a geometric mean moves far less than a token ratio):
    J = 1/G Σ_i min(s_i Â_i, clip(s_i, 1 − ε_low, 1 + ε_high) Â_i).

    The behaviour correction is per sequence too: w_i = min((π_old(o_i)/μ(o_i))^(1/|o_i|), C).
    The clip indicator in the metrics marks every token of a clipped sequence. The KL sums (what
    the trust region reads) are the token-level estimates of every loss: a geometric mean can stay
    at 1 while its tokens move in opposite directions, so s_i says nothing about how far π_θ went.
    """
    mask = batch.mask
    lengths = mask.sum(dim=1).clamp(min=1)  # (B,)
    log_s = _masked(batch.logprobs - batch.old_logprobs, mask).sum(dim=1) / lengths  # (B,)
    s = torch.exp(log_s)  # (B,)
    w = torch.exp(_masked(batch.old_logprobs - batch.behaviour_logprobs, mask).sum(dim=1) / lengths)
    w = w.clamp(max=cfg.is_cap).detach()  # (B,)
    adv = batch.sequence_advantage()  # (B,)
    surrogate = torch.minimum(s * adv, s.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)  # (B,)
    _, scored = batch.kl_log_ratio()
    kl = (_kl(batch, cfg) * scored).sum(dim=1) / scored.sum(dim=1).clamp(min=1)  # (B,)
    has_tokens = (mask.sum(dim=1) > 0).float()  # (B,) a row with no trainable token adds nothing
    loss = ((-w * surrogate + kl) * has_tokens).sum() / max(norm.sequences, 1)
    clipped_sequence = (s < 1 - cfg.eps_low) | (s > 1 + cfg.eps_high)  # (B,)
    ratio = s[:, None].expand_as(mask)
    clipped = clipped_sequence[:, None].expand_as(mask)
    is_weight = w[:, None].expand_as(mask)
    return LossOutput(loss, _sums(batch, ratio, is_weight, clipped))


def _unclipped(batch: TokenBatch, cfg: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """π_θ/π_old, the truncated behaviour weight and an all-False clip indicator, per token: the
    metrics of an objective that clips nothing and weighs nothing (`rft`, `dpo`)."""
    ratio = torch.exp(_masked(batch.logprobs - batch.old_logprobs, batch.mask)).detach()  # (B, T)
    is_weight = torch.exp(_masked(batch.old_logprobs - batch.behaviour_logprobs, batch.mask))
    return ratio, is_weight.clamp(max=cfg.is_cap).detach(), torch.zeros_like(batch.mask, dtype=torch.bool)


def rft(batch: TokenBatch, cfg: Any, norm: Normaliser) -> LossOutput:
    """Rejection-sampling fine-tuning: the negative log-likelihood of the accepted completions,
    token mean over the step, L = −1/Σ|o_i| Σ_i Σ_t w_i log π_θ(o_{i,t}), plus the KL penalty.

    w_i is the row's advantage, which trainer/objectives.py sets to 1 for an accepted episode's
    rows (the others are left out of the batch and its normaliser): plain supervised fine-tuning,
    no ratio and no behaviour weight. The token mean is the usual SFT normalisation and the default
    CISPO's, so one learning rate means the same step size for both (docs/algorithms.md, Objectives).
    """
    ratio, is_weight, clipped = _unclipped(batch, cfg)
    nll = -batch.token_advantage() * batch.logprobs  # (B, T)
    loss = _token_mean(nll, batch.mask, norm) + _kl_penalty(batch, cfg, norm)
    return LossOutput(loss, _sums(batch, ratio, is_weight, clipped))


def dpo(batch: TokenBatch, cfg: Any, norm: Normaliser) -> LossOutput:
    """DPO: L = 1/P Σ_p −log σ(β [(log π_θ(y_w) − log π_ref(y_w)) − (log π_θ(y_l) − log π_ref(y_l))]),
    plus the KL penalty, P being the step's pairs (``norm.sequences`` under DPO).

    π_ref is the behaviour policy μ: the champion that sampled both completions, its logprobs as
    vLLM recorded them. log π(y) is a sum over the completion tokens of every row of the pair's
    side (an episode of several segments is one trajectory); a token outside a row's truncation
    under π_θ or π_old leaves both sums. Every row of a pair is in the same micro-batch
    (trainer/objectives.py `dpo_micro_batches`); a pair missing a side's tokens adds nothing.
    """
    if batch.pairs is None:
        raise ValueError("the dpo loss needs each row's pair (TokenBatch.pairs)")
    ratio, is_weight, clipped = _unclipped(batch, cfg)
    mask = batch.mask
    log_ratio = _masked(batch.logprobs - batch.behaviour_logprobs, mask).sum(dim=1)  # (B,)
    side = torch.sign(batch.advantages)  # (B,) +1 winner, −1 loser
    in_pair = (batch.pairs >= 0) & (mask.sum(dim=1) > 0) & (side != 0)  # (B,)
    _, index = torch.unique(batch.pairs[in_pair], return_inverse=True)  # (B',) pair of each row
    n = int(index.max()) + 1 if index.numel() else 0
    margin = log_ratio.new_zeros(n).index_add(0, index, (side * log_ratio)[in_pair])  # (P,) h_p
    winners = log_ratio.new_zeros(n).index_add(0, index, (side[in_pair] > 0).float())
    losers = log_ratio.new_zeros(n).index_add(0, index, (side[in_pair] < 0).float())
    complete = ((winners > 0) & (losers > 0)).float()  # (P,)
    per_pair = torch.nn.functional.softplus(-cfg.beta * margin) * complete  # −log σ(β h)
    loss = per_pair.sum() / max(norm.sequences, 1) + _kl_penalty(batch, cfg, norm)
    return LossOutput(loss, _sums(batch, ratio, is_weight, clipped))


LOSSES: dict[str, LossFn] = {
    "cispo": cispo,
    "ppo": ppo,
    "grpo": grpo,
    "dapo": dapo,
    "dr_grpo": dr_grpo,
    "gspo": gspo,
    "rft": rft,
    "dpo": dpo,
}


def loss_function(cfg: LossSettings) -> LossFn:
    """The function of the configured loss."""
    return LOSSES[cfg.type]
