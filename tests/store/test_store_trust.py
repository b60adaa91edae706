"""The store's side of the trust boundary on SQLite: API keys, tenant switches in training selection
(an adapter of its own included), redacted segments, dead letters for operators, and the labeler's poison-pill bookkeeping."""

from __future__ import annotations

from datetime import timedelta

import pytest
from factories import FakeClock, Feeder, feedback, interaction

from schemas.keys import TenantNameError, hash_key
from store import Store

pytestmark = pytest.mark.unit


def settled(feeder: Feeder, episode: str, tenant: str, **kw: object) -> None:
    feeder.send(
        interaction(episode, tenant=tenant, **kw), feedback(f"r-{episode}-0", "thumbs_up", tenant=tenant)
    )


def test_keys_are_stored_hashed_listed_and_revoked(store: Store, clock: FakeClock) -> None:
    record, key = store.create_api_key(role="tenant", tenant="acme", name="ci")
    assert key.startswith("rtrl_") and len(key) > 40
    assert record.key_hash == hash_key(key) and key.startswith(record.prefix) and record.prefix != key
    admin, _ = store.create_api_key(role="admin", tenant=None, name="ops", rate_per_s=5.0)
    assert [k.id for k in store.api_keys()] == [record.id, admin.id]
    assert [t.tenant for t in store.tenants()] == ["acme"]  # a tenant key made its tenant (training on)
    clock.advance(1)
    assert store.revoke_api_key(record.id) and not store.revoke_api_key(record.id)
    assert [k.id for k in store.api_keys()] == [admin.id]
    assert store.api_keys(include_revoked=True)[0].revoked_at == clock()
    with pytest.raises(ValueError):
        store.create_api_key(role="tenant", tenant=None, name="x")
    with pytest.raises(TenantNameError):
        store.create_api_key(role="tenant", tenant="a:b", name="x")  # ":" separates episode namespaces


def test_a_tenant_switched_off_does_not_train(store: Store) -> None:
    feeder = Feeder(store)
    settled(feeder, "a1", "acme")
    settled(feeder, "b1", "bolt")
    settled(feeder, "d1", "default")  # a tenant without a row trains
    assert store.count_trainable(1, 0) == 3
    store.set_tenant("bolt", trains=False)
    assert store.count_trainable(1, 0) == 2
    assert {e.episode_id for e in store.select_episodes(1, 0, 10)} == {"a1", "d1"}
    store.set_tenant("bolt", trains=True)
    assert store.count_trainable(1, 0) == 3


def test_redacted_segments_train_only_where_the_tenant_allows(store: Store) -> None:
    feeder = Feeder(store)
    settled(feeder, "r1", "acme", redacted=["email"])
    settled(feeder, "c1", "acme")
    store.set_tenant("acme")
    segments = {e.episode_id: e.segments[0].trainable for e in store.select_episodes(1, 0, 10)}
    assert segments == {"r1": False, "c1": True}
    store.set_tenant("acme", train_redacted=True)
    assert all(e.segments[0].trainable for e in store.select_episodes(1, 0, 10))


def test_dead_letters_for_operators_replay_once(store: Store) -> None:
    feeder = Feeder(store)
    feeder.process([feeder.record(b"not json"), feeder.record(feedback("x", "task_outcome", value=7.0))])
    letters = store.dead_letters(10)
    assert sorted(d.reason.split(":")[0] for d in letters) == ["content", "schema"]
    content = store.dead_letters(10, reason_prefix="content:")[0]
    assert "outside [-1, 1]" in content.reason and content.source_topic == "feedback"
    assert store.dead_letter(content.event_id) == content
    assert store.mark_replayed(content.event_id) and not store.mark_replayed(content.event_id)
    assert store.dead_letter(content.event_id).replayed_at is not None  # type: ignore[union-attr]
    assert store.dead_letter("no-such") is None


def test_batch_starts_that_a_process_died_on(store: Store) -> None:
    assert store.note_batch_starts({("t", 0): 100, ("t", 1): 5}) == set()
    # The same starts noted again without moving on: a process died there.
    assert store.note_batch_starts({("t", 0): 100, ("t", 1): 7}) == {("t", 0)}
    assert store.note_attempt("t", 0, 110, "record") == 1
    assert store.note_batch_starts({("t", 0): 110}) == {("t", 0)}  # died on the record at 110
    assert store.note_attempt("t", 0, 110, "record") == 2
    assert store.note_batch_starts({("t", 0): 111}) == set()  # moved on


def test_server_rotation(store: Store) -> None:
    assert store.rotation() == {}  # no row: every server is in rotation
    store.set_rotation("http://a:1/", False, "swap to v3")
    store.set_rotation("http://b:1", True, "operator")
    rows = store.rotation()
    assert set(rows) == {"http://a:1", "http://b:1"}
    assert not rows["http://a:1"].in_rotation and rows["http://a:1"].reason == "swap to v3"
    store.set_rotation("http://a:1", True, "back after: swap to v3")
    assert all(r.in_rotation for r in store.rotation().values())


def test_served_versions_are_announced_with_an_epoch(store: Store) -> None:
    store.set_rotation("http://a:1", False, "swap to v3")
    assert store.rotation()["http://a:1"].version is None and store.rotation()["http://a:1"].epoch == 0
    assert store.set_serving_version("http://a:1/", None, "swapping to v3") == 1
    assert store.set_serving_version("http://a:1", 3, "serving v3") == 2
    row = store.rotation()["http://a:1"]
    assert (row.version, row.epoch, row.in_rotation) == (3, 2, False)  # rotation untouched
    # A server announced before it was ever taken out of rotation gets a row that is in rotation.
    assert store.set_serving_version("http://b:1", 1, "serving v1") == 1
    assert store.rotation()["http://b:1"].in_rotation


def test_a_tenant_with_an_adapter_trains_its_own_line_only(store: Store) -> None:
    feeder = Feeder(store)
    settled(feeder, "a1", "acme")
    settled(feeder, "b1", "bolt")
    settled(feeder, "d1", "default")  # a tenant without a row has no adapter: the global line
    assert store.count_trainable(1, 0) == 3 and store.adapter_tenants() == []
    record = store.set_tenant("acme", adapter=True)
    assert record.adapter and record.trains  # a new switch leaves the others as they were
    assert store.adapter_tenants() == ["acme"]
    assert {e.episode_id for e in store.select_episodes(1, 0, 10)} == {"b1", "d1"}  # the global line
    assert {e.episode_id for e in store.select_episodes(1, 0, 10, tenant="acme")} == {"a1"}
    assert store.count_trainable(1, 0, tenant="acme") == 1 and store.count_trainable(1, 0, tenant="bolt") == 1
    store.set_tenant(
        "acme", trains=False
    )  # switched off training: its line has nothing, the global still none
    assert store.count_trainable(1, 0, tenant="acme") == 0 and store.count_trainable(1, 0) == 2
    store.set_tenant("acme", trains=True, adapter=False)  # back on the global line
    assert store.count_trainable(1, 0) == 3 and store.adapter_tenants() == []
    assert [(t.tenant, t.adapter) for t in store.tenants()] == [("acme", False)]


def test_held_out_traffic_is_split_by_line(store: Store) -> None:
    feeder = Feeder(store)
    for i in range(40):
        settled(feeder, f"a{i}", "acme")
        settled(feeder, f"b{i}", "bolt")
    store.set_tenant("acme", adapter=True)
    spec = _spec(store)
    acme = store.select_heldout(100, spec_id=spec, holdout_percent=50, tenant="acme")
    rest = store.select_heldout(100, spec_id=spec, holdout_percent=50)
    assert acme and rest  # 40 episodes each, about half in the held-out buckets
    assert {e.episode_id[0] for e in acme} == {"a"} and {e.episode_id[0] for e in rest} == {"b"}
    assert store.count_heldout(spec_id=spec, holdout_percent=50, tenant="acme") == len(acme)
    prompts = store.heldout_prompts(100, holdout_percent=50, tenant="acme")
    assert prompts and {p.tenant for p in prompts} == {"acme"}
    assert {p.tenant for p in store.heldout_prompts(100, holdout_percent=50)} == {"bolt"}


def _spec(store: Store) -> str:
    """The reward spec the feeder's episodes were labelled under (all alike)."""
    from store.models import Episode

    with store.transaction() as session:
        found = session.query(Episode.reward_spec).filter(Episode.reward_spec.is_not(None)).first()
    assert found is not None
    return str(found[0])


def test_the_lines_take_turns_on_one_lease_and_keep_their_own_cadence(store: Store, clock: FakeClock) -> None:
    acme = store.acquire_cycle("w", 60, 1, line="acme")
    assert acme is not None
    assert store.acquire_cycle("w", 60, 1) is None  # one cycle at a time, whichever its line
    assert [c.line for c in store.active_cycles()] == ["acme"]
    store.finish_cycle(acme, "rejected")
    clock.advance(10)
    global_cycle = store.acquire_cycle("w", 60, 1)
    assert global_cycle is not None
    store.finish_cycle(global_cycle, "promoted")
    assert store.last_cycle_started_at(("promoted", "rejected"), line="acme") == clock() - timedelta(
        seconds=10
    )
    assert store.last_cycle_started_at(("promoted", "rejected")) == clock()  # the global line's own
    assert store.last_cycle_started_at(("promoted", "rejected"), line="bolt") is None


def test_a_tenant_lines_policy_lag_counts_its_own_version_numbers(store: Store) -> None:
    # The servers' announcements are the global adapter's (v5 served last): a tenant line's lag
    # must not take them for its own versions (docs/lora.md, An adapter per tenant).
    feeder = Feeder(store)
    for version in ("v1", "v2", "v3"):
        settled(feeder, f"a-{version}", "acme", version=version)
    store.set_tenant("acme", adapter=True)
    store.set_serving_version("http://a:1", 5, "serving v5")
    store.set_serving_version("http://a:1", 1, "serving v1")
    assert {e.episode_id for e in store.select_episodes(3, 1, 10, tenant="acme")} == {"a-v2", "a-v3"}
    assert {e.episode_id for e in store.select_episodes(3, 0, 10, tenant="acme")} == {"a-v3"}
