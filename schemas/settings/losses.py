"""The policy-gradient losses of a training cycle (``trainer.loss``): a tagged union on ``type``, each
loss with its paper's defaults (trainer/losses.py implements them; docs/algorithms.md).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from schemas.settings.section import Section


class _Loss(Section):
    """What every loss has: the behaviour-weight cap and optional KL penalties to the champion and
    to a fixed reference (``trainer.reference``: the base by default)."""

    is_cap: float = Field(
        2.0, gt=0, description="Truncation C of the behaviour importance weight min(pi_old/mu, C)."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight beta of KL(pi_theta || pi_old), pi_old being the champion the cycle "
        "started from; 0 = no penalty.",
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        "k3", description="KL estimator on the sampled tokens, of both penalties (kl_coef, ref_kl_coef)."
    )
    ref_kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of KL(pi_theta || pi_ref), pi_ref being the fixed version trainer.reference names "
        "(the base by default): unlike kl_coef it does not move with each promotion, so drift cannot add up "
        "over cycles; 0 = no penalty, and no reference is loaded.",
    )


class CispoLoss(_Loss):
    """CISPO (MiniMax-M1, arXiv 2506.13585 §3.1): the clipped ratio is a stop-gradient weight, so
    every token keeps its gradient; no lower bound, the upper bound of DAPO's clip-higher."""

    type: Literal["cispo"] = "cispo"
    eps_low: float = Field(
        1.0, ge=0, le=1, description="Lower clip of the ratio weight (1.0 = no lower bound)."
    )
    eps_high: float = Field(0.28, gt=0, description="Upper clip of the ratio weight.")
    # rtrl's default loss keeps each cycle near the champion: without the penalty, bench_learning's
    # gate rejected most challengers for lost held-out answers (docs/algorithms.md, Keeping what the
    # model knows).
    kl_coef: float = Field(
        0.5,
        ge=0,
        description="Weight beta of KL(pi_theta || pi_old), pi_old being the champion the cycle "
        "started from; 0 = no penalty.",
    )


class PpoLoss(_Loss):
    """PPO-clip (arXiv 1707.06347), token-level mean; clipped tokens get no gradient."""

    type: Literal["ppo"] = "ppo"
    eps_low: float = Field(0.2, ge=0, le=1, description="Lower clip of the ratio.")
    eps_high: float = Field(0.2, gt=0, description="Upper clip of the ratio.")


class GrpoLoss(_Loss):
    """GRPO (DeepSeekMath, arXiv 2402.03300): PPO-clip averaged per sequence, KL penalty k3 with
    beta 0.04."""

    type: Literal["grpo"] = "grpo"
    eps_low: float = Field(0.2, ge=0, le=1, description="Lower clip of the ratio.")
    eps_high: float = Field(0.2, gt=0, description="Upper clip of the ratio.")
    kl_coef: float = Field(0.04, ge=0, description="Weight beta of KL(pi_theta || pi_old).")


class DapoLoss(_Loss):
    """DAPO (arXiv 2503.14476): clip-higher (0.2 / 0.28), token-level mean, dynamic sampling and
    overlong reward shaping."""

    type: Literal["dapo"] = "dapo"
    eps_low: float = Field(0.2, ge=0, le=1, description="Lower clip of the ratio.")
    eps_high: float = Field(0.28, gt=0, description="Upper clip of the ratio (clip-higher).")
    dynamic_sampling: bool = Field(
        True, description="Leave rows whose advantage is 0 (no signal) out of the batch and its normaliser."
    )
    overlong_buffer: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="Soft overlong penalty: a completion longer than (1 - buffer) x its max_tokens "
        "loses up to 1 reward linearly until max_tokens (DAPO's 4096 of 20480); 0 = off.",
    )


class DrGrpoLoss(_Loss):
    """Dr. GRPO (arXiv 2503.20783): GRPO without the length bias, every token divided by the same
    constant instead of its sequence's length."""

    type: Literal["dr_grpo"] = "dr_grpo"
    eps_low: float = Field(0.2, ge=0, le=1, description="Lower clip of the ratio.")
    eps_high: float = Field(0.2, gt=0, description="Upper clip of the ratio.")
    norm_tokens: int = Field(
        512, ge=1, description="The constant L of 1/(G L): the generation budget in tokens."
    )


class GspoLoss(_Loss):
    """GSPO (Qwen, arXiv 2507.18071): one length-normalised ratio per sequence, clipped tightly."""

    type: Literal["gspo"] = "gspo"
    eps_low: float = Field(3e-4, ge=0, le=1, description="Lower clip of the sequence ratio.")
    eps_high: float = Field(4e-4, gt=0, description="Upper clip of the sequence ratio.")


class RftLoss(_Loss):
    """Rejection-sampling fine-tuning (RFT, arXiv 2308.01825; ReSpect, arXiv 2410.13852): the
    token-mean negative log-likelihood of the completions of the episodes users rewarded, every
    other episode left out (trainer/objectives.py `rft_accepts`)."""

    type: Literal["rft"] = "rft"
    min_reward: float = Field(
        0.0,
        description="An episode with feedback (or a judge's grade) is fine-tuned on when its reward is "
        "strictly above this; 0 = the reward spec's neutral: every net-positive verdict.",
    )


class DpoLoss(_Loss):
    """DPO (Rafailov et al. 2023, arXiv 2305.18290) on pairs of episodes of one prompt in the cycle's
    batch, the reference being the behaviour logprobs of the champion that sampled them
    (trainer/objectives.py `pair_indices`)."""

    type: Literal["dpo"] = "dpo"
    beta: float = Field(
        0.1, gt=0, description="DPO's beta: the strength of the implicit KL to the reference policy."
    )
    margin: float = Field(
        0.5,
        gt=0,
        description="Two episodes of one prompt pair when the winner's reward exceeds the loser's by at "
        "least this (equal rewards never pair); 0.5 is half of an accepted-versus-rejected gap.",
    )


LossSettings = Annotated[
    CispoLoss | PpoLoss | GrpoLoss | DapoLoss | DrGrpoLoss | GspoLoss | RftLoss | DpoLoss,
    Field(discriminator="type"),
]
"""The training objective, a tagged union on ``type`` (trainer/losses.py): the policy-gradient
losses, each with its paper's defaults, and two objectives that are not RL (``rft``, ``dpo``:
docs/algorithms.md, Objectives). ``RTRL_TRAINER__LOSS__TYPE=ppo`` picks PPO with PPO's defaults."""
LOSS_TYPES = ("cispo", "ppo", "grpo", "dapo", "dr_grpo", "gspo", "rft", "dpo")
