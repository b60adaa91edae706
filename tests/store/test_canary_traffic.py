"""The gateways' counts of a live canary's requests (store/canaries.py `record_canary_traffic`,
`canary_traffic`) and their retention (`rtrl store prune`): cumulative per gateway process, so a
repeated or late flush never counts twice; summed over processes per arm. On SQLite (unit) and
PostgreSQL (integration)."""

from __future__ import annotations

import pytest
from factories import FakeClock, at

from store import ArmTraffic, Store
from store.retention import prune

DAY = 86400.0
SERVER = "http://127.0.0.1:8002"
ZERO = ArmTraffic()


def buckets(**at_index: int) -> tuple[int, ...]:
    """Eleven latency buckets, zero but where named (b0 ... b10)."""
    return tuple(at_index.get(f"b{i}", 0) for i in range(11))


def test_a_flush_overwrites_and_processes_add_up(any_store: Store) -> None:
    assert any_store.canary_traffic(5) == {"canary": ZERO, "fleet": ZERO}
    first = {
        (5, "canary"): ArmTraffic(10, 1, buckets(b0=9, b10=1)),
        (5, "fleet"): ArmTraffic(90, 0, buckets(b0=80, b1=10)),
    }
    any_store.record_canary_traffic("gw-a", first)
    any_store.record_canary_traffic("gw-a", first)  # a repeated flush: the same counts, not twice
    assert any_store.canary_traffic(5) == {"canary": first[(5, "canary")], "fleet": first[(5, "fleet")]}

    later = {(5, "canary"): ArmTraffic(12, 2, buckets(b0=10, b4=1, b10=1))}
    any_store.record_canary_traffic("gw-a", later)  # cumulative: 12 in all, not 22
    any_store.record_canary_traffic("gw-b", {(5, "canary"): ArmTraffic(3, 3, buckets(b9=3))})
    any_store.record_canary_traffic("gw-b", {(6, "canary"): ArmTraffic(7, 0, buckets(b0=7))})
    assert any_store.canary_traffic(5) == {
        "canary": ArmTraffic(15, 5, buckets(b0=10, b4=1, b9=3, b10=1)),
        "fleet": first[(5, "fleet")],
    }
    assert any_store.canary_traffic(6)["canary"].requests == 7


def test_a_stale_flush_landing_late_changes_nothing(any_store: Store) -> None:
    any_store.record_canary_traffic("gw-a", {(5, "fleet"): ArmTraffic(20, 2, buckets(b0=20))})
    any_store.record_canary_traffic("gw-a", {(5, "fleet"): ArmTraffic(15, 1, buckets(b0=15))})
    assert any_store.canary_traffic(5)["fleet"] == ArmTraffic(20, 2, buckets(b0=20))


def test_an_unknown_arm_is_refused_and_nothing_is_written(any_store: Store) -> None:
    with pytest.raises(ValueError, match="arm must be one of canary, fleet"):
        any_store.record_canary_traffic(
            "gw-a", {(5, "canary"): ArmTraffic(1, 0, buckets(b0=1)), (5, "staging"): ArmTraffic(1)}
        )
    assert any_store.canary_traffic(5) == {"canary": ZERO, "fleet": ZERO}


def canary(store: Store, clock: FakeClock, version: int, day: float, ended: bool = True) -> None:
    """A canary of `version` started on `day` whose gateway counted 4 requests per arm, ended that day."""
    clock.now = at(day * DAY)
    record = store.start_canary("policy", version, 1, SERVER, 0.1)
    traffic(store, clock, version, day)
    if ended:
        store.end_canary(record.id, "failed", "guard errors", None)


def traffic(store: Store, clock: FakeClock, version: int, day: float) -> None:
    clock.now = at(day * DAY)
    store.record_canary_traffic(
        f"gw-{version}-{day}",
        {(version, arm): ArmTraffic(4, 1, buckets(b0=4)) for arm in ("canary", "fleet")},
    )


def test_traffic_goes_with_its_canaries_and_stays_while_one_runs_or_ended_late(
    any_store: Store, clock: FakeClock
) -> None:
    canary(any_store, clock, 2, day=1)  # ended before the cutoff: its rows go
    canary(any_store, clock, 3, day=1)  # ended before the cutoff, but v3 ran again after it: stays
    canary(any_store, clock, 3, day=15)
    canary(any_store, clock, 4, day=1, ended=False)  # running since day 1: stays
    traffic(any_store, clock, 9, day=1)  # no canary record, written before the cutoff: goes
    traffic(any_store, clock, 8, day=15)  # no canary record, written after it: stays
    clock.now = at(20 * DAY)
    cutoff = at(10 * DAY)

    dry = prune(any_store, cutoff, None, dry_run=True)
    assert (dry.deleted["canary_traffic"], dry.deleted["canaries"]) == (4, 2)
    assert any_store.canary_traffic(2)["canary"].requests == 4  # a dry run changes nothing
    report = prune(any_store, cutoff, None)
    assert report.deleted == dry.deleted
    gone = {"canary": ZERO, "fleet": ZERO}
    assert any_store.canary_traffic(2) == any_store.canary_traffic(9) == gone
    assert [any_store.canary_traffic(v)["fleet"].requests for v in (3, 4, 8)] == [8, 4, 4]
    assert prune(any_store, cutoff, None).deleted["canary_traffic"] == 0  # idempotent
