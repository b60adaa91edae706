"""Reconciliation: prove that every record produced to the event topics is stored or dead-lettered.

``rtrl labeler reconcile`` (``reconcile(settings)``) compares, per partition of the interactions and
feedback topics, the records Kafka holds (end offset - beginning offset) with the store's rows
whose source offset lies in that range: ``interactions`` + ``feedback`` (stored) and
``dead_letters`` (dead-lettered). Counting by source offset keeps the identity exact when
retention has deleted old records and when a crash made the labeler re-read a batch (re-reads
never add rows). ``pending`` is what the labeler group has not committed yet; while it is
non-zero the identity may not hold yet, so an operator waits for the lag to drain first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from feedback.models import DeadLetter, Feedback, Interaction
from feedback.store import Store
from schemas.settings import Settings


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


def reconcile(settings: Settings, store: Store | None = None) -> Reconciliation:
    """Count produced, stored, dead-lettered and pending records (see the module docstring)."""
    from kafka import KafkaConsumer  # type: ignore[import-untyped]
    from kafka.admin import KafkaAdminClient  # type: ignore[import-untyped]
    from kafka.structs import TopicPartition  # type: ignore[import-untyped]

    kafka = settings.kafka
    servers = kafka.bootstrap_servers.split(",")
    own_store = store is None
    store = store or Store(settings.store.url)
    consumer = KafkaConsumer(bootstrap_servers=servers, group_id=None, enable_auto_commit=False)
    admin = KafkaAdminClient(bootstrap_servers=servers)
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
        with store.transaction() as session:
            for tp in partitions:
                low, high = begin[tp], end[tp]
                done = committed[tp].offset if tp in committed and committed[tp].offset >= 0 else low

                counts.append(
                    PartitionCount(
                        topic=tp.topic,
                        partition=tp.partition,
                        produced=high - low,
                        stored=_rows(session, Interaction, tp.topic, tp.partition, low, high)
                        + _rows(session, Feedback, tp.topic, tp.partition, low, high),
                        dead_lettered=_rows(session, DeadLetter, tp.topic, tp.partition, low, high),
                        pending=max(0, high - max(done, low)),
                    )
                )
    finally:
        consumer.close()
        admin.close()
        if own_store:
            store.close()
    return Reconciliation(
        produced=sum(c.produced for c in counts),
        stored=sum(c.stored for c in counts),
        dead_lettered=sum(c.dead_lettered for c in counts),
        pending=sum(c.pending for c in counts),
        partitions=counts,
    )


def _rows(session: Session, model: Any, topic: str, partition: int, low: int, high: int) -> int:
    """Rows whose source record is offset low..high-1 of the partition."""
    query = (
        select(func.count())
        .select_from(model)
        .where(
            model.source_topic == topic,
            model.source_partition == partition,
            model.source_offset >= low,
            model.source_offset < high,
        )
    )
    return int(session.scalar(query) or 0)


def _group_offsets(admin: Any, group: str, attempts: int = 5) -> dict[Any, Any]:
    """Committed offsets of a group; retries while the group coordinator is moving or loading."""
    from kafka.errors import KafkaError  # type: ignore[import-untyped]

    for attempt in range(attempts):
        try:
            offsets: dict[Any, Any] = admin.list_group_offsets({group: None}).get(group, {})
            return offsets
        except KafkaError as exc:
            if not getattr(exc, "retriable", False) or attempt == attempts - 1:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")
