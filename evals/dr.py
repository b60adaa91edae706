"""The eval gate's doubly robust off-policy estimate (docs/gate.md, Suites: ope; docs/algorithms.md,
Doubly robust off-policy evaluation).

SNIPS (evals/stats.py `off_policy`) reweights the logged rewards themselves, so its variance is that
of the rewards under the weights, and at real completion lengths the weights' effective sample size
collapses. The doubly robust estimate (Dudík, Langford & Li 2011, https://arxiv.org/abs/1103.4601;
Jiang & Li 2016, https://arxiv.org/abs/1511.03722) reweights only what a reward model q (the *direct
method*) gets wrong, and takes the rest from q's predictions on completions sampled from the model
itself:

    V = mean_i q_target_i + Σ_i w_i (r_i − q_logged_i) / Σ_i w_i       (self-normalised)

with q_logged_i the prediction for the logged completion of episode i and q_target_i the mean
prediction over the completions sampled from the model on prompt i. It is unbiased when either the
weights or q are right, and its variance is that of the residuals r − q: a q that explains the
rewards shrinks it. q is a ridge regression on a small deterministic featuriser of the completion
(`featurise`), *cross-fitted* (Chernozhukov et al. 2018, https://arxiv.org/abs/1608.00060): every
episode is predicted by a model not fitted on it (`cross_fit`), so q's overfitting does not leak into
the residuals, and completions sampled on prompt i are predicted by episode i's fold model.

Pure numpy: no model, no I/O. Seeded, so a gate run is reproducible.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from evals.stats import PairedEstimate, paired_estimate, resampled

Floats = Sequence[float] | np.ndarray  # per episode
BUCKETS = 2**12  # hashed unigram + bigram counts of the completion
DENSE = 4  # log tokens, log chars, cut off by its length limit, a non-answer
ALPHAS = (0.1, 1.0, 10.0, 100.0, 1000.0)  # ridge penalties each fold chooses from (leave-one-out)
_WORD = re.compile(r"\w+|[^\w\s]")


def featurise(text: str, tokens: int, finish_reason: str | None, no_action: re.Pattern[str]) -> np.ndarray:
    """One completion's features (`BUCKETS + DENSE`): hashed unigram and bigram counts with sublinear
    tf (1 + log count; CRC-32, the same in every process, unlike `hash()`), log(1 + tokens),
    log(1 + chars), whether it was cut off (finish_reason "length") and whether it is a non-answer
    (`gate.alarms.no_action_pattern`, searched as deployer/alarms.py `non_answer` does)."""
    words = _WORD.findall(text.lower())
    grams = Counter(zlib.crc32(w.encode()) % BUCKETS for w in words)
    grams.update(zlib.crc32(f"{a}\0{b}".encode()) % BUCKETS for a, b in zip(words, words[1:], strict=False))
    row = np.zeros(BUCKETS + DENSE)
    for bucket, count in grams.items():
        row[bucket] = 1.0 + math.log(count)
    row[BUCKETS:] = (
        math.log1p(tokens),
        math.log1p(len(text)),
        float(finish_reason == "length"),
        float(no_action.search(text.strip()) is not None),
    )
    return row


@dataclass(frozen=True)
class Ridge:
    """One fold's reward model: q(x) = x·coef + intercept."""

    coef: np.ndarray  # (d,)
    intercept: float
    alpha: float

    def predict(self, features: np.ndarray) -> np.ndarray:
        return np.asarray(np.asarray(features, dtype=np.float64) @ self.coef + self.intercept)


def ridge(features: np.ndarray, rewards: np.ndarray, alphas: Sequence[float] = ALPHAS) -> Ridge:
    """Ridge regression with an intercept, its penalty chosen among `alphas` by exact leave-one-out
    error; solved through the eigendecomposition of the smaller of XᵀX (d×d) and XXᵀ (n×n: the gate
    has hundreds of episodes and thousands of features)."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(rewards, dtype=np.float64)
    mx, my = x.mean(axis=0), float(y.mean())
    xc, yc = x - mx, y - my
    primal = x.shape[1] < x.shape[0]
    eigval, eigvec = np.linalg.eigh(xc.T @ xc if primal else xc @ xc.T)
    eigval = np.clip(eigval, 0.0, None)
    # In the eigenbasis: scores s = XV (primal) or U√Λ (dual), so that the hat matrix is
    # H = s diag(1/(Λ+α)) sᵀ either way and the fit is s diag(1/(Λ+α)) sᵀ y.
    scores = xc @ eigvec if primal else eigvec * np.sqrt(eigval)
    sty = scores.T @ yc
    best: tuple[float, float] | None = None
    for alpha in alphas:
        inverse = 1.0 / (eigval + alpha)
        fitted = scores @ (inverse * sty)
        hat = (scores**2) @ inverse
        loo = float(np.mean(((yc - fitted) / np.maximum(1.0 - hat, 1e-9)) ** 2))
        if best is None or loo < best[0]:
            best = (loo, alpha)
    assert best is not None
    alpha = best[1]
    if primal:  # (XᵀX + αI)⁻¹ Xᵀy
        coef = eigvec @ ((eigvec.T @ (xc.T @ yc)) / (eigval + alpha))
    else:  # Xᵀ (XXᵀ + αI)⁻¹ y
        coef = xc.T @ (eigvec @ ((eigvec.T @ yc) / (eigval + alpha)))
    return Ridge(coef=coef, intercept=my - float(mx @ coef), alpha=alpha)


@dataclass(frozen=True)
class CrossFit:
    """A cross-fitted reward model: `fold[i]` is episode i's fold, `models[k]` was fitted on every
    episode outside fold k, `predicted[i]` is episode i's out-of-fold prediction."""

    fold: np.ndarray  # (n,) int
    models: list[Ridge]
    predicted: np.ndarray  # (n,)

    def predict(self, features: np.ndarray, episode: int) -> np.ndarray:
        """Predictions for completions sampled on episode `episode`'s prompt, by its fold's model."""
        return self.models[int(self.fold[episode])].predict(np.atleast_2d(features))


def cross_fit(features: np.ndarray, rewards: Floats, *, folds: int = 5, seed: int) -> CrossFit:
    """A ridge reward model fitted K-fold (`folds`, at most one per episode; episodes shuffled with
    `seed`), each episode predicted by the model fitted without its fold."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(rewards, dtype=np.float64)
    n = len(y)
    if n < 2 or len(x) != n:
        raise ValueError(f"need at least two episodes with one feature row each; got {len(x)} and {n}")
    k = min(folds, n)
    fold = np.empty(n, dtype=np.int64)
    fold[np.random.default_rng(seed).permutation(n)] = np.arange(n) % k
    models = [ridge(x[fold != f], y[fold != f]) for f in range(k)]
    predicted = np.empty(n)
    for f, model in enumerate(models):
        predicted[fold == f] = model.predict(x[fold == f])
    return CrossFit(fold=fold, models=models, predicted=predicted)


def scaled_weights(logp: Sequence[float], behaviour: Sequence[float]) -> np.ndarray:
    """The unclipped weights exp(log π − log μ) divided by the largest (a self-normalised estimate does
    not change; no weight overflows); all 0 when π can produce none of the logged sequences."""
    delta = np.asarray(logp, dtype=np.float64) - np.asarray(behaviour, dtype=np.float64)
    finite = np.isfinite(delta)
    if not finite.any():
        return np.zeros(len(delta))
    return np.asarray(np.where(finite, np.exp(np.where(finite, delta, 0.0) - delta[finite].max()), 0.0))


def out_of_fold_r2(rewards: Floats, predicted: Floats) -> float:
    """1 − Σ(r − q)² / Σ(r − r̄)² of the out-of-fold predictions: how much of the rewards' variance
    the direct method explains on episodes it was not fitted on (≤ 0: none; −inf when the rewards
    are constant and q misses them)."""
    r = np.asarray(rewards, dtype=np.float64)
    residual = float(((r - np.asarray(predicted, dtype=np.float64)) ** 2).sum())
    total = float(((r - r.mean()) ** 2).sum())
    if total == 0.0:
        return 0.0 if residual == 0.0 else -math.inf
    return 1.0 - residual / total


# The least share of `min_ess` a DR estimate needs however well the reward model fits: its R² is
# itself estimated, and a near-perfect fit on few episodes must not make a handful of them conclusive.
DR_MIN_ESS_SHARE = 0.25


def dr_min_ess(min_ess: float, r2: float) -> float:
    """The effective sample size the weights must reach for a DR estimate to be conclusive:
    `min_ess` × (1 − max(R², 0)), and never below `DR_MIN_ESS_SHARE` × `min_ess`. A heuristic:
    DR's weighted term carries the residuals, whose variance is the rewards' shrunk by (1 − R²), so
    the weights need that much fewer effective samples for the same precision as SNIPS at `min_ess`."""
    return min_ess * max(1.0 - max(r2, 0.0), DR_MIN_ESS_SHARE)


class DoublyRobust(PairedEstimate):
    """Self-normalised doubly robust estimates of both models on the same logs."""

    direct_difference: float  # mean q_target challenger − champion: the direct method alone


def dr_value(weights: np.ndarray, residual: np.ndarray, q_target: np.ndarray) -> np.ndarray:
    """DR values along the last axis (episodes; leading axes are bootstrap resamples): mean q_target + Σ w·(r − q) / Σ w (the mean alone where Σ w = 0)."""
    total = weights.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        correction = np.where(total > 0, (weights * residual).sum(-1) / total, 0.0)
    return np.asarray(q_target.mean(-1) + correction)


def doubly_robust(
    rewards: Floats,
    q_logged: Floats,
    q_target: tuple[Floats, Floats],
    weights_chal: np.ndarray,
    weights_champ: np.ndarray,
    *,
    clip: float,
    confidence: float,
    resamples: int,
    seed: int,
) -> DoublyRobust:
    """Both models' DR estimates (`q_target`: challenger's, champion's mean prediction per prompt;
    the weights already clipped at `clip`, as `importance_weights` returns them) and a paired
    bootstrap interval of their difference: episodes resampled, the same indices for both models."""
    r = np.asarray(rewards, dtype=np.float64)
    n = len(r)
    q1, q0 = (np.asarray(q, dtype=np.float64) for q in q_target)
    w1, w0 = np.asarray(weights_chal, dtype=np.float64), np.asarray(weights_champ, dtype=np.float64)
    if not n or not len(q_logged) == len(q1) == len(q0) == len(w1) == len(w0) == n:
        raise ValueError("need one reward, prediction, two target predictions and two weights per episode")
    residual = r - np.asarray(q_logged, dtype=np.float64)
    index = resampled(n, resamples, seed)
    boot = dr_value(w1[index], residual[index], q1[index]) - dr_value(w0[index], residual[index], q0[index])
    values = float(dr_value(w1, residual, q1)), float(dr_value(w0, residual, q0))
    return DoublyRobust(
        **paired_estimate(values, boot, (w1, w0), clip, confidence),
        direct_difference=float(q1.mean() - q0.mean()),
    )
