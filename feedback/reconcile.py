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

import streams
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
    kafka = settings.kafka
    consumer = streams.consumer(kafka, "rtrl-reconcile", group_id=None)
    admin = streams.admin(kafka, "rtrl-reconcile")
    try:
        partitions = [
            tp
            for topic in (kafka.interactions_topic, kafka.feedback_topic)
            for tp in streams.partitions_of(consumer, topic)
        ]
        begin = consumer.beginning_offsets(partitions)
        end = consumer.end_offsets(partitions)
        committed = streams.committed_offsets(admin, kafka.labeler_group)
        counts = []
        for tp in partitions:
            low, high = begin[tp], end[tp]
            done = committed.get((tp.topic, tp.partition), low)  # -1 when the group has none: low below
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
