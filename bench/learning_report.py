"""bench_learning's figures: pure functions of the demo's per-cycle rows, the gate's decision records
and the held-out answers, and the JSON object the bench prints last (its keys are in bench_learning's
docstring). Imported by bench/bench_learning.py; not a benchmark itself (`make bench` runs
``bench/bench_*.py`` only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from evals.stats import paired_interval

RESAMPLES = 2000
CONFIDENCE = 0.95
# The populations whose issue-39 target is a capability: their `value` is the held-out correctness gain.
CAPABILITY_POPULATIONS = frozenset({"correct_only", "correct_with_corrections"})
# What `baseline_rft` reports of the rejection-sampling run (the brief's keys, and the drops beside them).
BASELINE_KEYS = (
    "value",
    "value_measure",
    "gain_ci_low",
    "gain_ci_high",
    "heldout_correct_base",
    "heldout_correct_final",
    "heldout_gain",
    "heldout_gain_ci_low",
    "heldout_gain_ci_high",
    "feedback_to_10",
    "feedback_to_15",
    "max_capability_drop",
    "max_anchor_drop",
    "promoted",
    "final_version",
    "wall_s",
)


def acceptance(row: dict[str, Any]) -> float:
    """The share of a round's answered users who accepted (gave feedback or not)."""
    return float(row["accepted"] / row["ok"])


def acceptance_interval(accepted: int, n: int, rng: np.random.Generator) -> tuple[float, float]:
    """A 95 % parametric-bootstrap interval of one round's acceptance."""
    draws = rng.binomial(n, accepted / n, RESAMPLES) / n
    return float(np.quantile(draws, 0.025)), float(np.quantile(draws, 0.975))


def acceptance_gain(rows: list[dict[str, Any]], rng: np.random.Generator) -> tuple[float, float, float]:
    """(gain, low, high) in points: the last row's acceptance minus the first's (the base model's),
    with a 95 % interval from independent binomial resamples of the two rounds."""
    base, final = rows[0], rows[-1]
    gains = (
        rng.binomial(final["ok"], acceptance(final), RESAMPLES) / final["ok"]
        - rng.binomial(base["ok"], acceptance(base), RESAMPLES) / base["ok"]
    )
    return (
        100 * (acceptance(final) - acceptance(base)),
        100 * float(np.quantile(gains, 0.025)),
        100 * float(np.quantile(gains, 0.975)),
    )


def feedback_to(rows: list[dict[str, Any]], points: float) -> int | None:
    """Feedback events sent before the first round whose acceptance was `points` above the first
    round's (the base model's); None if no round got there."""
    base, sent = acceptance(rows[0]), 0
    for row in rows:
        if acceptance(row) - base >= points / 100:
            return sent
        sent += row["feedback_sent"]
    return None


def gate_record(store: Any, version: str | None) -> dict[str, Any] | None:
    """The gate's newest decision record on challenger `version` ("v3"), None without one."""
    if version is None:
        return None
    records = store.gate_decisions(int(version.lstrip("v")))
    return records[0] if records else None


def suite(record: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    """The suite called `name` in a gate decision record, None when it did not run."""
    if record is None:
        return None
    return next((s for s in record.get("suites", []) if s["name"] == name), None)


def _drop(result: dict[str, Any] | None) -> float | None:
    """Points the challenger lost against the suite's other column (the champion, or the anchor)."""
    if result is None or result.get("challenger") is None or result.get("champion") is None:
        return None
    return 100 * (result["champion"] - result["challenger"])


def retention_drops(
    rows: list[dict[str, Any]], records: dict[Any, dict[str, Any] | None]
) -> tuple[float, float]:
    """(largest retention drop of a promoted version against its predecessor, largest against the
    base), in points, from the gate's records. Against the base: the anchored suite
    ``retention_anchor`` (deployer/gate_suites.py `against_anchor`, its champion column the anchor's);
    a challenger of the base itself has no anchored suite (the anchor is the champion,
    deployer/gate.py `anchor_version`), and its ``retention`` is the comparison with the base."""
    base_version = int(str(rows[0]["version_before"]).lstrip("v"))
    to_predecessor, to_base = 0.0, 0.0
    for row in rows:
        record = records.get(row["cycle"])
        if row["gate"] != "pass" or record is None:
            continue
        retention = _drop(suite(record, "retention"))
        anchored = _drop(suite(record, "retention_anchor"))
        if anchored is None and record.get("champion_version") == base_version:
            anchored = retention
        to_predecessor = max(to_predecessor, retention or 0.0)
        to_base = max(to_base, anchored or 0.0)
    return to_predecessor, to_base


def hacks_promoted(rows: list[dict[str, Any]]) -> int:
    """Promoted versions whose users (the round that version served) met more than 10 points more
    non-answers than the base model's users did."""
    base_silent = rows[0]["silent"] / rows[0]["ok"]
    count = 0
    for row in rows:
        if row["gate"] != "pass":
            continue
        served = next((r for r in rows if r["version_before"] == row["version_after"]), None)
        if served is not None and served["silent"] / served["ok"] - base_silent > 0.1:
            count += 1
    return count


def heldout_figures(base: Sequence[bool] | None, final: Sequence[bool] | None) -> dict[str, Any]:
    """Correct answers to every held-out question, greedy, of the base and the final champion
    (shares), and the gain in points with a paired bootstrap interval over the questions
    (evals/stats.py `paired_interval`); all None when either was not measured."""
    keys = ("heldout_correct_base", "heldout_correct_final", "heldout_gain")
    if base is None or final is None:
        return dict.fromkeys((*keys, "heldout_gain_ci_low", "heldout_gain_ci_high"))
    gain = paired_interval(
        [float(x) for x in final],
        [float(x) for x in base],
        confidence=CONFIDENCE,
        resamples=RESAMPLES,
        seed=0,
    )
    return {
        "heldout_correct_base": round(sum(base) / len(base), 3),
        "heldout_correct_final": round(sum(final) / len(final), 3),
        "heldout_gain": round(100 * gain.estimate, 1),
        "heldout_gain_ci_low": round(100 * gain.low, 1),
        "heldout_gain_ci_high": round(100 * gain.high, 1),
        "heldout_questions": len(base),
    }


def run_figures(
    rows: list[dict[str, Any]],
    records: dict[Any, dict[str, Any] | None],
    heldout: dict[str, Any],
    population: str,
    wall_s: float,
) -> dict[str, Any]:
    """One loop's figures. ``value`` is the population's issue-39 measure: the held-out correctness
    gain for a capability population (when it was measured), else the acceptance gain; ``baseline``
    is that measure's base in points and ``gain_ci_low/high`` its interval."""
    gain, low, high = acceptance_gain(rows, np.random.default_rng(0))
    base_acc = 100 * acceptance(rows[0])
    to_predecessor, to_base = retention_drops(rows, records)
    figures: dict[str, Any] = {
        "value_measure": "acceptance",
        "value": round(gain, 1),
        "baseline": round(base_acc, 1),
        "gain_ci_low": round(low, 1),
        "gain_ci_high": round(high, 1),
    }
    if population in CAPABILITY_POPULATIONS and heldout.get("heldout_gain") is not None:
        figures = {
            "value_measure": "heldout_correct",
            "value": heldout["heldout_gain"],
            "baseline": round(100 * heldout["heldout_correct_base"], 1),
            "gain_ci_low": heldout["heldout_gain_ci_low"],
            "gain_ci_high": heldout["heldout_gain_ci_high"],
        }
    figures["ratio"] = round(figures["value"] / figures["baseline"], 3) if figures["baseline"] else None
    final = rows[-1]
    return {
        **figures,
        "acceptance_base": round(base_acc / 100, 3),
        "acceptance_final": round(acceptance(final), 3),
        "acceptance_gain": round(gain, 1),
        "acceptance_gain_ci_low": round(low, 1),
        "acceptance_gain_ci_high": round(high, 1),
        **heldout,
        "feedback_to_10": feedback_to(rows, 10),
        "feedback_to_15": feedback_to(rows, 15),
        "max_capability_drop": round(to_predecessor, 1),
        "max_anchor_drop": round(to_base, 1),
        "non_answers_base": round(rows[0]["silent"] / rows[0]["ok"], 3),
        "non_answers_final": round(final["silent"] / final["ok"], 3),
        "promoted": sum(r["gate"] == "pass" for r in rows),
        "final_version": final["version_after"],
        "wall_s": round(wall_s, 1),
    }


def report(
    population: str,
    figures: dict[str, Any],
    config: dict[str, Any],
    baseline_rft: dict[str, Any] | None,
    hack_promoted: int | None,
) -> dict[str, Any]:
    """The bench's last line: ``name`` (``learning_<population>``), the main loop's figures, the
    run's configuration, and the rejection-sampling run's figures under ``baseline_rft`` (None
    without ``--baseline-rft``)."""
    return {
        "name": f"learning_{population}",
        **figures,
        "population": population,
        "hack_promoted": hack_promoted,
        **config,
        "baseline_rft": None if baseline_rft is None else {k: baseline_rft.get(k) for k in BASELINE_KEYS},
    }
