"""Corrections in the store: the text of correction and edited feedback is kept (migration 0015) and
read with the trainer's episodes, one query per batch (store/episodes.py, `TrainingEpisode.corrections`).
On SQLite (unit) and PostgreSQL (integration), through the `any_store` fixture."""

from __future__ import annotations

from typing import Any

import pytest
from factories import Feeder, at, feedback, interaction
from sqlalchemy import event, select

from store import Correction, Store
from store.models import DeadLetter, Feedback


def test_an_episodes_corrections_are_read_with_it_oldest_first(any_store: Store) -> None:
    feeder = Feeder(any_store)
    feeder.send(
        interaction("e1", 0),
        interaction("e1", 1),
        interaction("plain"),
        feedback("r-e1-1", "correction", text="the answer is 12", created_at=at(2)),
        feedback("r-e1-0", "edited", text="def f(x):\n    return {x, 1}", created_at=at(1)),
        feedback("r-e1-0", "accepted"),  # no text: not a correction
        feedback("r-plain-0", "thumbs_up"),
    )
    feeder.send(  # the client ends e1: it settles
        feedback("r-e1-1", "rejected", created_at=at(3)),
        feedback("r-e1-1", "episode_end", episode_id="e1", created_at=at(3)),
        now=at(3),
    )
    # After it settled: joined late, kept, but not part of what it was labelled with.
    feeder.send(feedback("r-e1-1", "correction", event_id="late", text="no, 13", created_at=at(4)), now=at(4))
    episodes = {e.episode_id: e for e in any_store.select_episodes(champion_number=1, max_lag=0, limit=10)}
    assert episodes["e1"].corrections == (
        Correction("r-e1-0", "edited", "def f(x):\n    return {x, 1}", at(1)),
        Correction("r-e1-1", "correction", "the answer is 12", at(2)),
    )
    assert episodes["plain"].corrections == ()
    assert episodes["e1"].components == {  # the correction is text for the trainer, not a term
        "rejected": -0.25,
        "edited": 0.0,
        "accepted": 0.75,
    }
    with any_store.transaction() as session:
        late = session.scalars(select(Feedback).where(Feedback.event_id == "late")).one()
        assert (late.late, late.text) == (True, "no, 13")


def test_corrections_cost_one_query_per_batch(any_store: Store) -> None:
    feeder = Feeder(any_store)
    names = [f"e{i}" for i in range(12)]
    feeder.send(
        *[interaction(n) for n in names],
        *[feedback(f"r-{n}-0", "correction", text=f"hint {n}") for n in names],
        *[feedback(f"r-{n}-0", "rejected") for n in names],
    )
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(any_store.engine, "before_cursor_execute", seen)
    try:
        episodes = any_store.select_episodes(champion_number=1, max_lag=0, limit=100)
    finally:
        event.remove(any_store.engine, "before_cursor_execute", seen)
    assert sorted(c.text for e in episodes for c in e.corrections) == sorted(f"hint {n}" for n in names)
    assert sum("FROM feedback" in s for s in statements) == 1


def test_a_hostile_correction_on_the_wire_is_a_dead_letter_with_its_reason(any_store: Store) -> None:
    base = b'{"schema_version": "rtrl.feedback.v1", "event_id": "%s", "request_id": "r-e1-0", '
    records = {
        "f-none": base % b"f-none" + b'"kind": "correction"}',
        "f-kind": base % b"f-kind" + b'"kind": "thumbs_up", "text": "yes"}',
        "f-long": base % b"f-long" + b'"kind": "correction", "text": "' + b"x" * 8001 + b'"}',
        "f-utf8": base % b"f-utf8" + b'"kind": "correction", "text": "\xff\xfe"}',
        "f-nul": base % b"f-nul" + b'"kind": "correction", "text": "a\\u0000b"}',
    }
    feeder = Feeder(any_store)
    feeder.send(interaction())
    written, _ = feeder.process([feeder.record(raw, "feedback") for raw in records.values()])
    reasons = [r.reason for r in written.rejected]
    expected = [
        "a correction needs its text",
        "feedback of kind thumbs_up carries no text",
        "at most 8000 characters",
        "not JSON",
        "NUL",
    ]
    assert len(reasons) == len(expected)
    for reason, part in zip(reasons, expected, strict=True):
        assert reason.startswith("schema: ") and part in reason
    with any_store.transaction() as session:
        assert session.scalars(select(Feedback)).all() == []
        stored = session.scalars(
            select(DeadLetter.original_event_id).order_by(DeadLetter.source_offset)
        ).all()
    assert stored == ["f-none", "f-kind", "f-long", None, "f-nul"]  # the non-UTF-8 record's id is unreadable


@pytest.mark.unit
def test_the_migration_adds_a_nullable_text_column(store: Store) -> None:
    with store.transaction() as session:
        assert Feedback.__table__.c.text.nullable  # type: ignore[attr-defined]
        assert session.scalars(select(Feedback.text)).all() == []
