"""The demo's wait for a round's episodes (simulation/demo.py, `_wait_for_round`): it counts the round's
dead-lettered interactions, stops waiting for the episodes they cost, and says so in one line."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from factories import Feeder, at, interaction, wire

from simulation.demo import DemoError, _dead_letter_line, _dead_letters_since, _wait_for_round
from store import Store

pytestmark = pytest.mark.unit


def round_with_dead_letters(store: Store) -> Feeder:
    """An earlier dead letter (before the round), then a round of four calls: a and b stored, c
    refused for its version, d unreadable; plus what costs no episode: a duplicate of a, a dead
    letter on the feedback topic."""
    feeder = Feeder(store)
    feeder.send(b"an earlier round's junk", now=at(0))
    records = [
        feeder.record(e)
        for e in (
            interaction(episode="a"),
            interaction(episode="b"),
            interaction(episode="c", version="main"),
        )
    ]
    records += [
        feeder.record(b"not json"),
        feeder.record(wire(interaction(episode="a"))),
        feeder.record(b"{", topic="feedback"),
    ]
    feeder.process(records, now=at(10))
    return feeder


def test_the_wait_ends_without_the_episodes_their_dead_letters_cost(store: Store) -> None:
    round_with_dead_letters(store)
    checks: list[int] = []
    started = time.monotonic()
    lost = _wait_for_round(
        store,
        "interactions",
        at(5),
        4,
        labelled=lambda: 2,
        check=lambda: checks.append(1),
        timeout_s=30,
        what="cycle 1",
        logs=Path("logs"),
    )
    assert time.monotonic() - started < 5 and checks  # at once, not after the timeout
    assert sorted(lost) == ["dlq:interactions:0:3", "dlq:interactions:0:4"]
    assert lost["dlq:interactions:0:3"][0] == "c"  # the episode, from the payload
    assert lost["dlq:interactions:0:3"][1].startswith("content: not an rtrl policy version")
    assert lost["dlq:interactions:0:4"][0] == "dlq:interactions:0:4"  # unreadable: one episode of its own
    assert lost["dlq:interactions:0:4"][1].startswith("schema: not JSON")


def test_a_round_that_still_cannot_settle_times_out_naming_its_dead_letters(store: Store) -> None:
    round_with_dead_letters(store)
    with pytest.raises(DemoError) as failed:
        _wait_for_round(
            store,
            "interactions",
            at(5),
            5,
            labelled=lambda: 2,
            check=lambda: None,
            timeout_s=0.6,
            what="cycle 2",
            logs=Path("/run/logs"),
        )
    message = str(failed.value)
    assert (
        "cycle 2: episodes unsettled" in message and "(2/3 settled; 2 interactions dead-lettered" in message
    )
    assert "\n" not in message and message.endswith("see the labeler log in /run/logs")


def test_the_dead_letter_line() -> None:
    lost = {
        "d1": ("e1", "content: not an rtrl policy version: 'main'"),
        "d2": ("e2", "schema: not JSON:\n  line 1"),
        "d3": ("e2", "schema: not JSON:\n  line 1"),
    }
    assert _dead_letter_line(lost) == (
        "3 interactions dead-lettered, 2 episodes not waited for (2 x schema: not JSON: line 1; "
        "1 x content: not an rtrl policy version: 'main'; `rtrl dlq list`)"
    )


def test_dead_letters_since_reads_past_a_page(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(*[b"old"] * 3, now=at(0))
    feeder.send(*[b"new"] * 70, now=at(10))  # more than the first page of 64
    feeder.process([feeder.record(b"new", topic="feedback")], now=at(10))
    letters = _dead_letters_since(store, "interactions", at(5))
    assert len(letters) == 70 and {d.payload for d in letters} == {b"new"}
