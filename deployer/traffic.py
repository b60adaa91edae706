"""The gate's `traffic` suite: the tenant's own held-out prompts replayed through both models (docs/gate.md).

The prompts are those of held-out logged traffic (`Store.heldout_prompts`: episodes of the eval
bucket, ``gate.ope.holdout_percent`` of them by a keyed hash of the id, never trained on; settled or
not; each episode's first call as the model saw it, a chat request's chat-templated), deduped by
text. Each gate run takes ``gate.traffic.max_prompts`` of the newest ``gate.traffic.pool``, drawn
with the run's seed as the task's suites are (`draw`: the SHA-256 rank of the seed and the episode
id), at most ``gate.traffic.per_tenant`` of one tenant. The gate samples them on staging like any
prompt suite (deployer/gate.py `_sample_on_staging`, the served model's sampling defaults and the
run's seed for both models) and scores them with `deployer.gate_suites.score_prompts`:

- by the judge (``gate.judge``, its rubric) when one is configured;
- otherwise 1 per completion that answers and finishes: 0 for a non-answer
  (``gate.alarms.no_action_pattern``) or a completion cut off by ``gate.traffic.max_tokens``. That
  measures only that the challenger still answers the users' own prompts, not how well.

With fewer than ``gate.traffic.min_prompts`` held-out prompts the suite is inconclusive (it does not
decide) and nothing is sampled for it, as ope is with too little traffic.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deployer.alarms import non_answer
from deployer.gate_margins import margin
from deployer.gate_suites import SuiteResult
from evals.suites import ItemScorer, PromptSuite, SuiteError
from schemas.settings import Settings
from store import Store
from store.episodes import HeldoutPrompt

NAME = "traffic"


@dataclass(frozen=True)
class TrafficDraw:
    """What a gate run replays of held-out traffic: a suite, or why there is none."""

    suite: PromptSuite | None = None  # None: not configured, or too little held-out traffic
    verdict: SuiteResult | None = None  # the inconclusive verdict when there was too little
    episodes: list[str] = field(default_factory=list)  # the held-out episodes whose prompts `suite` holds


def draw(
    prompts: Sequence[HeldoutPrompt], n: int, seed: int | None, per_tenant: int | None = None
) -> list[HeldoutPrompt]:
    """At most `n` of `prompts` (newest first), one per prompt text and at most `per_tenant` of one
    tenant: without a seed the newest; with one, those whose SHA-256 of the seed and the episode id
    ranks lowest, the same in every process (docs/gate.md, Fresh draws). Returned newest first."""
    order = list(range(len(prompts)))
    if seed is not None:
        order.sort(key=lambda i: hashlib.sha256(f"{seed}\0{prompts[i].episode_id}".encode()).hexdigest())
    taken: list[int] = []
    texts: set[str] = set()
    tenants: Counter[str] = Counter()
    for i in order:
        if len(taken) == n:
            break
        prompt = prompts[i]
        if prompt.prompt in texts or (per_tenant is not None and tenants[prompt.tenant] >= per_tenant):
            continue
        texts.add(prompt.prompt)
        tenants[prompt.tenant] += 1
        taken.append(i)
    return [prompts[i] for i in sorted(taken)]


def answered(no_action_pattern: str) -> ItemScorer:
    """The scorer without a judge: 1 when the completion is not a non-answer (`non_answer` under
    `no_action_pattern`), else 0; the suite's `cut_off_fails` scores a cut-off completion 0 too."""
    pattern = re.compile(no_action_pattern)

    def score(prompt: str, completion: str, line: Mapping[str, Any]) -> float:
        return 0.0 if non_answer(completion, pattern) else 1.0

    return score


def _judged_only(prompt: str, completion: str, line: Mapping[str, Any]) -> float:
    raise SuiteError("the traffic suite with a judge is graded by its judge (Judge.score_many)")


def traffic_suite(
    settings: Settings, store: Store, seed: int | None, tenant: str | None = None
) -> TrafficDraw:
    """This gate run's traffic suite (drawn with `seed`; None: the newest prompts), or, with fewer
    than ``gate.traffic.min_prompts`` held-out prompts, the inconclusive verdict saying so; neither
    when ``gate.suites`` lacks "traffic". `tenant`: the prompts of that tenant's adapter line only
    (None: the global line's; docs/lora.md, An adapter per tenant)."""
    cfg = settings.gate
    if NAME not in cfg.suites:
        return TrafficDraw()
    traffic = cfg.traffic
    holdout = cfg.ope.holdout_percent
    pool = store.heldout_prompts(traffic.pool, holdout_percent=holdout, tenant=tenant)
    drawn = draw(pool, traffic.max_prompts, seed, traffic.per_tenant)
    where = f"of the newest {len(pool)} distinct held-out prompts (gate.ope.holdout_percent {holdout})"
    if len(drawn) < traffic.min_prompts:
        note = f"{len(drawn)} prompts {where}, fewer than gate.traffic.min_prompts {traffic.min_prompts}"
        verdict = SuiteResult(
            name=NAME,
            kind="prompts",
            challenger=None,
            champion=None,
            difference=None,
            conclusive=False,
            passed=None,
            n=len(drawn),
            margin=margin(settings, NAME),
            note=note,
        )
        return TrafficDraw(verdict=verdict)  # nothing is sampled for it
    scored = (
        f"graded by the judge {cfg.judge.model}"
        if cfg.judge is not None
        else "scored 1 per completion that answers and finishes (no judge: not a measure of quality)"
    )
    suite = PromptSuite(
        name=NAME,
        prompts=tuple(p.prompt for p in drawn),
        lines=tuple({"episode_id": p.episode_id, "tenant": p.tenant} for p in drawn),
        scorer=_judged_only if cfg.judge is not None else answered(cfg.alarms.no_action_pattern),
        max_tokens=traffic.max_tokens,
        stop=traffic.stop,
        judge=cfg.judge,
        cut_off_fails=cfg.judge is None,
        note=f"{len(drawn)} prompts {where}, {scored}",
    )
    return TrafficDraw(suite=suite, episodes=[p.episode_id for p in drawn])
