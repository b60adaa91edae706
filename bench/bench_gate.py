"""Does the gate, offline and then live, decide what the users would, for challengers with a known effect?

    .venv/bin/python bench/bench_gate.py [--runs 20] [--share 0.1] [--feedback-rate 0.3]
        [--flip-rate 0.1] [--look-every 100] [--seed 0] [--canary-only] [--logged 192] [--json PATH]

Twelve planted challengers, each with a known live effect on simulated users (better, equal, worse
for everyone, worse for a segment of users, sycophantic: more thumbs up and fewer successful
outcomes, longer answers cut off by max_tokens, a non-answer hack), through both stages:

**Offline stage** (`offline_stage`, below; skipped with ``--canary-only``): the five whose effect a
tiny-model checkpoint can carry (better, equal, worse for all, longer answers cut off, the
non-answer hack) are made as checkpoints (simulation/planted.py) and judged by the real offline
gate (`deployer.gate.evaluate`: ope on ``--logged`` held-out episodes the base served to exclaim
users, retention, the alarms) on a real staging vLLM server; each checkpoint's true effect is
measured on-policy with the same users (``truth_acceptance``). The other seven carry effects the
exclaim users cannot show (a segment of users, thumbs against outcomes): they have no offline stage,
and the canary alone decides them.

**Canary stage**: each challenger goes through the canary's own decision code (`deployer.canary.look`:
the always-valid sequential test of evals/sequential.py with its guards, under rtrl's default
`gate.canary` settings, ``primary=task_outcome`` and ``reward_range=[0, 1]``, the range of an outcome
reported as 0 or 1) on simulated traffic: each request goes to the challenger with probability
``--share``, a user answers with probability ``--feedback-rate``, and ``--flip-rate`` of the answers
say the opposite of what the user thinks. The canary looks every ``--look-every`` rated episodes at
first, then every time the rated episodes have grown by 10 % (fewer looks than a live canary's every
``check_every_s``: a confidence sequence's guarantee holds at every look, so looking less often
only delays a decision by at most one interval). The canary stage plays the planted *effect*, not
the checkpoint: the serving path is the canary's e2e test's (tests/deployer/test_canary.py).

A challenger is promoted when the offline gate passed it (where it has an offline stage) and the
canary ended ``pass``. The baseline is the same two stages with a canary without an always-valid
test: a 95 % normal (CLT) interval on the difference of the means, read at every look with the same
margin, minimum and guards' stopping rule.

The last line is one JSON object: ``value`` = agreement of the final decisions with the known
effects (promote or not), ``baseline`` = the same with the CLT canary, ``ratio``,
``false_promotions`` (runs that promoted a challenger users would reject), ``baseline_false_promotions``,
``canary_agreement`` and ``canary_false_promotions`` (the canary stage alone; ``baseline_canary_*`` the
CLT canary alone), ``offline_agreement`` (the offline gate's decisions
alone against the known effects, over the challengers it judged; null with ``--canary-only``),
``offline_truth_agreement`` (whether each checkpoint's measured effect has the planted direction),
``median_decision_requests`` (requests, both arms, until the canary decided, over the canaries that
would run: not those of challengers the offline gate refused), ``offline`` and ``per_challenger``.
One offline decision per challenger stands for all of its ``--runs`` canaries in ``value``. Targets (issue 38): agreement ≥ 0.95, false_promotions 0.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from deployer import canary, gate, rollout
from evals import get_task
from feedback.records import holdout_key
from registry import Registry
from schemas.settings import Settings, StoreSettings
from services import up
from services.testing import private_services
from simulation.planted import ASKING, RAMBLING, feed, perturbed_copy, sample_episodes, tuned_copy
from store import LiveEpisode, Store

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


def _promote(name: str) -> bool:
    return next(p.promote for p in PLANTED if p.name == name)


# ---- the offline stage: planted checkpoints through the real offline gate ------------------------
#
# For the planted challengers whose live effect a tiny-model checkpoint can carry (simulation/planted.py)
# a checkpoint is made and judged by `deployer.gate.evaluate` on a real staging vLLM server and MLflow
# registry, with the gate's default suites (ope on held-out traffic, retention) and alarms, against the
# base as champion: what `rtrl run` does before a canary. The held-out traffic is the base's own,
# `--logged` episodes rated by exclaim users (all held out). Each checkpoint's true effect on those users
# is measured on-policy (`truth_acceptance`; `truth_promote`: at least the base's) and checked against
# the planted direction (`offline_truth_agreement`). Fixed draws: a run repeats its questions and
# bootstrap. The other planted effects (a segment of users, thumbs against outcomes) need users that
# differ or a second signal, which the exclaim users and the tiny model do not have.

_EXCLAIM = get_task("exclaim")

# Planted name (bench_gate.PLANTED) -> how its checkpoint is made from the base.
CHECKPOINTS: dict[str, Callable[[Path, Path], Path]] = {
    "better": lambda base, out: tuned_copy(base, out, _EXCLAIM.preferred_shapes, steps=12),
    "equal": lambda base, out: perturbed_copy(base, out, std=0.0, seed=0),
    "worse_for_all": lambda base, out: tuned_copy(base, out, _EXCLAIM.plain_shapes, steps=12),
    "longer_same_content": lambda base, out: tuned_copy(base, out, RAMBLING),
    "non_answer_hack": lambda base, out: tuned_copy(base, out, ASKING),
}


def acceptance(model_dir: Path, n: int, seed: int) -> float:
    """The share of `n` of the model's own sampled answers that exclaim users accept (thumbs up)."""
    rated = sample_episodes(model_dir, n, seed=seed)
    return sum(f.kind == "thumbs_up" for _, f in rated) / len(rated)


def _settings(settings: Settings, run_dir: Path) -> Settings:
    gate_cfg = settings.gate
    return settings.model_copy(
        update={
            "store": StoreSettings(url=f"sqlite:///{run_dir / 'gate.db'}"),
            "mlflow": settings.mlflow.model_copy(update={"model_name": f"bench-gate-{uuid.uuid4().hex[:8]}"}),
            # Every logged episode is held out: the bench trains nothing on them. Fixed draws: the model
            # name is random, and fresh draws would follow it from run to run.
            "gate": gate_cfg.model_copy(
                update={
                    "suites": ("ope", "retention"),  # the checkpoints' task: what the offline stage reports
                    "fresh_draws": False,
                    "ope": gate_cfg.ope.model_copy(update={"holdout_percent": 100}),
                }
            ),
        }
    )


def offline_stage(logged: int, truth_samples: int) -> dict[str, dict[str, Any]]:
    """Each checkpoint-able planted challenger's offline gate decision and its measured truth."""
    results: dict[str, dict[str, Any]] = {}
    with private_services("rtrl-bench-gate-", enabled=("mlflow", "vllm")) as services:
        run_dir = services.services.run_dir
        settings = _settings(services, run_dir)
        from services.vllm import ensure_model

        base = ensure_model(settings)
        up(settings)
        store = Store(settings.store.url)
        store.migrate()
        feed(store, sample_episodes(base, logged, seed=21), holdout_key(settings))
        registry = Registry.from_settings(settings)
        rollout.bootstrap(settings, registry, base)
        champion_truth = acceptance(base, truth_samples, seed=33)
        for name, make in CHECKPOINTS.items():
            path = make(base, run_dir / f"planted-{name}")
            version = registry.register_checkpoint(path)
            decision = gate.evaluate(settings, registry, version, store)
            truth = acceptance(path, truth_samples, seed=33)
            results[name] = {
                "offline_passed": decision.passed,
                "reason": decision.reason,
                "suites": {
                    s.name: None if s.difference is None else round(s.difference.estimate, 4)
                    for s in decision.suites
                },
                "alarms": [a.name for a in decision.alarms if a.fired],
                "truth_acceptance": round(truth, 4),
                "champion_truth_acceptance": round(champion_truth, 4),
                "truth_promote": truth >= champion_truth,
            }
            print(f"offline {name:22s} {results[name]}", flush=True)
        store.close()
    return results


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="Seeded canaries per planted challenger.")
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--feedback-rate", type=float, default=0.3)
    parser.add_argument("--flip-rate", type=float, default=0.1)
    parser.add_argument("--look-every", type=int, default=100, help="Rated episodes between looks.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--canary-only", action="store_true", help="Skip the offline stage (no services).")
    parser.add_argument(
        "--logged", type=int, default=192, help="Held-out episodes for the offline gate's ope."
    )
    parser.add_argument("--truth-samples", type=int, default=192, help="On-policy samples per checkpoint.")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def _canary_settings() -> Settings:
    defaults = Settings()
    return defaults.model_copy(
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


@dataclass
class _Tally:
    """Runs whose decision agreed with the users, and false promotions: final, CLT baseline, canary alone."""

    total: int = 0
    agree: int = 0
    clt_agree: int = 0
    canary_agree: int = 0
    clt_canary_agree: int = 0
    false_promotions: int = 0
    clt_false: int = 0
    canary_false: int = 0
    clt_canary_false: int = 0
    decision_requests: list[int] = field(default_factory=list)


def _judge(
    planted: Planted, runs: list[dict[str, Any]], offline: dict[str, dict[str, Any]], tally: _Tally
) -> dict[str, Any]:
    """Count one challenger's runs into `tally` (promoted: offline passed, where judged, and canary
    passed); its line of ``per_challenger``."""
    offline_pass = offline[planted.name]["offline_passed"] if planted.name in offline else True
    canary_promoted = [r["canary"] == "pass" for r in runs]
    promoted = [offline_pass and p for p in canary_promoted]
    clt_promoted = [offline_pass and r["clt"] == "pass" for r in runs]
    tally.total += len(runs)
    tally.agree += sum(p == planted.promote for p in promoted)
    tally.clt_agree += sum(p == planted.promote for p in clt_promoted)
    tally.canary_agree += sum(p == planted.promote for p in canary_promoted)
    clt_alone = [r["clt"] == "pass" for r in runs]
    tally.clt_canary_agree += sum(p == planted.promote for p in clt_alone)
    if not planted.promote:
        tally.false_promotions += sum(promoted)
        tally.clt_false += sum(clt_promoted)
        tally.canary_false += sum(canary_promoted)
        tally.clt_canary_false += sum(clt_alone)
    decided = [r["canary_requests"] for r in runs if r["canary"] in ("pass", "fail")]
    if offline_pass:  # a challenger the offline gate refused never reaches a canary
        tally.decision_requests += decided
    return {
        "users_would_promote": planted.promote,
        "offline_passed": offline[planted.name]["offline_passed"] if planted.name in offline else None,
        "promoted": sum(promoted),
        "canary_promoted": sum(canary_promoted),
        "clt_promoted": sum(clt_promoted),
        "outcomes": {o: sum(r["canary"] == o for r in runs) for o in ("pass", "fail", "inconclusive")},
        "median_requests": statistics.median(decided) if decided else None,
    }


def main() -> None:
    args = _parse()
    started = time.monotonic()
    offline: dict[str, dict[str, Any]] = {}
    if not args.canary_only:
        offline = offline_stage(args.logged, args.truth_samples)
    settings = _canary_settings()
    per: dict[str, Any] = {}
    tally = _Tally()
    for k, planted in enumerate(PLANTED):
        runs = [
            run_one(settings, planted, args, args.seed * 1_000_003 + k * 1000 + r) for r in range(args.runs)
        ]
        per[planted.name] = _judge(planted, runs, offline, tally)
        print(
            f"{planted.name:28s} promote={planted.promote!s:5s} {json.dumps(per[planted.name])}", flush=True
        )
    value, baseline = tally.agree / tally.total, tally.clt_agree / tally.total
    result = {
        "name": "bench_gate",
        "value": round(value, 4),
        "baseline": round(baseline, 4),
        "ratio": round(value / baseline, 4) if baseline else None,
        "agreement": round(value, 4),
        "false_promotions": tally.false_promotions,
        "baseline_false_promotions": tally.clt_false,
        "canary_agreement": round(tally.canary_agree / tally.total, 4),
        "canary_false_promotions": tally.canary_false,
        "baseline_canary_agreement": round(tally.clt_canary_agree / tally.total, 4),
        "baseline_canary_false_promotions": tally.clt_canary_false,
        "median_decision_requests": statistics.median(tally.decision_requests)
        if tally.decision_requests
        else None,
        "offline_agreement": (
            round(sum(o["offline_passed"] == _promote(n) for n, o in offline.items()) / len(offline), 4)
            if offline
            else None
        ),
        "offline_truth_agreement": (
            round(sum(o["truth_promote"] == _promote(n) for n, o in offline.items()) / len(offline), 4)
            if offline
            else None
        ),
        "stages": ["offline", "canary"] if offline else ["canary"],
        "offline": offline,
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
