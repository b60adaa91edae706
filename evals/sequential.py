"""The live canary's statistics: an always-valid sequential test of challenger − champion (docs/gate.md,
Live canary: the sequential test).

The canary serves a share of live traffic with the challenger; every outcome in [0, 1] (a reward, an
acceptance) is fed here as it arrives, and after every update the test answers `continue`, `pass`,
`fail` or `inconclusive`. Because the bounds are confidence *sequences*, the answer may be read after
every observation and the canary stopped at the first `pass` or `fail`: the error rates below hold at
whatever (data-dependent) time the caller stops, which a fixed-n interval checked again and again does
not (tests/evals/test_sequential.py: a 95 % CLT interval read after every value leaves the mean at
some time in 46 % of streams, this sequence in 1 %).

**Method**: the predictable plug-in empirical-Bernstein confidence sequence (PrPl-EB) of Waudby-Smith &
Ramdas, "Estimating means of bounded random variables by betting", Journal of the Royal Statistical
Society Series B 86(1), 2024 (discussion paper, read 2023; arXiv:2010.09686), Theorem 2. For values
X_1, X_2, ... in [0, 1] whose conditional mean given the past is μ (independence is not needed),

    μ̂_t  = (1/2 + Σ_{i≤t} X_i) / (t + 1)              σ̂²_t = (1/4 + Σ_{i≤t} (X_i − μ̂_i)²) / (t + 1)
    λ_t  = min(√(2 log(2/α) / (σ̂²_{t−1} · t · log(1 + t))), c)                  (c = 1/2: TRUNCATION)
    v_i  = 4 (X_i − μ̂_{i−1})²                         ψ_E(λ) = (−log(1 − λ) − λ) / 4
    C_t  = Σ λ_i X_i / Σ λ_i  ±  (log(2/α) + Σ v_i ψ_E(λ_i)) / Σ λ_i

and P(μ ∈ C_t for every t ≥ 1) ≥ 1 − α. C_t is clipped to [0, 1] and intersected with every earlier
C_s (the running intersection keeps the guarantee and makes the bounds monotone). Every quantity is a
running sum, so an update costs O(1) and a batch is a cumulative sum; a batch gives bit-for-bit the
bounds of the same values fed one at a time.

Why PrPl-EB and not the stitched empirical-Bernstein boundary of Howard, Ramdas, McAuliffe & Sekhon,
"Time-uniform, nonparametric, nonasymptotic confidence sequences", Ann. Statist. 49(2), 2021: both are
closed-form, O(1) per update and adapt to the variance (an acceptance rate near 0.1 or 0.9 gets a
narrow interval). PrPl-EB is one theorem with one constant c, where stitching needs η, s and a
starting scale m, each changing the width; its state is six running sums and the two bounds. The
stitched boundary was not implemented here, so no width comparison between the two is claimed.

**Two arms** (`SequentialTest`): each arm (challenger, champion) has its own sequence at α/2, so by
the union bound both cover their means at all times with probability ≥ 1 − α, and then
challenger − champion lies in [L₁ − U₀, U₁ − L₀] at all times; the arms may grow at different rates
(a 10 % canary). Decision, with margin m ≥ 0 and n the smaller arm's count:

- `pass` when n ≥ min_n and L₁ − U₀ > −m: the challenger is at most m worse (non-inferior);
- `fail` when n ≥ min_n and U₁ − L₀ < −m: the challenger is more than m worse;
- `inconclusive` when n ≥ max_n and neither held (the caller does not promote);
- else `continue`.

Guarantee: a challenger more than m worse passes with probability ≤ α, and one at most m worse fails
(by the primary test) with probability ≤ α, at any stopping time.

**Guards** (`Guard`): a rate (errors, non-answers: values 0/1) of challenger vs champion with its own
α; it trips as soon as the lower bound of challenger − champion exceeds its allowed increase, before
min_n too, and a tripped guard fails the test. A guard whose true increase is within its allowance
trips with probability ≤ its α, so a challenger within every allowance and at most m worse is stopped
with probability ≤ α + Σ α_guard (union bound over the guards). Guards on unbounded values (latency,
length, a latency ratio) are out of scope: the sequences need values in [0, 1]. A guard with
``decrease`` holds a metric in [0, 1] that must not fall (the reward spec's primary term): it trips
when the upper bound of challenger − champion is below −allowed, and only once both arms have
``min_n`` values; its chance of tripping on a challenger within the allowance is ≤ its α likewise.

**Guards on counts** (`SequentialTest(count_guards=...)`, `set_guard_counts`): a rate known only as
counts (hits, n) per arm, e.g. the gateways' error counts, which are flushed as totals, not as one
value per request. PrPl-EB's bets are predictable (each depends on the order of the values), so it
cannot be computed from counts. For 0/1 values the conjugate-mixture sequence can (Robbins,
"Statistical methods related to the law of the iterated logarithm", Ann. Math. Statist. 41(5), 1970;
Howard et al. 2021 above, section 3): with a Beta(a, b) mixture over the rate q,

    M_t(p) = B(a + S_t, b + t − S_t) / B(a, b)  /  (p^S_t (1 − p)^(t − S_t))          (S_t = Σ_{i≤t} X_i)

is a nonnegative martingale with M_0 = 1 when every X_i is 1 with probability p given the past, so
by Ville's inequality P(M_t(p) ≥ 1/α for some t) ≤ α, and C_t = {p : M_t(p) < 1/α} covers p at every
t with probability ≥ 1 − α. C_t is an interval around S_t / t (log M_t is convex in p) found by
bisection (`rate_bounds`); a = b = 1/2 (the Krichevsky–Trofimov mixture). It depends on (t, S_t)
alone, so reading it at the times the counts are known (any subset of t) keeps the guarantee, with
the same assumption as above: in the order the counts grow, each value has the same conditional
mean. Two arms at α/2 each and the trip rule are those of `Guard`.

Assumption: within an arm, every value has the same conditional mean (traffic routed to the arms at
random, so a daily cycle moves both arms alike; the guarantee is proved for a constant mean, not
for a drifting one). Pure numpy and the standard library, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

TRUNCATION = 0.5  # c, the largest bet λ_t; Waudby-Smith & Ramdas suggest 1/2 or 3/4

Outcome = Literal["continue", "pass", "fail", "inconclusive"]
OUTCOMES: tuple[Outcome, ...] = ("continue", "pass", "fail", "inconclusive")  # index = code of `decide`
CONTINUE, PASS, FAIL, INCONCLUSIVE = range(4)

Values = Sequence[float] | np.ndarray


# ---- validation -------------------------------------------------------------------------------


def check_alpha(alpha: float, what: str = "alpha") -> float:
    if not isinstance(alpha, int | float) or not 0.0 < alpha < 1.0:  # NaN fails the comparison too
        raise ValueError(f"{what} must be in (0, 1); got {alpha!r}")
    return float(alpha)


def as_values(values: Values | float, what: str = "values") -> np.ndarray:
    """`values` as a float64 array, every one in [0, 1]; a ValueError names the first that is not."""
    array = np.asarray(values, dtype=np.float64)
    if np.isnan(array).any():
        index = np.unravel_index(int(np.argmax(np.isnan(array))), array.shape)
        raise ValueError(f"{what}: NaN at index {tuple(map(int, index))}; values must be numbers in [0, 1]")
    outside = (array < 0.0) | (array > 1.0)
    if outside.any():
        index = np.unravel_index(int(np.argmax(outside)), array.shape)
        raise ValueError(
            f"{what}: {float(array[index])!r} at index {tuple(map(int, index))} is outside [0, 1]"
        )
    return array


# ---- one arm: the PrPl-EB confidence sequence ---------------------------------------------------


class Sums(NamedTuple):
    """The running sums PrPl-EB needs (floats for one stream, arrays for many at once)."""

    n: Any  # t
    total: Any  # Σ X_i
    squares: Any  # Σ (X_i − μ̂_i)², for σ̂²
    bets: Any  # Σ λ_i
    weighted: Any  # Σ λ_i X_i
    penalty: Any  # Σ v_i ψ_E(λ_i)
    low: Any  # running intersection of the lower bounds
    high: Any  # ... and of the upper bounds


EMPTY = Sums(n=0, total=0.0, squares=0.0, bets=0.0, weighted=0.0, penalty=0.0, low=0.0, high=1.0)


def _running(start: Any, terms: np.ndarray) -> np.ndarray:
    """start + cumulative sums of `terms` along the last axis, added one at a time from `start` (so a
    batch sums exactly as the same values fed one by one)."""
    head = np.broadcast_to(np.asarray(start, dtype=np.float64), terms.shape[:-1])[..., None]
    out: np.ndarray = np.cumsum(np.concatenate([head, terms], axis=-1), axis=-1)[..., 1:]
    return out


def _previous(first: Any, path: np.ndarray) -> np.ndarray:
    """The path shifted right by one along the last axis, `first` in front: the value at t − 1."""
    head = np.broadcast_to(np.asarray(first, dtype=np.float64), path.shape[:-1])[..., None]
    return np.concatenate([head, path[..., :-1]], axis=-1)


def advance(
    sums: Sums, x: np.ndarray, alpha: float, truncation: float = TRUNCATION
) -> tuple[Sums, np.ndarray, np.ndarray]:
    """Feed values x (..., k) in [0, 1] to the sequences whose sums are `sums`; returns the new sums
    and the (running-intersection) lower and upper bounds after each value, each (..., k)."""
    log_term = math.log(2.0 / alpha)
    k = x.shape[-1]
    t = sums.n + np.arange(1, k + 1, dtype=np.float64)  # (k,)
    total = _running(sums.total, x)  # (..., k)
    mean = (0.5 + total) / (t + 1.0)  # μ̂_t
    mean_before = _previous((0.5 + np.asarray(sums.total)) / (sums.n + 1.0), mean)  # μ̂_{t−1}
    squares = _running(sums.squares, (x - mean) ** 2)
    variance_before = _previous(
        (0.25 + np.asarray(sums.squares)) / (sums.n + 1.0), (0.25 + squares) / (t + 1.0)
    )
    bet = np.minimum(np.sqrt(2.0 * log_term / (variance_before * t * np.log1p(t))), truncation)  # λ_t
    psi = (-np.log1p(-bet) - bet) / 4.0  # ψ_E(λ_t)
    bets = _running(sums.bets, bet)
    weighted = _running(sums.weighted, bet * x)
    penalty = _running(sums.penalty, 4.0 * (x - mean_before) ** 2 * psi)
    centre, radius = weighted / bets, (log_term + penalty) / bets
    low = np.maximum.accumulate(np.maximum(centre - radius, np.expand_dims(sums.low, -1)), axis=-1)
    high = np.minimum.accumulate(np.minimum(centre + radius, np.expand_dims(sums.high, -1)), axis=-1)
    new = Sums(
        n=sums.n + k,
        total=total[..., -1],
        squares=squares[..., -1],
        bets=bets[..., -1],
        weighted=weighted[..., -1],
        penalty=penalty[..., -1],
        low=low[..., -1],
        high=high[..., -1],
    )
    return new, low, high


def confidence_sequence(
    values: Values, *, alpha: float, truncation: float = TRUNCATION
) -> tuple[np.ndarray, np.ndarray]:
    """The PrPl-EB (1 − alpha) confidence sequence of each stream in `values` (..., T): lower and upper
    bounds after each of the T values (running intersection, within [0, 1]). Vectorised over streams."""
    x = as_values(values)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError("values: need at least one value along the last axis")
    _, low, high = advance(EMPTY, x, check_alpha(alpha), _check_truncation(truncation))
    return low, high


def _check_truncation(truncation: float) -> float:
    if not 0.0 < truncation < 1.0:
        raise ValueError(f"truncation (the largest bet) must be in (0, 1); got {truncation!r}")
    return float(truncation)


@dataclass(frozen=True)
class Arm:
    """One arm's state for the record: observations, sample mean (None before the first) and the
    confidence sequence's current bounds."""

    n: int
    mean: float | None
    low: float
    high: float


class ConfidenceSequence:
    """A PrPl-EB (1 − alpha) confidence sequence for the mean of one stream of values in [0, 1],
    updated one value (`update`) or a batch (`extend`) at a time, O(1) state and work per value."""

    def __init__(self, alpha: float, *, truncation: float = TRUNCATION) -> None:
        self.alpha = check_alpha(alpha)
        self.truncation = _check_truncation(truncation)
        self.sums = EMPTY

    def update(self, value: float) -> Arm:
        return self.extend([value])

    def extend(self, values: Values) -> Arm:
        x = as_values(values).reshape(-1)
        if x.size:
            new, _, _ = advance(self.sums, x, self.alpha, self.truncation)
            self.sums = Sums(*(int(v) if i == 0 else float(v) for i, v in enumerate(new)))
        return self.arm

    @property
    def arm(self) -> Arm:
        s = self.sums
        return Arm(n=s.n, mean=s.total / s.n if s.n else None, low=s.low, high=s.high)


# ---- two arms -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """Challenger − champion: each arm's bounds at alpha/2 and the difference's bounds [L₁ − U₀,
    U₁ − L₀], which hold at every time with probability ≥ 1 − alpha."""

    challenger: Arm
    champion: Arm
    estimate: float | None  # difference of the sample means
    low: float
    high: float


class TwoArms:
    """Challenger and champion sequences at alpha/2 each (union bound), fed independently."""

    def __init__(self, alpha: float, *, truncation: float = TRUNCATION) -> None:
        self.alpha = check_alpha(alpha)
        self.challenger = ConfidenceSequence(alpha / 2, truncation=truncation)
        self.champion = ConfidenceSequence(alpha / 2, truncation=truncation)

    def extend(self, challenger: Values, champion: Values) -> Difference:
        x1 = as_values(challenger, "challenger").reshape(-1)
        x0 = as_values(champion, "champion").reshape(-1)  # both checked before either arm moves
        self.challenger.extend(x1)
        self.champion.extend(x0)
        return self.difference

    @property
    def difference(self) -> Difference:
        one, zero = self.challenger.arm, self.champion.arm
        estimate = one.mean - zero.mean if one.mean is not None and zero.mean is not None else None
        return Difference(one, zero, estimate, low=one.low - zero.high, high=one.high - zero.low)


def decide(low: Any, high: Any, n: Any, *, margin: float, min_n: int, max_n: int) -> np.ndarray:
    """The primary rule, vectorised: codes (index into OUTCOMES) from the difference's bounds and the
    smaller arm's count n. `SequentialTest` uses it for one test, the simulations for thousands."""
    low, high, n = np.asarray(low), np.asarray(high), np.asarray(n)
    code = np.where(high < -margin, FAIL, np.where(n >= max_n, INCONCLUSIVE, CONTINUE))
    code = np.where(low > -margin, PASS, code)
    out: np.ndarray = np.where(n < min_n, CONTINUE, code)
    return out


# ---- a rate from counts alone: the conjugate-mixture sequence -------------------------------------

MIXTURE_PRIOR = (0.5, 0.5)  # Beta(a, b) over the rate: Krichevsky–Trofimov
_BISECTIONS = 60  # the bounds to within 2^-60 of the interval's ends, rounded outwards


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def rate_bounds(
    hits: int, n: int, alpha: float, prior: tuple[float, float] = MIXTURE_PRIOR
) -> tuple[float, float]:
    """The (1 − alpha) confidence sequence's interval for a rate after `hits` ones in `n` 0/1 values,
    from the counts alone (see the module docstring, Guards on counts): valid at every n at once."""
    check_alpha(alpha)
    if not isinstance(hits, int) or not isinstance(n, int) or not 0 <= hits <= n:
        raise ValueError(f"need integers 0 ≤ hits ≤ n; got hits={hits!r}, n={n!r}")
    if n == 0:
        return 0.0, 1.0
    a, b = prior
    mixture = _log_beta(a + hits, b + n - hits) - _log_beta(a, b)
    threshold = math.log(1.0 / alpha)

    def log_martingale(p: float) -> float:  # log M_n(p); p in (0, 1)
        return mixture - hits * math.log(p) - (n - hits) * math.log1p(-p)

    centre = hits / n  # log M_n is smallest there, and below the threshold (the mixture ≤ the maximum)

    def crossing(inside: float, outside: float) -> float:
        """The end of {p : log M_n(p) < threshold} between `inside` (in it) and `outside`, rounded outwards."""
        for _ in range(_BISECTIONS):
            middle = (inside + outside) / 2
            if log_martingale(middle) < threshold:
                inside = middle
            else:
                outside = middle
        return outside

    low = 0.0 if hits == 0 else crossing(centre, 0.0)
    high = 1.0 if hits == n else crossing(centre, 1.0)
    return low, high


def rate_difference(challenger: tuple[int, int], champion: tuple[int, int], alpha: float) -> Difference:
    """Challenger − champion of two rates known as (hits, n), each arm at alpha/2: the difference's
    bounds hold at every time with probability ≥ 1 − alpha (union bound), as for `TwoArms`."""
    arms = []
    for hits, n in (challenger, champion):
        low, high = rate_bounds(hits, n, alpha / 2)
        arms.append(Arm(n=n, mean=hits / n if n else None, low=low, high=high))
    one, zero = arms
    estimate = one.mean - zero.mean if one.mean is not None and zero.mean is not None else None
    return Difference(one, zero, estimate, low=one.low - zero.high, high=one.high - zero.low)


# ---- the canary's test: primary metric and guards ------------------------------------------------


@dataclass(frozen=True)
class Guard:
    """A rate that stops the canary at once: it trips when the lower bound of challenger − champion
    (values 0/1, e.g. an error or a non-answer per request) exceeds `allowed_increase`.

    With `decrease`, a metric in [0, 1] that must not fall (the reward spec's primary term): it trips
    when the *upper* bound of challenger − champion is below −`allowed_increase` (a non-inferiority
    guard, the primary rule's fail with its own alpha). `min_n`: it trips only once both arms have at
    least that many values (the rate guards trip from the first value: 0)."""

    name: str
    allowed_increase: float
    alpha: float
    decrease: bool = False
    min_n: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a guard needs a name")
        check_alpha(self.alpha, f"guard {self.name!r}: alpha")
        if not 0.0 <= self.allowed_increase < 1.0:  # NaN fails too
            raise ValueError(
                f"guard {self.name!r}: allowed_increase must be in [0, 1); got {self.allowed_increase!r}"
            )
        if not isinstance(self.min_n, int) or self.min_n < 0:
            raise ValueError(f"guard {self.name!r}: min_n must be an int ≥ 0; got {self.min_n!r}")

    def trips(self, d: Difference) -> bool:
        """Whether challenger − champion `d` trips the guard (see the class docstring)."""
        if min(d.challenger.n, d.champion.n) < self.min_n:
            return False
        return d.high < -self.allowed_increase if self.decrease else d.low > self.allowed_increase

    def explain(self, d: Difference) -> str:
        """Why it tripped, with its numbers."""
        if self.decrease:
            bound = f"≤ {d.high:+.4f} < allowed −{self.allowed_increase:.4f}"
        else:
            bound = f"≥ {d.low:+.4f} > allowed +{self.allowed_increase:.4f}"
        return f"guard {self.name}: challenger − champion {bound} (alpha {self.alpha:g}, {_counts(d)})"


@dataclass(frozen=True)
class GuardReading:
    guard: Guard
    difference: Difference
    tripped: bool


Cause = Literal["running", "non_inferior", "inferior", "guard", "max_n"]


@dataclass(frozen=True)
class Decision:
    """What the test says now, with every number needed to audit it."""

    outcome: Outcome
    cause: Cause
    reason: str
    alpha: float
    margin: float
    min_n: int
    max_n: int
    difference: Difference
    guards: tuple[GuardReading, ...]

    @property
    def final(self) -> bool:
        return self.outcome != "continue"

    def as_dict(self) -> dict[str, Any]:
        """The record in plain JSON types (what the canary will store with its decision)."""
        record = dataclasses.asdict(self)
        record["guards"] = list(record["guards"])
        return record


def _bounds(d: Difference) -> str:
    return f"[{d.low:+.4f}, {d.high:+.4f}]"


def _counts(d: Difference) -> str:
    return f"n {d.challenger.n} challenger / {d.champion.n} champion"


class SequentialTest:
    """Challenger vs champion on one primary metric in [0, 1], with guards; see the module docstring.

    `update` feeds the primary metric, `update_guard` a guard's rate; either arm may be empty in a
    call, and each call is one look. The first decision other than `continue` is final: later
    updates raise (start a new test for a new canary)."""

    def __init__(
        self,
        *,
        alpha: float,
        margin: float,
        min_n: int,
        max_n: int,
        guards: Sequence[Guard] = (),
        count_guards: Sequence[Guard] = (),
        truncation: float = TRUNCATION,
    ) -> None:
        self.alpha = check_alpha(alpha)
        if not isinstance(margin, int | float) or not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1) (values are in [0, 1]); got {margin!r}")
        if not isinstance(min_n, int) or not isinstance(max_n, int) or min_n < 0 or max_n < 1:
            raise ValueError(f"min_n must be an int ≥ 0 and max_n an int ≥ 1; got {min_n!r}, {max_n!r}")
        if min_n > max_n:
            raise ValueError(f"min_n ({min_n}) must not exceed max_n ({max_n})")
        names = [g.name for g in (*guards, *count_guards)]
        if len(set(names)) != len(names):
            raise ValueError(f"guard names must be unique; got {names}")
        self.margin, self.min_n, self.max_n = float(margin), min_n, max_n
        self.primary = TwoArms(alpha, truncation=truncation)
        self.guards = {g.name: (g, TwoArms(g.alpha, truncation=truncation)) for g in guards}
        self.count_guards = {g.name: (g, rate_difference((0, 0), (0, 0), g.alpha)) for g in count_guards}
        self.decision = self._decide()

    def update(self, challenger: Values = (), champion: Values = ()) -> Decision:
        self._check_open()
        self.primary.extend(challenger, champion)
        self.decision = self._decide()
        return self.decision

    def update_guard(self, name: str, challenger: Values = (), champion: Values = ()) -> Decision:
        self._check_open()
        if name not in self.guards:
            raise ValueError(f"no guard named {name!r}; guards: {sorted(self.guards)}")
        self.guards[name][1].extend(challenger, champion)
        self.decision = self._decide()
        return self.decision

    def set_guard_counts(
        self, name: str, challenger: tuple[int, int] = (0, 0), champion: tuple[int, int] = (0, 0)
    ) -> Decision:
        """A count guard's (hits, n) per arm, the totals so far (they replace the last ones)."""
        self._check_open()
        if name not in self.count_guards:
            raise ValueError(f"no count guard named {name!r}; count guards: {sorted(self.count_guards)}")
        guard = self.count_guards[name][0]
        self.count_guards[name] = (guard, rate_difference(challenger, champion, guard.alpha))
        self.decision = self._decide()
        return self.decision

    def _check_open(self) -> None:
        if self.decision.final:
            raise ValueError(
                f"the test has already decided ({self.decision.outcome}: {self.decision.reason})"
            )

    def _decide(self) -> Decision:
        differences = [(g, arms.difference) for g, arms in self.guards.values()]
        differences += list(self.count_guards.values())
        readings = tuple(GuardReading(g, d, tripped=g.trips(d)) for g, d in differences)
        d = self.primary.difference
        n = min(d.challenger.n, d.champion.n)
        code = int(decide(d.low, d.high, n, margin=self.margin, min_n=self.min_n, max_n=self.max_n))
        tripped = [r for r in readings if r.tripped]
        outcome, cause, reason = OUTCOMES[code], self._cause(code), self._reason(code, d, n)
        if tripped:
            outcome, cause = "fail", "guard"
            reason = "; ".join(r.guard.explain(r.difference) for r in tripped)
        return Decision(outcome, cause, reason, self.alpha, self.margin, self.min_n, self.max_n, d, readings)

    @staticmethod
    def _cause(code: int) -> Cause:
        causes: tuple[Cause, ...] = ("running", "non_inferior", "inferior", "max_n")
        return causes[code]

    def _reason(self, code: int, d: Difference, n: int) -> str:
        m, where = self.margin, f"challenger − champion in {_bounds(d)}"
        if code == PASS:
            return f"{where}: lower bound > −margin −{m:.4f} ({_counts(d)}, alpha {self.alpha:g})"
        if code == FAIL:
            return f"{where}: upper bound < −margin −{m:.4f}, worse than the margin allows ({_counts(d)})"
        if code == INCONCLUSIVE:
            return f"max_n {self.max_n} reached with {where}, still across −{m:.4f} ({_counts(d)})"
        if n < self.min_n:
            return f"{_counts(d)}: below min_n {self.min_n} per arm"
        return f"{where}, across −margin −{m:.4f} ({_counts(d)})"
