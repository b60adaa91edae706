"""The labeler's sustained rate from Kafka through join and reward into PostgreSQL, against a raw
kafka-python consumer of the same topics, in the same run.

    .venv/bin/python bench/bench_labeler.py [--interactions 20000] [--feedback 20000]
        [--partitions P (default: the topics' default)] [--replicas N (default: P)] [--profile]

Starts its own Kafka and PostgreSQL (a private run dir on free ports; both stopped at the end),
creates fresh topics with the default partition count (`--partitions` for more: a partition is
read by one replica at most, so more cores need more partitions), and produces N interactions
(single-segment episodes, as the gateway writes them: 64-token prompts, 16-token completions with
logprobs) and M feedback events about them (thumbs up or down, which settle the episode at once
under the default reward spec). Then, one after the other on the same records:

* baseline: a raw kafka-python consumer in a group of its own reads both topics to the end
  (records fetched, nothing parsed): records/s from its first batch to its last; the median of
  three such passes (`baseline_passes`);
* one labeler: one `feedback.labeler.Labeler` (the code of ``rtrl labeler``), in a group of its
  own, reads the same records and parses, checks, stores, joins and rewards them in a fresh
  PostgreSQL database: records/s from its first batch (both clocks start once the consumer has
  joined its group) until its steps report every interaction and feedback stored and every
  feedback joined, which the store is then checked to hold;
* the labeler group: N replicas of it (processes, as ``rtrl labeler`` scales out; default one per
  partition, the most that get work) in a group of their own, on another fresh database. The
  records are already in the topics, so the replicas hold their partitions paused until the group
  is stable with every partition assigned (the broker rebalances at each join: a start-up cost,
  not the sustained rate); then records/s from the first batch any replica gets until their steps
  report every record stored and joined, checked in the store as above.

`value` is the labeler group's rate (the stage as deployed), with the one labeler's rate beside it
(`single`, `single_ratio`). `group_cpu_s` is the CPU time (user + system) each part of the machine
spent during the group's run: the replicas, PostgreSQL's processes, the Kafka broker, everything
else; `group_cpu_us_per_record` is their sum per record (what the cores bound). Target (issue 14):
value >= 5,000 records/s and ratio >= 0.25. The last
line is one JSON object: ``{"name", "value", "baseline": raw records/s, "ratio", "records", ...}``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import os
import pstats
import queue
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from datetime import UTC, datetime, timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

import streams
from feedback.labeler import Labeler, freeze_heap, make_consumer, make_producer
from schemas.events import FeedbackEvent, InteractionEvent
from schemas.settings import Settings, StoreSettings, local_postgres_url
from services import up
from services.postgres import Postgres
from services.testing import private_services
from store import Store

RAW_PASSES = 3  # the baseline is the median of this many raw consumer passes
STABLE_S = 2.0  # the replicas' assignments unchanged this long: the group is stable


def events(
    n_interactions: int, n_feedback: int, tag: str
) -> tuple[list[InteractionEvent], list[FeedbackEvent]]:
    start = datetime.now(UTC) - timedelta(minutes=5)
    interactions = [
        InteractionEvent(
            event_id=f"i-{tag}-{i}",
            request_id=f"r-{tag}-{i}",
            episode_id=f"r-{tag}-{i}",
            model="rtrl-tiny",
            policy_version="v1",
            prompt="Q: What is 3 plus 4?\nA:" * 4,
            prompt_token_ids=list(range(1, 65)),
            completion=" The answer is 7!",
            completion_token_ids=list(range(100, 116)),
            completion_logprobs=[-0.5] * 16,
            created_at=start + timedelta(milliseconds=i),
        )
        for i in range(n_interactions)
    ]
    feedback = [
        FeedbackEvent(
            event_id=f"f-{tag}-{i}",
            request_id=f"r-{tag}-{i % n_interactions}",
            kind="thumbs_up" if i % 2 else "thumbs_down",
            value=1.0,
            created_at=start + timedelta(milliseconds=i, seconds=1),
        )
        for i in range(n_feedback)
    ]
    return interactions, feedback


def produce(settings: Settings, interactions: list[InteractionEvent], feedback: list[FeedbackEvent]) -> None:
    producer = streams.producer(settings.kafka, "rtrl-bench", linger_ms=20, batch_size=512 * 1024)
    try:
        for topic, batch in (
            (settings.kafka.interactions_topic, interactions),
            (settings.kafka.feedback_topic, feedback),
        ):
            for event in batch:
                producer.send(topic, key=event.request_id.encode(), value=event.model_dump_json().encode())
        producer.flush(timeout=300)
    finally:
        producer.close()


def raw_rate(settings: Settings, total: int) -> float:
    """Records/s of a bare kafka-python consumer reading both topics from the start."""
    consumer = streams.consumer(
        settings.kafka,
        "rtrl-bench-raw",
        settings.kafka.interactions_topic,
        settings.kafka.feedback_topic,
        group_id=f"bench-raw-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_poll_records=settings.labeler.max_poll_records,
    )
    seen, started = 0, None
    try:
        deadline = time.monotonic() + 600
        while seen < total and time.monotonic() < deadline:
            batch = consumer.poll(timeout_ms=500)
            if batch and started is None:
                started = time.perf_counter()
            seen += sum(len(records) for records in batch.values())
        elapsed = time.perf_counter() - (started or time.perf_counter())
    finally:
        consumer.close()
    if seen < total:
        raise RuntimeError(f"the raw consumer read {seen} of {total} records in 10 minutes")
    return seen / elapsed


def labeler_rate(
    settings: Settings, n_interactions: int, n_feedback: int, profile: bool = False
) -> tuple[float, float]:
    """(records/s, seconds) of one Labeler storing, joining and rewarding every record, timed like
    the raw consumer: from its first batch (after it joined the group) until its step reports show
    every interaction and feedback stored and every feedback joined; the store is checked to hold
    exactly that afterwards. With `profile`, the steps run under cProfile and the top functions
    are printed."""
    store = Store(settings.store.url)
    store.migrate()
    store.set_tenant("default")  # the bench's events' tenant: refused without a row (labeler.unknown_tenants)
    labeler = Labeler(settings, store, make_consumer(settings), make_producer(settings))
    freeze_heap()  # as `feedback.labeler.run` does before its loop
    profiler = cProfile.Profile() if profile else None
    stored = feedback = joined = 0
    first: list[float] = []
    on_first_batch(labeler.consumer, lambda: first.append(time.perf_counter()))  # as the raw consumer's clock
    deadline = time.monotonic() + 1800
    try:
        if profiler is not None:
            profiler.enable()
        while stored < n_interactions or feedback < n_feedback or joined < n_feedback:
            if time.monotonic() > deadline:
                raise RuntimeError("the labeler did not store every record within 30 minutes")
            report = labeler.step()
            if report is None:
                continue
            if report.dead_lettered:  # never stored: waiting on would only time out
                raise RuntimeError(dead_lettered(store, report.dead_lettered))
            stored += report.interactions
            feedback += report.feedback
            joined += report.settle.joined
        elapsed = time.perf_counter() - (first[0] if first else time.perf_counter())
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        check_store(store, n_interactions, n_feedback)
    finally:
        labeler.consumer.close(autocommit=False)
        labeler.producer.close()
        store.close()
    return (n_interactions + n_feedback) / elapsed, elapsed


def on_first_batch(consumer: Any, call: Callable[[], None]) -> None:
    """Make `consumer.poll` run `call` once, when it first returns records (where a clock starts)."""
    poll = consumer.poll
    called = False

    def polled(**kwargs: Any) -> Any:
        nonlocal called
        batch = poll(**kwargs)
        if batch and not called:
            called = True
            call()
        return batch

    consumer.poll = polled


def check_store(store: Store, n_interactions: int, n_feedback: int) -> None:
    """The store holds exactly the records the steps reported: every interaction, every feedback joined."""
    stats = store.stats()
    counted = (stats["interactions"], stats["feedback_joined"])
    if counted != (n_interactions, n_feedback):
        raise RuntimeError(
            f"the store holds {counted} (interactions, joined feedback), expected {(n_interactions, n_feedback)}"
        )


def dead_lettered(store: Store, n: int) -> str:
    """One line: the labeler dead-lettered `n` of the bench's records (a broken bench: every record
    it produces is valid), with the newest dead letters' reasons (``rtrl dlq list`` has them all)."""
    reasons = Counter(" ".join(d.reason.split())[:120] for d in store.dead_letters(max(n, 1)))
    why = "; ".join(f"{count} x {reason}" for reason, count in reasons.most_common(3))
    return f"the labeler dead-lettered {n} records, which will never be stored: {why}"


def replica(settings: Settings, go: Any, stop: Any, reports: Any) -> None:
    """One labeler replica (a process): joins the group with its partitions paused, reports its
    assignment, consumes once `go` is set, and reports each step (wall time, what it stored) until
    `stop`."""
    from kafka import ConsumerRebalanceListener

    store = Store(settings.store.url)
    labeler = Labeler(settings, store, make_consumer(settings), make_producer(settings))
    consumer = labeler.consumer
    freeze_heap()  # as `feedback.labeler.run` does before its loop

    class Hold(ConsumerRebalanceListener):  # type: ignore[misc]
        def on_partitions_revoked(self, revoked: Any) -> None:
            pass

        def on_partitions_assigned(self, assigned: Any) -> None:
            if not go.is_set():
                consumer.pause(*assigned)
            reports.put(("assigned", os.getpid(), sorted((tp.topic, tp.partition) for tp in assigned)))

    consumer.subscribe(topics=sorted(labeler.expected), listener=Hold())
    try:
        while not go.is_set():
            consumer.poll(timeout_ms=100)  # joins the group and heartbeats; paused partitions are not fetched
        consumer.resume(*consumer.assignment())
        on_first_batch(consumer, lambda: reports.put(("first", os.getpid(), time.time())))
        while not stop.is_set():
            report = labeler.step()
            if report is not None and report.records:
                reports.put(
                    (
                        "step",
                        os.getpid(),
                        time.time(),
                        report.interactions,
                        report.feedback,
                        report.settle.joined,
                        report.dead_lettered,
                    )
                )
    finally:
        consumer.close(autocommit=False)
        labeler.producer.close()
        store.close()


def replicas_rate(
    settings: Settings, n_interactions: int, n_feedback: int, replicas: int
) -> tuple[float, float, list[int], dict[str, float]]:
    """(records/s, seconds, records stored per replica, CPU seconds by part) of `replicas` labeler
    processes in one group, timed from the first batch any of them got (once the group was stable)
    until their steps reported every record stored and joined; the store is checked afterwards.
    The CPU seconds are read when the partitions are resumed and when the last record is reported
    (the replicas idle, paused, before; the first batch follows within milliseconds)."""
    store = Store(settings.store.url)
    store.migrate()
    store.set_tenant("default")  # the bench's events' tenant: refused without a row (labeler.unknown_tenants)
    context = multiprocessing.get_context("spawn")
    go, stop, reports = context.Event(), context.Event(), context.Queue()
    processes = [
        context.Process(target=replica, args=(settings, go, stop, reports), daemon=True)
        for _ in range(replicas)
    ]
    partitions = {
        (topic, p)
        for topic in (settings.kafka.interactions_topic, settings.kafka.feedback_topic)
        for p in range(settings.kafka.partitions)
    }
    try:
        for process in processes:
            process.start()
        wait_for_stable_group(reports, partitions, replicas)
        pids = {process.pid for process in processes if process.pid is not None}
        cpu_before = cpu_seconds(pids)
        go.set()
        first, end, per = wait_for_every_record(store, processes, go, reports, n_interactions, n_feedback)
        cpu_after = cpu_seconds(pids)
        stop.set()
        for process in processes:
            process.join(timeout=60)
        check_store(store, n_interactions, n_feedback)
    finally:
        stop.set()
        for process in processes:
            if process.is_alive():
                process.kill()
        store.close()
    seconds = end - min(first)
    cpu = {part: round(cpu_after[part] - cpu_before[part], 2) for part in cpu_after}
    return (n_interactions + n_feedback) / seconds, seconds, sorted(per.values(), reverse=True), cpu


def wait_for_stable_group(reports: Any, partitions: set[tuple[str, int]], replicas: int) -> None:
    """Read the replicas' assignment `reports` until every one of `partitions` is assigned to one
    replica, every replica that can get some has some, and nothing changed for STABLE_S; raises
    after 5 minutes."""
    assigned: dict[int, list[tuple[str, int]]] = {}
    changed, deadline = time.monotonic(), time.monotonic() + 300
    busy = min(replicas, len(partitions) // 2)  # the range assignor gives extra replicas nothing
    while True:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the labeler group did not settle on an assignment: {assigned}")
        try:
            kind, pid, *rest = reports.get(timeout=0.2)
            assigned[pid] = rest[0]
            changed = time.monotonic()
        except queue.Empty:
            pass
        owned = [tp for tps in assigned.values() for tp in tps]
        if (
            len(owned) == len(set(owned))
            and set(owned) == partitions
            and sum(1 for tps in assigned.values() if tps) == busy
            and time.monotonic() - changed >= STABLE_S
        ):
            return


def wait_for_every_record(
    store: Store,
    processes: Sequence[BaseProcess],
    go: Any,
    reports: Any,
    n_interactions: int,
    n_feedback: int,
) -> tuple[list[float], float, dict[int, int]]:
    """Read the replicas' `reports` (once `go` is set) until their steps report every record stored
    and every feedback joined: (the times of their first batches, the time of the last step, records
    stored per replica pid). Raises if a record was dead-lettered, every replica exited, the group
    rebalanced, or 30 minutes passed."""
    first: list[float] = []
    per: dict[int, int] = {}
    stored = feedback = joined = 0
    end = 0.0
    deadline = time.monotonic() + 1800
    while stored < n_interactions or feedback < n_feedback or joined < n_feedback:
        if time.monotonic() > deadline:
            raise RuntimeError("the labeler group did not store every record within 30 minutes")
        if not any(process.is_alive() for process in processes):
            raise RuntimeError("every labeler replica exited")
        try:
            kind, pid, *rest = reports.get(timeout=1.0)
        except queue.Empty:
            continue
        if kind == "first":
            first.append(rest[0])
        elif kind == "step":
            if rest[4]:  # never stored: waiting on would only time out
                raise RuntimeError(dead_lettered(store, rest[4]))
            end = max(end, rest[0])
            stored, feedback, joined = stored + rest[1], feedback + rest[2], joined + rest[3]
            per[pid] = per.get(pid, 0) + rest[1] + rest[2]
        elif kind == "assigned" and go.is_set():
            raise RuntimeError("the labeler group rebalanced during the run")
    return first, end, per


def cpu_seconds(labelers: Collection[int]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the processes of this machine, by part: the
    `labelers` (pids), PostgreSQL's processes, the Kafka broker (java), the rest. A process that
    exited between two readings is missing from the later one (the bench's parts all live on)."""
    parts = dict.fromkeys(("labelers", "postgres", "kafka", "other"), 0.0)
    for process in psutil.process_iter(["name", "cpu_times"]):
        times = process.info["cpu_times"]
        if times is None:
            continue  # exited meanwhile, or not ours to read
        name = process.info["name"]
        part = (
            "labelers"
            if process.pid in labelers
            else "postgres"
            if name == "postgres"
            else "kafka"
            if name == "java"
            else "other"
        )
        parts[part] += times.user + times.system
    return parts


def fresh(settings: Settings, name: str) -> Settings:
    """`settings` with a labeler group and a PostgreSQL database of their own (the database created)."""
    database = f"{settings.postgres.database}_{name}"
    Postgres(settings).create_database(database)
    return settings.model_copy(
        update={
            "kafka": settings.kafka.model_copy(
                update={"labeler_group": f"{settings.kafka.labeler_group}.{name}"}
            ),
            "store": StoreSettings(url=local_postgres_url(settings, database)),
        }
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interactions", type=int, default=20_000)
    parser.add_argument("--feedback", type=int, default=20_000)
    parser.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="Partitions of each topic (default: RTRL_KAFKA__PARTITIONS's default); more cores need more.",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="Labeler processes in the group run (default: the partition count).",
    )
    parser.add_argument(
        "--profile", action="store_true", help="Print where the one labeler's thread spends its time."
    )
    args = parser.parse_args()
    if args.interactions < 1 or args.feedback < 0:
        parser.error("--interactions must be >= 1 and --feedback >= 0")
    if args.partitions is not None and args.partitions < 1:
        parser.error("--partitions must be >= 1")
    if args.replicas is not None and args.replicas < 1:
        parser.error("--replicas must be >= 1")
    return args


def bench_settings(base: Settings, tag: str, partitions: int | None) -> Settings:
    """`base` with topics and a labeler group of the run's own (`partitions` per topic, or the
    default), and a settle window that never fires during the run."""
    kafka = base.kafka.model_copy(
        update={
            "interactions_topic": f"bench.{tag}.interactions",
            "feedback_topic": f"bench.{tag}.feedback",
            "dlq_topic": f"bench.{tag}.dlq",
            "labeler_group": f"bench.{tag}.labeler",
            "partitions": partitions or base.kafka.partitions,
        }
    )
    return base.model_copy(
        update={
            "kafka": kafka,
            # Episodes settle by their terminal feedback; the window never fires during the run.
            # The tiny model's vocabulary (the bench's token ids are below 116): no model is built.
            "labeler": base.labeler.model_copy(update={"settle_window_s": 3600.0, "vocab_size": 384}),
        }
    )


def produce_events(settings: Settings, n_interactions: int, n_feedback: int, tag: str) -> tuple[int, int]:
    """Produce the run's interactions and feedback into its topics; returns only their counts. The
    one labeler runs in this process: produced events kept alive here would be in its heap (frozen,
    or scanned by the collector's passes), where `rtrl labeler` holds nothing like them."""
    interactions, feedback = events(n_interactions, n_feedback, tag)
    produce(settings, interactions, feedback)
    return len(interactions), len(feedback)


def main() -> None:
    args = parse_args()
    with private_services("rtrl-bench-labeler-", enabled=("kafka", "postgres")) as base:
        up(base)
        tag = uuid.uuid4().hex[:8]
        settings = bench_settings(base, tag, args.partitions)
        replicas = args.replicas or settings.kafka.partitions
        streams.ensure_topics(settings.kafka)
        n_interactions, n_feedback = produce_events(settings, args.interactions, args.feedback, tag)
        total = n_interactions + n_feedback
        # A pass takes a fraction of a second, and its rate moved 2x between runs on this machine:
        # the median of three passes (each a group of its own) is the baseline, all three reported.
        raw_passes = [raw_rate(settings, total) for _ in range(RAW_PASSES)]
        raw = statistics.median(raw_passes)
        single, seconds = labeler_rate(fresh(settings, "single"), n_interactions, n_feedback, args.profile)
        rate, group_s, per, cpu = replicas_rate(
            fresh(settings, "group"), n_interactions, n_feedback, replicas
        )
    cpus = len(
        os.sched_getaffinity(0)
    )  # the CPUs this run may use (fewer under taskset than the machine has)
    print(
        f"raw kafka-python consume: {raw:,.0f} records/s (median of {', '.join(f'{r:,.0f}' for r in raw_passes)}); into PostgreSQL: one labeler {single:,.0f} records/s "
        f"({seconds:.1f} s), {replicas} replicas {rate:,.0f} records/s ({group_s:.1f} s; per replica {per}; CPU s {cpu}), "
        f"{total:,} records, {cpus} CPUs"
    )
    print(
        json.dumps(
            {
                "name": "labeler_records_per_s",
                "value": round(rate, 1),
                "baseline": round(raw, 1),
                "baseline_passes": [round(passed, 1) for passed in raw_passes],
                "ratio": round(rate / raw, 4),
                "records": total,
                "interactions": n_interactions,
                "feedback": n_feedback,
                "replicas": replicas,
                "replicas_s": round(group_s, 2),
                "per_replica": per,
                "group_cpu_s": cpu,
                "group_cpu_us_per_record": round(sum(cpu.values()) / total * 1e6, 1),
                "single": round(single, 1),
                "single_ratio": round(single / raw, 4),
                "single_s": round(seconds, 2),
                "store": "postgresql",
                "partitions": settings.kafka.partitions,
                "cpus": cpus,
                "target_value": 5000,
                "target_ratio": 0.25,
            }
        )
    )


if __name__ == "__main__":
    main()
