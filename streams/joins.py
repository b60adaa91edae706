"""A fix for kafka-python 3.0.12's group join, applied by `streams.consumer` to every consumer rtrl
builds (docs/platform.md, "A group join that finishes between two polls").

kafka-python runs a group join (JoinGroup, then SyncGroup) as a task on its IO thread.
``consumer.poll(timeout_ms)`` waits for that task at most its timeout and, when the timeout
expires first, leaves the task running for the next poll to wait for. When the task finishes
between two polls, the next poll loses its result:

* The group's leader ran the assignor inside the task, which records the partitions it assigned,
  so ``need_rejoin()`` is False afterwards and the poll does not look at the group again. The
  assignment is never applied and heartbeats stay off (they are disabled during a join), so the
  broker drops the member after ``session.timeout.ms`` and the others take its partitions.
* Any other member still needs a rejoin, so the poll sends a new JoinGroup instead of using the
  finished one; a consumer whose short polls are spaced by work may never join.

docs/platform.md says what each does to a consumer and what was measured. The fix keeps
kafka-python's join loop and changes two decisions in it. A join task that has not been applied
counts as "rejoin needed", so the next poll goes back to the group. A task that finished is
handled as the loop handles one it waited for: its assignment applied (unless the member has left
the group since), its error retried or raised. tests/streams/test_streams.py reproduces the
cases against the real broker.

The patch touches kafka-python internals, so it is applied only to the version it was written
for; on any other version it logs a warning and leaves kafka-python as it is (the tests then
show whether that version still needs it).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

FIXED_VERSION = "3.0.12"


@functools.cache
def fix_join_race() -> bool:
    """Patch kafka-python's consumer coordinator (once per process). True when the fix is in
    place, False when kafka-python is not the version it was written for."""
    import kafka
    from kafka import errors
    from kafka.coordinator.base import MemberState
    from kafka.coordinator.consumer import ConsumerCoordinator

    if kafka.__version__ != FIXED_VERSION:
        log.warning(
            "kafka-python %s is not %s: its group join is left unpatched (streams/joins.py)",
            kafka.__version__,
            FIXED_VERSION,
        )
        return False
    # The errors of a join after which kafka-python's loop joins again (it raises any other).
    retried = (
        errors.RetriableError,
        errors.UnknownMemberIdError,
        errors.RebalanceInProgressError,
        errors.IllegalGenerationError,
        errors.MemberIdRequiredError,
    )
    need_rejoin = ConsumerCoordinator.need_rejoin
    join_group_async = ConsumerCoordinator.join_group_async

    def need_rejoin_or_unapplied_join(self: Any) -> bool:
        return self._join_task is not None or bool(need_rejoin(self))

    async def apply_finished_join(self: Any, timeout_ms: Any = None) -> bool:
        task = self._join_task
        if task is not None and task.is_done:
            self._join_task = None
            if task.failed():
                if not isinstance(task.exception, retried):
                    raise task.exception  # dropped, it would be retried on every poll for good
            elif self.state is MemberState.REBALANCING and self._generation.protocol is not None:
                # The steps kafka-python's join loop takes once the task's result is in hand.
                log.info("applying the join of group %s that finished between two polls", self.group_id)
                with self._lock:
                    self.rejoining = False
                    self.rejoin_needed = False
                    self.state = MemberState.STABLE
                    self._enable_heartbeat()
                generation = self._generation
                await self._on_join_complete_async(
                    generation.generation_id, generation.member_id, generation.protocol, task.value
                )
                return True
            # else the member left or lost the group since the join finished (unsubscribe, a stale
            # heartbeat's error reset the generation): its assignment is void; join afresh.
        return bool(await join_group_async(self, timeout_ms=timeout_ms))

    ConsumerCoordinator.need_rejoin = need_rejoin_or_unapplied_join
    ConsumerCoordinator.join_group_async = apply_finished_join
    return True
