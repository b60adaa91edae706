"""The count guards of the live canary's test (evals/sequential.py, Guards on counts): the
conjugate-mixture confidence sequence of a rate from (hits, n) alone, hand-worked at n = 1, its
bounds where the martingale crosses 1/alpha, its coverage over whole paths by seeded simulation,
and a count guard that trips, or not, inside `SequentialTest`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evals.sequential import MIXTURE_PRIOR, Guard, SequentialTest, rate_bounds, rate_difference

pytestmark = pytest.mark.unit


def log_martingale(x: np.ndarray, p: float) -> np.ndarray:
    """log M_t(p) after each value of the 0/1 paths x (..., T), written the other way round from the
    module: the mixture's likelihood is the product of its predictions, P(X_t = 1 | S_{t−1}) =
    (a + S_{t−1}) / (a + b + t − 1), so no log-gamma is needed."""
    a, b = MIXTURE_PRIOR
    t = np.arange(x.shape[-1], dtype=np.float64)  # t − 1
    before = np.cumsum(x, axis=-1) - x  # S_{t−1}
    one = (a + before) / (a + b + t)
    mixture = np.cumsum(np.where(x == 1, np.log(one), np.log1p(-one)), axis=-1)
    hits = np.cumsum(x, axis=-1)
    out: np.ndarray = mixture - hits * math.log(p) - (t + 1 - hits) * math.log1p(-p)
    return out


def at_end(hits: int, n: int, p: float) -> float:
    """log M_n(p) after `hits` ones in `n` values (any order: the mixture is exchangeable)."""
    return float(log_martingale(np.array([1.0] * hits + [0.0] * (n - hits)), p)[-1])


def test_one_value_by_hand() -> None:
    # n = 1, no hit: M_1(p) = B(1/2, 3/2) / B(1/2, 1/2) / (1 − p) = (π/2) / π / (1 − p) = 1 / (2 (1 − p)),
    # below 1/alpha = 20 exactly when p < 1 − 1/40 = 0.975.
    low, high = rate_bounds(0, 1, 0.05)
    assert low == 0.0 and high == pytest.approx(0.975, abs=1e-12)
    low, high = rate_bounds(1, 1, 0.05)  # the mirror image
    assert low == pytest.approx(0.025, abs=1e-12) and high == 1.0
    assert rate_bounds(0, 0, 0.05) == (0.0, 1.0)


@pytest.mark.parametrize(("hits", "n"), [(0, 50), (3, 1000), (40, 200), (999, 1000), (5000, 10000)])
def test_the_bounds_are_where_the_martingale_crosses_one_over_alpha(hits: int, n: int) -> None:
    alpha = 0.01
    low, high = rate_bounds(hits, n, alpha)
    assert low <= hits / n <= high
    threshold = math.log(1 / alpha)
    if low > 0:  # just outside is rejected, just inside is not
        assert at_end(hits, n, low - 1e-9) > threshold > at_end(hits, n, low + 1e-9)
    if high < 1:
        assert at_end(hits, n, high + 1e-9) > threshold > at_end(hits, n, high - 1e-9)


def test_the_rate_is_covered_at_every_time_with_probability_at_least_1_minus_alpha() -> None:
    """2,000 paths of 5,000 requests erring with probability 0.02: the share of paths whose rate is
    outside the sequence at some time (M_t(p) ≥ 1/alpha for some t) stays below alpha; a fixed-n
    95 % interval read at every time would leave it in far more."""
    rng = np.random.default_rng(38)
    p, alpha = 0.02, 0.05
    x = (rng.random((2000, 5000)) < p).astype(np.float64)
    hits, n = np.cumsum(x, axis=1), np.arange(1, 5001)
    outside = (log_martingale(x, p) >= math.log(1 / alpha)).any(axis=1)
    assert outside.mean() <= alpha
    mean = hits / n
    half = 1.96 * np.sqrt(np.maximum(mean * (1 - mean), 1e-12) / n)
    assert (np.abs(mean - p) > half)[:, 29:].any(axis=1).mean() > 3 * alpha  # from n = 30 on


def test_a_count_guard_trips_on_a_real_increase_and_not_on_noise() -> None:
    def test() -> SequentialTest:
        return SequentialTest(
            alpha=0.05, margin=0.05, min_n=1000, max_n=10_000, count_guards=[Guard("errors", 0.01, 0.01)]
        )

    worse = test().set_guard_counts("errors", challenger=(60, 1000), champion=(20, 9000))
    assert (worse.outcome, worse.cause) == ("fail", "guard") and "guard errors" in worse.reason
    (reading,) = worse.guards
    assert reading.tripped and reading.difference.challenger.n == 1000
    assert reading.difference.estimate == pytest.approx(0.06 - 20 / 9000)
    same = test().set_guard_counts("errors", challenger=(3, 1000), champion=(20, 9000))
    assert same.outcome == "continue" and not same.guards[0].tripped
    few = test().set_guard_counts("errors", challenger=(2, 10), champion=(0, 90))
    assert few.outcome == "continue"  # 20 % of 10 requests: not enough to say it is over +1 %


def test_a_count_guard_is_refused_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="guard names must be unique"):
        SequentialTest(
            alpha=0.05,
            margin=0.05,
            min_n=1,
            max_n=10,
            guards=[Guard("a", 0.1, 0.01)],
            count_guards=[Guard("a", 0.1, 0.01)],
        )
    test = SequentialTest(alpha=0.05, margin=0.05, min_n=1, max_n=10, count_guards=[Guard("e", 0.1, 0.01)])
    with pytest.raises(ValueError, match="no count guard named 'x'"):
        test.set_guard_counts("x")
    with pytest.raises(ValueError, match="0 ≤ hits ≤ n"):
        test.set_guard_counts("e", challenger=(3, 2))
    difference = rate_difference((0, 0), (0, 0), 0.01)
    assert (difference.low, difference.high, difference.estimate) == (-1.0, 1.0, None)
