"""The labeler against a real Kafka broker (and PostgreSQL): hostile input, crashes, DB outages,
a record that kills the process.

Each test uses its own topics and consumer group on the session's broker, and its own store, so
tests never see each other's records. The invariant checked everywhere is the reconciliation:
every produced record is stored or dead-lettered, exactly once. Time is the labeler's injected
clock (starting at the real time, like the events): a test moves it past the settle window
instead of sleeping.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from factories import FakeClock, FakeMonotonic, feedback, fresh_topics, interaction, wire
from helpers import REPO, TopicReader, produce, run_rtrl
from prometheus_client import REGISTRY

import streams
from feedback.labeler import Labeler, make_consumer, make_producer
from feedback.reconcile import Reconciliation, reconcile
from feedback.records import vocab_size
from schemas.clock import utcnow, wait_until
from schemas.events import FeedbackEvent, new_id, parse_event
from schemas.settings import Settings, StoreSettings
from store import Store

pytestmark = pytest.mark.integration


# ---- helpers -----------------------------------------------------------------------------------------


def isolated(settings: Settings, store_url: str, settle_window_s: float = 1.0) -> Settings:
    """Settings with fresh topics, group and store for one test; the topics exist on return."""
    settings = fresh_topics(settings, partitions=2)
    labeler = settings.labeler.model_copy(update={"settle_window_s": settle_window_s, "poll_timeout_ms": 200})
    settings = settings.model_copy(update={"store": StoreSettings(url=store_url), "labeler": labeler})
    streams.ensure_topics(settings.kafka)
    return settings


def labeler_for(settings: Settings, store: Store, clock: FakeClock, **kw: object) -> Labeler:
    return Labeler(settings, store, make_consumer(settings), make_producer(settings), clock=clock, **kw)  # type: ignore[arg-type]


def close(labeler: Labeler) -> None:
    labeler.consumer.close(autocommit=False)
    labeler.producer.close()


def drain(labeler: Labeler, settings: Settings, store: Store, timeout_s: float = 90.0) -> Reconciliation:
    """Step until the group has committed everything produced; returns the final reconciliation."""

    def caught_up() -> Reconciliation | None:
        for _ in range(5):
            labeler.step()
        result = reconcile(settings, store)
        return result if result.pending == 0 and result.produced > 0 else None

    return wait_until(caught_up, timeout_s=timeout_s, interval_s=0.0, what="labeler catching up")


def settle_everything(labeler: Labeler, clock: FakeClock, settings: Settings) -> None:
    """Move the labeler's clock past the settle window and let it settle what is open."""
    clock.advance(settings.labeler.settle_window_s + 1)
    for _ in range(2):
        labeler.step()


def committed(settings: Settings) -> int:
    """Sum of the labeler group's committed offsets (0 when it never committed)."""
    admin = streams.admin(settings.kafka, "rtrl-tests")
    try:
        group = settings.kafka.labeler_group
        offsets = admin.list_group_offsets({group: None}).get(group, {})
    finally:
        admin.close()
    return sum(max(meta.offset, 0) for meta in offsets.values())


def dlq_records(settings: Settings) -> list[dict[str, object]]:
    """Every record on the DLQ topic, read up to its end offsets."""
    reader = TopicReader(settings.kafka, settings.kafka.dlq_topic, from_beginning=True)
    try:
        return [json.loads(r.value) for r in reader.read_to_end()]
    finally:
        reader.close()


@pytest.fixture
def clock() -> FakeClock:
    """The labelers' clock, starting now: events are made at the real time (a child labeler uses it)."""
    return FakeClock(utcnow())


@pytest.fixture
def sqlite_settings(services: Settings, tmp_path: Path) -> Settings:
    return isolated(services, f"sqlite:///{tmp_path}/rtrl.db")


@pytest.fixture
def postgres_settings(services: Settings, postgres_database: str) -> Settings:
    return isolated(services, postgres_database)


@pytest.fixture
def store_of(request: pytest.FixtureRequest) -> Iterator[object]:
    opened: list[Store] = []

    def open_store(settings: Settings, **kw: object) -> Store:
        store = Store(settings.store.url, **kw)  # type: ignore[arg-type]
        store.migrate()
        store.set_tenant("default")  # the tenant of tests/factories.py's events (labeler.unknown_tenants)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        store.close()


def hostile_mix(settings: Settings, now: datetime) -> tuple[list[tuple[str, bytes | None]], int, int]:
    """Valid and hostile records made at `now`; returns (records, how many should be stored, how many
    dead-lettered)."""
    t_int, t_fb = settings.kafka.interactions_topic, settings.kafka.feedback_topic
    episodes = [f"ep-{uuid.uuid4().hex[:8]}-{i}" for i in range(20)]
    items: list[tuple[str, bytes | None]] = []

    def fb(request: str, kind: str, **kw: object) -> FeedbackEvent:
        return feedback(request, kind, **({"event_id": new_id(), "created_at": now} | kw))  # type: ignore[arg-type]

    for i, ep in enumerate(episodes):
        items.append((t_int, wire(interaction(ep, created_at=now))))
        if i % 2 == 0:
            items.append((t_fb, wire(fb(f"r-{ep}-0", "accepted"))))
        if i % 4 == 0:
            items.append((t_fb, wire(fb(f"r-{ep}-0", "edit_persisted"))))
    stored = len(items)
    dup = interaction(episodes[0], event_id="dup-event", created_at=now)
    nan = wire(interaction("nan-ep", created_at=now)).replace(b"-0.5", b"NaN")
    huge = wire(interaction("huge-ep", created_at=now)).replace(
        b"[1,2,3]", b"[" + b",".join([b"7"] * 140_000) + b"]"
    )
    unknown_kind = wire(fb("r", "accepted")).replace(b'"accepted"', b'"loved_it"')
    wrong_version = wire(interaction("wv-ep", created_at=now)).replace(
        b"rtrl.interaction.v1", b"rtrl.interaction.v7"
    )
    first_dup = interaction(
        f"first-{uuid.uuid4().hex[:6]}", event_id=f"same-{uuid.uuid4().hex[:6]}", created_at=now
    )
    no_event_id = json.loads(wire(fb("r", "thumbs_up")))
    del no_event_id["event_id"]
    items += [
        (t_int, b"\xff\xfe not json at all"),
        (t_int, wrong_version),
        (t_int, huge),
        (t_int, nan),
        (t_fb, unknown_kind),
        (t_fb, None),  # tombstone
        (t_int, wire(fb("r", "accepted"))),  # wrong topic
        (t_int, wire(interaction("bad-version", version="latest", created_at=now))),
        (t_int, wire(first_dup)),
        (t_int, wire(first_dup)),  # the same event produced twice: second is a duplicate
        (t_int, wire(dup)),  # another event for a stored (episode, segment)
        (t_int, b"[" * 5000),  # nested too deeply for json.loads
        (t_fb, json.dumps(no_event_id).encode()),  # the reader must not invent the idempotency key
        (t_fb, wire(fb("r", "accepted", created_at=datetime.fromisoformat("9999-12-31T23:59:59-01:00")))),
        (t_int, wire(interaction("future-ep", created_at=now + timedelta(days=3650)))),  # ten years ahead
        (t_fb, wire(fb("r", "task_outcome", value=5.0))),  # outside the reward spec's [-1, 1]
        # Forged on the broker (docs/security.md, Forged events): a tenant with no row, and a token
        # id past the serving model's vocabulary (that one would fail every cycle that selected it).
        (t_int, wire(interaction("forged-tenant-ep", tenant="nobody", created_at=now))),
        (t_int, wire(interaction("forged-vocab-ep", completion_token_ids=[4, 2**31 - 1], created_at=now))),
    ]
    return items, stored + 1, 17


# ---- tests -------------------------------------------------------------------------------------------


def counted(name: str, **labels: str) -> float:
    """A sample of this process's labeler metrics (feedback/metrics.py); 0 before its first increment."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def run_mix_and_check(settings: Settings, store: Store, clock: FakeClock) -> None:
    items, stored, dead = hostile_mix(settings, clock())
    produce(settings.kafka, items)
    labeler = labeler_for(settings, store, clock)
    series = [
        ("rtrl_labeler_events_total", {"kind": "interaction"}),
        ("rtrl_labeler_events_total", {"kind": "feedback"}),
        *[
            ("rtrl_labeler_dead_letters_total", {"reason": r})
            for r in ("content", "duplicate", "schema", "unknown tenant")
        ],
        ("rtrl_labeler_feedback_joined_total", {}),
        ("rtrl_labeler_settled_total", {"how": "terminal_feedback"}),
        ("rtrl_labeler_settled_total", {"how": "window"}),
        ("rtrl_labeler_settle_latency_seconds_count", {}),
    ]
    before = [counted(name, **labels) for name, labels in series]
    try:
        result = drain(labeler, settings, store)
        assert (result.produced, result.stored, result.dead_lettered) == (len(items), stored, dead)
        assert result.balanced
        dlq = dlq_records(settings)
        assert len(dlq) == dead
        reasons = sorted(str(r["reason"]).split(":")[0] for r in dlq)
        assert reasons == ["content"] * 5 + ["duplicate"] * 2 + ["schema"] * 9 + ["unknown tenant"]
        assert {str(d.reason).split(":")[0] for d in store.dead_letters(100)} == {
            "content",
            "duplicate",
            "schema",
            "unknown tenant",
        }
        assert {str(r["reason"]) for r in dlq} >= {
            "unknown tenant: nobody",
            f"content: token id outside the vocabulary ({2**31 - 1} >= {vocab_size(settings)})",
        }
        huge = next(r for r in dlq if "truncated" in str(r["reason"]))
        assert len(str(huge["payload"])) == 64 * 1024
        parse_event(json.dumps(dlq[0]).encode())  # DLQ records are valid DeadLetterRecords

        assert store.stats()["episodes_open"] == 16  # 5 settled at once on edit_persisted
        settle_everything(labeler, clock, settings)
        stats = store.stats()
        assert stats["episodes_open"] == 0
        assert stats["episodes_settled_terminal"] == 5  # every 4th of 20 got edit_persisted
        assert stats["episodes_settled"] == 21
        rewards = sorted(e.reward for e in store.select_episodes(1, 0, limit=100))
        assert rewards == [0.0] * 11 + [0.75] * 5 + [1.75] * 5
        # The metrics count what was committed, once: 21 interactions and 15 feedback stored, the
        # dead letters by reason, 15 feedback joined, 5 + 16 settled with their latency.
        moved = [counted(name, **labels) - b for (name, labels), b in zip(series, before, strict=True)]
        assert moved == [21, 15, 5, 2, 9, 1, 15, 5, 16, 21]
        assert counted("rtrl_labeler_store_up") == 1.0
    finally:
        close(labeler)


def test_hostile_input_produced_equals_stored_plus_dead_lettered(
    sqlite_settings: Settings, store_of: object, clock: FakeClock
) -> None:
    run_mix_and_check(sqlite_settings, store_of(sqlite_settings), clock)  # type: ignore[operator]


def test_on_postgresql(postgres_settings: Settings, store_of: object, clock: FakeClock) -> None:
    run_mix_and_check(postgres_settings, store_of(postgres_settings), clock)  # type: ignore[operator]


CRASHING_LABELER = """
import os, signal, sys
from feedback.labeler import Labeler, make_consumer, make_producer
from schemas.settings import Settings
from store import Store

settings = Settings.model_validate_json(sys.argv[1])
def crash(records):
    if records:  # the DB transaction with the batch has committed; the offsets have not
        os.kill(os.getpid(), signal.SIGKILL)
labeler = Labeler(settings, Store(settings.store.url), make_consumer(settings), make_producer(settings),
                  after_db_commit=crash)
while True:
    labeler.step()
"""


def test_crash_between_db_commit_and_offset_commit(
    sqlite_settings: Settings, store_of: object, clock: FakeClock
) -> None:
    settings = sqlite_settings
    items, stored, dead = hostile_mix(settings, clock())
    produce(settings.kafka, items)
    store: Store = store_of(settings)  # type: ignore[operator]
    child = subprocess.run(
        [sys.executable, "-c", CRASHING_LABELER, settings.model_dump_json()],
        cwd=REPO,
        timeout=120,
        capture_output=True,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    after_crash = store.stats()
    assert after_crash["interactions"] + after_crash["feedback"] + after_crash["dead_letters"] > 0
    assert committed(settings) == 0  # killed before its first offset commit

    clock.now = utcnow()  # the crashed labeler ran on the real clock; carry on from there
    labeler = labeler_for(settings, store, clock)
    try:
        result = drain(labeler, settings, store)
        assert (result.produced, result.stored, result.dead_lettered) == (len(items), stored, dead)
        # The DLQ topic may hold a dead letter twice (produced before the crash, and again if the
        # crash came before the DB commit); its ids are deterministic, so consumers dedupe.
        dlq_ids = [r["event_id"] for r in dlq_records(settings)]
        assert len(set(dlq_ids)) == dead
        settle_everything(labeler, clock, settings)
        rewards = sorted(e.reward for e in store.select_episodes(1, 0, limit=100))
        assert rewards == [0.0] * 11 + [0.75] * 5 + [1.75] * 5  # no feedback counted twice
    finally:
        close(labeler)


def test_db_unavailable_commits_no_offsets_and_retries(
    services: Settings, tmp_path: Path, store_of: object, clock: FakeClock
) -> None:
    path = tmp_path / "rtrl.db"
    settings = isolated(services, f"sqlite:///{path}")
    store: Store = store_of(settings, busy_timeout_s=0.2)  # type: ignore[operator]
    produce(
        settings.kafka,
        [
            (settings.kafka.interactions_topic, wire(interaction(f"ep-{i}", created_at=clock())))
            for i in range(5)
        ],
    )

    # Another process holds the write lock: to the labeler, the database is unavailable.
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    backoff = FakeMonotonic()
    labeler = labeler_for(settings, store, clock, sleep=backoff.sleep)
    try:
        wait_until(
            lambda: labeler.step() is None and len(backoff.slept) >= 3,
            timeout_s=60,
            interval_s=0.0,
            what="three failed attempts",
        )
        assert backoff.slept[:3] == [0.5, 1.0, 2.0]  # doubling backoff, and no offset committed
        assert committed(settings) == 0

        blocker.execute("ROLLBACK")
        result = drain(labeler, settings, store)
        assert (result.produced, result.stored, result.dead_lettered) == (5, 5, 0)
        assert committed(settings) == 5
    finally:
        blocker.close()
        close(labeler)


def test_cli_reconcile_and_stats(sqlite_settings: Settings, store_of: object, clock: FakeClock) -> None:
    settings = sqlite_settings
    out = run_rtrl(settings, "labeler", "stats")
    assert (
        out.returncode == 1 and "run `rtrl labeler migrate`" in out.stderr and "Traceback" not in out.stderr
    )
    produce(
        settings.kafka,
        [
            (settings.kafka.feedback_topic, b"garbage"),
            (settings.kafka.feedback_topic, wire(feedback("x", "rejected", created_at=clock()))),
        ],
    )
    store: Store = store_of(settings)  # type: ignore[operator]
    out = run_rtrl(settings, "labeler", "reconcile")
    assert out.returncode == 1 and "NOT balanced" in out.stdout and "pending 2" in out.stdout

    labeler = labeler_for(settings, store, clock)
    try:
        drain(labeler, settings, store)
    finally:
        close(labeler)
    out = run_rtrl(settings, "labeler", "reconcile")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "produced 2  stored 1  dead-lettered 1  pending 0  -> balanced" in out.stdout
    out = run_rtrl(settings, "labeler", "stats")
    assert json.loads(out.stdout)["feedback_unjoined"] == 1

    # Operators see the dead letter, its bytes, and can send it through the labeler again.
    out = run_rtrl(settings, "dlq", "list", "--reason", "schema:")
    [letter] = [json.loads(line) for line in out.stdout.splitlines()]
    assert letter["reason"].startswith("schema:") and letter["replayed"] is False
    assert letter["source"].startswith(f"{settings.kafka.feedback_topic}:")
    out = run_rtrl(settings, "dlq", "show", letter["id"])
    assert out.returncode == 0 and "garbage" in out.stdout
    out = run_rtrl(settings, "dlq", "replay", letter["id"])
    assert out.returncode == 0, out.stderr
    out = run_rtrl(settings, "dlq", "replay", "dlq:no:such:1")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    labeler = labeler_for(settings, store, clock)
    try:
        result = drain(labeler, settings, store)  # the replayed copy is refused again, and counted
    finally:
        close(labeler)
    assert (result.produced, result.stored, result.dead_lettered) == (3, 1, 2)
    listed = [json.loads(line) for line in run_rtrl(settings, "dlq", "list").stdout.splitlines()]
    assert len(listed) == 2 and [d["replayed"] for d in listed if d["id"] == letter["id"]] == [True]


POISONED_LABELER = """
import os, signal, sys
from feedback.labeler import Labeler, make_consumer, make_producer
from schemas.settings import Settings
from store import Store

settings = Settings.model_validate_json(sys.argv[1])
def die_on_poison(records):  # stands for a record that crashes the process (a native library, OOM)
    if any(b"POISON" in (r.value or b"") for r in records):
        os.kill(os.getpid(), signal.SIGKILL)
labeler = Labeler(settings, Store(settings.store.url), make_consumer(settings), make_producer(settings),
                  before_write=die_on_poison)
idle = 0
while idle < 20:  # done: partitions assigned (a dead member's go after its session timeout) and no records
    report = labeler.step()
    busy = report is not None and report.records > 0
    idle = 0 if busy or not labeler.consumer.assignment() else idle + 1
"""


def test_a_record_that_kills_the_labeler_is_dead_lettered_after_three_deaths(
    sqlite_settings: Settings, store_of: object, clock: FakeClock
) -> None:
    # Each restart waits out the dead member's session (6 s in tests); a short poll ends the last idle.
    settings = sqlite_settings.model_copy(
        update={"labeler": sqlite_settings.labeler.model_copy(update={"poll_timeout_ms": 100})}
    )
    t_int = settings.kafka.interactions_topic
    now = clock()
    items = [(t_int, wire(interaction(f"ok-{i}", created_at=now))) for i in range(30)]
    items.insert(17, (t_int, wire(interaction("poison", prompt="POISON", created_at=now))))
    produce(settings.kafka, items)
    store: Store = store_of(settings)  # type: ignore[operator]

    exits = []
    for _ in range(6):  # what the supervisor would do: restart it (it allows 5 restarts)
        child = subprocess.run(
            [sys.executable, "-c", POISONED_LABELER, settings.model_dump_json()],
            cwd=REPO,
            timeout=300,
            capture_output=True,
        )
        exits.append(child.returncode)
        if child.returncode == 0:
            break
    assert exits == [-signal.SIGKILL] * 3 + [0], [exits, child.stderr.decode()[-2000:]]
    result = reconcile(settings, store)
    assert (result.produced, result.stored, result.dead_lettered, result.pending) == (31, 30, 1, 0)
    [poison] = store.dead_letters(10)
    assert poison.reason == "poison: 2 labeler processes died while processing it"
    assert b"POISON" in poison.payload


def test_a_failure_tied_to_one_record_dead_letters_only_that_record(
    sqlite_settings: Settings, store_of: object, clock: FakeClock
) -> None:
    settings = sqlite_settings
    t_int = settings.kafka.interactions_topic
    now = clock()
    items = [(t_int, wire(interaction(f"ok-{i}", created_at=now))) for i in range(10)]
    items.insert(4, (t_int, wire(interaction("boom", prompt="BOOM", created_at=now))))
    produce(settings.kafka, items)
    store: Store = store_of(settings)  # type: ignore[operator]

    def boom(records: list[object]) -> None:  # stands for a bug or a DB refusal tied to one record
        if any(b"BOOM" in (r.value or b"") for r in records):  # type: ignore[attr-defined]
            raise RuntimeError("this record cannot be written")

    labeler = labeler_for(settings, store, clock, before_write=boom)
    try:
        result = drain(labeler, settings, store)
    finally:
        close(labeler)
    assert (result.produced, result.stored, result.dead_lettered) == (11, 10, 1)
    [letter] = store.dead_letters(10)
    assert letter.reason == "record: RuntimeError: this record cannot be written"
    assert store.stats()["interactions"] == 10


def test_postgresql_stopped_for_30s_while_labelling_loses_nothing(
    services: Settings, postgres_settings: Settings, store_of: object, clock: FakeClock
) -> None:
    """The real PostgreSQL server is stopped for 30 s while records keep arriving: the labeler
    backs off, commits no offset for what it could not store, and once the server is back it stores
    everything exactly once (produced = stored + dead-lettered)."""
    import time

    from services import down, up

    settings = postgres_settings
    store: Store = store_of(settings)  # type: ignore[operator]
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # the labeler's backoff, shortened: the outage is real time
        slept.append(seconds)
        time.sleep(min(seconds, 1.0))

    labeler = labeler_for(settings, store, clock, sleep=sleep)
    topic = settings.kafka.interactions_topic
    produce(
        settings.kafka, [(topic, wire(interaction(f"before-{i}", created_at=clock()))) for i in range(20)]
    )
    try:
        drain(labeler, settings, store)
        assert committed(settings) == 20
        assert down(services, only=("postgres",)) == ["postgres"]
        try:
            outage_end = time.monotonic() + 30
            produce(
                settings.kafka,
                [(topic, wire(interaction(f"during-{i}", created_at=clock()))) for i in range(20)],
            )
            while time.monotonic() < outage_end:
                labeler.step()  # fails, seeks back, backs off
            assert committed(settings) == 20  # nothing it could not store was committed
            assert len(slept) >= 3 and slept[:3] == [0.5, 1.0, 2.0]
        finally:
            up(services, only=("postgres",))
        produce(
            settings.kafka, [(topic, wire(interaction(f"after-{i}", created_at=clock()))) for i in range(20)]
        )
        result = drain(labeler, settings, store)
        assert (result.produced, result.stored, result.dead_lettered) == (60, 60, 0)
        assert committed(settings) == 60
        assert store.stats()["interactions"] == 60  # exactly once
    finally:
        close(labeler)
