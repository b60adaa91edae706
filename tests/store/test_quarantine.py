"""A poisoned episode cannot fail every cycle (docs/security.md, Poisoned episodes): every failed
cycle counts against the episodes it had claimed, on each path that fails one (finish_cycle, an
expired lease, a reclaimed job), and an episode at ``trainer.max_episode_failures`` is quarantined
with the cycle's error instead of released, until an operator releases it. On SQLite (unit) and
PostgreSQL (integration)."""

import pytest
from factories import FakeClock, Feeder, feedback, interaction
from sqlalchemy import insert, inspect, update

from store import EpisodesUnavailable, Store
from store.models import Cycle, Episode

POISON = "CUDA error: device-side assert triggered (token id 2147483647 >= vocabulary 151936)"


def settle(store: Store, *episodes: str) -> None:
    feeder = Feeder(store)
    for name in episodes:
        feeder.send(interaction(name), feedback(f"r-{name}-0", "edit_persisted"))


def failed_cycle(store: Store, episodes: list[str], error: str = POISON, **kw: object) -> list[str]:
    """A cycle that claims `episodes` and fails in training; the ids it quarantined."""
    cycle = store.acquire_cycle("w", 60, 1)
    assert cycle is not None
    store.mark_used(cycle, episodes)
    return store.finish_cycle(cycle, "failed", error=error, **kw)  # type: ignore[arg-type]


def trainable(store: Store) -> set[str]:
    return {e.episode_id for e in store.select_episodes(1, 0, limit=100)}


def test_three_failed_cycles_quarantine_the_episode_with_its_reason(any_store: Store) -> None:
    settle(any_store, "poison", "a", "b", "c")
    assert failed_cycle(any_store, ["poison", "a"]) == []
    assert failed_cycle(any_store, ["poison", "b"]) == []
    assert trainable(any_store) == {"poison", "a", "b", "c"}  # two failures: still in the pool
    assert failed_cycle(any_store, ["poison", "c"]) == ["poison"]

    assert trainable(any_store) == {"a", "b", "c"}  # each innocent companion failed once
    assert any_store.count_trainable(1, 0) == 3
    (q,) = any_store.quarantined(10)
    assert (q.episode_id, q.tenant, q.failed_cycles) == ("poison", "default", 3)
    assert q.reason == f"cycle 3 failed: {POISON}"
    assert any_store.stats()["episodes_quarantined"] == 1
    cycle = any_store.acquire_cycle("w", 60, 1)
    assert cycle is not None
    with pytest.raises(EpisodesUnavailable, match="not quarantined"):
        any_store.mark_used(cycle, ["poison", "a"])  # nor can a cycle claim it by id
    any_store.mark_used(cycle, ["a"])
    any_store.finish_cycle(cycle, "promoted")  # the loop moves on
    assert any_store.get_cycle(4).status == "promoted"  # type: ignore[union-attr]


def test_two_failures_then_a_success_leave_it_trainable_and_touch_nothing_unclaimed(
    any_store: Store,
) -> None:
    settle(any_store, "e1", "e2", "other")
    failed_cycle(any_store, ["e1", "e2"], error="RuntimeError: NCCL timeout")
    failed_cycle(any_store, ["e1", "other"], error="RuntimeError: NCCL timeout")
    assert trainable(any_store) == {"e1", "e2", "other"}
    cycle = any_store.acquire_cycle("w", 60, 1)
    assert cycle is not None
    any_store.mark_used(cycle, ["e1", "e2"])
    assert any_store.finish_cycle(cycle, "promoted") == []
    assert trainable(any_store) == {"other"}  # e1 trained; "other" keeps its one failure
    assert failed_cycle(any_store, ["other"]) == []  # two failures: not yet
    assert failed_cycle(any_store, ["other"]) == ["other"]  # the third
    assert any_store.stats()["episodes_used"] == 2


def test_a_failure_that_is_not_the_datas_counts_nothing(any_store: Store) -> None:
    """A registered cycle whose gate or swap failed, or a stopping worker: `count_failure=False`."""
    settle(any_store, "e1")
    for _ in range(5):
        assert failed_cycle(any_store, ["e1"], error="swap failed: x", count_failure=False) == []
    assert trainable(any_store) == {"e1"} and any_store.quarantined(10) == []


def test_stale_cycles_count_the_same_way(any_store: Store, clock: FakeClock) -> None:
    """A worker the batch killed (a CUDA assert aborts the process) never finishes its cycle: the
    cycle is failed by expire_cycles, by the next acquire_cycle or by the redelivered job, and each
    counts once against its episodes."""
    settle(any_store, "e1", "e2")
    dead = any_store.acquire_cycle("host:1:task-1", 60, 1)
    assert dead is not None
    any_store.mark_used(dead, ["e1", "e2"])
    clock.advance(61)
    assert any_store.expire_cycles(max_episode_failures=3) == [dead]  # beat's check

    dead = any_store.acquire_cycle("host:1:task-2", 60, 1)
    assert dead is not None
    any_store.mark_used(dead, ["e1"])
    clock.advance(61)
    again = any_store.acquire_cycle("host:2:task-3", 60, 1, max_episode_failures=3)  # the next cycle
    assert again is not None
    any_store.mark_used(again, ["e1"])  # its worker dies too; the job is delivered again
    assert any_store.reclaim_cycle("task-3", "worker lost; re-run by host:3:task-3") == again

    assert trainable(any_store) == {"e2"}  # one failure
    (q,) = any_store.quarantined(10)
    assert (q.episode_id, q.failed_cycles) == ("e1", 3)
    assert q.reason == f"cycle {again} failed: worker lost; re-run by host:3:task-3"
    assert any_store.get_cycle(again).status == "failed"  # type: ignore[union-attr]


def test_a_lower_threshold_and_a_release(any_store: Store) -> None:
    settle(any_store, "e1", "e2")
    assert failed_cycle(any_store, ["e1", "e2"], max_episode_failures=1) == ["e1", "e2"]
    assert trainable(any_store) == set()
    assert [q.episode_id for q in any_store.quarantined(1)] == ["e1"]  # the limit holds
    assert any_store.release_quarantined(["e2", "no-such", "e2"]) == ["e2"]
    assert trainable(any_store) == {"e2"}
    assert any_store.release_quarantined(["e2"]) == []  # released already: not quarantined
    assert [q.episode_id for q in any_store.quarantined(10)] == ["e1"]
    # Released with no failure counted: max_episode_failures more failures quarantine it again.
    assert failed_cycle(any_store, ["e2"]) == [] and failed_cycle(any_store, ["e2"]) == []
    assert failed_cycle(any_store, ["e2"]) == ["e2"]


def test_a_long_error_is_truncated_in_the_reason(any_store: Store) -> None:
    settle(any_store, "e1")
    failed_cycle(any_store, ["e1"], error="x" * 9000, max_episode_failures=1)
    (q,) = any_store.quarantined(10)
    assert len(q.reason) == 2000 and q.reason.startswith("cycle 1 failed: xxx")


def test_the_migration_upgrades_a_store_with_episodes(url: str, clock: FakeClock) -> None:
    """Migration 0012 on a store of 0011 with settled, used and open episodes: none is counted or
    quarantined, and the trainable ones stay trainable."""
    store = Store(url, clock=clock)
    store.migrate("0011")
    settle(store, "e1", "e2")
    Feeder(store).send(interaction("open"))
    with store.transaction() as session:  # a promoted cycle and its claim, as 0011's code wrote them
        # (not through today's CycleStore: the cycles table has columns since, migration 0016's line)
        table = Cycle.__table__
        row = dict(status="promoted", owner="w", champion_version="v1")
        times = dict(lease_expires_at=clock(), started_at=clock(), finished_at=clock())
        cycle = session.execute(insert(table).values(**row, **times).returning(table.c.id)).scalar_one()
        session.execute(update(Episode).where(Episode.episode_id == "e2").values(used_in_cycle=cycle))
    store.migrate()
    store.check_schema()
    assert trainable(store) == {"e1"} and store.quarantined(10) == []
    assert store.stats()["episodes_quarantined"] == 0
    assert failed_cycle(store, ["e1"]) == []  # counted from 0
    assert failed_cycle(store, ["e1"]) == [] and failed_cycle(store, ["e1"]) == ["e1"]

    from alembic import command  # and back: the downgrade drops the three columns, keeps the rows

    config = store._alembic_config()
    with store.engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0011")
    with store.engine.connect() as connection:
        columns = {c["name"] for c in inspect(connection).get_columns("episodes")}
    assert not columns & {"failed_cycles", "quarantined_at", "quarantine_reason"}
    store.migrate()
    assert trainable(store) == {"e1"}  # the quarantine went with its columns
    store.close()
