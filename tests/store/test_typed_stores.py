"""The typed stores: each a context manager on the process's one engine of its URL (store/base.py,
store/engines.py), and `ReportStore`'s reads of ``rtrl report``'s numbers, worked by hand on a small
SQLite store."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from factories import T0, FakeClock, Feeder, at, feedback, interaction

from store import (
    CycleStore,
    DeployStore,
    EpisodeStore,
    LabellingStore,
    ReportStore,
    RetentionStore,
    Store,
    TenantStore,
    engines,
)

pytestmark = pytest.mark.unit

TYPED = (LabellingStore, EpisodeStore, CycleStore, DeployStore, TenantStore, ReportStore, RetentionStore)


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A migrated SQLite store's URL (its migrating store closed again)."""
    url = f"sqlite:///{tmp_path}/rtrl.db"
    with Store(url) as store:
        store.migrate()
    return url


# ---- context managers ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TYPED + (Store,), ids=lambda k: k.__name__)
def test_each_store_closes_when_its_block_ends(kind: type[Store], url: str) -> None:
    with kind(url) as store:
        store.check_schema()  # works on its own
        engine = store.engine
        assert not store.closed and engines.users(engine) == 1
    assert store.closed and engines.users(engine) == 0  # the last user disposed the engine


def test_a_store_closes_when_its_block_raises(url: str) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with CycleStore(url) as store:
            engine = store.engine
            raise RuntimeError("boom")
    assert store.closed and engines.users(engine) == 0


def test_close_is_idempotent_and_a_store_never_closed_lets_go_when_collected(url: str) -> None:
    store = TenantStore(url)
    engine = store.engine
    store.close()
    store.close()
    assert engines.users(engine) == 0
    forgotten = TenantStore(url)
    engine = forgotten.engine
    del forgotten  # CPython collects it now: its hold on the engine goes with it
    assert engines.users(engine) == 0


# ---- one engine per process per URL -------------------------------------------------------------


def test_stores_of_one_url_share_one_engine_and_outlive_each_others_close(url: str) -> None:
    with Store(url) as store, EpisodeStore(url) as episodes:
        assert episodes.engine is store.engine and engines.users(store.engine) == 2
        store.close()
        assert episodes.count_trainable(1, 0) == 0  # the engine still serves the other store
        assert engines.users(episodes.engine) == 1
        with CycleStore(url) as cycles:
            assert cycles.engine is episodes.engine  # the cached engine, not a new one
            assert cycles.acquire_cycle("w", 60, champion=1) == 1


def test_an_engine_is_made_again_once_every_store_of_it_closed(url: str) -> None:
    with ReportStore(url) as first:
        engine = first.engine
    with ReportStore(url) as again:
        assert again.engine is not engine
        assert again.stats()["cycles_running"] == 0


def test_other_urls_timeouts_and_in_memory_stores_get_engines_of_their_own(url: str, tmp_path: Path) -> None:
    with (
        Store(url) as a,
        Store(url, busy_timeout_s=0.2) as quick,
        Store(f"sqlite:///{tmp_path}/other.db") as b,
    ):
        assert len({id(a.engine), id(quick.engine), id(b.engine)}) == 3
    with (
        Store("sqlite://") as one,
        Store("sqlite://") as two,
    ):  # each in-memory store is a database of its own
        one.migrate()
        assert one.engine is not two.engine
        assert two.dialect == "sqlite"


def test_sharing_opens_another_typed_store_on_the_same_engine_and_clock(url: str) -> None:
    clock = FakeClock()
    with CycleStore(url, clock=clock) as cycles:
        with DeployStore.sharing(cycles) as deploys:
            assert (deploys.engine, deploys.clock, deploys.url) == (cycles.engine, clock, url)
            assert engines.users(cycles.engine) == 2
            deploys.set_serving_version("http://s1", 3, "verified")
        assert cycles.served_versions() == [3]  # closing the shared one left this one open
        assert engines.users(cycles.engine) == 1


def test_a_forked_child_drops_the_parents_pooled_connections(url: str) -> None:
    with Store(url) as store:
        store.check_schema()  # a connection now sits in the pool
        pool = store.engine.pool
        engines._after_fork_in_child()  # what os.register_at_fork runs in a child
        assert store.engine.pool is not pool  # a fresh pool: the parent's connections are left alone
        store.check_schema()  # and the store works on connections of its own


# ---- ReportStore: rtrl report's numbers ---------------------------------------------------------


def fill(store: Store) -> None:
    """v1: a1 accepted (0.75 by the window), a2 rejected (-0.25, terminal); v2: b1 without feedback
    (window, 0) from an untrainable segment; a sub-agent segment of b1 that does not count; two cycles;
    one dead letter on the second day."""
    feeder = Feeder(store)
    feeder.send(
        interaction("a1"),
        interaction("a2"),
        feedback("r-a1-0", "accepted"),
        feedback("r-a2-0", "rejected"),
        interaction("b1", version="v2", trainable=False, untrainable_reason="penalty"),
        interaction("b1", 1, version="v2", role="subagent", trainable=False),
    )
    feeder.settle_window(at(100))
    feeder.send(b"not json", now=at(86_400))
    c1 = store.acquire_cycle("w", 60, champion=1)
    assert c1 is not None
    store.finish_cycle(c1, "registered", challenger=2, metrics={"episodes": 2, "mean_reward": 0.25})
    store.finish_cycle(
        c1,
        "promoted",
        metrics={
            "gate": "pass",
            "gate_reason": "ok",
            "challenger_score": 0.6,
            "champion_score": 0.5,
            "swap_ms": 80,
            "data_to_deploy_s": 300,
        },
    )
    c2 = store.acquire_cycle("w", 60, champion=2)
    assert c2 is not None
    store.finish_cycle(c2, "failed", error="OOM", metrics={"gate": 1, "challenger_score": "nan?"})


def test_report_versions_counts_the_traffic_of_each_version(store: Store) -> None:
    fill(store)
    v1, v2 = store.report_versions()
    assert (v1.version, v1.episodes, v1.mean_reward, v1.positive, v1.no_feedback) == (1, 2, 0.25, 1, 0)
    assert (v1.judged, v1.accepted, v1.acceptance, v1.segments, v1.untrainable) == (2, 1, 0.5, 2, 0)
    assert (v2.version, v2.episodes, v2.mean_reward, v2.positive, v2.no_feedback) == (2, 1, 0.0, 0, 1)
    assert (v2.judged, v2.acceptance, v2.segments, v2.untrainable, v2.untrainable_rate) == (
        0,
        None,
        1,
        1,
        1.0,
    )
    assert store.report_versions(since=at(3_600)) == []  # they settled before


def test_report_cycles_reads_the_metrics_it_can_use(store: Store) -> None:
    fill(store)
    c1, c2 = store.report_cycles()
    assert (c1.id, c1.status, c1.champion, c1.challenger, c1.episodes, c1.mean_reward) == (
        1,
        "promoted",
        1,
        2,
        2,
        0.25,
    )
    assert (c1.gate, c1.gate_reason, c1.challenger_score, c1.champion_score) == ("pass", "ok", 0.6, 0.5)
    assert (c1.swap_ms, c1.data_to_deploy_s, c1.error) == (80.0, 300.0, None)
    # What is not a gate word or a finite number is left out, not passed on.
    assert (c2.status, c2.challenger, c2.gate, c2.challenger_score, c2.error) == (
        "failed",
        None,
        None,
        None,
        "OOM",
    )
    assert store.report_cycles(since=T0 + timedelta(seconds=1)) == []  # both started at T0


def test_report_dead_letters_counts_per_day_and_reason_prefix(store: Store) -> None:
    fill(store)
    assert store.report_dead_letters() == {T0.date() + timedelta(days=1): {"schema": 1}}
    assert store.report_dead_letters(since=at(86_401)) == {}


def test_report_tenants_lists_the_busiest_and_counts_them_all(store: Store) -> None:
    fill(store)
    rows, count = store.report_tenants()
    assert [(t.tenant, t.episodes, t.mean_reward, t.no_feedback) for t in rows] == [("default", 3, 1 / 6, 1)]
    assert count == 1
    assert store.report_tenants(limit=0) == ([], 1)


def test_report_reads_every_part_in_one_go(store: Store) -> None:
    fill(store)
    rows = store.report()
    assert rows.versions == store.report_versions() and rows.cycles == store.report_cycles()
    assert rows.dead_letters == store.report_dead_letters()
    assert (rows.tenants, rows.tenant_count) == store.report_tenants()
