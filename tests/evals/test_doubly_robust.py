"""The doubly robust off-policy estimate (evals/dr.py, docs/gate.md Suites: ope): on synthetic logs
where the target policies move far enough from the logging one that SNIPS's effective sample size
is small, DR's interval is narrower and still covers the true difference; with a reward model that
explains nothing it stays unbiased; cross-fitting never predicts an episode with a model fitted on it."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

from evals.dr import (
    BUCKETS,
    DENSE,
    DoublyRobust,
    cross_fit,
    doubly_robust,
    dr_min_ess,
    featurise,
    out_of_fold_r2,
    ridge,
)
from evals.stats import OffPolicy, importance_weights, off_policy

pytestmark = pytest.mark.unit

RUNS = 200
CONFIDENCE = 0.975  # each side: a 95 % two-sided interval


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return np.asarray(e / e.sum())


def synthetic(
    seed: int, *, explained: bool, n: int = 400, actions: int = 40, samples: int = 2
) -> dict[str, Any]:
    """Logged bandit data: `actions` completions with 6 features each, logged uniformly, the two
    targets softmax tilts of the features (SNIPS ESS about 25 of 400 at clip 10). With `explained`
    the reward is linear in the features plus noise sd 0.3; without, pure noise (true difference 0)."""
    rng = np.random.default_rng(seed)
    phi = rng.normal(size=(actions, 6))
    beta = rng.normal(size=6)
    f = phi @ (beta / np.linalg.norm(beta)) if explained else np.zeros(actions)
    mu = np.full(actions, 1.0 / actions)
    tilt = rng.normal(size=6)
    p1 = _softmax(1.6 * phi @ tilt)
    p0 = _softmax(1.6 * phi @ (-tilt + 0.3 * rng.normal(size=6)))
    logged = rng.choice(actions, size=n, p=mu)
    rewards = f[logged] + (0.3 if explained else 1.0) * rng.normal(size=n)
    return {
        "phi": phi,
        "logged": logged,
        "rewards": rewards,
        "behaviour": np.log(mu[logged]),
        "chal": np.log(p1[logged]),
        "champ": np.log(p0[logged]),
        "sampled": (
            rng.choice(actions, size=(n, samples), p=p1),
            rng.choice(actions, size=(n, samples), p=p0),
        ),
        "truth": float(p1 @ f - p0 @ f),
    }


def estimate(data: dict[str, Any], seed: int, clip: float = 10.0) -> tuple[DoublyRobust, OffPolicy, float]:
    phi, logged, rewards = data["phi"], data["logged"], data["rewards"]
    fit = cross_fit(phi[logged], rewards, seed=seed)
    q1, q0 = (
        np.asarray([fit.predict(phi[sampled[i]], i).mean() for i in range(len(rewards))])
        for sampled in data["sampled"]
    )
    w1 = importance_weights(data["chal"], data["behaviour"], clip)
    w0 = importance_weights(data["champ"], data["behaviour"], clip)
    common: dict[str, Any] = {"clip": clip, "confidence": CONFIDENCE, "resamples": 400, "seed": seed}
    dr = doubly_robust(rewards, fit.predicted, (q1, q0), w1, w0, **common)
    snips = off_policy(rewards, data["behaviour"], data["chal"], data["champ"], **common)
    return dr, snips, out_of_fold_r2(rewards, fit.predicted)


def test_dr_is_narrower_than_snips_and_covers_the_truth_when_the_reward_model_explains_the_rewards() -> None:
    narrower = covered = 0
    ess, r2s = [], []
    for seed in range(RUNS):
        data = synthetic(seed, explained=True)
        dr, snips, r2 = estimate(data, seed)
        width = dr.difference.high - dr.difference.low
        narrower += width < snips.difference.high - snips.difference.low
        covered += dr.difference.low <= data["truth"] <= dr.difference.high
        ess.append(min(snips.ess_challenger, snips.ess_champion))
        r2s.append(r2)
    assert np.median(ess) < 32  # SNIPS would be inconclusive at the default gate.ope.min_ess
    assert np.median(r2s) > 0.8
    assert narrower >= 0.9 * RUNS
    assert covered >= 0.85 * RUNS


def test_dr_stays_unbiased_with_a_reward_model_that_explains_nothing() -> None:
    covered = 0
    estimates, r2s = [], []
    for seed in range(RUNS):
        data = synthetic(seed, explained=False)
        dr, _, r2 = estimate(data, seed)
        covered += dr.difference.low <= data["truth"] <= dr.difference.high
        estimates.append(dr.difference.estimate)
        r2s.append(r2)
    assert data["truth"] == 0.0
    assert np.median(r2s) <= 0.0  # nothing to explain: the gate's auto choice would not use DR
    assert covered >= 0.85 * RUNS
    assert abs(np.mean(estimates)) < 3 * np.std(estimates) / math.sqrt(RUNS)  # mean ≈ 0


def test_the_dr_estimate_by_hand() -> None:
    # r − q = (1, −1, 0); weights (1, 3, 0) and (2, 0, 2); q_target means 0.5 and 0.25.
    dr = doubly_robust(
        [1.0, 0.0, 1.0],
        [0.0, 1.0, 1.0],
        ([0.5, 0.5, 0.5], [0.0, 0.5, 0.25]),
        np.asarray([1.0, 3.0, 0.0]),
        np.asarray([2.0, 0.0, 2.0]),
        clip=3.0,
        confidence=0.95,
        resamples=50,
        seed=0,
    )
    assert dr.challenger == pytest.approx(0.5 + (1 - 3) / 4)
    assert dr.champion == pytest.approx(0.25 + 2 / 4)
    assert dr.difference.estimate == pytest.approx(-0.75)
    assert dr.clipped_challenger == pytest.approx(1 / 3)
    assert dr.ess_challenger == pytest.approx(16 / 10)
    assert dr.direct_difference == pytest.approx(0.25)


def test_identical_weights_and_samples_give_exactly_zero() -> None:
    w = np.asarray([0.5, 2.0, 1.0, 4.0])
    dr = doubly_robust(
        [1, 0, 1, 1],
        [0.4, 0.6, 0.5, 0.7],
        ([0.3] * 4, [0.3] * 4),
        w,
        w,
        clip=10,
        confidence=0.95,
        resamples=100,
        seed=3,
    )
    assert dr.difference.estimate == 0.0 and dr.difference.low == 0.0 and dr.difference.high == 0.0


def test_cross_fitting_never_predicts_an_episode_with_a_model_fitted_on_it() -> None:
    # One-hot features, one column per episode: a model fitted on episode i would reproduce its
    # reward; one not fitted on it sees an all-zero column and predicts its training mean.
    n = 23
    rewards = np.random.default_rng(1).normal(size=n)
    fit = cross_fit(np.eye(n), rewards, folds=5, seed=4)
    assert sorted(set(fit.fold.tolist())) == [0, 1, 2, 3, 4]
    for i in range(n):
        outside = fit.fold != fit.fold[i]
        assert fit.predicted[i] == pytest.approx(rewards[outside].mean())
        assert fit.predict(np.eye(n)[i], i)[0] == pytest.approx(fit.predicted[i])
    # Each fold's model is fitted on exactly the other folds.
    for k, model in enumerate(fit.models):
        again = ridge(np.eye(n)[fit.fold != k], rewards[fit.fold != k])
        np.testing.assert_allclose(model.coef, again.coef)


def test_the_r2_and_the_ess_floor() -> None:
    assert out_of_fold_r2([0, 1, 0, 1], [0, 1, 0, 1]) == 1.0
    assert out_of_fold_r2([0, 1, 0, 1], [0.5] * 4) == 0.0
    assert out_of_fold_r2([0, 1, 0, 1], [1, 0, 1, 0]) == -3.0
    assert dr_min_ess(32, 0.75) == 8.0
    assert dr_min_ess(32, -0.5) == 32.0  # a model worse than the mean relaxes nothing
    assert dr_min_ess(32, 0.99) == 8.0  # however good the fit, never below a quarter of min_ess


def test_the_features_are_deterministic_and_say_length_cut_off_and_non_answer() -> None:
    pattern = re.compile(r"(?i)^i (cannot|can't)")
    a = featurise("I cannot help with that.", 6, "stop", pattern)
    b = featurise("I cannot help with that.", 6, "stop", pattern)
    assert a.shape == (BUCKETS + DENSE,)
    np.testing.assert_array_equal(a, b)
    assert a[BUCKETS + 3] == 1.0 and a[BUCKETS + 2] == 0.0
    assert a[BUCKETS] == pytest.approx(math.log(7)) and a[BUCKETS + 1] == pytest.approx(math.log(25))
    cut = featurise("the the the", 3, "length", pattern)
    assert cut[BUCKETS + 2] == 1.0 and cut[BUCKETS + 3] == 0.0
    assert cut[:BUCKETS].max() == pytest.approx(1 + math.log(3))  # sublinear tf of "the"
