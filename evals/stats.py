"""The eval gate's statistics: paired bootstrap intervals and off-policy estimates (docs/gate.md).

Both answer the gate's one question, *is the challenger at most a margin worse than the champion?*,
with an estimate of challenger − champion and a one-sided lower confidence bound on it:

- `paired_interval`: the same items (prompts) scored under both models; the bootstrap resamples
  items, so the per-item pairing (same prompt, same sampling seed) cancels what both share.
- `off_policy`: logged episodes (reward r, behaviour log-probability log μ of what was sampled)
  reweighted to each model: w = min(π(y|x)/μ(y|x), clip), value = Σ w·r / Σ w (self-normalised,
  clipped importance sampling). Challenger and champion are weighted on the same episodes and the
  bootstrap resamples episodes for both at once. The effective sample size (Σw)²/Σw² says how many
  logged episodes the estimate is worth; below a configured floor it is inconclusive.

Pure numpy: no model, no I/O. Seeded, so a gate run is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict


class Interval(BaseModel):
    """Challenger − champion, with a one-sided lower bound at the stated confidence (and the
    symmetric upper bound, for reading)."""

    model_config = ConfigDict(frozen=True)

    estimate: float
    low: float
    high: float
    n: int


def _bounds(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = 1.0 - confidence
    return float(np.quantile(samples, alpha)), float(np.quantile(samples, 1.0 - alpha))


def paired_interval(
    challenger: Sequence[float], champion: Sequence[float], *, confidence: float, resamples: int, seed: int
) -> Interval:
    """Mean of challenger[i] − champion[i] over items, with a bootstrap (percentile) interval."""
    if len(challenger) != len(champion) or not challenger:
        raise ValueError(f"need paired, non-empty scores; got {len(challenger)} and {len(champion)}")
    diffs = np.asarray(challenger, dtype=np.float64) - np.asarray(champion, dtype=np.float64)
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(diffs), size=(resamples, len(diffs)))
    low, high = _bounds(diffs[index].mean(axis=1), confidence)
    return Interval(estimate=float(diffs.mean()), low=low, high=high, n=len(diffs))


class PairedEstimate(BaseModel):
    """Both models' off-policy estimates on the same logs, their difference with a paired bootstrap
    interval, and what their importance weights say: effective sample sizes and clipped shares
    (`off_policy` here, `doubly_robust` in evals/dr.py; `paired_estimate` builds the fields)."""

    model_config = ConfigDict(frozen=True)

    challenger: float
    champion: float
    difference: Interval
    ess_challenger: float
    ess_champion: float
    clipped_challenger: float  # share of episodes whose weight was clipped
    clipped_champion: float


def paired_estimate(
    values: tuple[float, float],
    boot: np.ndarray,
    weights: tuple[np.ndarray, np.ndarray],
    clip: float,
    confidence: float,
) -> dict[str, Any]:
    """`PairedEstimate`'s fields: (challenger, champion) `values`, `boot` the bootstrap's differences
    (on `resampled` indices, the same for both models), the two models' clipped importance `weights`."""
    (est1, est0), (w1, w0) = values, weights
    low, high = _bounds(boot, confidence)
    return {
        "challenger": est1,
        "champion": est0,
        "difference": Interval(estimate=est1 - est0, low=low, high=high, n=len(w1)),
        "ess_challenger": effective_sample_size(w1),
        "ess_champion": effective_sample_size(w0),
        "clipped_challenger": float((w1 >= clip).mean()),
        "clipped_champion": float((w0 >= clip).mean()),
    }


def resampled(n: int, resamples: int, seed: int) -> np.ndarray:
    """(resamples, n) episode indices drawn with replacement: one paired bootstrap for both models."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


class OffPolicy(PairedEstimate):
    """Self-normalised, clipped importance-sampling estimates of both models on the same logs."""

    # The difference's point estimate with unclipped weights: how far clipping moved it (clipping
    # trades that bias, toward the logged rewards, for variance; docs/gate.md, Suites: ope).
    unclipped_difference: float = 0.0


def importance_weights(logp: Sequence[float], behaviour: Sequence[float], clip: float) -> np.ndarray:
    """min(exp(log π − log μ), clip) per episode; a sequence π cannot produce (log π = −inf) weighs 0."""
    delta = np.asarray(logp, dtype=np.float64) - np.asarray(behaviour, dtype=np.float64)
    # Exactly `clip` where clipped (exp(log clip) may round below it, and `off_policy` counts them).
    weights: np.ndarray = np.where(delta >= math.log(clip), clip, np.exp(np.minimum(delta, math.log(clip))))
    return weights


def unclipped_snips(logp: Sequence[float], behaviour: Sequence[float], values: np.ndarray) -> float:
    """`snips` with the unclipped weights exp(log π − log μ), computed scaled by the largest (the ratio
    does not change) so that no weight overflows; 0 when π can produce none of the logged sequences."""
    delta = np.asarray(logp, dtype=np.float64) - np.asarray(behaviour, dtype=np.float64)
    finite = np.isfinite(delta)
    if not finite.any():
        return 0.0
    weights = np.where(finite, np.exp(np.where(finite, delta, 0.0) - delta[finite].max()), 0.0)
    return snips(weights, values)


def effective_sample_size(weights: np.ndarray) -> float:
    total = float(weights.sum())
    squares = float((weights**2).sum())
    return total * total / squares if squares > 0 else 0.0


def snips(weights: np.ndarray, values: np.ndarray) -> float:
    """Σ w·v / Σ w (0 when every weight is 0)."""
    total = float(weights.sum())
    return float((weights * values).sum()) / total if total > 0 else 0.0


def off_policy(
    rewards: Sequence[float],
    behaviour: Sequence[float],
    challenger: Sequence[float],
    champion: Sequence[float],
    *,
    clip: float,
    confidence: float,
    resamples: int,
    seed: int,
) -> OffPolicy:
    """Estimate both models' mean reward on logged episodes (sequence log-probabilities per episode:
    `behaviour` as sampled, `challenger` and `champion` recomputed) and their difference."""
    n = len(rewards)
    if not n or not len(behaviour) == len(challenger) == len(champion) == n:
        raise ValueError("need one reward and three sequence logprobs per episode")
    r = np.asarray(rewards, dtype=np.float64)
    w1 = importance_weights(challenger, behaviour, clip)
    w0 = importance_weights(champion, behaviour, clip)
    index = resampled(n, resamples, seed)
    s1, s0 = w1[index], w0[index]  # (B, n)
    with np.errstate(invalid="ignore", divide="ignore"):
        v1 = np.where(s1.sum(1) > 0, (s1 * r[index]).sum(1) / s1.sum(1), 0.0)
        v0 = np.where(s0.sum(1) > 0, (s0 * r[index]).sum(1) / s0.sum(1), 0.0)
    return OffPolicy(
        **paired_estimate((snips(w1, r), snips(w0, r)), v1 - v0, (w1, w0), clip, confidence),
        unclipped_difference=unclipped_snips(challenger, behaviour, r)
        - unclipped_snips(champion, behaviour, r),
    )
