"""The labeler against a real Kafka broker (and PostgreSQL): hostile input, crashes, DB outages.

Each test uses its own topics and consumer group on the session's broker, and its own store, so
tests never see each other's records. The invariant checked everywhere is the reconciliation:
every produced record is stored or dead-lettered, exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient

from feedback.labeler import Labeler, ensure_topics, make_consumer, make_producer
from feedback.reconcile import Reconciliation, reconcile
from feedback.store import Store
from schemas.events import FeedbackEvent, InteractionEvent, parse_event
from schemas.settings import Settings, StoreSettings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


# ---- helpers -----------------------------------------------------------------------------------------


def isolated(settings: Settings, store_url: str, settle_window_s: float = 1.0) -> Settings:
    """Settings with fresh topics, group and store for one test."""
    tag = uuid.uuid4().hex[:10]
    kafka = settings.kafka.model_copy(
        update={
            "interactions_topic": f"t.{tag}.interactions",
            "feedback_topic": f"t.{tag}.feedback",
            "dlq_topic": f"t.{tag}.dlq",
            "labeler_group": f"labeler-{tag}",
            "partitions": 2,
        }
    )
    labeler = settings.labeler.model_copy(update={"settle_window_s": settle_window_s, "poll_timeout_ms": 200})
    return settings.model_copy(
        update={"kafka": kafka, "store": StoreSettings(url=store_url), "labeler": labeler}
    )


def interaction(episode: str, version: str = "v1", **kw: object) -> InteractionEvent:
    fields: dict[str, object] = {
        "request_id": f"req-{episode}",
        "episode_id": episode,
        "model": "tiny",
        "policy_version": version,
        "prompt": "def add(a, b):",
        "prompt_token_ids": [1, 2, 3],
        "completion": " return a + b",
        "completion_token_ids": [4, 5],
        "completion_logprobs": [-0.25, -0.5],
    }
    return InteractionEvent(**(fields | kw))


def produce(settings: Settings, items: list[tuple[str, bytes | None]]) -> None:
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka.bootstrap_servers, acks="all", max_request_size=2**21
    )
    for topic, value in items:
        producer.send(topic, key=b"k", value=value).get(timeout=30)
    producer.close()


def wire(event: InteractionEvent | FeedbackEvent) -> bytes:
    return event.model_dump_json().encode()


def drain(labeler: Labeler, settings: Settings, store: Store, timeout_s: float = 90.0) -> Reconciliation:
    """Step until the group has committed everything produced; returns the final reconciliation."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _ in range(5):
            labeler.step()
        result = reconcile(settings, store)
        if result.pending == 0 and result.produced > 0:
            return result
    raise AssertionError(f"labeler did not catch up in {timeout_s}s: {reconcile(settings, store)}")


def committed(settings: Settings) -> int:
    """Sum of the labeler group's committed offsets (0 when it never committed)."""
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap_servers)
    try:
        group = settings.kafka.labeler_group
        offsets = admin.list_group_offsets({group: None}).get(group, {})
    finally:
        admin.close()
    return sum(max(meta.offset, 0) for meta in offsets.values())


def dlq_records(settings: Settings, timeout_s: float = 60.0) -> list[dict[str, object]]:
    """Every record on the DLQ topic, read up to its end offsets."""
    from kafka.structs import TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=settings.kafka.bootstrap_servers, group_id=None)
    try:
        tps = [
            TopicPartition(settings.kafka.dlq_topic, p)
            for p in consumer.partitions_for_topic(settings.kafka.dlq_topic)
        ]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        records: list[dict[str, object]] = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            assert time.monotonic() < deadline, "could not read the DLQ topic to its end"
            for batch in consumer.poll(timeout_ms=1000).values():
                records += [json.loads(r.value) for r in batch]
        return records
    finally:
        consumer.close()


@pytest.fixture
def sqlite_settings(services: Settings, tmp_path: Path) -> Iterator[Settings]:
    settings = isolated(services, f"sqlite:///{tmp_path}/rtrl.db")
    ensure_topics(settings.kafka)
    yield settings


@pytest.fixture
def postgres_settings(services: Settings) -> Iterator[Settings]:
    """A throw-away database on the session's PostgreSQL server."""
    import psycopg

    host, port, user = services.services.host, services.services.postgres_port, services.postgres.user
    name = f"rtrl_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(
        host=host, port=port, user=user, dbname=services.postgres.database, autocommit=True
    ) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    settings = isolated(services, f"postgresql+psycopg://{user}@{host}:{port}/{name}")
    ensure_topics(settings.kafka)
    yield settings
    with psycopg.connect(
        host=host, port=port, user=user, dbname=services.postgres.database, autocommit=True
    ) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def hostile_mix(settings: Settings) -> tuple[list[tuple[str, bytes | None]], int, int]:
    """Valid and hostile records; returns (records, how many should be stored, how many dead-lettered)."""
    t_int, t_fb = settings.kafka.interactions_topic, settings.kafka.feedback_topic
    episodes = [f"ep-{uuid.uuid4().hex[:8]}-{i}" for i in range(20)]
    items: list[tuple[str, bytes | None]] = []
    for i, ep in enumerate(episodes):
        items.append((t_int, wire(interaction(ep))))
        if i % 2 == 0:
            items.append((t_fb, wire(FeedbackEvent(request_id=f"req-{ep}", kind="accepted"))))
        if i % 4 == 0:
            items.append((t_fb, wire(FeedbackEvent(request_id=f"req-{ep}", kind="edit_persisted"))))
    stored = len(items)
    dup = interaction(episodes[0]).model_copy(update={"event_id": "dup-event"})
    nan = wire(interaction("nan-ep")).replace(b"-0.5", b"NaN")
    huge = wire(interaction("huge-ep")).replace(b"[1,2,3]", b"[" + b",".join([b"7"] * 140_000) + b"]")
    unknown_kind = wire(FeedbackEvent(request_id="r", kind="accepted")).replace(b'"accepted"', b'"loved_it"')
    wrong_version = wire(interaction("wv-ep")).replace(b"rtrl.interaction.v1", b"rtrl.interaction.v7")
    first_dup = interaction(f"first-{uuid.uuid4().hex[:6]}", event_id=f"same-{uuid.uuid4().hex[:6]}")
    items += [
        (t_int, b"\xff\xfe not json at all"),
        (t_int, wrong_version),
        (t_int, huge),
        (t_int, nan),
        (t_fb, unknown_kind),
        (t_fb, None),  # tombstone
        (t_int, wire(FeedbackEvent(request_id="r", kind="accepted"))),  # wrong topic
        (t_int, wire(interaction("bad-version", version="latest"))),
        (t_int, wire(first_dup)),
        (t_int, wire(first_dup)),  # the same event produced twice: second is a duplicate
        (t_int, wire(dup)),  # another event for a stored (episode, segment)
    ]
    return items, stored + 1, 10


# ---- tests -------------------------------------------------------------------------------------------


def run_mix_and_check(settings: Settings) -> None:
    items, stored, dead = hostile_mix(settings)
    produce(settings, items)
    store = Store(settings.store.url)
    store.migrate()
    labeler = Labeler(settings, store, make_consumer(settings), make_producer(settings))
    try:
        result = drain(labeler, settings, store)
        assert (result.produced, result.stored, result.dead_lettered) == (len(items), stored, dead)
        assert result.balanced
        dlq = dlq_records(settings)
        assert len(dlq) == dead
        reasons = sorted(str(r["reason"]).split(":")[0] for r in dlq)
        assert reasons == ["content"] + ["duplicate"] * 2 + ["schema"] * 7
        huge = next(r for r in dlq if "truncated" in str(r["reason"]))
        assert len(str(huge["payload"])) == 64 * 1024
        parse_event(json.dumps(dlq[0]).encode())  # DLQ records are valid DeadLetterRecords

        time.sleep(settings.labeler.settle_window_s + 0.1)
        for _ in range(5):
            labeler.step()
        stats = store.stats()
        assert stats["episodes_open"] == 0
        assert stats["episodes_settled_terminal"] == 5  # every 4th of 20 got edit_persisted
        assert stats["episodes_settled"] == 21
        rewards = sorted(e.reward for e in store.select_episodes(1, 0, limit=100))
        assert rewards == [0.0] * 11 + [0.75] * 5 + [1.75] * 5
    finally:
        labeler.consumer.close(autocommit=False)
        labeler.producer.close()
        store.close()


def test_hostile_input_produced_equals_stored_plus_dead_lettered(sqlite_settings: Settings) -> None:
    run_mix_and_check(sqlite_settings)


def test_on_postgresql(postgres_settings: Settings) -> None:
    run_mix_and_check(postgres_settings)


CRASHING_LABELER = """
import os, signal, sys
from feedback.labeler import Labeler, make_consumer, make_producer
from feedback.store import Store
from schemas.settings import Settings

settings = Settings.model_validate_json(sys.argv[1])
def crash(records):
    if records:  # the DB transaction with the batch has committed; the offsets have not
        os.kill(os.getpid(), signal.SIGKILL)
labeler = Labeler(settings, Store(settings.store.url), make_consumer(settings), make_producer(settings),
                  after_db_commit=crash)
while True:
    labeler.step()
"""


def test_crash_between_db_commit_and_offset_commit(sqlite_settings: Settings) -> None:
    settings = sqlite_settings
    items, stored, dead = hostile_mix(settings)
    produce(settings, items)
    store = Store(settings.store.url)
    store.migrate()
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

    labeler = Labeler(settings, store, make_consumer(settings), make_producer(settings))
    try:
        result = drain(labeler, settings, store)
        assert (result.produced, result.stored, result.dead_lettered) == (len(items), stored, dead)
        # The DLQ topic may hold a dead letter twice (produced before the crash, and again if the
        # crash came before the DB commit); its ids are deterministic, so consumers dedupe.
        dlq_ids = [r["event_id"] for r in dlq_records(settings)]
        assert len(set(dlq_ids)) == dead
        time.sleep(settings.labeler.settle_window_s + 0.1)
        for _ in range(5):
            labeler.step()
        rewards = sorted(e.reward for e in store.select_episodes(1, 0, limit=100))
        assert rewards == [0.0] * 11 + [0.75] * 5 + [1.75] * 5  # no feedback counted twice
    finally:
        labeler.consumer.close(autocommit=False)
        labeler.producer.close()
        store.close()


def test_db_unavailable_commits_no_offsets_and_retries(services: Settings, tmp_path: Path) -> None:
    path = tmp_path / "rtrl.db"
    settings = isolated(services, f"sqlite:///{path}")
    ensure_topics(settings.kafka)
    store = Store(settings.store.url, busy_timeout_s=0.2)
    store.migrate()
    produce(settings, [(settings.kafka.interactions_topic, wire(interaction(f"ep-{i}"))) for i in range(5)])

    # Another process holds the write lock: to the labeler, the database is unavailable.
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    labeler = Labeler(settings, store, make_consumer(settings), make_producer(settings))
    try:
        deadline = time.monotonic() + 30
        while labeler._backoff_s < 2 and time.monotonic() < deadline:  # at least two failed attempts
            assert labeler.step() is None
        assert labeler._backoff_s >= 2, "the labeler never hit the locked database"
        assert committed(settings) == 0

        blocker.execute("ROLLBACK")
        result = drain(labeler, settings, store)
        assert (result.produced, result.stored, result.dead_lettered) == (5, 5, 0)
        assert committed(settings) == 5
    finally:
        blocker.close()
        labeler.consumer.close(autocommit=False)
        labeler.producer.close()
        store.close()


def test_cli_reconcile_and_stats(sqlite_settings: Settings) -> None:
    settings = sqlite_settings
    produce(
        settings,
        [
            (settings.kafka.feedback_topic, b"garbage"),
            (settings.kafka.feedback_topic, wire(FeedbackEvent(request_id="x", kind="rejected"))),
        ],
    )
    env = {**os.environ, **env_of(settings)}
    out = cli(env, "labeler", "reconcile")
    assert out.returncode == 1 and "NOT balanced" in out.stdout and "pending 2" in out.stdout

    store = Store(settings.store.url)
    store.migrate()
    labeler = Labeler(settings, store, make_consumer(settings), make_producer(settings))
    try:
        drain(labeler, settings, store)
    finally:
        labeler.consumer.close(autocommit=False)
        labeler.producer.close()
        store.close()
    out = cli(env, "labeler", "reconcile")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "produced 2  stored 1  dead-lettered 1  pending 0  -> balanced" in out.stdout
    out = cli(env, "labeler", "stats")
    assert json.loads(out.stdout)["feedback_unjoined"] == 1


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rtrl.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def env_of(settings: Settings) -> dict[str, str]:
    kafka = settings.kafka
    return {
        "RTRL_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "RTRL_KAFKA__INTERACTIONS_TOPIC": kafka.interactions_topic,
        "RTRL_KAFKA__FEEDBACK_TOPIC": kafka.feedback_topic,
        "RTRL_KAFKA__DLQ_TOPIC": kafka.dlq_topic,
        "RTRL_KAFKA__LABELER_GROUP": kafka.labeler_group,
        "RTRL_STORE__URL": settings.store.url,
    }
