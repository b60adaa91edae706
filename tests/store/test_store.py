"""The SQL store on SQLite: migrations, idempotent writes, cycle leases, on-policy selection."""

import json
from pathlib import Path

import pytest
from factories import HOLDOUT_KEY, FakeClock, Feeder, at, feedback, interaction
from sqlalchemy import select

from store import EpisodesUnavailable, LeaseLost, Store, StoreNotMigrated, UnsupportedStoreUrl
from store.models import Base, Cycle, DeadLetter, Interaction

pytestmark = pytest.mark.unit


def test_migrations_create_exactly_the_models(store: Store) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    store.migrate()  # a second run is a no-op
    with store.engine.connect() as connection:
        diff = compare_metadata(
            MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata
        )
    assert diff == []


def test_reads_check_the_schema_and_never_create_it(tmp_path: Path) -> None:
    path = tmp_path / "never-migrated.db"
    fresh = Store(f"sqlite:///{path}")
    with pytest.raises(StoreNotMigrated, match="does not exist; run `rtrl labeler migrate`"):
        fresh.check_schema()
    assert not path.exists()  # a read did not leave an empty database behind
    with pytest.raises(StoreNotMigrated, match="lacks rtrl's tables"):
        fresh.count_trainable(1, 0)  # a query on a database without the tables says what to do
    fresh.migrate()
    fresh.check_schema()
    fresh.close()


def test_a_store_url_that_is_not_a_database_is_an_operator_error() -> None:
    with pytest.raises(UnsupportedStoreUrl, match="RTRL_STORE__URL"):
        Store("mysql://somewhere/db")
    with pytest.raises(UnsupportedStoreUrl, match="RTRL_STORE__URL"):
        Store("not a url")


def test_sqlite_runs_in_wal_mode(store: Store) -> None:
    with store.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_the_same_record_twice_is_one_row(store: Store) -> None:
    feeder = Feeder(store)
    record = feeder.record(interaction())
    first, _ = feeder.process([record])
    again, _ = feeder.process([record])  # re-read after a crash before the offset commit
    assert (len(first.interactions), first.replayed) == (1, 0)
    assert (len(again.interactions), again.replayed, again.rejected) == (0, 1, [])
    assert store.stats()["interactions"] == 1
    assert store.stats()["dead_letters"] == 0


def test_a_second_record_with_a_stored_event_id_is_dead_lettered_once(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(interaction())
    duplicate = feeder.record(interaction())  # same event_id, produced again at offset 1
    written, _ = feeder.process([duplicate])
    assert [r.reason for r in written.rejected] == [
        "duplicate: event_id already stored from interactions:0:0"
    ]
    replay, _ = feeder.process([duplicate])
    assert (replay.rejected, replay.replayed) == ([], 1)
    stats = store.stats()
    assert (stats["interactions"], stats["dead_letters"]) == (1, 1)


def test_duplicates_inside_one_batch(store: Store) -> None:
    feeder = Feeder(store)
    written, _ = feeder.send(
        interaction(),
        interaction(),
        interaction(event_id="other"),
        feedback("r-e1-0", "accepted"),
        feedback("r-e1-0", "accepted"),
    )
    reasons = sorted(r.reason.split(":")[0] + ":" + r.record.source for r in written.rejected)
    assert reasons == ["duplicate:feedback:0:1", "duplicate:interactions:0:1", "duplicate:interactions:0:2"]
    assert (len(written.interactions), len(written.feedback)) == (1, 1)


def test_hostile_records_are_dead_lettered_with_reasons(store: Store) -> None:
    feeder = Feeder(store)
    nan = interaction().model_dump_json().replace("-1.25", "NaN").encode()
    written, _ = feeder.send(
        b"not json",
        b'{"schema_version": "rtrl.interaction.v9"}',
        nan,
        interaction(episode="badversion", version="main").model_dump_json().encode(),
        feedback("r", "accepted").model_dump_json().encode(),  # a feedback event on the interactions topic
        json.dumps(json.loads(nan) | {"event_id": "bad\ud800"}).encode(),  # an id no store can hold
    )
    reasons = [r.reason for r in written.rejected]
    assert reasons[0].startswith("schema: not JSON")
    assert reasons[1] == "schema: unknown schema_version 'rtrl.interaction.v9'"
    assert reasons[2].startswith("schema:") and "logprobs must be finite" in reasons[2]
    assert reasons[3].startswith("content: not an rtrl policy version")
    assert reasons[4] == "schema: rtrl.feedback.v1 on a topic for InteractionEvent"
    assert reasons[5].startswith("schema:")
    with store.transaction() as session:
        rows = session.scalars(select(DeadLetter).order_by(DeadLetter.source_offset)).all()
        assert [r.payload for r in rows][:2] == [b"not json", b'{"schema_version": "rtrl.interaction.v9"}']
        assert rows[3].original_event_id == "i-badversion-0"
        assert rows[5].original_event_id is None  # dead-lettered without it rather than not at all
        assert session.scalar(select(Interaction.event_id)) is None


def test_any_text_a_tokenizer_can_produce_is_stored_and_its_token_ids_are_exact(store: Store) -> None:
    """A byte-level tokenizer can produce any byte: NUL, other control characters, and (through a
    lenient JSON writer) lone surrogates, which PostgreSQL, orjson and UTF-8 refuse. The interaction
    is stored with each NUL and lone surrogate as U+FFFD and the rest of its text as it was; its
    token ids and logprobs are what the gateway sent (schemas.events.storable_text)."""
    feeder = Feeder(store)
    sent = json.loads(interaction().model_dump_json()) | {
        "prompt": "a\x00b\x01\x07\x1b[0m\x1f\x7f\x85\ud800\n",
        "prompt_token_ids": [0, 1, 2**31 - 1],
        "completion": "\udfff\x00x\ud83d\ude00\tdone\x00",  # a lone surrogate; a pair is one character
        "completion_token_ids": [255, 0],
        "finish_reason": "st\x00p",
        "sampling": {"stop": ["\x00", "\udc00", "\x1b"]},
    }
    raw = json.dumps(sent).encode()  # as Python's json writes it: NUL as \u0000, surrogates as \udXXX
    written, _ = feeder.send(
        raw, interaction(episode="e2", prompt="\x00", completion="\ud800").model_dump_json().encode()
    )
    assert (written.rejected, len(written.interactions)) == ([], 2)
    with store.transaction() as session:
        row = session.get(Interaction, "i-e1-0")
        assert row is not None
        assert row.prompt == "a\ufffdb\x01\x07\x1b[0m\x1f\x7f\x85\ufffd\n"
        assert row.completion == "\ufffd\ufffdx\U0001f600\tdone\ufffd"
        assert row.finish_reason == "st\ufffdp"
        assert row.sampling["stop"] == ["\ufffd", "\ufffd", "\x1b"]
        assert (row.prompt_token_ids, row.completion_token_ids) == ([0, 1, 2**31 - 1], [255, 0])
        assert row.completion_logprobs == [-0.5, -1.25]
        built = session.get(Interaction, "i-e2-0")  # built by the gateway in Python, as from vLLM's answer
        assert built is not None and (built.prompt, built.completion) == ("\ufffd", "\ufffd")
    assert store.stats()["dead_letters"] == 0


# ---- cycles ------------------------------------------------------------------------------------------


def test_one_active_cycle_at_a_time(store: Store) -> None:
    first = store.acquire_cycle("w1", ttl_s=60, champion=1)
    assert first is not None
    assert store.acquire_cycle("w2", ttl_s=60, champion=1) is None
    store.finish_cycle(first, "registered", challenger=2)
    assert store.acquire_cycle("w2", ttl_s=60, champion=1) is None  # gate/deploy still pending
    assert [c.id for c in store.active_cycles()] == [first]
    store.finish_cycle(first, "promoted", metrics={"reward": 0.5})
    assert store.active_cycles() == []
    second = store.acquire_cycle("w2", ttl_s=60, champion=2)
    assert second == first + 1
    cycle = store.get_cycle(first)
    assert cycle is not None
    assert (cycle.status, cycle.champion, cycle.challenger, cycle.metrics) == (
        "promoted",
        1,
        2,
        {"reward": 0.5},
    )
    assert [c.id for c in store.recent_cycles(10)] == [second, first]
    with store.transaction() as session:  # "vN" in the table, int in the API
        assert session.scalar(select(Cycle.challenger_version).where(Cycle.id == first)) == "v2"


def test_an_expired_lease_is_failed_and_replaced(store: Store, clock: FakeClock) -> None:
    feeder = Feeder(store)
    feeder.send(interaction(), feedback("r-e1-0", "edit_persisted"))
    stale = store.acquire_cycle("crashed", ttl_s=60, champion=1)
    assert stale is not None
    store.mark_used(stale, ["e1"])
    clock.advance(59)
    assert store.acquire_cycle("w2", ttl_s=60, champion=1) is None  # still held
    clock.advance(2)
    fresh = store.acquire_cycle("w2", ttl_s=60, champion=1)
    assert fresh is not None
    crashed = store.get_cycle(stale)
    assert crashed is not None and crashed.status == "failed" and "lease expired" in (crashed.error or "")
    assert store.count_trainable(1, 0) == 1  # its episode was released
    with pytest.raises(LeaseLost):
        store.heartbeat_cycle(stale, 60)
    with pytest.raises(LeaseLost):
        store.finish_cycle(stale, "registered", challenger=2)
    store.heartbeat_cycle(fresh, 60)
    clock.advance(59)
    store.mark_used(fresh, ["e1"])  # the heartbeat extended the lease


def test_a_dead_workers_cycle_expires_before_anyone_counts_and_a_live_one_is_renewed(
    store: Store, clock: FakeClock
) -> None:
    """The beat check and the next cycle call expire_cycles first: episodes a dead worker's cycle
    claimed are trainable again as soon as its lease has expired, before anyone counts them
    (counting first once kept the loop waiting behind a dead cycle for 42 minutes)."""
    feeder = Feeder(store)
    feeder.send(interaction(), feedback("r-e1-0", "edit_persisted"))
    dead = store.acquire_cycle("host:1:task-1", ttl_s=60, champion=1)
    assert dead is not None
    store.mark_used(dead, ["e1"])
    assert store.renew_lease("host:1:task-1", 60) == dead  # the keeper thread, while the worker lives
    assert store.renew_lease("host:2:task-2", 60) is None  # holds no cycle: nothing to renew
    clock.advance(59)
    assert store.expire_cycles() == [] and store.count_trainable(1, 0) == 0  # renewed: still held
    clock.advance(2)  # the renewals stopped 61 s ago: the worker is dead
    assert store.expire_cycles() == [dead]
    assert store.count_trainable(1, 0) == 1  # released
    ended = store.get_cycle(dead)
    assert ended is not None and ended.status == "failed"
    assert "stopped renewing" in (ended.error or "") and "host:1:task-1" in (ended.error or "")
    assert store.expire_cycles() == []  # once
    assert store.renew_lease("host:1:task-1", 60) is None  # a late renewal does not revive it
    with pytest.raises(LeaseLost):
        store.heartbeat_cycle(dead, 60)


def test_a_redelivered_job_reclaims_its_lost_cycle_at_once(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(interaction(), feedback("r-e1-0", "edit_persisted"))
    lost = store.acquire_cycle("host:111:task-7", ttl_s=3600, champion=1)  # worker then died
    assert lost is not None
    store.mark_used(lost, ["e1"])
    assert store.reclaim_cycle("task-8", reason="x") is None  # another job's cycle is left alone
    assert store.acquire_cycle("host:222:task-8", ttl_s=60, champion=1) is None
    assert store.reclaim_cycle("task-7", reason="worker lost") == lost
    cycle = store.get_cycle(lost)
    assert cycle is not None and (cycle.status, cycle.error) == ("failed", "worker lost")
    assert store.count_trainable(1, 0) == 1  # its episode is back in the pool
    assert store.acquire_cycle("host:333:task-7", ttl_s=60, champion=1) is not None


def test_finish_rules(store: Store) -> None:
    cycle = store.acquire_cycle("w", 60, 1)
    assert cycle is not None
    with pytest.raises(ValueError):
        store.finish_cycle(cycle, "running")
    store.finish_cycle(cycle, "failed", error="boom")
    store.finish_cycle(cycle, "failed")  # retried finish: no-op
    with pytest.raises(LeaseLost):
        store.finish_cycle(cycle, "promoted")


# ---- selection ---------------------------------------------------------------------------------------


def settled_episodes(feeder: Feeder) -> None:
    """e-v1, e-v2, e-v3 (one per policy version, newer ones later) and a two-segment e-v3b; all settled."""
    for n, name in [(1, "e-v1"), (2, "e-v2"), (3, "e-v3")]:
        feeder.send(
            interaction(name, version=f"v{n}", created_at=at(n)), feedback(f"r-{name}-0", "edit_persisted")
        )
    feeder.send(
        interaction("e-v3b", 1, version="v3", created_at=at(11)),
        interaction("e-v3b", 0, version="v3", created_at=at(10), role="summary"),
        feedback("r-e-v3b-1", "rejected"),  # about one call of a two-call episode: joins, does not end it
        feedback("r-e-v3b-1", "episode_end", episode_id="e-v3b"),  # the client ends it
    )
    feeder.send(interaction("e-v3b", 2, version="v3"))  # after settlement: late, not trained


def test_selection_by_policy_lag_newest_first(store: Store) -> None:
    settled_episodes(Feeder(store))
    assert store.count_trainable(3, 0) == 2
    assert store.count_trainable(3, 1) == 3
    assert store.count_trainable(2, 5) == 2
    episodes = store.select_episodes(champion_number=3, max_lag=1, limit=10)
    assert [e.episode_id for e in episodes] == ["e-v3b", "e-v3", "e-v2"]
    multi = episodes[0]
    assert multi.reward == -0.25 and multi.created_at == at(10) and multi.policy_version == 3
    assert {s.policy_version for s in multi.segments} == {3}
    assert [s.role for s in multi.segments] == ["summary", "policy"]  # segment 2 came late
    assert multi.segments[0].completion_logprobs == [-0.5, -1.25]
    assert [e.episode_id for e in store.select_episodes(3, 1, limit=1)] == ["e-v3b"]


def test_policy_lag_counts_versions_that_served_not_registry_numbers(store: Store, clock: FakeClock) -> None:
    """v3 was a challenger the gate rejected: it never served, so one version behind v4 is v2."""
    feeder = Feeder(store)
    for n in (1, 2, 3, 4):
        feeder.send(interaction(f"e{n}", version=f"v{n}"), feedback(f"r-e{n}-0", "thumbs_up"))
    for n in (1, 2, 4):
        clock.advance(60)
        store.set_serving_version("http://vllm-a:8000", None, f"swap to v{n}")
        store.set_serving_version("http://vllm-a:8000", n, f"after: swap to v{n}")
    assert store.served_versions() == [4, 2, 1]
    assert {e.episode_id for e in store.select_episodes(4, 1, 10)} == {"e4", "e2"}
    assert store.count_trainable(4, 2) == 3 and store.count_trainable(4, 0) == 1
    clock.advance(60)
    store.set_serving_version("http://vllm-a:8000", 1, "rollback to v1")  # v1 served again, most recently
    assert store.served_versions()[0] == 1


def test_every_episode_becomes_trainable_by_the_same_rule_whatever_its_outcome(
    store: Store, clock: FakeClock
) -> None:
    """A rejection settles an episode at once, an acceptance when the window passes; the trainer's
    rule (the window after the last event) makes both trainable at the same moment."""
    feeder = Feeder(store)
    feeder.send(
        interaction("rej"),
        interaction("acc"),
        feedback("r-rej-0", "rejected"),
        feedback("r-acc-0", "accepted"),
    )
    assert store.count_trainable(1, 0) == 1  # on settlement alone the rejection is ahead
    assert store.count_trainable(1, 0, settle_window_s=30) == 0
    clock.advance(31)
    feeder.settle_window(clock(), 30)
    assert store.count_trainable(1, 0, settle_window_s=30) == 2
    assert {e.episode_id for e in store.select_episodes(1, 0, 10, settle_window_s=30)} == {"rej", "acc"}


def test_reward_spec_versions_are_never_mixed(store: Store) -> None:
    from schemas.rewards import TAB_V1

    v3 = TAB_V1.model_copy(update={"version": 3})
    Feeder(store).send(interaction("old"), feedback("r-old-0", "thumbs_up"))
    Feeder(store, spec=v3).send(interaction("new"), feedback("r-new-0", "thumbs_up"), now=at(1))
    assert store.count_trainable(1, 0) == 2
    assert store.count_trainable(1, 0, spec_id="tab-v1@3") == 1
    assert [e.episode_id for e in store.select_episodes(1, 0, 10, spec_id=TAB_V1.spec_id)] == ["old"]


def test_the_gates_held_out_slice_is_never_trained_on(store: Store) -> None:
    """Episodes below the held-out percent (by a keyed hash of their id) are the gate's: never selected
    for training, selected by `select_heldout`; together the two are every settled episode."""
    from store.settle import eval_bucket

    feeder = Feeder(store)
    ids = [f"e{i}" for i in range(40)]
    feeder.send(*[interaction(i) for i in ids], *[feedback(f"r-{i}-0", "thumbs_up") for i in ids])
    held = {i for i in ids if eval_bucket(i, HOLDOUT_KEY) < 30}
    assert 0 < len(held) < 40 and eval_bucket("e1", HOLDOUT_KEY) == eval_bucket("e1", HOLDOUT_KEY)
    assert store.count_trainable(1, 0, holdout_percent=30) == 40 - len(held)
    assert {e.episode_id for e in store.select_episodes(1, 0, 100, holdout_percent=30)} == set(ids) - held
    heldout = store.select_heldout(100, spec_id="tab-v1@2", holdout_percent=30)
    assert {e.episode_id for e in heldout} == held and store.count_heldout(
        spec_id="tab-v1@2", holdout_percent=30
    ) == len(held)
    assert all(e.segments and not e.no_feedback for e in heldout)
    assert store.select_heldout(100, spec_id="other@1", holdout_percent=30) == []
    assert store.select_heldout(100, spec_id="tab-v1@2", holdout_percent=0) == []
    assert store.count_trainable(1, 0) == 40  # without a held-out slice every episode trains


def test_gate_decisions_are_kept_newest_first(store: Store) -> None:
    store.record_gate_decision(3, 2, False, "worse", {"passed": False, "n": 1}, at(0))
    store.record_gate_decision(3, 2, True, "fine", {"passed": True, "n": 2}, at(1))
    assert [r["n"] for r in store.gate_decisions(3)] == [2, 1]
    assert store.gate_decisions(4) == []


def test_an_episode_is_never_used_by_two_cycles(store: Store) -> None:
    settled_episodes(Feeder(store))
    first = store.acquire_cycle("w1", 60, 3)
    assert first is not None
    store.mark_used(first, ["e-v3", "e-v3b"])
    assert store.count_trainable(3, 0) == 0
    store.finish_cycle(first, "failed", error="OOM")  # a failed cycle releases its episodes
    assert store.count_trainable(3, 0) == 2

    second = store.acquire_cycle("w2", 60, 3)
    assert second is not None
    store.mark_used(second, ["e-v3"])
    with pytest.raises(EpisodesUnavailable):
        store.mark_used(second, ["e-v3b", "e-v3"])  # all or nothing
    assert store.count_trainable(3, 0) == 1
    with pytest.raises(EpisodesUnavailable):
        store.mark_used(second, ["no-such-episode"])
    store.finish_cycle(second, "rejected")  # a rejected cycle keeps them: that batch was judged
    assert store.count_trainable(3, 0) == 1
    assert store.stats()["episodes_used"] == 1
    assert store.get_cycle(second).episode_ids == ["e-v3"]  # type: ignore[union-attr]
    with pytest.raises(LeaseLost):
        store.mark_used(second, ["e-v3b"])
