"""Reconciliation: prove that every record produced to the event topics is stored or dead-lettered.

``rtrl labeler reconcile`` (``reconcile(settings, store)``) compares, per partition of the interactions and
feedback topics, the records Kafka holds (end offset - beginning offset) with the store's rows
whose source offset lies in that range: ``interactions`` + ``feedback`` (stored) and
``dead_letters`` (dead-lettered). Counting by source offset keeps the identity exact when
retention has deleted old records and when a crash made the labeler re-read a batch (re-reads
never add rows). ``pending`` is what the labeler group has not committed yet; while it is
non-zero the identity may not hold yet, so an operator waits for the lag to drain first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import streams
from schemas.clock import wait_until
from schemas.settings import Settings
from store import Store


@dataclass(frozen=True)
class PartitionCount:
    topic: str
    partition: int
    produced: int
    stored: int
    dead_lettered: int
    pending: int


@dataclass(frozen=True)
class Reconciliation:
    """Counts over the interactions and feedback topics; ``balanced`` is the invariant."""

    produced: int
    stored: int
    dead_lettered: int
    pending: int
    partitions: list[PartitionCount] = field(default_factory=list)

    @property
    def balanced(self) -> bool:
        return self.produced == self.stored + self.dead_lettered


def reconcile(settings: Settings, store: Store) -> Reconciliation:
    """Count produced, stored, dead-lettered and pending records (see the module docstring)."""
    from kafka.structs import TopicPartition

    kafka = settings.kafka
    consumer = streams.consumer(kafka, "rtrl-reconcile", group_id=None)
    admin = streams.admin(kafka, "rtrl-reconcile")
    try:
        partitions = [
            TopicPartition(topic, p)
            for topic in (kafka.interactions_topic, kafka.feedback_topic)
            for p in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        begin = consumer.beginning_offsets(partitions)
        end = consumer.end_offsets(partitions)
        committed = _group_offsets(admin, kafka.labeler_group)
        counts = []
        for tp in partitions:
            low, high = begin[tp], end[tp]
            done = committed[tp].offset if tp in committed and committed[tp].offset >= 0 else low
            stored, dead_lettered = store.source_counts(tp.topic, tp.partition, low, high)
            counts.append(
                PartitionCount(
                    topic=tp.topic,
                    partition=tp.partition,
                    produced=high - low,
                    stored=stored,
                    dead_lettered=dead_lettered,
                    pending=max(0, high - max(done, low)),
                )
            )
    finally:
        consumer.close()
        admin.close()
    return Reconciliation(
        produced=sum(c.produced for c in counts),
        stored=sum(c.stored for c in counts),
        dead_lettered=sum(c.dead_lettered for c in counts),
        pending=sum(c.pending for c in counts),
        partitions=counts,
    )


def _group_offsets(admin: Any, group: str, timeout_s: float = 10.0) -> dict[Any, Any]:
    """Committed offsets of a group; retries while the group coordinator is moving or loading."""
    from kafka.errors import KafkaError

    last: list[KafkaError] = []

    def read() -> tuple[dict[Any, Any]] | None:
        try:
            return (admin.list_group_offsets({group: None}).get(group, {}),)
        except KafkaError as exc:
            if not getattr(exc, "retriable", False):
                raise
            last[:] = [exc]
            return None

    try:
        (offsets,) = wait_until(read, timeout_s=timeout_s, interval_s=1.0, what=f"committed offsets of group {group}")
    except TimeoutError:
        raise last[0] from None  # the coordinator kept answering a retriable error: that one
    return offsets
