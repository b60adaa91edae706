"""The live canary: the users have the last word (docs/gate.md, Live canary).

After the offline gate passes a challenger, `run` puts it on the canary server
(``vllm.canary_server``) with the verified swap, out of the gateways' rotation while it loads, then
into it: the gateways send ``gate.canary.share`` of users there (sticky per user, else per episode,
ingest/routing.py) and the rest to the champion fleet. Every ``check_every_s`` it reads the settled,
rated episodes each version served since the canary began (`Store.live_episodes`) and asks the
always-valid sequential test (evals/sequential.py) about challenger − champion on the users' reward
(or on one scored term of it, ``gate.canary.primary``: an outcome or a judge, so that thumbs alone
cannot carry a challenger that loses on the outcome), normalised to 0..1, with guards that stop it at once:
under ``primary`` "spec" (the default) the reward spec's primary term (`RewardSpec.primary`) must not be
confidently worse than −margin, once both arms have ``min_episodes`` episodes carrying it (without them the
reward alone decides, the guard noted "no data"); the share of non-answers
(``gate.alarms.no_action_pattern``) and of completions cut off by max_tokens, on the same episodes;
the share of requests answered with an upstream failure and the p95 latency, on the gateways' counts
per arm (`Store.canary_traffic`: failed and slow requests never become episodes). The canary ends when
the test decides (``passed``, ``failed``), at ``max_episodes`` per arm or ``max_duration_s``
(``inconclusive``), when an operator stops it (``rtrl deploy canary stop``: ``stopped``) or when the
worker is stopping (``aborted``). On every ending the canary server leaves the rotation at once, so
the canary's users go back to the champion: requests already on the canary server finish there, and
no request fails. Only ``passed`` lets the chain promote the fleet (worker/chain.py).

Every look recomputes the test from the first episode (ordered by settlement), which is the same
sequence as feeding each episode as it settled: confidence sequences may be read at every
observation, so looking every ``check_every_s`` costs no error rate. Feedback that arrives after
the canary ended still lands on the episode, and so on the version that served it: episodes carry
the version the gateway attributed the generation to, not the version serving now.

One canary at a time per store (the store's ``running_slot``), and its runner holds the "canary"
lock (`rollout_lock`) for the whole run. When the runner dies (a killed worker), the fleet reconciler
finds the lock free and the record running, takes the canary server out of rotation and ends the
record ``aborted`` (`reap`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from deployer import metrics
from deployer.errors import GateError, RolloutBusy
from deployer.swap import NO_WAIT, LockWait, rollout_lock, server_client, swap_server, swap_window, target
from evals.sequential import Decision, Guard, SequentialTest
from registry import Registry
from schemas.events import FeedbackKind
from schemas.rewards import RewardSpec, get_spec
from schemas.settings import Settings
from schemas.settings.canary import CANARY_STALE_REFRESHES, LATENCY_BUCKETS_S
from serving import CallFailed, ServerError, ServingError
from store import ArmTraffic, CanaryRecord, LiveEpisode, Store, StoreError

log = logging.getLogger(__name__)

CANARY_LOCK = "canary"
Ending = Literal["passed", "failed", "inconclusive", "stopped", "aborted"]
_ENDINGS: dict[str, Ending] = {"pass": "passed", "fail": "failed", "inconclusive": "inconclusive"}


class CanaryOutcome(BaseModel):
    """How a canary ended, with the numbers that decided it."""

    model_config = ConfigDict(frozen=True)

    canary_id: int
    version: int
    champion: int
    state: Ending
    reason: str
    episodes: dict[str, int]  # rated episodes per arm: challenger, champion
    duration_s: float
    decision: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return self.state == "passed"


@dataclass(frozen=True)
class Look:
    """One reading of the live arms: the test's decision and what went into it."""

    decision: Decision
    challenger: int  # rated episodes
    champion: int
    clipped: int  # rewards outside the normalising range, clipped into it
    reward_range: tuple[float, float]
    # The gateways' counts per arm and the latency guard's numbers.
    traffic: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The spec's primary-term guard (primary "spec"): its term, episodes carrying it per arm, status.
    primary: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision.as_dict(),
            "episodes": {"challenger": self.challenger, "champion": self.champion},
            "clipped": self.clipped,
            "reward_range": list(self.reward_range),
            "traffic": self.traffic,
            "primary": self.primary,
        }


def p95(buckets: tuple[int, ...]) -> float | None:
    """The 95th percentile of the latencies counted in `buckets` (``LATENCY_BUCKETS_S`` then +inf), as
    Prometheus's histogram_quantile reads a histogram: linear within the bucket it falls in, the last
    finite bound when it falls in +inf. None without a request."""
    total = sum(buckets)
    if total == 0:
        return None
    rank, below, lower = 0.95 * total, 0, 0.0
    for upper, count in zip(LATENCY_BUCKETS_S, buckets, strict=False):
        if count and below + count >= rank:
            return lower + (upper - lower) * (rank - below) / count
        below, lower = below + count, upper
    return LATENCY_BUCKETS_S[-1]


def _latency_trip(
    settings: Settings, canary: ArmTraffic, fleet: ArmTraffic
) -> tuple[str | None, dict[str, Any]]:
    """The latency guard (a threshold, not a sequential test: docs/gate.md, Guards): why it trips, or
    None, with its numbers."""
    c = settings.gate.canary
    mine, theirs = p95(canary.latency_buckets), p95(fleet.latency_buckets)
    numbers = {"canary_p95_s": mine, "fleet_p95_s": theirs, "min_requests": c.latency_min_requests}
    if mine is None or theirs is None or min(canary.requests, fleet.requests) < c.latency_min_requests:
        return None, numbers
    if mine > c.latency_ratio * theirs and mine - theirs > c.latency_min_increase_s:
        return (
            f"guard latency: canary p95 {mine:.3f}s > {c.latency_ratio:g} x fleet p95 {theirs:.3f}s and "
            f"more than {c.latency_min_increase_s:g}s slower (n {canary.requests} canary / {fleet.requests} "
            "fleet requests)"
        ), numbers
    return None, numbers


def reward_range(settings: Settings) -> tuple[float, float]:
    """The range the primary metric is normalised from. For ``reward``: ``gate.canary.reward_range``,
    else the reward spec's declared range, else [-1, 1]. For a scored term: its weight times its
    kind's value range (the judge term: ± its weight), or ``gate.canary.reward_range`` when set."""
    c = settings.gate.canary
    spec = get_spec(settings.labeler.reward_spec)
    if c.reward_range is not None:
        return c.reward_range
    if c.primary in ("reward", "spec"):  # "spec": the reward decides, its primary term guards
        return spec.reward_range if spec.reward_range is not None else (-1.0, 1.0)
    if c.primary == "judge":
        weight = spec.judge.weight if spec.judge is not None else 0.0
    else:
        weight = spec.weights[FeedbackKind(c.primary)]
        low, high = spec.value_range[FeedbackKind(c.primary)]
        ends = sorted((weight * low, weight * high))
        if ends[0] < ends[1]:
            return ends[0], ends[1]
    if weight == 0.0:
        raise GateError(
            f"gate.canary.primary={c.primary} but reward spec {spec.spec_id} gives it no weight: set "
            "gate.canary.reward_range, or a primary the spec scores"
        )
    return -abs(weight), abs(weight)


def _value(settings: Settings, episode: LiveEpisode) -> float | None:
    """The episode's primary metric, or None when it has no such term."""
    primary = settings.gate.canary.primary
    return episode.reward if primary in ("reward", "spec") else episode.components.get(primary)


PRIMARY_GUARD = "primary"


def _primary_guard(settings: Settings) -> tuple[Guard | None, RewardSpec]:
    """The guard on the spec's primary term under ``gate.canary.primary`` "spec" (None otherwise, or
    when the spec names no primary): non-inferior within ``margin`` at ``guard_alpha``, deciding
    nothing before both arms have ``min_episodes`` episodes carrying the term (docs/gate.md, Guards)."""
    c = settings.gate.canary
    spec = get_spec(settings.labeler.reward_spec)
    if c.primary != "spec" or spec.primary is None:
        return None, spec
    return Guard(PRIMARY_GUARD, c.margin, c.guard_alpha, decrease=True, min_n=c.min_episodes), spec


def _primary_values(spec: RewardSpec, episodes: list[LiveEpisode]) -> list[float]:
    """The primary term of the episodes that carry it, mapped from the term's range onto 0..1."""
    low, high = spec.primary_range()
    span = (high - low) or 1.0  # a scored kind's value_range may be one point
    values = [spec.primary_value(e.components) for e in episodes]
    return [(min(max(v, low), high) - low) / span for v in values if v is not None]


def _primary_note(
    settings: Settings, spec: RewardSpec, decision: Decision, carried: tuple[int, int]
) -> dict[str, Any]:
    """The primary guard's record: its term, the episodes carrying it per arm (`carried`: challenger,
    champion), and its status."""
    c = settings.gate.canary
    if c.primary != "spec":
        return {"status": f"off (gate.canary.primary={c.primary} decides)"}
    if spec.primary is None:
        return {"status": f"off (reward spec {spec.spec_id} names no primary)"}
    tripped = any(r.tripped for r in decision.guards if r.guard.name == PRIMARY_GUARD)
    status = "no data" if min(carried) < c.min_episodes else "tripped" if tripped else "watching"
    return {
        "term": spec.primary,
        "episodes": {"challenger": carried[0], "champion": carried[1]},
        "status": status,
    }


def look(
    settings: Settings,
    episodes: list[LiveEpisode],
    challenger: int,
    champion: int,
    traffic: Mapping[str, ArmTraffic] | None = None,
) -> Look:
    """The sequential test over the rated episodes of both arms, in their order, with the guards on
    the gateways' counts per arm (`traffic`: canary, fleet; None: none counted). Pure: no I/O."""
    c = settings.gate.canary
    low, high = reward_range(settings)
    pattern = re.compile(settings.gate.alarms.no_action_pattern)
    arms: dict[int, list[LiveEpisode]] = {challenger: [], champion: []}
    values: dict[int, list[float]] = {challenger: [], champion: []}
    for episode in episodes:
        value = _value(settings, episode)
        if episode.policy_number in arms and value is not None:
            arms[episode.policy_number].append(episode)
            values[episode.policy_number].append(value)
    rewards = {v: np.array(values[v], dtype=float) for v in arms}
    clipped = int(sum(np.count_nonzero((r < low) | (r > high)) for r in rewards.values()))
    scaled = {v: (np.clip(r, low, high) - low) / (high - low) for v, r in rewards.items()}
    primary_guard, spec = _primary_guard(settings)
    test = SequentialTest(
        alpha=c.alpha,
        margin=c.margin,
        min_n=c.min_episodes,
        max_n=c.max_episodes,
        guards=(
            Guard("non_answer", c.non_answer_increase, c.guard_alpha),
            Guard("truncation", c.truncation_increase, c.guard_alpha),
            *((primary_guard,) if primary_guard is not None else ()),
        ),
        count_guards=(Guard("errors", c.error_increase, c.guard_alpha),),
    )
    guards: dict[str, Callable[[LiveEpisode], bool]] = {
        "non_answer": lambda e: any(pattern.search(text) for text in e.completions),
        "truncation": lambda e: "length" in e.finish_reasons,
    }
    for name, hit in guards.items():  # guards first: they stop the canary before min_episodes too
        if not test.decision.final:
            test.update_guard(
                name, [float(hit(e)) for e in arms[challenger]], [float(hit(e)) for e in arms[champion]]
            )
    carried = (_primary_values(spec, arms[challenger]), _primary_values(spec, arms[champion]))
    if primary_guard is not None and not test.decision.final:
        test.update_guard(PRIMARY_GUARD, *carried)
    canary, fleet = (traffic or {}).get("canary", ArmTraffic()), (traffic or {}).get("fleet", ArmTraffic())
    if not test.decision.final:
        test.set_guard_counts("errors", (canary.errors, canary.requests), (fleet.errors, fleet.requests))
    tripped, latency = _latency_trip(settings, canary, fleet)
    decision = test.decision
    if tripped is not None and not decision.final:
        decision = dataclasses.replace(decision, outcome="fail", cause="guard", reason=tripped)
    elif not decision.final:
        decision = test.update(scaled[challenger], scaled[champion])
    counts = {
        arm: {"requests": t.requests, "errors": t.errors, "latency_buckets": list(t.latency_buckets)}
        for arm, t in (("canary", canary), ("fleet", fleet))
    }
    numbers = {**counts, "latency": {**latency, "tripped": tripped is not None}}
    primary = _primary_note(settings, spec, decision, (len(carried[0]), len(carried[1])))
    if decision.cause != "guard" and decision.final and primary.get("status") == "no data":
        note = (  # the reward decided alone: said beside its verdict
            f"guard {PRIMARY_GUARD} ({spec.primary}): no data, n {len(carried[0])} challenger / "
            f"{len(carried[1])} champion below min_episodes {c.min_episodes}"
        )
        decision = dataclasses.replace(decision, reason=f"{decision.reason}; {note}")
    arm_sizes = (len(arms[challenger]), len(arms[champion]))
    return Look(decision, *arm_sizes, clipped, (low, high), numbers, primary=primary)


def read(settings: Settings, store: Store, record: CanaryRecord) -> Look:
    """The canary's arms as the store has them now."""
    episodes = store.live_episodes((record.challenger_version, record.champion_version), record.started_at)
    traffic = store.canary_traffic(record.challenger_version)
    return look(settings, episodes, record.challenger_version, record.champion_version, traffic)


def run(
    settings: Settings,
    registry: Registry,
    store: Store,
    version: int,
    champion: int,
    *,
    cycle_id: int | None = None,
    stopping: Callable[[], bool] = lambda: False,
    lock_wait: LockWait = NO_WAIT,
) -> CanaryOutcome:
    """Serve `version` to the canary's share of users until the test, a guard, a limit, an operator
    or `stopping` ends it; the traffic is back on the champion when this returns or raises.
    Raises RolloutBusy when another process (a canary, the reconciler's `reap`) holds the lock past
    `lock_wait` (`NO_WAIT`: at once), CanaryRunning (store) when a record says one runs."""
    url = settings.vllm.canary_server
    if url is None:
        raise ServerError("vllm.canary_server", "gate.canary needs vllm.canary_server")
    c = settings.gate.canary
    with lock_wait.hold(store, CANARY_LOCK, f"canary v{version}"):
        stale = store.running_canary()
        if stale is not None:  # we hold the lock: no process runs it any more
            store.end_canary(
                stale.id, "aborted", "found running with no runner when the next canary began", None
            )
        record = store.start_canary(registry.model_name, version, champion, url, c.share, cycle_id)
        started = time.monotonic()
        metrics.CANARY_RUNNING.set(1)
        state: Ending = "aborted"
        reason = "the canary's runner raised"
        last: Look | None = None
        try:
            _serve(settings, registry, store, url, version)
            log.info("canary #%d: v%d serves %.0f%% of users on %s", record.id, version, c.share * 100, url)
            state, reason, last = _watch(settings, store, record, stopping)
        except (ServingError, CallFailed) as exc:
            state, reason = "failed", f"the canary server could not serve v{version}: {exc}"
        except BaseException as exc:
            reason = f"the canary's runner raised {type(exc).__name__}: {exc}"[:4000]
            raise
        finally:
            _withdraw(store, url, f"canary #{record.id} of v{version} ended")
            decision = None if last is None else last.as_dict()
            store.end_canary(record.id, state, reason, decision)
            metrics.CANARY_RUNNING.set(0)
            metrics.CANARY_ENDINGS.labels(state).inc()
    counts = {"challenger": 0, "champion": 0} if last is None else last.as_dict()["episodes"]
    log.warning("canary #%d of v%d %s: %s", record.id, version, state, reason)
    _tag(registry, version, record.id, state, reason)
    return CanaryOutcome(
        canary_id=record.id,
        version=version,
        champion=champion,
        state=state,
        reason=reason,
        episodes=counts,
        duration_s=round(time.monotonic() - started, 3),
        decision=decision,
    )


def _tag(registry: Registry, version: int, canary_id: int, state: str, reason: str) -> None:
    """The canary's ending on the version in MLflow, beside the gate's tags (best effort: the store
    has the record)."""
    try:
        registry.tag_version(
            version, {"canary": state, "canary_id": str(canary_id), "canary_reason": reason[:4000]}
        )
    except Exception as exc:  # noqa: BLE001 - MLflow down must not undo the canary's decision
        log.error("could not tag v%d with its canary's ending (%r); the store has it", version, exc)


def _serve(settings: Settings, registry: Registry, store: Store, url: str, version: int) -> None:
    """Load `version` on the canary server with the verified swap while it is out of rotation, then
    put it in: from then on the gateways route the canary's share there."""
    store.set_rotation(url, False, f"canary: loading v{version}")
    want = target(settings, registry, store, version)
    time.sleep(withdraw_wait_s(settings))  # no gateway sends it a user any more, even on a stale view
    with server_client(settings, url) as server:
        if server.is_paused():  # a runner that died mid-swap left it paused
            server.resume()
        with swap_window(settings, store, server, f"canary v{version}", drain=False) as window:
            step, _ = swap_server(server, want, settings, restore=None)
            if step.verified:
                window.serving = version
    metrics.record_swap(url.rstrip("/"), step.verified, step.restored, step.pause_ms, window.serving)
    if not step.verified:
        raise ServerError(url, f"v{version} did not verify on the canary server: {step.error}")
    store.set_rotation(url, True, f"canary: serving v{version}")


def withdraw_wait_s(settings: Settings) -> float:
    """How long after taking the canary out of rotation no gateway sends it a user: a gateway keeps
    a canary's users on it while its view is younger than `CANARY_STALE_REFRESHES` refresh intervals
    (ingest/routing.py), so that a slow store read does not move them to the fleet and back."""
    return CANARY_STALE_REFRESHES * settings.gateway.rotation_refresh_s + 0.05


def _watch(
    settings: Settings, store: Store, record: CanaryRecord, stopping: Callable[[], bool]
) -> tuple[Ending, str, Look | None]:
    c = settings.gate.canary
    deadline = time.monotonic() + c.max_duration_s
    last: Look | None = None
    while True:
        try:
            ended = _look_once(settings, store, record)
        except StoreError as exc:  # a store outage: look again later; max_duration_s still bounds the canary
            log.warning(
                "canary #%d: cannot read the store (%r); looking again in %gs",
                record.id,
                exc,
                c.check_every_s,
            )
        else:
            if isinstance(ended, Look):
                last = ended
            else:
                return ended[0], ended[1], last
        if last is not None and last.decision.final and last.decision.outcome != "pass":
            return _ENDINGS[last.decision.outcome], last.decision.reason, last
        if last is not None and last.decision.final and _old_enough(settings, record):
            return "passed", last.decision.reason, last
        if time.monotonic() >= deadline:
            why = "no look succeeded" if last is None else last.decision.reason
            return "inconclusive", f"max_duration_s {c.max_duration_s:g} reached: {why}", last
        waited = 0.0
        while waited < c.check_every_s:
            if stopping():
                return (
                    "aborted",
                    "the worker is stopping (SIGTERM); the traffic returned to the champion",
                    last,
                )
            time.sleep(min(0.5, c.check_every_s - waited))
            waited += 0.5


def _look_once(settings: Settings, store: Store, record: CanaryRecord) -> Look | tuple[Ending, str]:
    """One look: the test's reading, or how the canary ends when an operator or a restart ended it."""
    now = store.canary(record.id)
    if now is not None and now.stop_requested_at is not None:
        return "stopped", f"stopped by {now.stop_requested_by}: {now.reason or 'no reason given'}"
    row = store.rotation().get(record.server.rstrip("/"))
    if row is None or not row.in_rotation:
        why = "no record" if row is None else row.reason
        return "aborted", f"the canary server left the rotation behind the canary's back ({why})"
    with server_client(settings, record.server) as server:
        try:
            label = server.weight_version()
        except (ServingError, CallFailed) as exc:  # down: its users go to the fleet meanwhile
            log.warning("canary #%d: cannot read the canary server's version (%r)", record.id, exc)
        else:
            if label != record.challenger_version:
                return (
                    "aborted",
                    f"the canary server serves {label}, not v{record.challenger_version} (restarted?)",
                )
            # Vouch for it again: a gateway whose check of the server failed once (a timeout) stops
            # sending it users until the next announcement (ingest/routing.py `Fleet.verify`).
            store.set_serving_version(record.server, record.challenger_version, "canary: label verified")
    looked = read(settings, store, record)
    metrics.observe_canary(looked.challenger, looked.champion, looked.decision.difference, looked.traffic)
    return looked


def _old_enough(settings: Settings, record: CanaryRecord) -> bool:
    """Whether the canary ran ``min_duration_s`` (a pass waits for it; a fail or a guard does not)."""
    from schemas.clock import utcnow

    return (utcnow() - record.started_at).total_seconds() >= settings.gate.canary.min_duration_s


def _withdraw(store: Store, url: str, reason: str) -> None:
    """The canary server out of the gateways' rotation: new requests of its users go to the fleet."""
    try:
        store.set_rotation(url, False, reason)
    except Exception as exc:  # noqa: BLE001 - logged loudly; the reconciler's `reap` retries it
        log.error("could not take the canary server %s out of rotation (%r); the reconciler will", url, exc)


def reap(settings: Settings, store: Store, state: Ending = "aborted", why: str | None = None) -> str | None:
    """End a canary whose runner died (the fleet reconciler's tick; ``rtrl deploy canary stop``
    with `state` stopped): when the "canary" lock is free, a running record is ended `state` and
    the canary server leaves the rotation. Returns what it did, or None (nothing to do, or a live
    runner holds the lock)."""
    url = settings.vllm.canary_server
    if url is None:
        return None
    try:
        with rollout_lock(store, CANARY_LOCK, "end an orphaned canary"):
            running = store.running_canary()
            row = store.rotation().get(url.rstrip("/"))
            if running is None and (row is None or not row.in_rotation):
                return None
            store.set_rotation(url, False, "canary: no runner")
            if running is None:
                return f"took {url} out of rotation: no canary runs"
            reason = (
                why
                or "its runner died (no process held the canary lock); the traffic returned to the champion"
            )
            store.end_canary(running.id, state, reason, None)
            metrics.CANARY_ENDINGS.labels(state).inc()
            return f"ended canary #{running.id} of v{running.challenger_version}: {reason}"
    except RolloutBusy:
        return None
