"""A fix for kafka-python 3.0.12's group join, applied by `streams.consumer` to every consumer rtrl
builds (docs/platform.md, "A group join that finishes between two polls").

kafka-python runs a group join (JoinGroup, then SyncGroup) as a task on its IO thread.
``consumer.poll(timeout_ms)`` waits for that task at most its timeout and, when the timeout
expires first, leaves the task running for the next poll to wait for. When the task finishes
between two polls, the next poll loses its result:

* The group's leader ran the assignor inside the task, which records the partitions it assigned,
  so ``need_rejoin()`` is False afterwards and the poll does not look at the group again. The
  assignment is never applied and heartbeats stay off (they are disabled during a join). The
  broker drops the member after ``session.timeout.ms`` (45 s) and the others take its
  partitions. At start-up the consumer then polls on with no partitions; after a rebalance it
  keeps reading the partitions it held before, which others now own, and its offset commits
  fail. It stays so until its topics' partitions change. Repeating the labeler bench's start-up
  (three replicas joining one group, 100 ms polls) showed it in 5 of 40 tries.
* Any other member still needs a rejoin, so the poll sends a new JoinGroup instead of using the
  finished one. A consumer whose short polls are spaced by work may never join: with
  non-blocking polls 100 ms apart, none of 5 consumers joined in 40 polls (with 1 ms polls, 3
  of 5 did not).

The fix keeps kafka-python's join loop and changes two decisions in it. A join task that has not
been applied counts as "rejoin needed", so the next poll goes back to the group. A task that
finished with an assignment is applied the way kafka-python's loop applies one, instead of being
replaced; one whose member has left the group since is dropped, and one that failed is handled
as the loop handles the error (rejoin, or raise a non-retriable one). tests/streams/test_streams.py reproduces both cases against the real broker.

The patch touches kafka-python internals, so it is applied only to the version it was written
for; on any other version it logs a warning and leaves kafka-python as it is (the tests then
show whether that version still needs it).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

FIXED_VERSION = "3.0.12"
_applied = False


def fix_join_race() -> bool:
    """Patch kafka-python's consumer coordinator (once per process). True when the fix is in
    place, False when kafka-python is not the version it was written for."""
    global _applied
    if _applied:
        return True
    import kafka
    from kafka import errors
    from kafka.coordinator.base import MemberState
    from kafka.coordinator.consumer import ConsumerCoordinator

    if kafka.__version__ != FIXED_VERSION:
        log.warning("kafka-python %s is not %s: its group join is left unpatched (streams/joins.py)",
                    kafka.__version__, FIXED_VERSION)  # fmt: skip
        return False
    retried = (errors.RetriableError, errors.UnknownMemberIdError, errors.RebalanceInProgressError,
                errors.IllegalGenerationError, errors.MemberIdRequiredError)  # fmt: skip
    need_rejoin = ConsumerCoordinator.need_rejoin
    join_group_async = ConsumerCoordinator.join_group_async

    def need_rejoin_or_unapplied_join(self: Any) -> bool:
        return self._join_task is not None or bool(need_rejoin(self))

    async def apply_finished_join(self: Any, timeout_ms: Any = None) -> bool:
        task = self._join_task
        if task is not None and task.failed():
            # What kafka-python's loop does with the error of a join it waited for: rejoin after
            # one it retries, raise any other (it would otherwise be dropped and retried forever).
            self._join_task = None
            if not isinstance(task.exception, retried):
                raise task.exception
        elif task is not None and task.is_done and not (
                self.state is MemberState.REBALANCING and self._generation.protocol is not None):  # fmt: skip
            # The member left or lost the group since the join finished (unsubscribe, a stale
            # heartbeat's error reset the generation): its assignment is void; join afresh.
            self._join_task = None
        if self._join_task is None or not self._join_task.is_done:
            return bool(await join_group_async(self, timeout_ms=timeout_ms))
        # The steps kafka-python's join loop takes once the task's result is in hand.
        log.info("applying the join of group %s that finished between two polls", self.group_id)
        self._join_task = None
        with self._lock:
            self.rejoining = False
            self.rejoin_needed = False
            self.state = MemberState.STABLE
            self._enable_heartbeat()
        generation = self._generation
        await self._on_join_complete_async(generation.generation_id, generation.member_id, generation.protocol,
                                           task.value)  # fmt: skip
        return True

    ConsumerCoordinator.need_rejoin = need_rejoin_or_unapplied_join
    ConsumerCoordinator.join_group_async = apply_finished_join
    _applied = True
    return True
