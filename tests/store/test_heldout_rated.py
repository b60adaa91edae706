"""`Store.select_heldout(rated_only=True)` (the ope suite's rated episodes, docs/gate.md Suites: ope):
only held-out episodes whose reward carries user feedback, never those the window settled without
any, on SQLite and PostgreSQL."""

from __future__ import annotations

from factories import Feeder, at, feedback, interaction

from store import Store


def test_rated_only_keeps_the_episodes_with_feedback_and_leaves_the_window_settled_ones(
    any_store: Store,
) -> None:
    feeder = Feeder(any_store)
    rated = [f"r{i}" for i in range(5)]
    silent = [f"s{i}" for i in range(7)]
    feeder.send(
        *[interaction(i) for i in rated + silent], *[feedback(f"r-{i}-0", "thumbs_up") for i in rated]
    )
    assert feeder.settle_window(at(3600)) == len(silent)  # settled with the no_feedback component

    every = any_store.select_heldout(100, spec_id="tab-v1@2", holdout_percent=100)
    only = any_store.select_heldout(100, spec_id="tab-v1@2", holdout_percent=100, rated_only=True)
    assert {e.episode_id for e in every} == set(rated + silent)
    assert {e.episode_id for e in only} == set(rated)
    assert all(not e.no_feedback for e in only) and all(
        e.no_feedback for e in every if e.episode_id in silent
    )
    assert len(any_store.select_heldout(2, spec_id="tab-v1@2", holdout_percent=100, rated_only=True)) == 2
