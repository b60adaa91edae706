"""Prometheus metrics of the eval gate and the deployer (the worker runs both; the reconciler runs
the fleet checks). Served by the exporter of whichever process moves them (telemetry/);
docs/metrics.md gives each with its unit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

GATE_DECISIONS = Counter(
    "rtrl_gate_decisions_total",
    "Eval gate decisions, by decision (pass, fail) and cause (non_inferior, inferior, alarm, inconclusive, "
    "challenger_not_loaded; docs/gate.md).",
    ["decision", "cause"],
)
GATE_SCORE = Gauge(
    "rtrl_gate_score",
    "Mean score of the last gate's evaluation, by model (challenger, champion); NaN when the model was not scored.",
    ["model"],
)
GATE_LAST = Gauge(
    "rtrl_gate_last_decision", "The last gate decision: 1 pass, 0 fail (NaN before this process's first)."
)
GATE_LAST_AT = Gauge(
    "rtrl_gate_last_decision_timestamp_seconds",
    "Unix time of the last gate decision (NaN before this process's first).",
)
SWAP_WINDOW = Histogram(
    "rtrl_deployer_swap_window_seconds",
    "A server's pause window during a swap (pause to resume: it served nothing), by server.",
    ["server"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
SWAPS = Counter(
    "rtrl_deployer_swaps_total",
    "Server swaps by outcome: verified, restored (failed verification, put back), failed (the server did not answer).",
    ["outcome"],
)
ROLLOUTS = Counter(
    "rtrl_deployer_rollouts_total",
    "Fleet promotions (and rollbacks) by outcome: ok, failed (the fleet is back on the previous champion).",
    ["outcome"],
)
SERVER_VERSION = Gauge(
    "rtrl_deployer_server_weight_version",
    "The weight version a server serves, as this process last saw it (set after each swap and each fleet check).",
    ["server"],
)
SERVER_UP = Gauge(
    "rtrl_deployer_server_up", "1 when a server answered the last fleet check, else 0.", ["server"]
)
CHAMPION = Gauge(
    "rtrl_deployer_champion_version",
    "The @champion version at this process's last fleet check or promotion (NaN before either).",
)
FLEET_AGREES = Gauge(
    "rtrl_deployer_fleet_agreement",
    "1 when every server (fleet and staging) served @champion at the reconciler's last fleet check, else 0 (NaN in "
    "processes that do not check the fleet).",
)
RECONCILE = Counter(
    "rtrl_deployer_reconcile_total",
    "Fleet checks by outcome: aligned (nothing to do), changed (servers swapped, relabelled, resumed, returned or "
    "restarted), error (a server could not be aligned), busy (a rollout held the fleet), failed (the check itself failed).",
    ["outcome"],
)
ALIAS_REFUSED = Counter(
    "rtrl_deployer_alias_refused_total",
    "Times the reconciler found @champion moved outside rtrl (to a version rtrl did not promote) and put it back "
    "(deployer/trust.py; alert RtrlChampionAliasMoved).",
)
RESTARTS = Counter(
    "rtrl_deployer_server_restarts_total",
    "Local vLLM servers the reconciler restarted, by server.",
    ["server"],
)
ARTEFACTS_PRUNED = Counter(
    "rtrl_artefacts_pruned_total",
    "Artefacts retention deleted, by kind: checkpoint (a cycle's checkpoint or ranks' work directory), download "
    "(the deployer's copy of a version), registry (a version the gate rejected, with its checkpoint artifacts; "
    "deployer/artefacts.py).",
    ["kind"],
)

CANARY_RUNNING = Gauge(
    "rtrl_canary_running",
    "1 while this process runs a live canary (deployer/canary.py), 0 after (NaN before its first).",
)
CANARY_ENDINGS = Counter(
    "rtrl_canary_endings_total",
    "Live canaries by how they ended: passed, failed (the test or a guard), inconclusive (a limit), stopped "
    "(an operator), aborted (the worker stopped, or the reconciler found its runner dead).",
    ["state"],
)
CANARY_EPISODES = Gauge(
    "rtrl_canary_episodes",
    "Rated episodes of the running canary's last look, by arm (challenger, champion).",
    ["arm"],
)
CANARY_BOUND = Gauge(
    "rtrl_canary_difference_bound",
    "The running canary's confidence sequence for challenger − champion on the normalised reward, by bound "
    "(low, high); NaN before its first look.",
    ["bound"],
)

CANARY_REQUESTS = Gauge(
    "rtrl_canary_requests",
    "Requests of the running canary's users the gateways counted by its last look, by arm (canary: served by "
    "the canary server, fleet) and kind (all, errors: answered with an upstream failure).",
    ["arm", "kind"],
)
CANARY_LATENCY_P95 = Gauge(
    "rtrl_canary_latency_p95_seconds",
    "p95 latency (gateway handler start to last byte) of the running canary's requests by its last look, by "
    "arm; NaN before a request was counted.",
    ["arm"],
)


# Every outcome of the counters exists from the start (at 0): a first failure is an increase a rule sees.
for _decision, _cause in (
    ("pass", "non_inferior"),
    ("fail", "inferior"),
    ("fail", "alarm"),
    ("fail", "inconclusive"),
    ("fail", "challenger_not_loaded"),
):
    GATE_DECISIONS.labels(_decision, _cause)
for _outcome in ("verified", "restored", "failed"):
    SWAPS.labels(_outcome)
for _outcome in ("ok", "failed"):
    ROLLOUTS.labels(_outcome)
for _outcome in ("aligned", "changed", "error", "busy", "failed"):
    RECONCILE.labels(_outcome)
for _state in ("passed", "failed", "inconclusive", "stopped", "aborted"):
    CANARY_ENDINGS.labels(_state)
for _kind in ("checkpoint", "download", "registry"):
    ARTEFACTS_PRUNED.labels(_kind)

# Unlabelled gauges exist from import in every process that imports this module: NaN, not 0, until
# this process sets them, so `== 0` alerts and min() across processes see only real values.
for _unset in (GATE_LAST, GATE_LAST_AT, CHAMPION, FLEET_AGREES, CANARY_RUNNING):
    _unset.set(math.nan)
for _bound in ("low", "high"):
    CANARY_BOUND.labels(_bound).set(math.nan)
for _arm in ("canary", "fleet"):
    CANARY_LATENCY_P95.labels(_arm).set(math.nan)


def record_gate(
    passed: bool, cause: str, challenger_score: float | None, champion_score: float | None
) -> None:
    """One decision of the gate; `cause` as deployer/gate.py `cause`."""
    GATE_DECISIONS.labels("pass" if passed else "fail", cause).inc()
    GATE_LAST.set(1 if passed else 0)
    GATE_LAST_AT.set(time.time())
    for model, score in (("challenger", challenger_score), ("champion", champion_score)):
        GATE_SCORE.labels(model).set(math.nan if score is None else score)


def record_swap(url: str, verified: bool, restored: bool, pause_ms: float, serving: int | None) -> None:
    """One server's swap (a promotion's, a rollback's or the reconciler's realignment)."""
    SWAPS.labels("verified" if verified else "restored" if restored else "failed").inc()
    if pause_ms > 0:
        SWAP_WINDOW.labels(url.rstrip("/")).observe(pause_ms / 1000)
    if serving is not None:
        SERVER_VERSION.labels(url.rstrip("/")).set(serving)


def observe_canary(
    challenger: int, champion: int, difference: Any, traffic: Mapping[str, Any] | None = None
) -> None:
    """One look of the running canary: its arms' sizes, the bounds of challenger − champion (an
    `evals.sequential.Difference`) and the gateways' counts (`deployer.canary.Look.traffic`)."""
    CANARY_EPISODES.labels("challenger").set(challenger)
    CANARY_EPISODES.labels("champion").set(champion)
    CANARY_BOUND.labels("low").set(difference.low)
    CANARY_BOUND.labels("high").set(difference.high)
    if not traffic:
        return
    for arm in ("canary", "fleet"):
        CANARY_REQUESTS.labels(arm, "all").set(traffic[arm]["requests"])
        CANARY_REQUESTS.labels(arm, "errors").set(traffic[arm]["errors"])
        p95 = traffic["latency"][f"{arm}_p95_s"]
        CANARY_LATENCY_P95.labels(arm).set(math.nan if p95 is None else p95)
