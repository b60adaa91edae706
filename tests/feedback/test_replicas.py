"""Several labeler replicas on one PostgreSQL store (store/settle.py, Concurrency).

Episodes have segments on different partitions, so different replicas create, extend, join to and
settle the same episode at the same time; a short settle window makes window settles race with
joins. The invariants: every record stored exactly once and none dead-lettered, every feedback
joined, every episode settled once, and each reward is the score of exactly the feedback that
joined before it settled (the rest is marked late) - what one labeler computes from those events.
The must-show runs three real ``rtrl labeler`` processes and SIGKILLs one while they work.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from factories import HOLDOUT_KEY, T0, TOPICS, FakeClock, Feeder, feedback, fresh_topics, interaction, wire
from helpers import REPO, run_rtrl, stop_group
from prometheus_client import REGISTRY
from sqlalchemy import func, select

import streams
from feedback.labeler import Labeler, make_consumer, make_producer
from feedback.reconcile import Reconciliation, reconcile
from feedback.records import Checks, parse_record
from schemas.clock import Clock, utcnow, wait_until
from schemas.events import FeedbackEvent, InteractionEvent
from schemas.rewards import TAB_V1, score
from schemas.settings import LimitsSettings, Settings, StoreSettings
from services.launch import child_env, rtrl_command
from services.testing import free_ports
from services.tinymodel import VOCAB_SIZE as TINY_VOCAB_SIZE
from store import SourceRecord, Store
from store.models import Episode, Feedback, Interaction

pytestmark = pytest.mark.integration

PARTITIONS = 6


def replica_settings(services: Settings, store_url: str, settle_window_s: float, **labeler: Any) -> Settings:
    """Fresh topics of PARTITIONS partitions, a group and a store of this test's own."""
    settings = fresh_topics(services, partitions=PARTITIONS)
    # The tiny model's vocabulary: these labelers run without the model being built.
    update = {
        "settle_window_s": settle_window_s,
        "poll_timeout_ms": 100,
        "vocab_size": TINY_VOCAB_SIZE,
        **labeler,
    }
    settings = settings.model_copy(
        update={"store": StoreSettings(url=store_url), "labeler": settings.labeler.model_copy(update=update)}
    )
    streams.ensure_topics(settings.kafka)
    return settings


def produce_keyed(settings: Settings, events: list[InteractionEvent | FeedbackEvent]) -> None:
    """Produce events as the gateway does, keyed by request_id (so a request's interaction and its
    feedback share a partition number), batched."""
    kafka = settings.kafka
    producer = streams.producer(kafka, "rtrl-tests", linger_ms=20, batch_size=256 * 1024)
    try:
        for event in events:
            topic = kafka.interactions_topic if isinstance(event, InteractionEvent) else kafka.feedback_topic
            producer.send(topic, key=event.request_id.encode(), value=wire(event))
        producer.flush(timeout=120)
    finally:
        producer.close()


def counted(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def check_labelled(store: Store, interactions: int, feedback_events: int) -> dict[str, int]:
    """The invariants over the whole store; returns its stats."""
    stats = store.stats()
    assert stats["interactions"] == interactions
    assert stats["feedback"] == feedback_events
    assert stats["dead_letters"] == 0, store.dead_letters(5)
    assert stats["feedback_unjoined"] == 0
    assert stats["episodes_open"] == 0
    with store.transaction() as session:
        assert session.scalar(select(func.count(func.distinct(Interaction.event_id)))) == interactions
        signals: dict[str, list[Feedback]] = defaultdict(list)
        for row in session.scalars(
            select(Feedback).where(Feedback.late.is_(False)).order_by(Feedback.created_at, Feedback.event_id)
        ):
            assert row.joined_episode_id is not None
            signals[row.joined_episode_id].append(row)
        wrong = []
        for episode in session.scalars(select(Episode)):
            expected = score(TAB_V1, signals[episode.episode_id])
            if (episode.reward, episode.reward_components) != (expected.reward, expected.components):
                wrong.append((episode.episode_id, episode.reward, expected.reward))
        assert not wrong, (
            f"{len(wrong)} episodes whose reward is not that of their non-late feedback: {wrong[:5]}"
        )
    return stats


def caught_up(settings: Settings, store: Store, produced: int) -> Reconciliation | None:
    result = reconcile(settings, store)
    return result if result.pending == 0 and result.produced == produced else None


# ---- two transactions at once, one held open (what two replicas do at the worst moment) ------------


class Concurrently:
    """Run `work` in a thread (its own transaction) while the test holds another open."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.result: list[Any] = []
        self.error: list[BaseException] = []

        def run() -> None:
            try:
                self.result.append(work())
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error.append(exc)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def waiting(self, seconds: float = 1.0) -> bool:
        """Whether it is still running (blocked on our transaction) after `seconds`."""
        self.thread.join(timeout=seconds)
        return self.thread.is_alive()

    def outcome(self) -> Any:
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        if self.error:
            raise self.error[0]
        return self.result[0]


@pytest.fixture
def pg_store(postgres_database: str) -> Iterator[Store]:
    store = Store(postgres_database)
    store.migrate()
    store.set_tenant("default")  # the tenant of tests/factories.py's events (labeler.unknown_tenants)
    yield store
    store.close()


def episode_row(store: Store, episode_id: str) -> Episode:
    with store.transaction() as session:
        row = session.get(Episode, episode_id)
        assert row is not None
        return row


def feedback_rows(store: Store) -> dict[str, tuple[str | None, bool]]:
    with store.transaction() as session:
        return {f.kind: (f.joined_episode_id, f.late) for f in session.scalars(select(Feedback))}


def test_two_replicas_open_the_same_episode(pg_store: Store) -> None:
    """Segments 0 and 1 of one episode written at once: the second waits, then extends the episode
    (it used to fail on the episode's primary key, and the batch went a record at a time)."""
    one, two = Feeder(pg_store), Feeder(pg_store)
    with pg_store.labelling(T0) as tx:
        written = tx.write_events([(r := one.record(interaction("e", 0, version="v2")), one_parse(r))])
        tx.join_and_settle(TAB_V1, written.interactions, written.feedback, holdout_key=HOLDOUT_KEY)
        other = Concurrently(lambda: two.send(interaction("e", 1, version="v1"), now=T0))
        assert other.waiting()
    _, report = other.outcome()
    assert report.late_segments == 0
    episode = episode_row(pg_store, "e")
    assert (episode.status, episode.policy_version) == ("open", "v1")
    assert pg_store.stats()["interactions"] == 2


def test_a_join_waits_for_a_window_settle_and_is_late(pg_store: Store) -> None:
    """Feedback joined while another replica settles its episode by window: it waits, then is late
    (it used to join as not late while the reward, computed without it, said no_feedback)."""
    feeder = Feeder(pg_store)
    feeder.send(interaction("e", 0))
    later = T0 + timedelta(seconds=61)
    with pg_store.labelling(later) as tx:
        assert len(tx.settle_expired(TAB_V1, 60)) == 1
        other = Concurrently(lambda: feeder.send(feedback("r-e-0", "accepted"), now=later))
        other.waiting()
    other.outcome()
    assert feedback_rows(pg_store) == {"accepted": ("e", True)}
    episode = episode_row(pg_store, "e")
    assert (episode.status, episode.reward, episode.reward_components) == (
        "settled",
        0.0,
        {"no_feedback": 0.0},
    )


def test_two_window_passes_settle_an_episode_once(pg_store: Store) -> None:
    """Two replicas' window passes at once: the second skips what the first holds (it used to settle
    it again)."""
    feeder = Feeder(pg_store)
    feeder.send(interaction("e", 0), interaction("f", 0))
    later = T0 + timedelta(seconds=61)
    with pg_store.labelling(later) as tx:
        assert len(tx.settle_expired(TAB_V1, 60)) == 2
        other = Concurrently(lambda: feeder.settle_window(later, 60))
        assert not other.waiting(10)
    assert other.outcome() == 0


def test_terminal_feedback_from_two_replicas_settles_once(pg_store: Store) -> None:
    """Two terminal signals for one episode (naming it: it has two calls), about requests on different
    partitions, written at once: the first settles the episode, the second waits and is late (it used
    to settle it again, with a different reward)."""
    one, two = Feeder(pg_store), Feeder(pg_store)
    one.send(interaction("e", 0), interaction("e", 1))
    with pg_store.labelling(T0) as tx:
        written = tx.write_events(
            [(r := one.record(feedback("r-e-0", "thumbs_up", episode_id="e")), one_parse(r))]
        )
        assert (
            tx.join_and_settle(
                TAB_V1, written.interactions, written.feedback, holdout_key=HOLDOUT_KEY
            ).settled_terminal
            == 1
        )
        other = Concurrently(lambda: two.send(feedback("r-e-1", "thumbs_down", episode_id="e"), now=T0))
        other.waiting()
    _, report = other.outcome()
    assert (report.settled_terminal, report.late_feedback) == (0, 1)
    assert feedback_rows(pg_store) == {"thumbs_up": ("e", False), "thumbs_down": ("e", True)}
    episode = episode_row(pg_store, "e")
    assert (episode.reward, episode.settle_reason) == (0.5, "terminal_feedback")


def strand(store: Store, *items: FeedbackEvent, now: datetime = T0) -> None:
    """Write `items` while another transaction creates episode "e" (segment 0, not committed yet):
    neither sees the other's row, so feedback naming "e" is stored unjoined."""
    one, two = Feeder(store), Feeder(store)
    with store.labelling(now) as tx:
        written = tx.write_events([(r := one.record(interaction("e", 0)), one_parse(r))])
        tx.join_and_settle(TAB_V1, written.interactions, written.feedback, holdout_key=HOLDOUT_KEY)
        other = Concurrently(lambda: two.send(*items, now=now))
        assert not other.waiting(10)  # nothing of ours to wait for
        _, report = other.outcome()
    assert report.joined == 0


def test_feedback_naming_an_episode_being_created_is_joined_by_the_next_window_pass(pg_store: Store) -> None:
    """Terminal feedback naming episode "e" about a call of it not stored, written while another
    replica creates "e": stored unjoined (nothing can order the two), then joined by the next window
    pass and the episode settled on it, once (it used to stay unjoined: orphaned, and the episode
    settled by window with reward 0)."""
    strand(pg_store, feedback("r-e-1", "thumbs_up", episode_id="e"))
    assert feedback_rows(pg_store) == {"thumbs_up": (None, False)}
    with pg_store.labelling(T0 + timedelta(seconds=1)) as tx:
        report = tx.join_stranded(TAB_V1, 60)
        assert tx.settle_expired(TAB_V1, 60) == []
    assert (report.joined, report.late_feedback, report.settled_terminal) == (1, 0, 1)
    assert feedback_rows(pg_store) == {"thumbs_up": ("e", False)}
    episode = episode_row(pg_store, "e")
    assert (episode.status, episode.settle_reason, episode.reward) == ("settled", "terminal_feedback", 0.5)
    with pg_store.labelling(T0 + timedelta(seconds=2)) as tx:
        assert tx.join_stranded(TAB_V1, 60).joined == 0  # found once


def test_stranded_feedback_is_late_once_its_episode_settled_and_never_joins_another_tenant(
    pg_store: Store,
) -> None:
    """A stranded feedback whose episode settled by window meanwhile joins it late (kept, not in the
    reward); one of another tenant naming the episode is left alone, as any join would."""
    strand(
        pg_store,
        feedback("r-e-1", "accepted", episode_id="e"),
        feedback("r-x-0", "rejected", episode_id="e", tenant="other"),
    )
    later = T0 + timedelta(seconds=61)
    with pg_store.labelling(later) as tx:
        assert len(tx.settle_expired(TAB_V1, 60)) == 1
    with pg_store.labelling(later) as tx:
        report = tx.join_stranded(TAB_V1, 60)
    assert (report.joined, report.late_feedback) == (0, 1)
    assert feedback_rows(pg_store) == {"accepted": ("e", True), "rejected": (None, False)}
    episode = episode_row(pg_store, "e")
    assert (episode.settle_reason, episode.reward) == ("window", 0.0)


def test_the_labelers_window_pass_joins_stranded_feedback(pg_store: Store, kafka_service: Settings) -> None:
    """The labeler runs the join in its window pass and counts it (rtrl_labeler_feedback_stranded_total)."""
    strand(pg_store, feedback("r-e-1", "thumbs_up", episode_id="e"))
    settings = replica_settings(kafka_service, pg_store.url, 60)
    before = counted("rtrl_labeler_feedback_stranded_total")
    consumer, producer = make_consumer(settings), make_producer(settings)
    try:
        labeler = Labeler(settings, pg_store, consumer, producer, clock=lambda: T0 + timedelta(seconds=1))
        report = labeler.step()  # the first step is a window pass
    finally:
        consumer.close()
        producer.close()
    assert report is not None and (report.settle.joined, report.settle.settled_terminal) == (1, 1)
    assert counted("rtrl_labeler_feedback_stranded_total") == before + 1
    assert episode_row(pg_store, "e").settle_reason == "terminal_feedback"


def one_parse(record: SourceRecord) -> Any:
    return parse_record(record, TOPICS[record.topic], Checks(spec=TAB_V1, limits=LimitsSettings()), T0)


# ---- several Labeler instances in threads ---------------------------------------------------------------


def run_replicas(
    settings: Settings,
    n: int,
    until: Callable[[], bool],
    clock: Clock = utcnow,
    timeout_s: float = 180,
    what: str = "the replicas catching up",
) -> None:
    """Run `n` Labeler instances (threads, each with its own store handle) until `until()` holds."""
    stop = threading.Event()
    errors: list[BaseException] = []
    labelers = [
        Labeler(
            settings, Store(settings.store.url), make_consumer(settings), make_producer(settings), clock=clock
        )
        for _ in range(n)
    ]

    def run(labeler: Labeler) -> None:
        try:
            labeler.run(stop)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(labeler,), daemon=True) for labeler in labelers]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: bool(errors) or until(), timeout_s=timeout_s, interval_s=0.5, what=what)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        for labeler in labelers:
            labeler.consumer.close(autocommit=False)
            labeler.producer.close()
            labeler.store.close()
    assert not errors, errors


def episode_events(tag: str, k: int, now: datetime) -> tuple[list[InteractionEvent], list[FeedbackEvent]]:
    """Episode k: three segments (each its own request, so they land on different partitions) and
    feedback by request, by episode id, terminal or not, depending on k."""
    episode = f"{tag}-{k}"
    segments = [interaction(episode, segment=s, created_at=now) for s in range(3)]
    signals: list[FeedbackEvent] = []
    kinds = [
        ["accepted"],
        ["accepted", "thumbs_up"],
        ["judge_score"],
        ["rejected"],
        ["tool_call_error", "edit_persisted"],
        [],
    ][k % 6]
    for n, kind in enumerate(kinds):
        request = segments[(k + n) % 3].request_id
        by_episode = {"episode_id": episode} if (k + n) % 2 else {}
        signals.append(feedback(request, kind, value=0.5, created_at=now, **by_episode))
    return segments, signals


def test_replicas_racing_on_shared_episodes_label_each_once(
    kafka_service: Settings, postgres_database: str
) -> None:
    """Three replicas, a 0.4 s settle window on the real clock, events arriving in waves: window
    settles race with joins, and still every episode is settled once with the reward of exactly its
    non-late feedback."""
    settings = replica_settings(kafka_service, postgres_database, settle_window_s=0.4, max_poll_records=50)
    store = Store(settings.store.url)
    store.migrate()
    store.set_tenant("default")
    tag = f"ep-{uuid.uuid4().hex[:8]}"
    series = [("rtrl_labeler_settled_total", {"how": h}) for h in ("terminal_feedback", "window")]
    series += [("rtrl_labeler_feedback_joined_total", {}), ("rtrl_labeler_feedback_late_total", {})]
    before = [counted(name, **labels) for name, labels in series]
    # Waves a settle window apart: segments and feedback of an episode arrive in different waves, on
    # different partitions, while replicas settle what went quiet.
    episodes = 240
    waves: list[list[InteractionEvent | FeedbackEvent]] = [[] for _ in range(4)]
    for k in range(episodes):
        segments, signals = episode_events(tag, k, utcnow())
        for n, event in enumerate([*segments, *signals]):
            waves[(k + n) % 4].append(event)
    interactions = sum(isinstance(e, InteractionEvent) for wave in waves for e in wave)
    total = sum(len(wave) for wave in waves)

    def produce_waves() -> None:
        for wave in waves:
            produce_keyed(settings, wave)
            time.sleep(0.6)

    producer = threading.Thread(target=produce_waves, daemon=True)
    producer.start()
    try:
        run_replicas(
            settings,
            3,
            lambda: (
                not producer.is_alive()
                and caught_up(settings, store, total) is not None
                and store.stats()["episodes_open"] == 0
            ),
        )
        stats = check_labelled(store, interactions, total - interactions)
    finally:
        producer.join(timeout=60)
        store.close()
    moved = [counted(name, **labels) - b for (name, labels), b in zip(series, before, strict=True)]
    # Each episode settled once; each feedback counted once, joined or late.
    assert moved[0] + moved[1] == episodes == stats["episodes_settled"]
    assert (moved[2], moved[3]) == (stats["feedback"] - stats["feedback_late"], stats["feedback_late"])


def test_replicas_label_like_one_labeler(
    kafka_service: Settings, postgres_database: str, tmp_path: Any
) -> None:
    """Without window settles racing (the clock stands still until everything is stored), three
    replicas give every episode the reward that one labeler gives it from the same events (the
    labeler's store work, fed in production order): all feedback of an episode is about one request
    (so on one partition, in order, terminal last), its segments on any partition."""
    settings = replica_settings(kafka_service, postgres_database, settle_window_s=60, max_poll_records=50)
    tag = f"one-{uuid.uuid4().hex[:8]}"
    now = utcnow()
    events: list[InteractionEvent | FeedbackEvent] = []
    for k in range(300):
        episode = f"{tag}-{k}"
        segments = [interaction(episode, segment=s, created_at=now) for s in range(3)]
        kinds = [
            ["accepted"],
            ["accepted", "thumbs_up"],
            ["judge_score", "followup_dissatisfied"],
            ["rejected"],
            ["tool_call_error", "edited", "edit_persisted"],
            [],
        ][k % 6]
        request = segments[k % 3].request_id
        by_episode = {"episode_id": episode} if k % 2 else {}
        signals = [feedback(request, kind, value=0.5, created_at=now, **by_episode) for kind in kinds]
        events += [*segments, *signals]
    produce_keyed(settings, events)
    interactions = sum(isinstance(e, InteractionEvent) for e in events)
    expired = now + timedelta(seconds=settings.labeler.settle_window_s + 5)

    def labelled(store: Store) -> dict[str, tuple[Any, ...]]:
        check_labelled(store, interactions, len(events) - interactions)
        with store.transaction() as session:
            return {
                e.episode_id: (e.reward, e.reward_components, e.settle_reason)
                for e in session.scalars(select(Episode))
            }

    replicas = Store(settings.store.url)
    replicas.migrate()
    replicas.set_tenant("default")
    alone = Store(f"sqlite:///{tmp_path}/alone.db")
    alone.migrate()
    try:
        run_replicas(
            settings, 3, lambda: caught_up(settings, replicas, len(events)) is not None, clock=FakeClock(now)
        )
        # Three replicas' window passes at once, once every open episode is expired.
        passes = [
            Concurrently(lambda: Feeder(replicas).settle_window(expired, settings.labeler.settle_window_s))
            for _ in range(3)
        ]
        assert sum(p.outcome() for p in passes) == replicas.stats()["episodes_settled_window"]
        by_replicas = labelled(replicas)

        feeder = Feeder(alone)
        for i in range(0, len(events), 50):
            feeder.send(*events[i : i + 50], now=now)
        feeder.settle_window(expired, settings.labeler.settle_window_s)
        by_one = labelled(alone)
    finally:
        replicas.close()
        alone.close()
    assert len(by_replicas) == 300
    assert by_replicas == by_one


# ---- the must-show: three `rtrl labeler` processes, one SIGKILLed --------------------------------------

INTERACTIONS = 50_000
FEEDBACK = 10_000


def must_show_events(tag: str, now: datetime) -> list[InteractionEvent | FeedbackEvent]:
    """25,000 episodes of two segments; every 5th episode gets two feedback events (half terminal)."""
    events: list[InteractionEvent | FeedbackEvent] = []
    for k in range(INTERACTIONS // 2):
        episode = f"{tag}-{k}"
        segments = [interaction(episode, segment=s, created_at=now) for s in range(2)]
        events += segments
        if k % 5 == 0:
            events.append(feedback(segments[0].request_id, "accepted", created_at=now))
            last = "thumbs_up" if k % 10 == 0 else "followup_dissatisfied"
            events.append(feedback(segments[1].request_id, last, created_at=now, episode_id=episode))
    return events


def test_three_labeler_processes_one_sigkilled(
    kafka_service: Settings, postgres_database: str, tmp_path: Any
) -> None:
    settings = replica_settings(kafka_service, postgres_database, settle_window_s=60.0)
    store = Store(settings.store.url)
    store.migrate()
    store.set_tenant("default")
    events = must_show_events(f"ms-{uuid.uuid4().hex[:8]}", utcnow())
    assert sum(isinstance(e, InteractionEvent) for e in events) == INTERACTIONS
    assert len(events) - INTERACTIONS == FEEDBACK

    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    for n, port in enumerate(free_ports(3)):
        replica = settings.model_copy(
            update={"metrics": settings.metrics.model_copy(update={"labeler_port": port})}
        )
        log = open(tmp_path / f"labeler-{n}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(
                rtrl_command("labeler"),
                cwd=REPO,
                env=child_env(replica),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    try:
        t0 = time.monotonic()
        produce_keyed(settings, events)
        produce_s = time.monotonic() - t0

        def stored() -> int:
            with store.transaction() as session:
                return int(session.scalar(select(func.count()).select_from(Interaction)) or 0)

        wait_until(lambda: stored() >= 5_000, timeout_s=120, interval_s=0.2, what="5,000 interactions stored")
        killed_at = stored()
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait(timeout=30)
        t_kill = time.monotonic() - t0
        result = wait_until(
            lambda: caught_up(settings, store, len(events)),
            timeout_s=420,
            interval_s=1.0,
            what="the two survivors catching up",
        )
        drained_s = time.monotonic() - t0
        assert (result.stored, result.dead_lettered, result.pending) == (
            len(events),
            0,
            0,
        ) and result.balanced
        wait_until(
            lambda: store.stats()["episodes_open"] == 0, timeout_s=120, interval_s=1.0, what="all settled"
        )
        settled_s = time.monotonic() - t0
        stats = check_labelled(store, INTERACTIONS, FEEDBACK)
        assert stats["episodes_settled"] == INTERACTIONS // 2
        out = run_rtrl(settings, "labeler", "reconcile")
        assert out.returncode == 0 and "-> balanced" in out.stdout, out.stdout + out.stderr
        assert all(p.poll() is None for p in procs[1:]), "a surviving replica exited"
        print(
            f"\n3 replicas, one SIGKILLed at {t_kill:.1f}s ({killed_at} interactions stored): {len(events)} records "
            f"produced in {produce_s:.1f}s, all stored after {drained_s:.1f}s = {len(events) / drained_s:.0f} "
            f"records/s; all settled after {settled_s:.1f}s (60 s window); {stats}"
        )
    finally:
        for proc in procs:
            stop_group(proc)
        for log in logs:
            log.close()
        store.close()
