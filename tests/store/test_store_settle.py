"""Join and settle on SQLite: out-of-order feedback, windows, late and orphaned feedback."""

import pytest
from factories import FakeClock, Feeder, at, feedback, interaction
from sqlalchemy import select

from store import Store
from store.models import Episode, Feedback

pytestmark = pytest.mark.unit


def episode(store: Store, episode_id: str) -> Episode:
    with store.transaction() as session:
        row = session.get(Episode, episode_id)
        assert row is not None
        return row


def test_feedback_before_its_interaction_joins_when_it_arrives(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(feedback("r-e1-0", "accepted"), now=at(0))
    feeder.send(feedback("r-e1-0", "edit_persisted"), now=at(1))
    assert store.stats()["feedback_unjoined"] == 2
    _, report = feeder.send(interaction("e1"), now=at(2))
    assert (report.joined, report.settled_terminal) == (2, 1)
    settled = episode(store, "e1")
    assert (settled.status, settled.settle_reason, settled.settled_at) == (
        "settled",
        "terminal_feedback",
        at(2),
    )
    assert settled.reward == 1.75  # accepted 0.75 + edit_persisted 1.0
    assert settled.reward_components == {"accepted": 0.75, "edit_persisted": 1.0}
    assert settled.reward_spec == "tab-v1@2"


def test_an_unfinished_answer_is_labelled_negative_never_dropped_or_neutral(store: Store) -> None:
    """Cursor's second reward hack: a response the loop cannot score (here cut off by max_tokens)
    must not pay better than answering and being rejected (-0.25), with or without feedback."""
    feeder = Feeder(store)
    feeder.send(interaction("cut", finish_reason="length"), interaction("done", finish_reason="stop"),
                interaction("cut-rejected", finish_reason="length"), feedback("r-cut-rejected-0", "rejected"),
                now=at(0))  # fmt: skip
    assert feeder.settle_window(at(31)) == 2
    cut, done, rejected = (episode(store, e) for e in ("cut", "done", "cut-rejected"))
    assert cut.reward == -0.5 and cut.reward_components == {"no_feedback": 0.0, "unfinished": -0.5}
    assert done.reward == 0.0 and done.reward_components == {"no_feedback": 0.0}
    assert rejected.reward == -0.75 and rejected.reward_components == {"rejected": -0.25, "unfinished": -0.5}
    assert cut.reward < -0.25  # failing never beats a rejected answer


def test_an_untrainable_unfinished_segment_does_not_count(store: Store) -> None:
    # A stream the client hung up on is published truncated and untrainable: not the model's failure.
    feeder = Feeder(store)
    feeder.send(interaction("gone", finish_reason="length", trainable=False, truncated=True), now=at(0))
    assert feeder.settle_window(at(31)) == 1
    assert episode(store, "gone").reward_components == {"no_feedback": 0.0}


def test_non_terminal_feedback_settles_when_the_window_passes(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(interaction("e1"), now=at(0))
    feeder.send(feedback("r-e1-0", "accepted"), now=at(20))  # extends the window to t=50
    assert feeder.settle_window(at(49)) == 0
    assert episode(store, "e1").status == "open"
    assert feeder.settle_window(at(51)) == 1
    settled = episode(store, "e1")
    assert (settled.settle_reason, settled.reward) == ("window", 0.75)


def test_an_episode_without_feedback_is_labelled_zero(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(interaction("e1"), now=at(0))
    assert feeder.settle_window(at(31)) == 1
    settled = episode(store, "e1")
    assert (settled.reward, settled.reward_components, settled.settle_reason) == (
        0.0,
        {"no_feedback": 0.0},
        "window",
    )


def test_late_feedback_is_kept_and_flagged_not_rewarded(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(interaction("e1"), feedback("r-e1-0", "rejected"), now=at(0))
    _, report = feeder.send(feedback("r-e1-0", "thumbs_up"), now=at(5))
    assert (report.late_feedback, report.joined) == (1, 0)
    assert episode(store, "e1").reward == -0.25
    stats = store.stats()
    assert (stats["feedback"], stats["feedback_late"], stats["feedback_joined"]) == (2, 1, 2)


def test_orphaned_feedback_is_counted_not_lost(store: Store, clock: FakeClock) -> None:
    feeder = Feeder(store)
    feeder.send(feedback("never-served", "accepted"), now=clock())
    clock.advance(29)
    assert store.stats(orphan_after_s=30)["feedback_orphaned"] == 0
    clock.advance(2)
    feeder.settle_window(clock())
    stats = store.stats(orphan_after_s=30)
    assert (stats["feedback"], stats["feedback_orphaned"]) == (1, 1)


def test_feedback_of_another_tenant_does_not_join(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(
        interaction("e1", tenant="acme"), feedback("r-e1-0", "edit_persisted", tenant="mallory"), now=at(0)
    )
    assert episode(store, "e1").status == "open"
    assert store.stats()["feedback_unjoined"] == 1


def test_multi_segment_episode_feedback_by_episode_id(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(
        interaction("agent", 0, version="v4"),
        interaction("agent", 1, version="v3", created_at=at(-5)),  # served just before a hot-swap
        now=at(0),
    )
    feeder.send(feedback("r-elsewhere", "task_outcome", value=0.5, episode_id="agent"), now=at(3))
    settled = episode(store, "agent")
    assert (settled.status, settled.reward, settled.policy_version, settled.policy_number) == (
        "settled",
        0.5,
        "v3",
        3,
    )
    assert settled.first_event_at == at(-5)
    with store.transaction() as session:
        assert session.scalar(select(Feedback.joined_episode_id)) == "agent"


def test_feedback_and_its_interaction_in_one_batch(store: Store) -> None:
    feeder = Feeder(store)
    _, report = feeder.send(
        feedback("r-e1-0", "tool_call_error"), interaction("e1"), feedback("r-e1-0", "rejected")
    )
    assert report.settled_terminal == 1
    assert episode(store, "e1").reward == -1.25  # tool_call_error -1 + rejected -0.25
