"""Forged events (docs/security.md): the labeler's store work refuses events of tenants without a
row (``labeler.unknown_tenants``, store/events.py) and token ids outside the serving model's
vocabulary (``labeler.vocab_size``, feedback/records.py), as dead letters with their reasons."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from factories import Feeder, feedback, interaction
from sqlalchemy import event

from store import Store
from store.models import Episode

pytestmark = pytest.mark.unit

V = 384  # the tiny model's vocabulary (services/tinymodel.py)


def has_episode(store: Store, episode_id: str) -> bool:
    with store.transaction() as session:
        return session.get(Episode, episode_id) is not None


@contextmanager
def statements(store: Store) -> Iterator[list[str]]:
    """The SQL statements the store runs inside the block."""
    seen: list[str] = []

    def note(*args: Any) -> None:
        seen.append(args[2])

    event.listen(store.engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(store.engine, "before_cursor_execute", note)


def test_events_of_a_tenant_without_a_row_are_dead_lettered(store: Store) -> None:
    store.set_tenant("acme")
    feeder = Feeder(store, unknown_tenants="refuse")
    written, _ = feeder.send(
        interaction("a1", tenant="acme"),
        interaction("g1", tenant="ghost"),
        feedback("r-a1-0", "accepted", tenant="acme"),
        feedback("r-g1-0", "accepted", tenant="ghost"),
        feedback("r-a1-0", "edited", value=0.5, tenant="default"),
    )
    assert [e.event_id for e in written.interactions] == ["i-a1-0"]
    assert [e.event_id for e in written.feedback] == ["f-r-a1-0-accepted"]
    assert [(r.record.source, r.reason, r.original_event_id) for r in written.rejected] == [
        ("interactions:0:1", "unknown tenant: ghost", "i-g1-0"),
        ("feedback:0:1", "unknown tenant: ghost", "f-r-g1-0-accepted"),
        ("feedback:0:2", "unknown tenant: default", "f-r-a1-0-edited"),
    ]
    stats = store.stats()
    # produced (5) = stored (2) + dead-lettered (3): `rtrl labeler reconcile` balances
    assert (stats["interactions"], stats["feedback"], stats["dead_letters"]) == (1, 1, 3)
    assert len(store.dead_letters(10, reason_prefix="unknown tenant:")) == 3  # `rtrl dlq --reason`
    assert not has_episode(store, "g1")  # nothing of the forged episode trains


def test_accept_stores_them_as_before(store: Store) -> None:
    written, _ = Feeder(store, unknown_tenants="accept").send(interaction("g1", tenant="ghost"))
    assert [e.tenant for e in written.interactions] == ["ghost"] and written.rejected == []


def test_the_tenants_of_a_batch_are_looked_up_once(store: Store) -> None:
    for tenant in ("acme", "bolt"):
        store.set_tenant(tenant)
    events = [interaction(f"e{i}", tenant=("acme", "bolt", "ghost")[i % 3]) for i in range(30)]
    feeder = Feeder(store, unknown_tenants="refuse")
    with statements(store) as seen:
        written, _ = feeder.send(*events)
    assert len(written.interactions) == 20 and len(written.rejected) == 10
    assert sum(1 for s in seen if "FROM tenants" in s) == 1


def test_a_refused_record_read_again_is_a_replay(store: Store) -> None:
    feeder = Feeder(store, unknown_tenants="refuse")
    record = feeder.record(interaction("g1", tenant="ghost"))
    first, _ = feeder.process([record])
    again, _ = feeder.process([record])  # re-delivered after a crash before the offset commit
    assert len(first.rejected) == 1 and (again.rejected, again.replayed) == ([], 1)
    assert store.stats()["dead_letters"] == 1


def test_an_event_stored_while_accepting_stays_a_replay_once_refusing(store: Store) -> None:
    """Switching accept -> refuse while a batch is uncommitted on Kafka must not make one record
    both a row and a dead letter (reconcile counts it once)."""
    accepting = Feeder(store, unknown_tenants="accept")
    record = accepting.record(interaction("g1", tenant="ghost"))
    accepting.process([record])
    refusing = Feeder(store, unknown_tenants="refuse")
    again, _ = refusing.process([record])
    assert (again.rejected, again.replayed) == ([], 1)
    assert (store.stats()["interactions"], store.stats()["dead_letters"]) == (1, 0)
    # The same event from another record is still refused (not a duplicate of a stored event).
    other, _ = refusing.process([accepting.record(interaction("g1", tenant="ghost"))])  # offset 1
    assert [r.reason for r in other.rejected] == ["unknown tenant: ghost"]


def test_token_ids_outside_the_vocabulary_are_dead_lettered(store: Store) -> None:
    feeder = Feeder(store, vocab_size=V)
    written, _ = feeder.send(
        interaction("ok", prompt_token_ids=[0, V - 1], completion_token_ids=[V - 1, 5]),
        interaction("edge", completion_token_ids=[4, V]),
        interaction("forged", prompt_token_ids=[1, 2**31 - 1, 3]),
        interaction("empty", completion_token_ids=[], completion_logprobs=[]),
    )
    assert sorted(e.episode_id for e in written.interactions) == ["empty", "ok"]
    assert [r.reason for r in written.rejected] == [
        f"content: token id outside the vocabulary ({V} >= {V})",
        f"content: token id outside the vocabulary ({2**31 - 1} >= {V})",
    ]
    assert not has_episode(store, "forged")


def test_without_a_vocabulary_any_schema_valid_id_is_stored(store: Store) -> None:
    written, _ = Feeder(store).send(interaction("big", completion_token_ids=[4, 2**31 - 1]))
    assert len(written.interactions) == 1
