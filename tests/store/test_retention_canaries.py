"""Retention of the live canary's records (store/retention.py, `rtrl store prune`): a canary that
ended before the cutoff goes, in any final state and whatever Kafka holds; one that ended after it
stays; a running canary stays however long ago it started or was asked to stop. On SQLite (unit)
and PostgreSQL (integration)."""

from __future__ import annotations

import pytest
from factories import FakeClock, at

from store import Store
from store.retention import prune

DAY = 86400.0
NOW = at(30 * DAY)  # when prune runs
CUTOFF = at(23 * DAY)  # --older-than 7
SERVER = "http://127.0.0.1:8002"


def canary(store: Store, clock: FakeClock, version: int, start: float, end: float | None, state: str) -> int:
    """A canary of v`version` started at `start` and ended `state` at `end` (None: still running)."""
    clock.now = at(start)
    record = store.start_canary("policy", version, 1, SERVER, 0.1, cycle_id=version)
    if end is not None:
        clock.now = at(end)
        store.end_canary(record.id, state, f"v{version} {state}", {"episodes": {"challenger": 3}})
    return record.id


def fill(store: Store, clock: FakeClock) -> dict[str, int]:
    """Four canaries ended long ago (one per final state but passed), one that started long ago and
    ended after the cutoff, one that ended a second before it, and one running since day 1 whose
    stop was asked on day 2 (its runner has not looked yet)."""
    ids = {
        state: canary(
            store, clock, version, start=version * 0.1 * DAY, end=(version * 0.1 + 0.05) * DAY, state=state
        )
        for version, state in enumerate(("failed", "inconclusive", "stopped", "aborted"), start=2)
    }
    ids["passed late"] = canary(store, clock, 6, start=DAY / 2, end=25 * DAY, state="passed")
    ids["passed just before"] = canary(store, clock, 7, start=22 * DAY, end=23 * DAY - 1, state="passed")
    ids["running"] = canary(store, clock, 8, start=DAY, end=None, state="running")
    clock.now = at(2 * DAY)
    store.request_canary_stop(ids["running"], "ops@host", "users complain")
    clock.now = NOW
    return ids


def remaining(store: Store) -> set[int]:
    return {c.id for c in store.recent_canaries(limit=100)}


@pytest.mark.parametrize("batch_size", [1, 5000])
def test_ended_canaries_older_than_the_cutoff_go_and_a_running_one_stays(
    any_store: Store, clock: FakeClock, batch_size: int
) -> None:
    ids = fill(any_store, clock)
    before = remaining(any_store)
    dry = prune(any_store, CUTOFF, None, dry_run=True, batch_size=batch_size)
    assert dry.deleted["canaries"] == 5 and remaining(any_store) == before  # a dry run changes nothing

    report = prune(any_store, CUTOFF, None, batch_size=batch_size)
    assert report.deleted == {
        "episodes": 0,
        "interactions": 0,
        "feedback": 0,
        "dead_letters": 0,
        "canary_traffic": 0,
        "canaries": 5,
    }
    assert "canaries" not in report.held  # no Kafka record behind a canary
    assert remaining(any_store) == {ids["passed late"], ids["running"]}
    running = any_store.running_canary()
    assert running is not None and running.id == ids["running"]
    assert running.stop_requested_by == "ops@host"  # untouched: its runner still ends it
    assert prune(any_store, CUTOFF, None, batch_size=batch_size).deleted["canaries"] == 0  # idempotent


def test_canaries_go_by_age_alone_whatever_kafka_still_holds(any_store: Store, clock: FakeClock) -> None:
    ids = fill(any_store, clock)
    # An empty floor: Kafka holds every record, so no episode, feedback or dead letter may go.
    report = prune(any_store, CUTOFF, {})
    assert report.deleted["canaries"] == 5
    assert remaining(any_store) == {ids["passed late"], ids["running"]}


def test_a_running_canary_goes_once_it_has_ended_and_aged(any_store: Store, clock: FakeClock) -> None:
    ids = fill(any_store, clock)
    prune(any_store, CUTOFF, None)
    any_store.end_canary(ids["running"], "stopped", "stopped by ops@host: users complain", None)
    assert prune(any_store, CUTOFF, None).deleted["canaries"] == 0  # ended now: after the cutoff
    clock.advance(7 * DAY)
    later = prune(any_store, at(30 * DAY + 1), None)  # a week on, with the same --older-than
    assert later.deleted["canaries"] == 2 and remaining(any_store) == set()
    # The running slot is free, and a new canary starts as before.
    assert any_store.start_canary("policy", 9, 1, SERVER, 0.1).running
