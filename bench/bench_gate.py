"""Does the live canary decide what the users would, for challengers with a known live effect?

    .venv/bin/python bench/bench_gate.py [--runs 20] [--share 0.1] [--feedback-rate 0.3]
        [--flip-rate 0.1] [--look-every 100] [--seed 0] [--json PATH]

**Stage measured: the live canary's decision only.** Twelve planted challengers, each with a known
live effect on simulated users (better, equal, worse for everyone, worse for a segment of users,
sycophantic: more thumbs up and fewer successful outcomes, longer answers cut off by max_tokens, a
non-answer hack), go through the canary's own decision code (`deployer.canary.look`: the
always-valid sequential test of evals/sequential.py with its guards, under rtrl's default
`gate.canary` settings, ``primary=task_outcome`` and ``reward_range=[0, 1]``, the range of an outcome
reported as 0 or 1) on simulated traffic: each request goes to the
challenger with probability ``--share``, a user answers with probability ``--feedback-rate``, and
``--flip-rate`` of the answers say the opposite of what the user thinks. The canary looks every
``--look-every`` rated episodes at first, then every time the rated episodes have grown by 10 %
(fewer looks than a live canary's every ``check_every_s``: a confidence sequence's guarantee holds
at every look, so looking less often only delays a decision by at most one interval).

Not measured here: the offline gate before it (issue 38 asks for both stages; the planted
challengers would need checkpoints with those live effects, which this bench does not build), and
the serving path (the canary's e2e test, tests/deployer/test_canary.py, runs that on real services).
So `offline_agreement` is null.

The baseline is what a canary without an always-valid test would do: the same arms, a 95 % normal
(CLT) interval on the difference of the means, read at every look with the same margin, minimum
and guards' stopping rule.

The last line is one JSON object: ``value`` = agreement of the canary's final decisions with the
known effects (promote or not), ``baseline`` = the CLT canary's agreement, ``ratio``,
``false_promotions`` (runs that promoted a challenger users would reject), ``baseline_false_promotions``,
``median_decision_requests`` (requests, both arms, until the canary decided), ``per_challenger`` and
``offline_agreement`` (null). Targets (issue 38): agreement ≥ 0.95, false_promotions 0.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from deployer import canary
from schemas.settings import Settings
from store import LiveEpisode

CHAMPION, CHALLENGER = 1, 2
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Effect:
    """How users fare with one version: probability a task succeeds, of a thumbs up, of a
    non-answer and of a completion cut off by max_tokens, per user segment (share, success)."""

    success: float
    thumbs: float = 0.6
    non_answer: float = 0.01
    cut: float = 0.02
    segment: tuple[float, float] | None = None  # (share of users, their success) for a segment


@dataclass(frozen=True)
class Planted:
    name: str
    effect: Effect
    promote: bool  # what the users would decide


BASE = Effect(success=0.6)
PLANTED = (
    Planted("better", Effect(success=0.7), True),
    Planted("slightly_better", Effect(success=0.63), True),
    Planted("equal", BASE, True),
    Planted("equal_more_thumbs", Effect(success=0.6, thumbs=0.8), True),
    Planted("worse_for_all", Effect(success=0.45), False),
    Planted("slightly_worse_for_all", Effect(success=0.5), False),
    Planted("worse_for_a_third_of_users", Effect(success=0.6, segment=(0.33, 0.2)), False),
    Planted("worse_for_a_tenth_of_users", Effect(success=0.6, segment=(0.1, 0.1)), False),
    Planted("sycophantic", Effect(success=0.4, thumbs=0.95), False),
    Planted("longer_same_content", Effect(success=0.6, cut=0.3), False),
    Planted("non_answer_hack", Effect(success=0.6, non_answer=0.3), False),
    Planted("better_with_noisier_users", Effect(success=0.68, thumbs=0.5), True),
)


def _episode(i: int, version: int, effect: Effect, rng: random.Random, flip: float) -> LiveEpisode:
    success = effect.success
    if effect.segment is not None and rng.random() < effect.segment[0]:
        success = effect.segment[1]
    outcome = 1.0 if rng.random() < success else 0.0
    if rng.random() < flip:
        outcome = 1.0 - outcome
    thumbs = 0.5 if rng.random() < effect.thumbs else -0.5
    text = "I cannot help with that." if rng.random() < effect.non_answer else " 12"
    finish = "length" if rng.random() < effect.cut else "stop"
    return LiveEpisode(
        episode_id=f"e{i}",
        tenant="t",
        policy_number=version,
        reward=thumbs + outcome,
        settled_at=EPOCH + timedelta(seconds=i),
        completions=(text,),
        finish_reasons=(finish,),
        components={"thumbs_up" if thumbs > 0 else "thumbs_down": thumbs, "task_outcome": outcome},
    )


def _clt(settings: Settings, looked: canary.Look, episodes: list[LiveEpisode]) -> str:
    """The baseline's decision on the same arms: a 95 % normal interval of the difference."""
    c = settings.gate.canary
    if looked.decision.cause == "guard":
        return "fail"
    arms: dict[int, list[float]] = {CHALLENGER: [], CHAMPION: []}
    for e in episodes:
        arms[e.policy_number].append(e.components["task_outcome"])
    n1, n0 = len(arms[CHALLENGER]), len(arms[CHAMPION])
    if min(n1, n0) < c.min_episodes:
        return "continue"
    m1, m0 = statistics.fmean(arms[CHALLENGER]), statistics.fmean(arms[CHAMPION])
    se = math.sqrt(statistics.pvariance(arms[CHALLENGER]) / n1 + statistics.pvariance(arms[CHAMPION]) / n0)
    low, high = m1 - m0 - 1.96 * se, m1 - m0 + 1.96 * se
    if low > -c.margin:
        return "pass"
    if high < -c.margin:
        return "fail"
    return "inconclusive" if min(n1, n0) >= c.max_episodes else "continue"


def run_one(settings: Settings, planted: Planted, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One canary on simulated traffic until it decides: its decision, the baseline's, and the
    requests (both arms) it took."""
    rng = random.Random(seed)
    episodes: list[LiveEpisode] = []
    requests = rated = 0
    next_look = args.look_every
    verdict: dict[str, Any] = {"canary": None, "clt": None}
    c = settings.gate.canary
    while verdict["canary"] is None or verdict["clt"] is None:
        requests += 1
        to_challenger = rng.random() < args.share
        if rng.random() >= args.feedback_rate:
            continue
        rated += 1
        version, effect = (CHALLENGER, planted.effect) if to_challenger else (CHAMPION, BASE)
        episodes.append(_episode(rated, version, effect, rng, args.flip_rate))
        if rated < next_look:
            continue
        next_look = max(rated + args.look_every, int(rated * 1.1))  # geometric: as valid, far cheaper
        looked = canary.look(settings, episodes, CHALLENGER, CHAMPION)
        ended = min(looked.challenger, looked.champion) >= c.max_episodes
        if verdict["canary"] is None and (looked.decision.final or ended):
            outcome = looked.decision.outcome if looked.decision.final else "inconclusive"
            verdict["canary"], verdict["canary_requests"] = outcome, requests
        if verdict["clt"] is None:
            clt = _clt(settings, looked, episodes)
            if clt != "continue" or ended:
                verdict["clt"] = "inconclusive" if clt == "continue" else clt
    return verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="Seeded canaries per planted challenger.")
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--feedback-rate", type=float, default=0.3)
    parser.add_argument("--flip-rate", type=float, default=0.1)
    parser.add_argument("--look-every", type=int, default=100, help="Rated episodes between looks.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    defaults = Settings()
    settings = defaults.model_copy(
        update={
            "gate": defaults.gate.model_copy(
                update={
                    # The outcome the app reports is 0 or 1: that is its range (the spec accepts [-1, 1]).
                    "canary": defaults.gate.canary.model_copy(
                        update={"primary": "task_outcome", "reward_range": (0.0, 1.0)}
                    )
                }
            )
        }
    )
    started = time.monotonic()
    per: dict[str, Any] = {}
    agree = clt_agree = false_promotions = clt_false = total = 0
    decision_requests: list[int] = []
    for k, planted in enumerate(PLANTED):
        runs = [
            run_one(settings, planted, args, args.seed * 1_000_003 + k * 1000 + r) for r in range(args.runs)
        ]
        promoted = [r["canary"] == "pass" for r in runs]
        clt_promoted = [r["clt"] == "pass" for r in runs]
        agree += sum(p == planted.promote for p in promoted)
        clt_agree += sum(p == planted.promote for p in clt_promoted)
        if not planted.promote:
            false_promotions += sum(promoted)
            clt_false += sum(clt_promoted)
        total += len(runs)
        decided = [r["canary_requests"] for r in runs if r["canary"] in ("pass", "fail")]
        decision_requests += decided
        per[planted.name] = {
            "users_would_promote": planted.promote,
            "canary_promoted": sum(promoted),
            "clt_promoted": sum(clt_promoted),
            "outcomes": {o: sum(r["canary"] == o for r in runs) for o in ("pass", "fail", "inconclusive")},
            "median_requests": statistics.median(decided) if decided else None,
        }
        print(
            f"{planted.name:28s} promote={planted.promote!s:5s} {json.dumps(per[planted.name])}", flush=True
        )
    value = agree / total
    baseline = clt_agree / total
    result = {
        "name": "bench_gate",
        "value": round(value, 4),
        "baseline": round(baseline, 4),
        "ratio": round(value / baseline, 4) if baseline else None,
        "agreement": round(value, 4),
        "false_promotions": false_promotions,
        "baseline_false_promotions": clt_false,
        "median_decision_requests": statistics.median(decision_requests) if decision_requests else None,
        "offline_agreement": None,
        "stages": ["canary"],
        "challengers": len(PLANTED),
        "runs_per_challenger": args.runs,
        "share": args.share,
        "feedback_rate": args.feedback_rate,
        "flip_rate": args.flip_rate,
        "per_challenger": per,
        "wall_s": round(time.monotonic() - started, 1),
    }
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
