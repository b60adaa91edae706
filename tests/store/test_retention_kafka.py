"""`rtrl store prune` asks the real broker which records it still holds: a row whose record Kafka
has deleted goes, one whose record Kafka still has stays (so `rtrl labeler reconcile` keeps
counting it), and a topic the broker does not have is one clear error."""

from __future__ import annotations

import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from factories import HOLDOUT_KEY, fresh_topics, interaction, wire
from kafka.structs import TopicPartition

import streams
from feedback.records import Checks, parse_record
from schemas.clock import utcnow
from schemas.events import InteractionEvent
from schemas.rewards import get_spec
from schemas.settings import Settings, StoreSettings
from services.launch import child_env, rtrl_command
from store import SourceRecord, Store

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def rtrl(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        rtrl_command(*args),
        cwd=REPO,
        env=child_env(settings),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_prune_keeps_what_kafka_still_holds(kafka_service: Settings, tmp_path: Path) -> None:
    settings = fresh_topics(kafka_service, partitions=1).model_copy(
        update={"store": StoreSettings(url=f"sqlite:///{tmp_path / 'rtrl.db'}")}
    )
    kafka = settings.kafka
    streams.ensure_topics(kafka)
    then = utcnow() - timedelta(days=40)
    events = [interaction(name, created_at=then) for name in ("gone", "kept")]
    producer = streams.producer(kafka, "rtrl-tests")
    try:
        for event in events:  # offsets 0 and 1 of partition 0
            producer.send(kafka.interactions_topic, partition=0, value=wire(event)).get(timeout=30)
    finally:
        producer.close()
    admin = streams.admin(kafka, "rtrl-tests")
    try:
        admin.delete_records(
            {TopicPartition(kafka.interactions_topic, 0): 1}
        )  # Kafka's retention took offset 0
    finally:
        admin.close()

    # The store holds both, as the labeler wrote them, settled by the window 40 days ago.
    store = Store(settings.store.url)
    store.migrate()
    spec = get_spec(settings.labeler.reward_spec)
    checks = Checks(spec=spec, limits=settings.limits)
    records = [SourceRecord(kafka.interactions_topic, 0, offset, wire(e)) for offset, e in enumerate(events)]
    with store.labelling(then) as tx:
        written = tx.write_events([(r, parse_record(r, InteractionEvent, checks, then)) for r in records])
        tx.join_and_settle(spec, written.interactions, written.feedback, holdout_key=HOLDOUT_KEY)
    with store.labelling(then + timedelta(hours=1)) as tx:
        assert len(tx.settle_expired(spec, settings.labeler.settle_window_s)) == 2

    done = rtrl(settings, "store", "prune", "--older-than", "30", "--yes")
    assert done.returncode == 0, done.stderr
    assert "episodes      1 deleted" in done.stdout and "interactions  1 deleted" in done.stdout
    assert "kept because Kafka still holds their records" in done.stdout and "1 episodes" in done.stdout
    with store.transaction() as session:
        from sqlalchemy import select

        from store.models import Episode

        assert list(session.scalars(select(Episode.episode_id))) == ["kept"]
    store.close()

    missing = settings.model_copy(
        update={"kafka": kafka.model_copy(update={"interactions_topic": "no-such-topic"})}
    )
    refused = rtrl(missing, "store", "prune", "--older-than", "30", "--yes")
    assert refused.returncode == 1 and "has no topic 'no-such-topic'" in refused.stderr
    assert "Traceback" not in refused.stderr
