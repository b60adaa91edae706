"""Caps per episode on real services (docs/security.md, Caps per episode and held-out membership):
a tenant floods one episode with segments, feedback and an oversized prompt through a real Kafka
broker; the labeler stores the first of each, dead-letters the rest with their reasons on the DLQ
topic and in the store, the flooded episode settles by its window, and the held-out bucket is the
keyed one. On SQLite and PostgreSQL."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from factories import FakeClock, feedback, fresh_topics, interaction, wire
from helpers import TopicReader, produce
from sqlalchemy import select

import streams
from feedback.labeler import Labeler, make_consumer, make_producer
from feedback.reconcile import reconcile
from feedback.records import holdout_key
from schemas.clock import utcnow, wait_until
from schemas.events import new_id
from schemas.settings import Settings, StoreSettings
from store import Store
from store.models import Episode, Feedback, Interaction
from store.settle import eval_bucket

pytestmark = pytest.mark.integration

SEGMENTS, FEEDBACK, PROMPT_BYTES = 5, 4, 2048


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(utcnow())


@pytest.fixture(params=["sqlite", "postgresql"])
def capped(request: pytest.FixtureRequest, services: Settings, tmp_path: Path) -> Iterator[Settings]:
    """Settings with fresh topics, a store of the backend and small caps."""
    url = (
        f"sqlite:///{tmp_path}/rtrl.db"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_database")
    )
    settings = fresh_topics(services, partitions=2)
    limits = settings.limits.model_copy(
        update={
            "max_segments_per_episode": SEGMENTS,
            "max_feedback_per_episode": FEEDBACK,
            "max_prompt_bytes": PROMPT_BYTES,
        }
    )
    labeler = settings.labeler.model_copy(update={"settle_window_s": 1.0, "poll_timeout_ms": 200})
    settings = settings.model_copy(
        update={"store": StoreSettings(url=url), "labeler": labeler, "limits": limits}
    )
    streams.ensure_topics(settings.kafka)
    yield settings


def test_caps_per_episode_on_real_services(capped: Settings, clock: FakeClock) -> None:
    settings = capped
    store = Store(settings.store.url)
    store.migrate()
    store.set_tenant("default")
    labeler = Labeler(settings, store, make_consumer(settings), make_producer(settings), clock=clock)
    try:
        now = clock()
        ep = f"flood-{uuid.uuid4().hex[:8]}"
        t_int, t_fb = settings.kafka.interactions_topic, settings.kafka.feedback_topic
        items: list[tuple[str, bytes | None]] = [
            (t_int, wire(interaction(ep, s, created_at=now))) for s in range(SEGMENTS + 7)
        ]
        items.append((t_int, wire(interaction(f"big-{ep}", prompt="p" * (PROMPT_BYTES + 1), created_at=now))))
        items += [
            (t_fb, wire(feedback(f"r-{ep}-1", "accepted", event_id=new_id(), created_at=now)))
            for _ in range(30)
        ]
        produce(settings.kafka, items)

        def caught_up() -> bool:
            for _ in range(5):
                labeler.step()
            result = reconcile(settings, store)
            return result.pending == 0 and result.produced == len(items)

        wait_until(caught_up, timeout_s=90, interval_s=0.0, what="labeler catching up")
        with store.transaction() as session:
            segments = sorted(
                session.scalars(select(Interaction.segment_index).where(Interaction.episode_id == ep))
            )
            joined = len(
                session.scalars(select(Feedback.event_id).where(Feedback.joined_episode_id == ep)).all()
            )
        assert segments == list(range(SEGMENTS)) and joined == FEEDBACK
        dead = 7 + 1 + (30 - FEEDBACK)
        stats = store.stats()
        assert stats["dead_letters"] == dead and len(store.dead_letters(100, reason_prefix="cap:")) == dead
        reader = TopicReader(settings.kafka, settings.kafka.dlq_topic, from_beginning=True)
        try:
            reasons = [json.loads(r.value)["reason"] for r in reader.read_to_end()]
        finally:
            reader.close()
        assert len(reasons) == dead and all(r.startswith("cap: ") for r in reasons)
        result = reconcile(settings, store)
        assert result.produced == stats["interactions"] + stats["feedback"] + stats["dead_letters"]

        # The flood stopped moving the episode: it settles by its window.
        clock.advance(settings.labeler.settle_window_s + 1)
        for _ in range(3):
            labeler.step()
        with store.transaction() as session:
            row = session.get(Episode, ep)
            assert row is not None and (row.status, row.settle_reason) == ("settled", "window")
            assert row.eval_bucket == eval_bucket(ep, holdout_key(settings))
    finally:
        labeler.consumer.close(autocommit=False)
        labeler.producer.close()
        store.close()
