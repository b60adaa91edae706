"""Caps per episode and held-out membership (docs/security.md, Caps per episode and held-out
membership): segments and feedback past their episode's cap are dead letters ``cap: ...`` (store/caps.py),
a flooded episode still settles, a batch read again stays a replay, and the held-out bucket is a
keyed hash (store/settle.py, `eval_bucket`)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from factories import HOLDOUT_KEY, Feeder, at, feedback, interaction
from sqlalchemy import select

from store import Caps, Store
from store.models import Episode, Feedback, Interaction
from store.settle import eval_bucket

pytestmark = pytest.mark.unit

CAPS = Caps(segments=3, feedback=4)


def segments_of(store: Store, episode_id: str) -> list[int]:
    with store.transaction() as session:
        return sorted(
            session.scalars(select(Interaction.segment_index).where(Interaction.episode_id == episode_id))
        )


def episode(store: Store, episode_id: str) -> Any:
    with store.transaction() as session:
        row = session.get(Episode, episode_id)
        assert row is not None
        return (row.status, row.settle_reason, row.eval_bucket, row.last_event_at)


def test_segments_past_the_cap_are_dead_lettered_and_the_episode_keeps_its_first(store: Store) -> None:
    feeder = Feeder(store, caps=CAPS)
    written, _ = feeder.send(*[interaction("e1", s) for s in range(2)], interaction("other"))
    assert written.rejected == []
    written, _ = feeder.send(*[interaction("e1", s) for s in range(2, 6)])
    assert [e.segment_index for e in written.interactions] == [2]
    assert [(r.original_event_id, r.reason) for r in written.rejected] == [
        (f"i-e1-{s}", "cap: episode e1 has its 3 segments (limits.max_segments_per_episode)")
        for s in (3, 4, 5)
    ]
    assert segments_of(store, "e1") == [0, 1, 2] and segments_of(store, "other") == [0]
    stats = store.stats()
    # produced (7) = stored (4) + dead-lettered (3): `rtrl labeler reconcile` balances
    assert (stats["interactions"], stats["dead_letters"]) == (4, 3)
    assert len(store.dead_letters(10, reason_prefix="cap:")) == 3  # `rtrl dlq --reason cap:`


def test_segments_of_a_settled_episode_count_too(store: Store) -> None:
    """Late segments are stored (late = true): they count, or a settled episode would take any number."""
    feeder = Feeder(store, caps=CAPS)
    feeder.send(interaction("e1", 0), feedback("r-e1-0", "thumbs_up"))
    assert episode(store, "e1")[0] == "settled"
    written, report = feeder.send(*[interaction("e1", s) for s in range(1, 5)])
    assert report.late_segments == 2 and len(written.rejected) == 2


def test_a_batch_read_again_is_a_replay_not_a_cap(store: Store) -> None:
    """A crash after the DB commit re-delivers the batch: what was stored stays stored, what was
    dead-lettered stays one dead letter, nothing is counted twice."""
    feeder = Feeder(store, caps=CAPS)
    records = [feeder.record(interaction("e1", s)) for s in range(5)]
    records += [feeder.record(feedback("r-e1-0", "edited", 0.5, event_id=f"f{i}")) for i in range(6)]
    first, _ = feeder.process(records)
    assert (len(first.interactions), len(first.feedback), len(first.rejected)) == (3, 4, 4)
    again, _ = feeder.process(records)
    assert (again.interactions, again.feedback, again.rejected, again.replayed) == ([], [], [], 11)
    stats = store.stats()
    assert (stats["interactions"], stats["feedback"], stats["dead_letters"]) == (3, 4, 4)


def test_an_episode_flooded_with_feedback_still_settles_and_is_read_a_cap_at_a_time(store: Store) -> None:
    """`accepted` is not terminal under tab-v1: it joins and moves the episode's last event, so
    without a cap a flood keeps the episode open for ever and every batch reads all of it again."""
    feeder = Feeder(store, caps=CAPS)
    feeder.send(interaction("e1", 0), interaction("e1", 1), now=at(0))
    for second in range(1, 40):  # one flood batch a second, each past the cap after the first
        flood = [feedback("r-e1-1", "accepted", event_id=f"f{second}-{i}") for i in range(3)]
        written, report = feeder.send(*flood, now=at(second))
        if second > 2:
            assert written.feedback == [] and report.joined == 0 and len(written.rejected) == 3
    assert episode(store, "e1")[3] == at(2)  # the last admitted feedback moved it, nothing after
    with store.transaction() as session:
        assert (
            len(session.scalars(select(Feedback.event_id).where(Feedback.joined_episode_id == "e1")).all())
            == 4
        )
    assert feeder.settle_window(at(40), window_s=30.0) == 1
    assert episode(store, "e1")[:2] == ("settled", "window")
    assert store.stats()["dead_letters"] == 39 * 3 - 4


def test_feedback_waiting_for_its_interaction_is_capped_per_request(store: Store) -> None:
    feeder = Feeder(store, caps=CAPS)
    written, _ = feeder.send(*[feedback("r-e1-0", "edited", 0.5, event_id=f"f{i}") for i in range(6)])
    assert (
        len(written.feedback) == 4
        and [r.reason for r in written.rejected]
        == [
            "cap: request (its episode not known yet) r-e1-0 has its 4 feedback (limits.max_feedback_per_episode)"
        ]
        * 2
    )
    # The interaction arrives with more feedback: the waiting four join it and fill its cap.
    written, report = feeder.send(
        interaction("e1", 0), interaction("e1", 1), feedback("r-e1-1", "edited", 0.5, event_id="g")
    )
    assert report.joined == 4 and [r.original_event_id for r in written.rejected] == ["g"]


def test_feedback_of_another_tenant_does_not_use_up_an_episodes_cap(store: Store) -> None:
    """Feedback naming another tenant's episode never joins it; it is counted on its own."""
    feeder = Feeder(store, caps=CAPS)
    feeder.send(interaction("e1", 0), interaction("e1", 1))
    forged = [
        feedback("x", "edited", 0.5, event_id=f"g{i}", episode_id="e1", tenant="ghost") for i in range(6)
    ]
    written, _ = feeder.send(*forged)
    assert len(written.rejected) == 2
    written, report = feeder.send(*[feedback("r-e1-0", "edited", 0.5, event_id=f"f{i}") for i in range(4)])
    assert written.rejected == [] and report.joined == 4


def test_the_held_out_bucket_is_a_keyed_hash_of_the_episode_id(store: Store) -> None:
    """A client chooses its episode ids; without the key it cannot tell (or choose) which are held out."""
    ids = [f"acme:e{i}" for i in range(200)]
    Feeder(store).send(*[interaction(i) for i in ids])
    stored = {i: episode(store, i)[2] for i in ids}
    assert stored == {i: eval_bucket(i, HOLDOUT_KEY) for i in ids}
    unkeyed = {i: int.from_bytes(hashlib.sha256(i.encode()).digest()[:8], "big") % 100 for i in ids}
    other_key = {i: eval_bucket(i, b"another key") for i in ids}
    assert sum(stored[i] == unkeyed[i] for i in ids) < 20  # the old public hash says nothing (~1 %)
    assert sum(stored[i] == other_key[i] for i in ids) < 20
    assert sum(b < 10 for b in stored.values()) in range(5, 40)  # still ~10 % below 10
    with pytest.raises(ValueError, match="held-out key"):
        eval_bucket("e1", b"")
    with store.labelling(at(0)) as tx, pytest.raises(ValueError, match="held-out key"):
        tx.join_and_settle(Feeder(store).spec, [interaction("e2")], [], holdout_key=None)  # type: ignore[arg-type]
