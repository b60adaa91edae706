"""The live canary's sequential test (evals/sequential.py) by seeded, vectorised simulation: coverage over
whole paths, type I error at the margin, power and decision times, min_n / max_n, unequal allocation,
guards, batch against one-by-one updates, and the errors. The decision times measured here are the
figures in docs/gate.md (Live canary: the sequential test)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
import pytest

from evals.sequential import (
    OUTCOMES,
    PASS,
    ConfidenceSequence,
    Guard,
    SequentialTest,
    confidence_sequence,
    decide,
)

pytestmark = pytest.mark.unit

Draw = Callable[[np.random.Generator, tuple[int, int]], np.ndarray]
ALPHA, MARGIN = 0.05, 0.05


def bernoulli(p: float) -> Draw:
    return lambda rng, shape: (rng.random(shape) < p).astype(np.float64)


def beta(a: float, b: float) -> Draw:
    return lambda rng, shape: rng.beta(a, b, shape)


def theorem_2(x: np.ndarray, alpha: float, c: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Waudby-Smith & Ramdas's Theorem 2 (PrPl-EB), written out one value at a time as in the paper."""
    lows, highs = [], []
    total = squares = bets = weighted = penalty = 0.0
    mean_before, variance_before = 0.5, 0.25
    for t, xi in enumerate(x, start=1):
        bet = min(math.sqrt(2 * math.log(2 / alpha) / (variance_before * t * math.log(1 + t))), c)
        total += xi
        mean = (0.5 + total) / (t + 1)
        bets += bet
        weighted += bet * xi
        penalty += 4 * (xi - mean_before) ** 2 * (-math.log(1 - bet) - bet) / 4
        squares += (xi - mean) ** 2
        mean_before, variance_before = mean, (0.25 + squares) / (t + 1)
        radius = (math.log(2 / alpha) + penalty) / bets
        lows.append(max(0.0, weighted / bets - radius))
        highs.append(min(1.0, weighted / bets + radius))
    return np.maximum.accumulate(lows), np.minimum.accumulate(highs)


def test_the_sequence_is_theorem_2_of_waudby_smith_and_ramdas() -> None:
    x = np.random.default_rng(0).beta(2, 5, 400)
    low, high = confidence_sequence(x, alpha=0.05)
    ref_low, ref_high = theorem_2(x, 0.05)
    assert np.allclose(low, ref_low, atol=1e-12) and np.allclose(high, ref_high, atol=1e-12)
    # the first value: λ₁ = c = 1/2, radius (log 40 + ψ)/λ₁ ≈ 7.5, so the interval is all of [0, 1]
    assert (low[0], high[0]) == (0.0, 1.0)
    assert 0.22 < low[-1] < x.mean() < high[-1] < 0.34


# ---- coverage over whole paths ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("draw", "mean"),
    [(bernoulli(0.1), 0.1), (bernoulli(0.5), 0.5), (bernoulli(0.9), 0.9), (beta(2, 5), 2 / 7)],
    ids=["bernoulli-0.1", "bernoulli-0.5", "bernoulli-0.9", "beta-2-5"],
)
def test_the_sequence_covers_the_mean_at_every_time(draw: Draw, mean: float) -> None:
    """1000 streams of 2000 values: the share whose sequence ever misses the mean, checked after every
    value, is at most alpha (measured at alpha 0.05: 0.7 %, 1.2 %, 1.3 % and 0.6 %)."""
    x = draw(np.random.default_rng(1), (1000, 2000))
    low, high = confidence_sequence(x, alpha=ALPHA)
    ever_missed = ((low > mean) | (high < mean)).any(axis=1).mean()
    assert ever_missed <= ALPHA
    assert (high - low)[:, -1].mean() < 0.15  # and it is not vacuous


def test_a_fixed_n_interval_monitored_after_every_value_misses_far_more_often() -> None:
    """The same check on the 95 % CLT interval (mean ± 1.96·sd/√n), read after every value from n = 30:
    45.7 % of streams leave it at some time, against 1.1 % for the sequence, though at n = 2000 alone
    it misses in 5.0 %, as it should."""
    x = bernoulli(0.5)(np.random.default_rng(2), (1000, 2000))
    n = np.arange(1, 2001)
    mean = np.cumsum(x, axis=1) / n
    sd = np.sqrt(np.maximum(np.cumsum(x**2, axis=1) / n - mean**2, 0.0))
    miss = np.abs(mean - 0.5) > 1.96 * sd / np.sqrt(n)
    naive = miss[:, 29:].any(axis=1).mean()
    low, high = confidence_sequence(x, alpha=ALPHA)
    sequence = ((low > 0.5) | (high < 0.5)).any(axis=1).mean()
    assert naive > 5 * ALPHA and sequence <= ALPHA
    assert naive > 20 * max(sequence, 0.001)


# ---- two arms, simulated -------------------------------------------------------------------------


def _at(path: np.ndarray, counts: np.ndarray, before: float) -> np.ndarray:
    """path[r, counts[r, t] − 1], and `before` where counts is 0 (the interval before any value)."""
    padded = np.concatenate([np.full((path.shape[0], 1), before), path], axis=1)
    return np.take_along_axis(padded, counts, axis=1)


def simulate(
    challenger: Draw,
    champion: Draw,
    *,
    share: float,
    runs: int,
    steps: int,
    seed: int,
    min_n: int = 100,
    max_n: int = 10**9,
    margin: float = MARGIN,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`runs` canaries of `steps` requests, each sent to the challenger with probability `share`, the
    test read after every request. Returns each run's first decision (code; 0 if none within `steps`)
    and the challenger's and the champion's observations at that time."""
    rng = np.random.default_rng(seed)
    to_challenger = rng.random((runs, steps)) < share
    n1 = np.cumsum(to_challenger, axis=1)
    n0 = np.arange(1, steps + 1) - n1
    low1, high1 = confidence_sequence(challenger(rng, (runs, max(int(n1[:, -1].max()), 1))), alpha=ALPHA / 2)
    low0, high0 = confidence_sequence(champion(rng, (runs, max(int(n0[:, -1].max()), 1))), alpha=ALPHA / 2)
    low = _at(low1, n1, 0.0) - _at(high0, n0, 1.0)
    high = _at(high1, n1, 1.0) - _at(low0, n0, 0.0)
    codes = decide(low, high, np.minimum(n1, n0), margin=margin, min_n=min_n, max_n=max_n)
    decided = codes != 0
    first = np.argmax(decided, axis=1)
    rows = np.arange(runs)
    return np.where(decided.any(axis=1), codes[rows, first], 0), n1[rows, first], n0[rows, first]


@pytest.mark.parametrize(
    ("share", "runs", "max_n"), [(0.5, 1000, 2000), (0.1, 400, 1000)], ids=["50-50", "10-90"]
)
def test_type_i_error_at_the_margin(share: float, runs: int, max_n: int) -> None:
    """The challenger exactly `margin` worse (0.45 vs 0.5), the test read after every request until
    max_n per arm: it passes in at most alpha of runs, and fails in at most alpha too (the boundary is
    an error either way). Measured: 1 pass and 0 fails of 1000 runs (50/50), 0 and 0 of 400 (10/90),
    every other run inconclusive at max_n: the union-bounded sequences are conservative."""
    steps = int(max_n / min(share, 1 - share) * 1.15)
    outcome, n1, n0 = simulate(
        bernoulli(0.45), bernoulli(0.5), share=share, runs=runs, steps=steps, seed=3, max_n=max_n
    )
    assert (outcome != 0).all()  # every run reached a decision within `steps`
    assert (outcome == PASS).mean() <= ALPHA
    assert (outcome == OUTCOMES.index("fail")).mean() <= ALPHA


# (name, challenger, champion, share, runs, steps, expected outcome, median challenger observations)
POWER = [
    ("equal-0.5", bernoulli(0.5), bernoulli(0.5), 0.5, 100, 50_000, "pass", 10_800),
    ("equal-0.8", bernoulli(0.8), bernoulli(0.8), 0.5, 200, 30_000, "pass", 5_700),
    ("equal-beta", beta(2, 5), beta(2, 5), 0.5, 200, 6_000, "pass", 610),
    ("better-0.55", bernoulli(0.55), bernoulli(0.5), 0.5, 200, 16_000, "pass", 2_100),
    ("worse-0.4", bernoulli(0.4), bernoulli(0.5), 0.5, 100, 50_000, "fail", 10_000),
    ("worse-0.3", bernoulli(0.3), bernoulli(0.5), 0.5, 200, 8_000, "fail", 600),
    ("equal-0.8-10pct", bernoulli(0.8), bernoulli(0.8), 0.1, 100, 80_000, "pass", 2_300),
    ("worse-0.3-10pct", bernoulli(0.3), bernoulli(0.5), 0.1, 200, 40_000, "fail", 260),
]


@pytest.mark.parametrize(
    ("challenger", "champion", "share", "runs", "steps", "expected", "median"),
    [case[1:] for case in POWER],
    ids=[case[0] for case in POWER],
)
def test_power_and_decision_times(
    challenger: Draw, champion: Draw, share: float, runs: int, steps: int, expected: str, median: int
) -> None:
    """Margin 0.05, alpha 0.05, min_n 100, read after every request. Median challenger observations to
    the decision (seed 1), the figures of docs/gate.md:

    equal, acceptance 0.5 (100 runs): pass, 10,783 (90th percentile 19,594);
    equal, acceptance 0.8: pass, 5,709 (p90 9,659);
    equal Beta(2, 5) rewards (sd 0.16): pass, 610 (p90 986);
    better by 0.05 (0.55 vs 0.5): pass, 2,098 (p90 3,885);
    worse by 0.1 (0.4 vs 0.5, 100 runs): fail, 9,972 (p90 18,113);
    worse by 0.2 (0.3 vs 0.5): fail, 608 (p90 1,145);
    10 % canary, equal at 0.8 (100 runs): pass, 2,284 challenger (20,691 champion);
    10 % canary, worse by 0.2: fail, 259 challenger (2,266 champion).

    At least 95 % of runs reach the expected decision within `steps` requests and none the other one."""
    outcome, n1, _ = simulate(challenger, champion, share=share, runs=runs, steps=steps, seed=1)
    code = OUTCOMES.index(expected)
    assert (outcome == code).mean() >= 0.95
    assert not np.isin(outcome, [c for c in (1, 2) if c != code]).any()
    assert 0.8 * median <= np.median(n1[outcome == code]) <= 1.2 * median


def test_the_class_reads_as_the_simulation_after_every_request() -> None:
    """SequentialTest fed one request at a time decides at the same time with the same outcome as the
    vectorised simulation of the same draws."""
    runs, steps, share = 4, 8000, 0.3
    outcome, n1, n0 = simulate(bernoulli(0.3), bernoulli(0.5), share=share, runs=runs, steps=steps, seed=5)
    rng = np.random.default_rng(5)
    to_challenger = rng.random((runs, steps)) < share
    x1 = bernoulli(0.3)(rng, (runs, int(to_challenger.sum(1).max())))
    x0 = bernoulli(0.5)(rng, (runs, int((~to_challenger).sum(1).max())))
    for r in range(runs):
        test, i1, i0 = SequentialTest(alpha=ALPHA, margin=MARGIN, min_n=100, max_n=10**9), 0, 0
        for goes_to_challenger in to_challenger[r]:
            if goes_to_challenger:
                decision, i1 = test.update(challenger=[x1[r, i1]]), i1 + 1
            else:
                decision, i0 = test.update(champion=[x0[r, i0]]), i0 + 1
            if decision.final:
                break
        assert outcome[r] != 0 and (OUTCOMES.index(decision.outcome), i1, i0) == (outcome[r], n1[r], n0[r])
        assert decision.outcome == "fail" and decision.cause == "inferior"


# ---- min_n, max_n, the record ------------------------------------------------------------------


def test_no_decision_before_min_n_per_arm_then_pass() -> None:
    test = SequentialTest(alpha=ALPHA, margin=MARGIN, min_n=50, max_n=1000)
    decision = test.update(challenger=[1.0] * 49, champion=[0.0] * 400)  # overwhelming, but 49 < 50
    assert decision.outcome == "continue" and decision.cause == "running"
    assert "below min_n 50" in decision.reason and decision.difference.low > 0
    decision = test.update(challenger=[1.0])
    assert (decision.outcome, decision.cause) == ("pass", "non_inferior")
    assert decision.difference.challenger.n == 50 and decision.difference.champion.n == 400
    record = decision.as_dict()
    assert record["alpha"] == ALPHA and record["margin"] == MARGIN and record["min_n"] == 50
    assert record["difference"]["estimate"] == 1.0 and record["difference"]["challenger"]["mean"] == 1.0
    assert "lower bound > −margin" in record["reason"]
    assert json.loads(json.dumps(record)) == record  # plain JSON, ready for the store


def test_max_n_ends_inconclusive_and_the_decision_is_final() -> None:
    """Equal arms with margin 0: the difference's interval always holds 0, so neither side is ever
    shown; at max_n per arm (the smaller arm counts) the test is inconclusive."""
    x = bernoulli(0.5)(np.random.default_rng(7), (2, 300))
    test = SequentialTest(alpha=ALPHA, margin=0.0, min_n=10, max_n=300)
    assert test.update(challenger=x[0, :200], champion=x[1]).outcome == "continue"  # 200 < 300
    decision = test.update(challenger=x[0, 200:])
    assert (decision.outcome, decision.cause) == ("inconclusive", "max_n")
    assert decision.difference.low < 0 < decision.difference.high
    assert "max_n 300 reached" in decision.reason
    with pytest.raises(ValueError, match="already decided"):
        test.update(challenger=[0.5])


def test_unequal_allocation_counts_the_smaller_arm() -> None:
    """A 10 % canary: the champion's 9,000 observations do not satisfy min_n for the challenger."""
    rng = np.random.default_rng(8)
    test = SequentialTest(alpha=ALPHA, margin=MARGIN, min_n=1000, max_n=5000)
    decision = test.update(challenger=rng.beta(8, 2, 999), champion=rng.beta(2, 8, 9000))
    assert decision.outcome == "continue" and decision.difference.low > 0.5
    assert test.update(challenger=rng.beta(8, 2, 1)).outcome == "pass"


# ---- guards ------------------------------------------------------------------------------------


def test_a_guard_trips_at_once_before_min_n() -> None:
    """Errors 20 % on the challenger vs 2 % on the champion, allowed increase 0.05 at alpha 0.01: the
    guard fails the test long before the primary metric's min_n of 1000 (measured: after 252
    challenger and 2268 champion requests)."""
    rng = np.random.default_rng(9)
    errors = Guard("errors", allowed_increase=0.05, alpha=0.01)
    test = SequentialTest(alpha=ALPHA, margin=MARGIN, min_n=1000, max_n=5000, guards=[errors])
    for step in range(1, 10_001):
        to_challenger = step % 10 == 0
        rate = 0.2 if to_challenger else 0.02
        value = [float(rng.random() < rate)]
        decision = test.update_guard("errors", **{"challenger" if to_challenger else "champion": value})
        if decision.final:
            break
    assert (decision.outcome, decision.cause) == ("fail", "guard")
    reading = decision.guards[0]
    assert reading.tripped and reading.difference.low > 0.05 and reading.guard == errors
    assert reading.difference.challenger.n < 500 and decision.difference.challenger.n == 0
    assert decision.reason.startswith("guard errors:") and "allowed +0.0500" in decision.reason


def test_guards_do_not_trip_on_equal_rates() -> None:
    """1000 canaries with equal error rates (5 %), 2000 requests per arm, allowed increase 0 (the
    strictest), guard alpha 0.01: the share that ever trips is at most 0.01 (measured: 0)."""
    rng = np.random.default_rng(10)
    low1, _ = confidence_sequence(bernoulli(0.05)(rng, (1000, 2000)), alpha=0.005)
    _, high0 = confidence_sequence(bernoulli(0.05)(rng, (1000, 2000)), alpha=0.005)
    assert ((low1 - high0) > 0.0).any(axis=1).mean() <= 0.01
    test = SequentialTest(
        alpha=ALPHA, margin=MARGIN, min_n=10, max_n=10**6, guards=[Guard("non_answers", 0.0, 0.01)]
    )
    x = bernoulli(0.05)(rng, (2, 2000))
    decision = test.update_guard("non_answers", challenger=x[0], champion=x[1])
    assert decision.outcome == "continue" and not decision.guards[0].tripped


# ---- batches -----------------------------------------------------------------------------------


def test_a_batch_gives_exactly_the_bounds_of_one_by_one_updates() -> None:
    x = np.random.default_rng(11).beta(2, 5, 777)
    one, batch, pieces = ConfidenceSequence(0.05), ConfidenceSequence(0.05), ConfidenceSequence(0.05)
    for value in x:
        one.update(float(value))
    batch.extend(x)
    for chunk in np.array_split(x, 13):
        pieces.extend(chunk)
    assert one.sums == batch.sums == pieces.sums  # bit for bit
    assert one.arm.n == 777 and one.arm.low < x.mean() < one.arm.high
    low, high = confidence_sequence(x, alpha=0.05)
    assert (low[-1], high[-1]) == (one.arm.low, one.arm.high)


def test_a_batched_test_decides_as_the_one_by_one_test() -> None:
    rng = np.random.default_rng(12)
    x1, x0 = rng.beta(5, 5, 300), rng.beta(5, 5, 900)
    # min_n 300: no decision before the last update, so both take their one decision on the same data
    batched = SequentialTest(alpha=ALPHA, margin=0.1, min_n=300, max_n=10**6)
    single = SequentialTest(alpha=ALPHA, margin=0.1, min_n=300, max_n=10**6)
    for i in range(300):
        single.update(challenger=[x1[i]], champion=x0[3 * i : 3 * i + 3])
    assert batched.update(challenger=x1, champion=x0) == single.decision
    assert single.decision.outcome == "pass"


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([0.5, 1.5], r"1\.5 at index \(1,\) is outside \[0, 1\]"),
        ([0.1, math.nan], "NaN at index"),
        ([-0.01], "outside"),
        ([math.inf], "outside"),
    ],
)
def test_values_outside_the_unit_interval_are_refused(values: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        confidence_sequence(values, alpha=0.05)
    test = SequentialTest(alpha=ALPHA, margin=MARGIN, min_n=1, max_n=10, guards=[Guard("errors", 0.1, 0.01)])
    with pytest.raises(ValueError, match="champion: "):
        test.update(challenger=[0.5], champion=values)
    assert test.primary.challenger.arm.n == 0  # a refused update moves neither arm
    with pytest.raises(ValueError, match="challenger: "):
        test.update_guard("errors", challenger=values)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 0.0}, r"alpha must be in \(0, 1\)"),
        ({"alpha": 1.0}, r"alpha must be in \(0, 1\)"),
        ({"alpha": math.nan}, r"alpha must be in \(0, 1\)"),
        ({"margin": -0.01}, r"margin must be in \[0, 1\)"),
        ({"margin": math.nan}, r"margin must be in \[0, 1\)"),
        ({"min_n": 200, "max_n": 100}, r"min_n \(200\) must not exceed max_n \(100\)"),
        ({"max_n": 0}, "max_n an int ≥ 1"),
        ({"guards": [Guard("a", 0.1, 0.01), Guard("a", 0.2, 0.01)]}, "guard names must be unique"),
        ({"truncation": 1.0}, r"truncation .* must be in \(0, 1\)"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    settings: dict[str, object] = {"alpha": ALPHA, "margin": MARGIN, "min_n": 10, "max_n": 100} | kwargs
    with pytest.raises(ValueError, match=message):
        SequentialTest(**settings)  # type: ignore[arg-type]


def test_bad_guards_and_unknown_guard_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"guard 'errors': alpha must be in \(0, 1\)"):
        Guard("errors", 0.1, 1.5)
    with pytest.raises(ValueError, match=r"allowed_increase must be in \[0, 1\)"):
        Guard("errors", -0.1, 0.01)
    test = SequentialTest(alpha=ALPHA, margin=MARGIN, min_n=1, max_n=10)
    with pytest.raises(ValueError, match="no guard named 'latency'"):
        test.update_guard("latency", challenger=[1.0])
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\)"):
        ConfidenceSequence(2.0)
