"""The live canary's records (store/canaries.py): one running per store, the first ending wins, stop
requests, and the rated live episodes its test reads. The one-at-a-time and first-ending races run
on SQLite (unit) and PostgreSQL (integration)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from factories import FakeClock, Feeder, at, feedback, interaction
from sqlalchemy import select, update

from store import CanaryRecord, CanaryRunning, Store, StoreError
from store.canaries import CanaryStore
from store.models import Episode, Feedback

MODEL = "policy"
SERVER = "http://127.0.0.1:8002"


def start(store: CanaryStore, challenger: int = 5, **kw: Any) -> CanaryRecord:
    return store.start_canary(MODEL, challenger, challenger - 1, SERVER, 0.1, **kw)


def race(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` at once on threads; what each returned or raised, in order."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except Exception as exc:  # the race's loser: its error is the result under test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


# ---- one running at a time -----------------------------------------------------------------------


def test_one_canary_runs_at_a_time_and_a_new_one_starts_after_the_end(
    any_store: Store, clock: FakeClock
) -> None:
    assert any_store.running_canary() is None
    first = start(any_store, 5, cycle_id=12)
    assert (first.state, first.running, first.reason, first.decision) == ("running", True, "", None)
    assert (first.model, first.challenger_version, first.champion_version) == (MODEL, 5, 4)
    assert (first.server, first.share, first.cycle_id, first.started_at) == (SERVER, 0.1, 12, clock())
    assert first.ended_at is None and first.stop_requested_at is None
    with pytest.raises(
        CanaryRunning, match=rf"canary #{first.id} of v5 is running since .*canary stop` ends it"
    ):
        start(any_store, 6)
    assert any_store.running_canary() == first
    clock.advance(60)
    any_store.end_canary(first.id, "failed", "lost live", {"lower": -0.2})
    assert any_store.running_canary() is None
    second = start(any_store, 6)
    assert second.running and second.id != first.id
    assert any_store.running_canary() == second
    assert [c.id for c in any_store.recent_canaries()] == [second.id, first.id]
    assert [c.id for c in any_store.recent_canaries(limit=1)] == [second.id]


def test_of_two_deployers_starting_at_once_exactly_one_wins(any_store: Store) -> None:
    others = [Store.sharing(any_store) for _ in range(4)]
    results = race([partial(start, s) for s in others])
    for other in others:
        other.close()
    started = [r for r in results if isinstance(r, CanaryRecord)]
    refused = [r for r in results if isinstance(r, CanaryRunning)]
    assert (len(started), len(refused)) == (1, 3), results
    assert any_store.running_canary() == started[0]


@pytest.mark.unit
def test_an_insert_that_loses_the_race_in_the_database_is_canary_running(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read saw none, but another deployer's row got in first: the unique running slot refuses
    ours, and the error names the winner (PostgreSQL's path; SQLite's writers queue up front)."""
    winner = start(store, 5)
    looked = CanaryStore._running
    blind = iter([True])  # the first look (start_canary's) misses it; the error's own look finds it
    monkeypatch.setattr(
        CanaryStore, "_running", staticmethod(lambda session: None if next(blind, False) else looked(session))
    )
    with pytest.raises(CanaryRunning, match=f"canary #{winner.id} of v5"):
        start(store, 6)
    assert [c.id for c in store.recent_canaries()] == [winner.id]


# ---- ending ----------------------------------------------------------------------------------------


def test_the_first_ending_wins_and_a_later_one_changes_nothing(any_store: Store, clock: FakeClock) -> None:
    canary = start(any_store)
    clock.advance(30)
    ended = any_store.end_canary(canary.id, "passed", "non-inferior", {"n": 400, "lower": -0.01})
    assert (ended.state, ended.running, ended.reason, ended.decision) == (
        "passed",
        False,
        "non-inferior",
        {"n": 400, "lower": -0.01},
    )
    assert ended.ended_at == clock()
    clock.advance(30)
    again = any_store.end_canary(canary.id, "aborted", "the reconciler found it", None)
    assert again == ended
    assert any_store.canary(canary.id) == ended


def test_a_canary_loop_and_a_reconciler_ending_at_once_agree_on_one_ending(any_store: Store) -> None:
    canary = start(any_store)
    loop, reconciler = Store.sharing(any_store), Store.sharing(any_store)
    results = race(
        [
            lambda: loop.end_canary(canary.id, "failed", "lost live", {"lower": -0.3}),
            lambda: reconciler.end_canary(canary.id, "aborted", "the canary server is gone", None),
        ]
    )
    loop.close()
    reconciler.close()
    assert all(isinstance(r, CanaryRecord) for r in results), results
    assert results[0] == results[1] == any_store.canary(canary.id)
    assert results[0].state in ("failed", "aborted")
    assert any_store.running_canary() is None


@pytest.mark.unit
def test_a_canary_ends_only_in_a_final_state_and_an_unknown_one_is_an_error(store: Store) -> None:
    canary = start(store)
    with pytest.raises(ValueError, match="a canary ends in one of passed, failed"):
        store.end_canary(canary.id, "running", "", None)
    assert store.running_canary() == canary
    with pytest.raises(StoreError, match="there is no canary #999"):
        store.end_canary(999, "stopped", "", None)
    with pytest.raises(StoreError, match="there is no canary #999"):
        store.request_canary_stop(999, "op@host", "why")
    assert store.canary(999) is None


# ---- stop requests ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_stop_request_is_recorded_once_and_is_a_no_op_after_the_end(store: Store, clock: FakeClock) -> None:
    canary = start(store)
    clock.advance(10)
    asked = store.request_canary_stop(canary.id, "ana@ops", "users complain about v5")
    assert (asked.stop_requested_at, asked.stop_requested_by, asked.reason) == (
        clock(),
        "ana@ops",
        "users complain about v5",
    )
    assert asked.running  # the canary loop ends it, not the request
    clock.advance(10)
    again = store.request_canary_stop(canary.id, "bo@ops", "me too")
    assert again == asked  # the first request is the one on record
    ended = store.end_canary(canary.id, "stopped", asked.reason, None)
    clock.advance(10)
    assert store.request_canary_stop(canary.id, "cy@ops", "late") == ended


@pytest.mark.unit
def test_a_stop_request_keeps_a_reason_already_set(store: Store) -> None:
    from store.models import Canary

    canary = start(store)
    with store.transaction() as session:
        session.execute(update(Canary).where(Canary.id == canary.id).values(reason="guard: latency"))
    asked = store.request_canary_stop(canary.id, "ana@ops", "mine")
    assert (asked.stop_requested_by, asked.reason) == ("ana@ops", "guard: latency")


@pytest.mark.unit
def test_a_stop_request_on_an_ended_canary_records_nothing(store: Store) -> None:
    canary = start(store)
    ended = store.end_canary(canary.id, "inconclusive", "maximum duration", {"n": 12})
    assert store.request_canary_stop(canary.id, "ana@ops", "stop") == ended
    assert ended.stop_requested_at is None and ended.stop_requested_by is None


# ---- live episodes ---------------------------------------------------------------------------------


def rated(feeder: Feeder, name: str, version: str, settled: float, created: float = 0.0) -> None:
    """A one-segment episode of `version` settled at once at `settled` by a terminal rating."""
    feeder.send(
        interaction(name, version=version, created_at=at(created)),
        feedback(f"r-{name}-0", "edit_persisted"),
        now=at(settled),
    )


@pytest.mark.unit
def test_live_episodes_are_the_settled_rated_episodes_of_the_two_versions_since_the_start(
    store: Store,
) -> None:
    feeder = Feeder(store)
    rated(feeder, "b-champion", "v4", settled=20, created=10)
    rated(feeder, "a-challenger", "v5", settled=20, created=11)  # same settled_at: by episode_id
    rated(feeder, "c-first", "v5", settled=15, created=12)
    rated(feeder, "before", "v5", settled=16, created=9)  # began before the canary
    rated(feeder, "other-version", "v3", settled=17, created=10)
    rated(feeder, "poisoned", "v5", settled=18, created=10)
    with store.transaction() as session:
        session.execute(update(Episode).where(Episode.episode_id == "poisoned").values(quarantined_at=at(19)))
    # Unrated: settled by the window with no feedback, or by an episode_end alone (a control kind).
    feeder.send(interaction("silent", version="v5", created_at=at(10)), now=at(10))
    feeder.settle_window(at(41))
    feeder.send(
        interaction("ended-only", version="v5", created_at=at(10)),
        feedback("r-ended-only-0", "episode_end", episode_id="ended-only"),
        now=at(21),
    )
    # Rated only late, after the window settled it without a signal: its reward does not count it.
    feeder.send(feedback("r-silent-0", "thumbs_up"), now=at(50))
    # Rated but not settled yet: the window has not passed.
    feeder.send(
        interaction("open", version="v5", created_at=at(45)), feedback("r-open-0", "accepted"), now=at(45)
    )
    assert {e.status for e in [_episode(store, n) for n in ("silent", "ended-only")]} == {"settled"}
    with store.transaction() as session:
        joined = {(f.joined_episode_id, f.kind, f.late) for f in session.scalars(select(Feedback))}
    assert {("silent", "thumbs_up", True), ("ended-only", "episode_end", False)} <= joined
    assert _episode(store, "open").status == "open"

    found = store.live_episodes((5, 4), since=at(10))
    assert [e.episode_id for e in found] == ["c-first", "a-challenger", "b-champion"]
    first = found[0]
    assert (first.tenant, first.policy_number, first.reward, first.settled_at) == ("default", 5, 1.0, at(15))
    assert store.live_episodes((4, 4), since=at(10))[0].episode_id == "b-champion"
    assert [e.episode_id for e in store.live_episodes((5, 4), since=at(11))] == ["c-first", "a-challenger"]


@pytest.mark.unit
def test_a_later_read_extends_an_earlier_one(store: Store) -> None:
    feeder = Feeder(store)
    rated(feeder, "e1", "v5", settled=10)
    rated(feeder, "e2", "v4", settled=11)
    earlier = store.live_episodes((5, 4), since=at(0))
    rated(feeder, "e0", "v5", settled=12)  # named before the others, settled after them
    later = store.live_episodes((5, 4), since=at(0))
    assert later[: len(earlier)] == earlier
    assert [e.episode_id for e in later] == ["e1", "e2", "e0"]


@pytest.mark.unit
def test_live_episodes_carry_their_segments_completions_and_finish_reasons_in_order(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(
        interaction("agent", 1, version="v5", completion="second", finish_reason="length"),
        interaction("agent", 0, version="v5", completion="first", finish_reason="stop"),
        interaction("agent", 2, version="v5", completion="third", finish_reason=None),
        now=at(0),
    )
    feeder.send(feedback("r-agent-2", "edit_persisted"), now=at(5))
    feeder.settle_window(at(40))
    (found,) = store.live_episodes((5, 4), since=at(0))
    assert found.completions == ("first", "second", "third")
    assert found.finish_reasons == ("stop", "length", None)


@pytest.mark.unit
def test_live_episodes_read_their_segments_in_bounded_chunks(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    import store.canaries as canaries

    monkeypatch.setattr(canaries, "SEGMENT_CHUNK", 2)
    feeder = Feeder(store)
    for i in range(5):
        rated(feeder, f"e{i}", "v5", settled=i)
    found = store.live_episodes((5, 4), since=at(0))
    assert [e.episode_id for e in found] == [f"e{i}" for i in range(5)]
    assert all(e.completions == ("x):",) for e in found)


def _episode(store: Store, episode_id: str) -> Episode:
    with store.transaction() as session:
        row = session.get(Episode, episode_id)
        assert row is not None
        return row
