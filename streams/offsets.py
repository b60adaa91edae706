"""Partitions and offsets by plain ``(topic, partition)`` keys, for code outside this package.

kafka-python names a partition with its `TopicPartition`, a ``(topic, partition)`` named tuple, and
a committed offset with its `OffsetAndMetadata`. The labeler commits offsets, reconciliation and
``rtrl store prune`` read them; these functions build kafka-python's types for them. A partition
they return is a `TopicPartition`, so it is also a ``(topic, partition)`` tuple and can be handed
back to the consumer (``beginning_offsets``, ``seek``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from schemas.clock import wait_until
from streams.errors import BrokerError, kafka_errors


def partitions_of(consumer: Any, topic: str) -> list[Any]:
    """The partitions of `topic` in order, as `TopicPartition`; none when the brokers do not know it."""
    from kafka.structs import TopicPartition

    return [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]


def commit(consumer: Any, offsets: Mapping[tuple[str, int], int]) -> None:
    """Commit the group's next offset to read for each ``(topic, partition)``; raises `BrokerError`
    when the commit fails (a group rebalance, a broker away)."""
    from kafka.structs import OffsetAndMetadata, TopicPartition

    with kafka_errors():
        consumer.commit(
            {
                TopicPartition(topic, partition): OffsetAndMetadata(offset, "", -1)
                for (topic, partition), offset in offsets.items()
            }
        )


def committed_offsets(admin: Any, group: str, timeout_s: float = 10.0) -> dict[tuple[str, int], int]:
    """The offsets `group` committed, by ``(topic, partition)`` (kafka-python gives -1 for a
    partition without one). Retries while the group coordinator is moving or loading; raises the
    `BrokerError` of a request that cannot succeed, or the last retriable one after `timeout_s`."""
    last: list[BrokerError] = []

    def read() -> tuple[dict[Any, Any]] | None:
        try:
            with kafka_errors():
                return (admin.list_group_offsets({group: None}).get(group, {}),)
        except BrokerError as exc:
            if not exc.retriable:
                raise
            last[:] = [exc]
            return None

    try:
        (offsets,) = wait_until(
            read, timeout_s=timeout_s, interval_s=1.0, what=f"committed offsets of group {group}"
        )
    except TimeoutError:
        raise last[0] from last[0].cause  # the coordinator kept answering a retriable error: that one
    return {(tp.topic, tp.partition): int(meta.offset) for tp, meta in offsets.items()}
