"""What one gateway process sees of a live canary's requests, per arm, for the canary's guards on
errors and latency (deployer/canary.py; docs/gate.md, Live canary: Guards).

A request that fails, or is merely slow, never becomes a rated episode, so the canary's test on
episodes cannot see it. While a canary is live (`ingest.routing.Fleet.canary_version`), every
completion request that reached routing (it has a sticky key, so either arm could have served it)
is counted under the canary's version and its arm: ``canary`` when the canary server served it,
else ``fleet``. Counted per arm: requests; errors, the requests the gateway answered with an upstream
failure (vLLM's own 5xx, no answer in time, the connection lost after vLLM had the request, an
error or unreadable chunk in a stream, a stream vLLM ended before ``[DONE]``, no server reachable), not a client's 4xx, nor a client that
hung up or stopped reading, nor the gateway's own refusals (every server out of rotation, no pooled
connection free: vLLM never had those); and the latency from the handler's start to the last byte
sent (a stream's too) in the buckets of ``LATENCY_BUCKETS_S`` (schemas/settings/canary.py).

The counts live in memory: nothing is written on a request's path. The gateway's rotation refresh
(ingest/app.py `follow_rotation`) flushes them every `FLUSH_EVERY_S` in a task of its own, and once
more at shutdown (`CanaryCounts.flush`), as cumulative totals since
this process started, keyed by (instance, version, arm), with ``instance`` new at every start: the
store overwrites the row (store/canaries.py `record_canary_traffic`), so a repeated or retried flush
never counts a request twice, and a store outage only delays the counts (the next flush carries
them). A process that dies loses what it counted since its last flush (at most `FLUSH_EVERY_S` of
requests); what it flushed stays in the store under its instance.
"""

from __future__ import annotations

import asyncio
import bisect
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas.settings.canary import LATENCY_BUCKETS_S
from store import ArmTraffic, CanaryStore

Key = tuple[int, str]  # (the canary's version, arm)
# How often at most the rotation refresh flushes (ingest/app.py `CanaryFlush`): the canary looks every
# gate.canary.check_every_s (10 s), and a write every refresh (0.25 s) per gateway would load the store.
FLUSH_EVERY_S = 2.0


@dataclass
class Tally:
    """One request's part in a live canary's counts, filled in as the request goes: the canary's
    version when routing began (None: no canary live, nothing counted), the arm that served it, and
    whether the gateway answered it with an upstream failure."""

    started: float = field(default_factory=time.perf_counter)
    version: int | None = None
    arm: str = "fleet"
    error: bool = False


@dataclass
class _Counts:
    requests: int = 0
    errors: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))

    def frozen(self) -> ArmTraffic:
        return ArmTraffic(self.requests, self.errors, tuple(self.buckets))


def bucket(latency_s: float) -> int:
    """The index of the latency bucket `latency_s` falls in (an upper bound includes itself, as a
    Prometheus ``le``); len(LATENCY_BUCKETS_S) is +inf."""
    return bisect.bisect_left(LATENCY_BUCKETS_S, latency_s)


class CanaryCounts:
    """This process's counts per (canary version, arm), and what of them the store has. Used on the
    event loop only: `changed` snapshots there, the store write runs in a thread, `flushed` is
    called back on the loop."""

    def __init__(
        self, instance: str | None = None, on_count: Callable[[str, bool, float], None] | None = None
    ) -> None:
        self.instance = instance or uuid.uuid4().hex  # new per process start
        self._counts: dict[Key, _Counts] = {}
        self._stored: dict[Key, ArmTraffic] = {}
        self._on_count = on_count  # (arm, error, latency_s): the gateway's own metrics

    def record(self, tally: Tally, ended: float | None = None) -> None:
        """Count the request of `tally`, ended now (perf_counter) or at `ended`; nothing without a version."""
        if tally.version is None:
            return
        latency_s = max(0.0, (time.perf_counter() if ended is None else ended) - tally.started)
        counts = self._counts.setdefault((tally.version, tally.arm), _Counts())
        counts.requests += 1
        counts.errors += int(tally.error)
        counts.buckets[bucket(latency_s)] += 1
        if self._on_count is not None:
            self._on_count(tally.arm, tally.error, latency_s)

    def totals(self) -> dict[Key, ArmTraffic]:
        """Every count since this process started."""
        return {key: counts.frozen() for key, counts in self._counts.items()}

    def changed(self) -> dict[Key, ArmTraffic]:
        """The totals the store does not have yet."""
        return {key: now for key, now in self.totals().items() if self._stored.get(key) != now}

    def flushed(self, sent: dict[Key, ArmTraffic]) -> None:
        """The store took `sent` (a `changed` snapshot)."""
        self._stored.update(sent)

    async def flush(self, store: CanaryStore) -> int:
        """Write the changed totals to the store (in a thread); how many rows. Raises what the store
        raises, and then the same totals, or newer ones, go with the next flush."""
        sent = self.changed()
        if sent:
            await asyncio.to_thread(store.record_canary_traffic, self.instance, sent)
            self.flushed(sent)
        return len(sent)
