"""Prometheus metrics of the eval gate and the deployer (the worker runs both; the reconciler runs
the fleet checks). Served by the exporter of whichever process moves them (telemetry/);
docs/metrics.md gives each with its unit.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

GATE_DECISIONS = Counter(
    "rtrl_gate_decisions_total", "Eval gate decisions, by decision (pass, fail).", ["decision"]
)
GATE_SCORE = Gauge(
    "rtrl_gate_score", "Mean score of the last gate's evaluation, by model (challenger, champion).", ["model"]
)
GATE_LAST = Gauge("rtrl_gate_last_decision", "The last gate decision: 1 pass, 0 fail.")
GATE_LAST_AT = Gauge("rtrl_gate_last_decision_timestamp_seconds", "Unix time of the last gate decision.")
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
    "rtrl_deployer_champion_version", "The @champion version at the last fleet check or promotion."
)
FLEET_AGREES = Gauge(
    "rtrl_deployer_fleet_agreement",
    "1 when every server (fleet and staging) served @champion after the last fleet check, else 0.",
)
RECONCILE = Counter(
    "rtrl_deployer_reconcile_total",
    "Fleet checks by outcome: aligned (nothing to do), changed (servers swapped, relabelled, resumed, returned or "
    "restarted), error (a server could not be aligned), busy (a rollout held the fleet), failed (the check itself failed).",
    ["outcome"],
)
RESTARTS = Counter(
    "rtrl_deployer_server_restarts_total",
    "Local vLLM servers the reconciler restarted, by server.",
    ["server"],
)


def record_gate(passed: bool, challenger_score: float | None, champion_score: float | None) -> None:
    GATE_DECISIONS.labels("pass" if passed else "fail").inc()
    GATE_LAST.set(1 if passed else 0)
    GATE_LAST_AT.set(time.time())
    for model, score in (("challenger", challenger_score), ("champion", champion_score)):
        if score is not None:
            GATE_SCORE.labels(model).set(score)
