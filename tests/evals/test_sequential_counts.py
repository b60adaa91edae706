"""The count guards of the live canary's test (evals/sequential.py, Guards on counts): the
conjugate-mixture confidence sequence of a rate from (hits, n) alone, hand-worked at n = 1, its
bounds where the martingale crosses 1/alpha, its coverage over whole paths by seeded simulation,
and a count guard that trips, or not, inside `SequentialTest`."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import gammaln

from evals.sequential import MIXTURE_PRIOR, Guard, SequentialTest, rate_bounds, rate_difference

pytestmark = pytest.mark.unit


def log_martingale(hits: np.ndarray, n: np.ndarray, p: float) -> np.ndarray:
    """log M_n(p) of the Beta(1/2, 1/2) mixture, vectorised (scipy's log-gamma)."""
    a, b = MIXTURE_PRIOR

    def log_beta(x: np.ndarray | float, y: np.ndarray | float) -> np.ndarray:
        return np.asarray(gammaln(x) + gammaln(y) - gammaln(np.add(x, y)))

    mixture = log_beta(a + hits, b + n - hits) - log_beta(a, b)
    return mixture - hits * math.log(p) - (n - hits) * math.log1p(-p)


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
    h, t = np.array(hits), np.array(n)
    if low > 0:  # just outside is rejected, just inside is not
        assert log_martingale(h, t, low - 1e-9) > threshold > log_martingale(h, t, low + 1e-9)
    if high < 1:
        assert log_martingale(h, t, high + 1e-9) > threshold > log_martingale(h, t, high - 1e-9)


def test_the_rate_is_covered_at_every_time_with_probability_at_least_1_minus_alpha() -> None:
    """2,000 paths of 5,000 requests erring with probability 0.02: the share of paths whose rate is
    outside the sequence at some time (M_t(p) ≥ 1/alpha for some t) stays below alpha; a fixed-n
    95 % interval read at every time would leave it in far more."""
    rng = np.random.default_rng(38)
    p, alpha = 0.02, 0.05
    x = rng.random((2000, 5000)) < p
    hits, n = np.cumsum(x, axis=1), np.arange(1, 5001)
    outside = (log_martingale(hits, n, p) >= math.log(1 / alpha)).any(axis=1)
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
