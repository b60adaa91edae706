"""The live canary's guards on the gateways' counts (deployer/canary.py `look`, `read`, `p95`):
errors (an always-valid test on counts) and latency (a threshold on p95), with planted counts; they
trip, they do not, and they wait for enough requests. `read` on a SQLite store."""

from __future__ import annotations

import random

import pytest
from gating import CANARY, canary_settings

from deployer import canary
from schemas.settings.canary import LATENCY_BUCKETS_S
from store import ArmTraffic, Store

pytestmark = pytest.mark.unit


def buckets(**at_index: int) -> tuple[int, ...]:
    """Latency buckets (b0: ≤ 0.05 s ... b9: ≤ 60 s, b10: +inf), zero but where named."""
    return tuple(at_index.get(f"b{i}", 0) for i in range(len(LATENCY_BUCKETS_S) + 1))


def traffic(canary_arm: ArmTraffic, fleet: ArmTraffic) -> dict[str, ArmTraffic]:
    return {"canary": canary_arm, "fleet": fleet}


def test_p95_reads_the_buckets_as_prometheus_does() -> None:
    # 90 requests ≤ 0.05 s and 10 in (0.5, 1]: rank 95 is the 5th of those 10, halfway: 0.75 s.
    assert canary.p95(buckets(b0=90, b4=10)) == pytest.approx(0.75)
    assert canary.p95(buckets(b2=100)) == pytest.approx(0.1 + 0.15 * 0.95)
    assert canary.p95(buckets(b10=7)) == 60.0  # +inf: the last finite bound
    assert canary.p95(buckets()) is None


def test_an_arm_that_fails_more_requests_trips_the_errors_guard_before_any_episode() -> None:
    looked = canary.look(
        canary_settings(),
        [],
        2,
        1,
        traffic(ArmTraffic(1000, 60, buckets(b0=1000)), ArmTraffic(9000, 20, buckets(b0=9000))),
    )
    assert (looked.decision.outcome, looked.decision.cause) == ("fail", "guard")
    assert looked.decision.reason.startswith("guard errors:")
    errors = [r for r in looked.decision.guards if r.guard.name == "errors"]
    assert errors[0].tripped and errors[0].difference.challenger.n == 1000
    record = looked.as_dict()
    assert record["traffic"]["canary"]["errors"] == 60 and record["traffic"]["fleet"]["requests"] == 9000


@pytest.mark.parametrize(
    ("canary_arm", "fleet"),
    [
        (ArmTraffic(1000, 3, buckets(b0=1000)), ArmTraffic(9000, 25, buckets(b0=9000))),  # the same rate
        (ArmTraffic(10, 2, buckets(b0=10)), ArmTraffic(90, 0, buckets(b0=90))),  # 20 %, of 10 requests
    ],
)
def test_the_errors_guard_does_not_trip_on_the_same_rate_or_on_too_few_requests(
    canary_arm: ArmTraffic, fleet: ArmTraffic
) -> None:
    looked = canary.look(canary_settings(), [], 2, 1, traffic(canary_arm, fleet))
    assert looked.decision.outcome == "continue", looked.decision.reason


def test_a_slower_canary_trips_the_latency_guard_once_both_arms_have_enough_requests() -> None:
    settings = canary_settings()
    slow = traffic(
        ArmTraffic(200, 0, buckets(b5=200)), ArmTraffic(1800, 0, buckets(b2=1800))
    )  # ~2.4 s vs ~0.24 s
    looked = canary.look(settings, [], 2, 1, slow)
    assert (looked.decision.outcome, looked.decision.cause) == ("fail", "guard")
    assert looked.decision.reason.startswith("guard latency:") and "1.5 x fleet p95" in looked.decision.reason
    assert looked.traffic["latency"]["tripped"] and looked.traffic["latency"]["canary_p95_s"] > 2.0

    few = traffic(ArmTraffic(199, 0, buckets(b5=199)), ArmTraffic(1800, 0, buckets(b2=1800)))
    assert canary.look(settings, [], 2, 1, few).decision.outcome == "continue"  # below latency_min_requests


def test_the_latency_guard_needs_both_the_ratio_and_the_absolute_increase() -> None:
    settings = canary_settings()
    # p95 0.2425 s against 0.0975 s: 2.5 times slower, but only 0.145 s (< latency_min_increase_s 0.25).
    quick = traffic(ArmTraffic(500, 0, buckets(b2=500)), ArmTraffic(500, 0, buckets(b1=500)))
    assert canary.look(settings, [], 2, 1, quick).decision.outcome == "continue"
    # p95 9.75 s against 7.5 s (450 ≤ 5 s, 50 in (5, 10]): 2.25 s slower, but only 1.3 times (< 1.5).
    both_slow = traffic(ArmTraffic(500, 0, buckets(b7=500)), ArmTraffic(500, 0, buckets(b6=450, b7=50)))
    looked = canary.look(settings, [], 2, 1, both_slow)
    assert looked.decision.outcome == "continue", looked.traffic
    looser = canary_settings(latency_ratio=1.2)
    assert canary.look(looser, [], 2, 1, both_slow).decision.cause == "guard"


def test_without_counts_the_canary_reads_its_episodes_as_before() -> None:
    looked = canary.look(canary_settings(), [], 2, 1)
    assert looked.decision.outcome == "continue"
    assert looked.traffic["canary"] == {"requests": 0, "errors": 0, "latency_buckets": [0] * 11}


def test_read_passes_the_gateways_counts_of_the_canarys_version(store: Store) -> None:
    settings = canary_settings()
    record = store.start_canary("m", 2, 1, CANARY, 0.1, None)
    assert canary.read(settings, store, record).decision.outcome == "continue"
    rng = random.Random(0)
    for instance in ("gw-a", "gw-b"):  # two gateways: their counts add up
        errors = rng.randint(28, 32)
        store.record_canary_traffic(
            instance,
            {
                (2, "canary"): ArmTraffic(500, errors, buckets(b0=500)),
                (2, "fleet"): ArmTraffic(4500, 10, buckets(b0=4500)),
                (3, "canary"): ArmTraffic(500, 500, buckets(b10=500)),  # another canary's version: not read
            },
        )
    looked = canary.read(settings, store, record)
    assert looked.decision.cause == "guard" and "guard errors" in looked.decision.reason
    assert looked.traffic["canary"]["requests"] == 1000 and looked.traffic["latency"]["tripped"] is False
