"""The labeler's set-based writes (store/bulk.py, store/events.py) on SQLite and on PostgreSQL, where
a batch is one `json_to_recordset` statement per table and conflicts are classified after the insert."""

import collections
import enum
import json
from collections.abc import Iterator
from datetime import timedelta, timezone
from decimal import Decimal

import pytest
from factories import T0, FakeClock, Feeder, feedback, interaction
from sqlalchemy import select
from sqlalchemy.orm import Session

from store import Store
from store.bulk import _document, insert_rows, update_rows
from store.models import DeadLetter, Episode, Feedback, Interaction

BACKENDS = [
    pytest.param("sqlite", marks=pytest.mark.unit),
    pytest.param("postgresql", marks=pytest.mark.integration),
]


@pytest.fixture(params=BACKENDS)
def any_store(request: pytest.FixtureRequest, tmp_path: object, clock: FakeClock) -> Iterator[Store]:
    url = (
        f"sqlite:///{tmp_path}/rtrl.db"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_database")
    )
    store = Store(url, clock=clock)
    store.migrate()
    yield store
    store.close()


@pytest.fixture
def pg_store(postgres_database: str, clock: FakeClock) -> Iterator[Store]:
    store = Store(postgres_database, clock=clock)
    store.migrate()
    yield store
    store.close()


def test_replays_and_duplicates_of_stored_rows_are_told_apart(any_store: Store) -> None:
    feeder = Feeder(any_store)
    first = feeder.record(interaction())
    assert len(feeder.process([first])[0].interactions) == 1
    again, _ = feeder.process([first])  # the same record re-read after a crash
    assert (again.interactions, again.replayed, again.rejected) == ([], 1, [])

    written, _ = feeder.send(
        interaction(),  # the stored event_id from another offset
        interaction(event_id="other"),  # the stored episode and segment under another event_id
        feedback("r-e1-0", "accepted", event_id="i-e1-0"),  # an interaction's event_id on a feedback
        interaction(episode="e2"),  # new: stored
    )
    assert [r.reason for r in written.rejected] == [
        "duplicate: event_id already stored from interactions:0:0",
        "duplicate: segment 0 of episode e1 already stored as event i-e1-0",
        "duplicate: event_id already stored from interactions:0:0",
    ]
    assert [e.episode_id for e in written.interactions] == ["e2"] and written.feedback == []
    stats = any_store.stats()
    assert (stats["interactions"], stats["feedback"], stats["dead_letters"]) == (2, 0, 3)


def test_a_batch_of_new_rows_keeps_every_value(any_store: Store) -> None:
    feeder = Feeder(any_store)
    elsewhere = T0.astimezone(timezone(timedelta(hours=5, minutes=30)))  # the same instant, another offset
    event = interaction(created_at=elsewhere, redacted=["prompt"])
    hostile = b"\xff\xfe not json \x00"
    written, _ = feeder.send(event, hostile, feedback("r-e1-0", "thumbs_up"))
    assert len(written.interactions) == 1 and len(written.rejected) == 1
    with Session(any_store.engine) as session:
        row = session.scalars(select(Interaction)).one()
        assert row.created_at == T0 and row.created_at.utcoffset() == timedelta(0)
        assert (row.prompt_token_ids, row.completion_logprobs) == (
            list(event.prompt_token_ids),
            list(event.completion_logprobs),
        )
        assert (row.sampling, row.redacted) == (event.sampling.model_dump(mode="json"), ["prompt"])
        assert session.scalars(select(DeadLetter.payload)).one() == hostile
        stored = session.scalars(select(Feedback)).one()
        assert (stored.kind, stored.joined_episode_id) == ("thumbs_up", "e1")  # joined: update_rows
        episode = session.scalars(select(Episode)).one()
        assert (episode.status, episode.reward, episode.reward_components) == (
            "settled",
            0.5,
            {"thumbs_up": 0.5},
        )


def test_update_rows_sets_only_the_columns_each_row_gives(any_store: Store) -> None:
    Feeder(any_store).send(interaction(), interaction(episode="e2"))
    with Session(any_store.engine) as session, session.begin():
        update_rows(
            session,
            Episode.__table__,
            "episode_id",
            [  # type: ignore[arg-type]
                {"episode_id": "e1", "metrics": {"a": 1}, "reward": None},
                {"episode_id": "e2", "status": "expired"},
            ],
        )
    with Session(any_store.engine) as session:
        episodes = {e.episode_id: e for e in session.scalars(select(Episode))}
    assert (episodes["e1"].metrics, episodes["e1"].status) == ({"a": 1}, "open")
    assert (episodes["e2"].metrics, episodes["e2"].status) == (None, "expired")


@pytest.mark.integration
def test_values_json_cannot_carry_are_refused_before_the_server(pg_store: Store) -> None:
    row = {
        "event_id": "f",
        "request_id": "r",
        "episode_id": None,
        "tenant": "default",
        "kind": "accepted",
        "value": float("nan"),
        "joined_episode_id": None,
        "late": False,
        "created_at": T0,
        "ingested_at": T0,
        "source_topic": "feedback",
        "source_partition": 0,
        "source_offset": 0,
    }
    with Session(pg_store.engine) as session:
        with pytest.raises(ValueError, match="Out of range float"):
            insert_rows(session, Feedback.__table__, [row], conflict=["event_id"])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="naive datetime"):
            insert_rows(
                session,
                Feedback.__table__,
                [row | {"value": 1.0, "created_at": T0.replace(tzinfo=None)}],  # type: ignore[arg-type]
                conflict=["event_id"],
            )
        with pytest.raises(ValueError, match="give late"):
            insert_rows(session, Feedback.__table__, [{k: v for k, v in row.items() if k != "late"}])  # type: ignore[arg-type]
        # orjson would write these as null: nested in a JSON column, at any depth, they fail as well.
        for metrics in (
            {"loss": float("inf")},
            {"stages": [{"ratio": float("-inf")}]},
            {"n": [1, (2, float("nan"))]},
        ):
            with pytest.raises(ValueError, match="Out of range float"):
                update_rows(
                    session, Episode.__table__, "episode_id", [{"episode_id": "e1", "metrics": metrics}]
                )  # type: ignore[arg-type]


@pytest.mark.integration
def test_values_orjson_would_encode_differently_are_stored_as_the_json_module_would(pg_store: Store) -> None:
    Feeder(pg_store).send(interaction())
    float64 = type("float64", (float,), {})  # a float subclass, as numpy's float64 is one
    with Session(pg_store.engine) as session, session.begin():
        update_rows(
            session,
            Episode.__table__,
            "episode_id",
            [  # type: ignore[arg-type]
                {
                    "episode_id": "e1",
                    "reward": float64(0.25),
                    "metrics": {"per_stage": {0: 1, 1: float64(2.5)}, "ok": True},
                },
            ],
        )
    with Session(pg_store.engine) as session:
        episode = session.scalars(select(Episode)).one()
    assert (episode.reward, episode.metrics) == (0.25, {"per_stage": {"0": 1, "1": 2.5}, "ok": True})


@pytest.mark.unit
def test_a_document_orjson_would_write_differently_is_written_as_the_json_module_writes_it() -> None:
    def document(table: object, row: dict[str, object]) -> dict[str, object]:
        return json.loads(_document(table, tuple(row), [row]))[0]  # type: ignore[arg-type]

    Point = collections.namedtuple("Point", "x y")  # a tuple subclass, as a caller might pass
    episode = {
        "episode_id": "e1",
        "reward": 0.5,
        "metrics": {"seed": 2**64, "per_stage": {0: 1}, "at": Point(1, 2.5)},
        "first_event_at": T0.astimezone(timezone(timedelta(hours=5, minutes=30, seconds=15))),
    }
    assert document(Episode.__table__, episode) == {  # integers beyond 64 bits, int keys, tuple subclasses
        "episode_id": "e1",
        "reward": 0.5,
        "metrics": {"seed": 2**64, "per_stage": {"0": 1}, "at": [1, 2.5]},
        "first_event_at": episode["first_event_at"].isoformat(),  # type: ignore[union-attr] # its offset's seconds too
    }
    float64 = type("float64", (float,), {})  # a float subclass, as numpy's float64 is one
    assert document(Episode.__table__, {"episode_id": "e1", "reward": float64(0.25)}) == {
        "episode_id": "e1",
        "reward": 0.25,
    }
    for hidden in (
        float64("nan"),
        collections.OrderedDict(loss=float("nan")),
        [collections.Counter(a=float("inf"))],
    ):
        with pytest.raises(
            ValueError, match="Out of range float"
        ):  # inside subclasses too: the json module looks
            _document(Episode.__table__, ("episode_id", "metrics"), [{"episode_id": "e1", "metrics": hidden}])  # type: ignore[arg-type]
    Bad = enum.Enum("Bad", {"NAN": float("nan")}, type=float)  # orjson writes an enum's value itself
    with pytest.raises(ValueError, match="Out of range float"):
        _document(Feedback.__table__, ("event_id", "value"), [{"event_id": "f", "value": Bad.NAN}])  # type: ignore[arg-type]
    for unwritable in ({"d": Decimal(1)}, [Decimal("Infinity"), Decimal("-Infinity")]):  # refused, as before
        with pytest.raises(TypeError):
            _document(
                Episode.__table__, ("episode_id", "metrics"), [{"episode_id": "e1", "metrics": unwritable}]
            )  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="episodes.first_event_at: a datetime, not str"
    ):  # not read in the server's zone
        _document(
            Episode.__table__,
            ("episode_id", "first_event_at"),
            [{"episode_id": "e1", "first_event_at": "2026-01-01 00:00"}],
        )  # type: ignore[arg-type]
    logprobs = [-0.5] * 4096 + [float("-inf")]
    with pytest.raises(ValueError, match="Out of range float value -inf in completion_logprobs"):
        _document(
            Interaction.__table__,
            ("event_id", "completion_logprobs"),
            [{"event_id": "i", "completion_logprobs": logprobs}],
        )  # type: ignore[arg-type]
