"""The live canary's records: which challenger serves a share of live traffic, how it ended, and
the rated live episodes its sequential test reads.

After the offline gate passes, the deployer starts a canary (`start_canary`): the challenger serves
``share`` of live episodes on the canary server while the champion serves the rest, until the
canary's test decides, a guard trips, or an operator asks it to stop (`request_canary_stop`,
``rtrl deploy canary stop``); the loop then ends it (`end_canary`) with its decision and numbers.
At most one canary runs per store: a unique ``running_slot`` (1 while running, NULL once ended)
makes that hold inside the database, as ``cycles.active_slot`` does for cycles (store/cycles.py),
so two deployers racing on PostgreSQL cannot both start one. Ending is a conditional UPDATE of a
running row: when the canary loop and a reconciler race, the first ending wins and the second
reads it back unchanged.

`live_episodes` is what the test compares: settled, rated episodes of the two versions since the
canary began, ordered by (settled_at, episode_id) so that a later read extends an earlier one.
Times come from the store's clock.

`record_canary_traffic` and `canary_traffic` hold what the gateways saw of a live canary's requests,
which never become episodes when they fail or are merely slow: per gateway process (an instance id
new at every start), canary version and arm (canary | fleet), the process's cumulative requests,
errors and latency-bucket counts. A flush overwrites its rows (an upsert that never lowers a count),
so a flush repeated or retried after a store outage never counts a request twice; `canary_traffic`
sums the instances (deployer/canary.py's errors and latency guards).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import case, exists, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from schemas.events import CONTROL_KINDS
from schemas.settings.canary import LATENCY_BUCKETS_S, TRAFFIC_ARMS
from store.base import StoreBase, upsert
from store.errors import CanaryRunning, DatabaseError, StoreError
from store.models import CANARY_FINAL_STATES, Canary, CanaryTraffic, Episode, Feedback, Interaction

_RUNNING_SLOT = 1
SEGMENT_CHUNK = 500  # episode ids per query for their segments (bounded IN lists)


@dataclass(frozen=True)
class CanaryRecord:
    """One canary as the store holds it (what `rtrl deploy canary status` prints)."""

    id: int
    model: str
    challenger_version: int
    champion_version: int
    server: str
    share: float
    cycle_id: int | None
    state: str  # running | passed | failed | inconclusive | stopped | aborted
    reason: str
    decision: dict[str, Any] | None
    started_at: datetime
    ended_at: datetime | None
    stop_requested_at: datetime | None
    stop_requested_by: str | None

    @property
    def running(self) -> bool:
        return self.state == "running"


@dataclass(frozen=True)
class LiveEpisode:
    """A settled, rated live episode of one of the canary's two versions, as its test reads it."""

    episode_id: str
    tenant: str
    policy_number: int
    reward: float
    settled_at: datetime
    completions: tuple[str, ...]  # the completion text of each segment, by segment_index
    finish_reasons: tuple[str | None, ...]  # and its finish reason (stop, length, ...)
    components: dict[str, float] = field(
        default_factory=dict
    )  # the reward's terms, by name (reward_components)


@dataclass(frozen=True)
class ArmTraffic:
    """Requests of a live canary's arm as the gateways counted them: how many, how many were answered
    with an upstream failure, and how many fell in each latency bucket (``LATENCY_BUCKETS_S`` then
    +inf; not cumulative)."""

    requests: int = 0
    errors: int = 0
    latency_buckets: tuple[int, ...] = (0,) * (len(LATENCY_BUCKETS_S) + 1)

    def __add__(self, other: ArmTraffic) -> ArmTraffic:
        size = max(len(self.latency_buckets), len(other.latency_buckets))
        mine = self.latency_buckets + (0,) * (size - len(self.latency_buckets))
        theirs = other.latency_buckets + (0,) * (size - len(other.latency_buckets))
        return ArmTraffic(
            self.requests + other.requests,
            self.errors + other.errors,
            tuple(a + b for a, b in zip(mine, theirs, strict=True)),
        )


def _record(row: Canary) -> CanaryRecord:
    return CanaryRecord(
        id=row.id,
        model=row.model,
        challenger_version=row.challenger_version,
        champion_version=row.champion_version,
        server=row.server,
        share=row.share,
        cycle_id=row.cycle_id,
        state=row.state,
        reason=row.reason,
        decision=row.decision,
        started_at=row.started_at,
        ended_at=row.ended_at,
        stop_requested_at=row.stop_requested_at,
        stop_requested_by=row.stop_requested_by,
    )


def _running_error(running: CanaryRecord | None) -> CanaryRunning:
    if running is None:  # it ended between the refused insert and this read
        return CanaryRunning(
            "another canary started at the same moment; look again with `rtrl deploy canary status`"
        )
    return CanaryRunning(
        f"canary #{running.id} of v{running.challenger_version} is running since "
        f"{running.started_at.isoformat()}; `rtrl deploy canary stop` ends it"
    )


class CanaryStore(StoreBase):
    """The live canary's runs and the live episodes it judges (see the module docstring)."""

    def start_canary(
        self,
        model: str,
        challenger_version: int,
        champion_version: int,
        server: str,
        share: float,
        cycle_id: int | None = None,
    ) -> CanaryRecord:
        """Record a canary of `challenger_version` against `champion_version` as running from now.
        Raises CanaryRunning, naming it, when another canary runs."""
        row = Canary(
            model=model,
            challenger_version=challenger_version,
            champion_version=champion_version,
            server=server,
            share=share,
            cycle_id=cycle_id,
            state="running",
            reason="",
            decision=None,
            started_at=self.clock(),
            running_slot=_RUNNING_SLOT,
        )
        try:
            with self.transaction() as session:
                running = self._running(session)
                if running is not None:
                    raise _running_error(_record(running))
                session.add(row)
                session.flush()
                return _record(row)
        except DatabaseError as exc:
            if isinstance(exc.__cause__, IntegrityError):
                # Another deployer inserted its running canary between our read and our insert.
                raise _running_error(self.running_canary()) from None
            raise

    @staticmethod
    def _running(session: Session) -> Canary | None:
        return session.scalars(select(Canary).where(Canary.running_slot == _RUNNING_SLOT)).first()

    def running_canary(self) -> CanaryRecord | None:
        """The canary running now, or None."""
        with self.transaction() as session:
            row = self._running(session)
            return None if row is None else _record(row)

    def canary(self, canary_id: int) -> CanaryRecord | None:
        """The canary `canary_id`, or None when there is none of that id."""
        with self.transaction() as session:
            row = session.get(Canary, canary_id)
            return None if row is None else _record(row)

    def recent_canaries(self, limit: int = 10) -> list[CanaryRecord]:
        """The newest `limit` canaries, newest first."""
        with self.transaction() as session:
            rows = session.scalars(select(Canary).order_by(Canary.id.desc()).limit(limit)).all()
            return [_record(row) for row in rows]

    def request_canary_stop(self, canary_id: int, actor: str, reason: str) -> CanaryRecord:
        """Ask the running canary `canary_id` to stop: who asked and when are kept from the first
        request (a second one changes nothing), and `reason` only when no reason is set yet. The
        canary loop ends it. On an ended canary nothing changes; the record either way."""
        with self.transaction() as session:
            session.execute(
                update(Canary)
                .where(
                    Canary.id == canary_id,
                    Canary.state == "running",
                    Canary.stop_requested_at.is_(None),
                )
                .values(
                    stop_requested_at=self.clock(),
                    stop_requested_by=actor[:300],
                    reason=case((Canary.reason == "", reason), else_=Canary.reason),
                )
            )
            return self._read(session, canary_id)

    def end_canary(
        self, canary_id: int, state: str, reason: str, decision: dict[str, Any] | None
    ) -> CanaryRecord:
        """End the running canary `canary_id` in `state` (a final state) with why and its decision's
        numbers, freeing the running slot. An ended canary is returned unchanged: the first ending wins."""
        if state not in CANARY_FINAL_STATES:
            raise ValueError(f"a canary ends in one of {', '.join(CANARY_FINAL_STATES)}, not {state!r}")
        with self.transaction() as session:
            session.execute(
                update(Canary)
                .where(Canary.id == canary_id, Canary.state == "running")
                .values(
                    state=state,
                    reason=reason,
                    decision=decision,
                    ended_at=self.clock(),
                    running_slot=None,
                )
            )
            return self._read(session, canary_id)

    @staticmethod
    def _read(session: Session, canary_id: int) -> CanaryRecord:
        row = session.scalars(
            select(Canary).where(Canary.id == canary_id).execution_options(populate_existing=True)
        ).first()
        if row is None:
            raise StoreError(f"there is no canary #{canary_id}; `rtrl deploy canary status` lists them")
        return _record(row)

    def live_episodes(self, versions: tuple[int, int], since: datetime) -> list[LiveEpisode]:
        """Settled, rated episodes served by one of `versions` whose first event is at or after
        `since`, not quarantined, with their segments, ordered by (settled_at, episode_id).

        Rated: at least one feedback joined to the episode before it settled (so its reward counts
        it) of a kind that carries reward; an episode settled by the window with no rating, or only
        control kinds (``episode_end``), says nothing about the version. Late feedback is left out
        too: it joined after the reward was set (store/settle.py) and is not in it."""
        control = [kind.value for kind in CONTROL_KINDS]
        rated = exists(
            select(Feedback.event_id).where(
                Feedback.joined_episode_id == Episode.episode_id,
                Feedback.late.is_(False),
                Feedback.kind.not_in(control),
            )
        )
        with self.transaction() as session:
            episodes = session.execute(
                select(
                    Episode.episode_id,
                    Episode.tenant,
                    Episode.policy_number,
                    Episode.reward,
                    Episode.settled_at,
                    Episode.reward_components,
                )
                .where(
                    Episode.status == "settled",
                    Episode.policy_number.in_(versions),
                    Episode.first_event_at >= since,
                    Episode.reward.is_not(None),
                    Episode.settled_at.is_not(None),
                    Episode.quarantined_at.is_(None),
                    rated,
                )
                .order_by(Episode.settled_at, Episode.episode_id)
            ).all()
            segments = self._segments(session, [e.episode_id for e in episodes])
        found = []
        for episode_id, tenant, policy_number, reward, settled_at, components in episodes:
            own = segments.get(episode_id, [])
            assert reward is not None and settled_at is not None  # the query's conditions
            found.append(
                LiveEpisode(
                    episode_id=episode_id,
                    tenant=tenant,
                    policy_number=policy_number,
                    reward=reward,
                    settled_at=settled_at,
                    completions=tuple(completion for completion, _ in own),
                    finish_reasons=tuple(finish for _, finish in own),
                    components=dict(components or {}),
                )
            )
        return found

    @staticmethod
    def _segments(session: Session, ids: list[str]) -> dict[str, list[tuple[str, str | None]]]:
        """(completion, finish_reason) of each episode's segments by segment_index, late ones left
        out (they arrived after it settled and are not part of its labelled trajectory)."""
        segments: dict[str, list[tuple[str, str | None]]] = {}
        for start in range(0, len(ids), SEGMENT_CHUNK):
            rows = session.execute(
                select(Interaction.episode_id, Interaction.completion, Interaction.finish_reason)
                .where(
                    Interaction.episode_id.in_(ids[start : start + SEGMENT_CHUNK]),
                    Interaction.late.is_(False),
                )
                .order_by(Interaction.episode_id, Interaction.segment_index)
            ).all()
            for episode_id, completion, finish_reason in rows:
                segments.setdefault(episode_id, []).append((completion, finish_reason))
        return segments

    # ---- the gateways' counts of a live canary's requests -----------------------------------------

    def record_canary_traffic(self, instance: str, counts: Mapping[tuple[int, str], ArmTraffic]) -> None:
        """Store gateway process `instance`'s cumulative counts, keyed by (canary version, arm), in one
        transaction. Idempotent: a row is overwritten, and never by fewer requests than it holds (a
        stale flush that lands late changes nothing)."""
        if not counts:
            return
        now = self.clock()
        with self.transaction() as session:
            for (version, arm), traffic in sorted(counts.items()):
                if arm not in TRAFFIC_ARMS:
                    raise ValueError(f"arm must be one of {', '.join(TRAFFIC_ARMS)}, not {arm!r}")
                values = {
                    "instance": instance,
                    "version": version,
                    "arm": arm,
                    "requests": traffic.requests,
                    "errors": traffic.errors,
                    "latency_buckets": list(traffic.latency_buckets),
                    "updated_at": now,
                }
                session.execute(
                    upsert(
                        self.dialect,
                        CanaryTraffic,
                        values,
                        ["instance", "version", "arm"],
                        only_if=lambda excluded: CanaryTraffic.requests <= excluded.requests,
                    )
                )

    def canary_traffic(self, version: int) -> dict[str, ArmTraffic]:
        """The gateways' counts of the canary of `version`, per arm (every arm of ``TRAFFIC_ARMS``,
        zero where none was counted), summed over the gateway processes."""
        totals = {arm: ArmTraffic() for arm in TRAFFIC_ARMS}
        with self.transaction() as session:
            rows = session.execute(
                select(
                    CanaryTraffic.arm,
                    CanaryTraffic.requests,
                    CanaryTraffic.errors,
                    CanaryTraffic.latency_buckets,
                ).where(CanaryTraffic.version == version)
            ).all()
        for arm, requests, errors, buckets in rows:
            if arm in totals:
                totals[arm] = totals[arm] + ArmTraffic(requests, errors, tuple(int(b) for b in buckets))
        return totals
