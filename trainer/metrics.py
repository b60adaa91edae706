"""Prometheus metrics of the trainer worker (served by `rtrl worker`'s exporter, telemetry/).

Set by `worker.chain.run_chain` around each cycle chain (train → gate → deploy); the gate's and
the swaps' own families are in deployer/metrics.py (they move in this process too). docs/metrics.md
gives each with its unit.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

CYCLES = Counter(
    "rtrl_trainer_cycles_total",
    "Cycle chains by outcome: promoted, rejected (gate), failed, skipped (no signal), abandoned (worker stopping), "
    "busy (another cycle held the lease), not_enough_data.",
    ["status"],
)
RUNNING = Gauge("rtrl_trainer_cycle_running", "1 while this worker runs a cycle chain, else 0.")
STARTED = Gauge(
    "rtrl_trainer_cycle_started_timestamp_seconds",
    "Unix time the running cycle chain started (0 when none runs): time() − this is how long it has run.",
)
DURATION = Histogram(
    "rtrl_trainer_cycle_duration_seconds",
    "Duration of a cycle's phases in seconds: train (load champion + optimizer steps), cycle (lease to "
    "registration), gate, deploy (the rolling swap), chain (all of it).",
    ["phase"],
    buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400),
)
LAST = Gauge(
    "rtrl_trainer_last_cycle",
    "Figures of the last cycle that trained, by stat: episodes, rows, tokens, reward_mean, reward_std, "
    "advantage_mean, advantage_abs_mean, is_weight_mean (truncated behaviour weight), clip_fraction, kl (k3, last "
    "step), steps, data_age_seconds (policy lag: the oldest episode's age when the cycle started), "
    "data_to_deploy_seconds, mismatch_outside_band (share of tokens whose raw pi_old/mu is outside [0.9, 1.1]), "
    "mismatch_ratio_max, mismatch_abs_log_ratio_mean; under a reward spec with a hindsight term, hindsight_episodes "
    "(episodes distilled from written corrections) and hindsight_gap_mean (mean teacher − student logprob per "
    "distilled token).",
    ["stat"],
)
LAST_AT = Gauge(
    "rtrl_trainer_last_cycle_timestamp_seconds",
    "Unix time rtrl_trainer_last_cycle was set (NaN until this worker trained a cycle): with several workers, the newest.",
)
BATCH_REWARD = Gauge(
    "rtrl_trainer_batch_reward_mean",
    "Mean reward of the episodes the last cycle trained from each champion version learnt from, by that champion "
    "version (on-policy: the version that served them).",
    ["version"],
)
CHAMPION = Gauge(
    "rtrl_trainer_champion_version",
    "The @champion version after the last cycle chain (NaN before the first).",
)
for _status in ("promoted", "rejected", "failed", "skipped", "abandoned", "busy", "not_enough_data"):
    CYCLES.labels(_status)  # every outcome exists from the start (at 0): a first failure is an increase
for _unset in (CHAMPION, LAST_AT):
    _unset.set(math.nan)  # not 0: a worker that has not trained yet knows no version (docs/metrics.md)


def cycle_started(now: float) -> None:
    RUNNING.set(1)
    STARTED.set(now)


def cycle_ended(out: dict[str, Any], chain_s: float) -> None:
    """Record a finished chain from `worker.chain.run_chain`'s result."""
    RUNNING.set(0)
    STARTED.set(0)
    CYCLES.labels(str(out.get("status"))).inc()
    DURATION.labels("chain").observe(chain_s)
    for phase, key in (
        ("train", "train_s"),
        ("cycle", "cycle_s"),
        ("gate", "gate_s"),
        ("deploy", "deploy_s"),
    ):
        if out.get(key) is not None:
            DURATION.labels(phase).observe(float(out[key]))
    if out.get("version_after") is not None:
        CHAMPION.set(int(out["version_after"]))
    steps = out.get("steps") or []
    if not out.get("episodes") or out.get("mean_reward") is None:
        return
    stats = {
        "episodes": out["episodes"],
        "rows": out.get("trainable_rows"),
        "tokens": out.get("tokens"),
        "reward_mean": out["mean_reward"],
        "reward_std": out.get("reward_std"),
        "advantage_mean": out.get("advantage_mean"),
        "advantage_abs_mean": out.get("advantage_abs_mean"),
        "data_age_seconds": out.get("data_age_s"),
        "data_to_deploy_seconds": out.get("data_to_deploy_s"),
        "steps": len(steps),
    }
    if steps:
        stats.update(
            is_weight_mean=statistics.fmean(s["is_weight"] for s in steps),
            clip_fraction=statistics.fmean(s["clip_fraction"] for s in steps),
            kl=steps[-1]["kl_k3"],
        )
        mismatch = steps[0].get("mismatch") or {}
        if mismatch.get("tokens"):
            stats.update(
                mismatch_outside_band=mismatch["outside_0.9_1.1"],
                mismatch_ratio_max=mismatch["ratio_max"],
                mismatch_abs_log_ratio_mean=mismatch["abs_log_ratio_mean"],
            )
    hindsight = out.get("hindsight") or {}
    for stat in ("hindsight_episodes", "hindsight_gap_mean"):
        stats[stat] = hindsight.get(stat)
    for stat, value in stats.items():
        if value is not None:
            LAST.labels(stat).set(float(value))
    LAST_AT.set(time.time())
    if out.get("champion_version") is not None:
        BATCH_REWARD.labels(f"v{out['champion_version']}").set(float(out["mean_reward"]))
