"""The eval gate's suites (docs/gate.md; deployer/gate.py runs them and decides): which prompt suites
are configured (`prompt_suites`), each one's verdict of challenger − champion from both models'
generations (`score_prompts`, the judge suite's through the judge), a suite's verdict against the
anchor (`against_anchor`), and the off-policy suite on held-out traffic with the alarms it feeds
(`ope_suite`, which also estimates the challenger against the anchor when `gate.anchor_suites` has
ope: the users' reward held against it, and `ope_primary`, the same estimate of the reward spec's
primary term alone: a guard); the traffic suite's prompts are drawn in
deployer/traffic.py, the episodes suite is deployer/episodes.py. A verdict is a `SuiteResult`, under
the suite's margin (`margin`). The retention suite asked greedily of every held-out question is a
census (`census`): its verdict is exact, not a bootstrap interval; beside it `retention_sampled`
samples every question `gate.retention.sampled_k` times and is decided by the paired bootstrap
(`paired`) under its own margin (docs/gate.md, The retention suite's power).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

import evals
from deployer import alarms, gate_dr, ope
from deployer.alarms import Alarm
from deployer.errors import GateError
from deployer.gate_margins import anchor_margin, margin
from evals.judge import Judge
from evals.stats import (
    Interval,
    OffPolicy,
    effective_sample_size,
    importance_weights,
    off_policy,
    paired_interval,
    snips,
)
from evals.suites import PromptSuite, judge_suite, load_offline, retention_sampled_suite, retention_suite
from schemas.rewards import carries_signal, get_spec
from schemas.settings import JudgeSettings, Settings
from serving import Generation
from store import Store, TrainingEpisode

TASK_SUITES = ("retention", "oracle", "judge", "episodes")  # the suites on `gate.task`'s held-out questions


class SuiteResult(BaseModel):
    """One suite's verdict: both models' figures, the difference's interval, and whether it decides."""

    model_config = ConfigDict(frozen=True)

    name: str
    kind: Literal["ope", "prompts"]
    challenger: float | None
    champion: float | None
    difference: Interval | None
    conclusive: bool
    passed: bool | None = Field(description="None when inconclusive (it does not decide).")
    n: int = Field(description="Prompts (prompt suites) or usable held-out episodes (ope).")
    ess: float | None = Field(None, description="ope: the smaller effective sample size of the two models.")
    margin: float = Field(0.0, description="Its non-inferiority margin (`gate.margins` or `gate.tolerance`).")
    note: str = ""
    against_anchor: bool = Field(
        False, description="A verdict against the anchor (`against_anchor`), not against the champion."
    )
    guard: bool = Field(
        False,
        description="A guard (ope_primary): it can fail a challenger but is never the conclusive suite that "
        "lets one pass (docs/gate.md, The rule).",
    )
    estimator: str | None = Field(
        None, description="ope: the estimator that decided, snips or dr (deployer/gate_dr.py)."
    )
    r2: float | None = Field(
        None,
        description="ope: the reward model's out-of-fold R² when one was fitted (the doubly robust estimate).",
    )
    census: bool = Field(
        False,
        description="A census (`census`): every question of the set asked greedily, so the difference is exact "
        "(low = high = estimate) and a loss of exactly the margin passes.",
    )
    unrated: int | None = Field(
        None,
        description="ope (and its anchored verdict): usable held-out episodes left out as unrated, no user "
        "feedback and no judge's grade (``gate.ope.episodes`` rated; 0 under all). `n` counts those kept.",
    )


def prompt_suites(settings: Settings, draw_seed: int | None = None) -> list[tuple[PromptSuite, bool]]:
    """(suite, oracle?) for every configured prompt suite; the task's suites on the same
    `gate.eval_prompts` held-out questions, the first ones or drawn with `draw_seed`
    (`Task.heldout_draw`); raises GateError on a bad suite."""
    cfg = settings.gate
    suites: list[tuple[PromptSuite, bool]] = []
    try:
        suites.extend(_task_suites(settings, draw_seed))
        suites.extend((load_offline(offline), False) for offline in cfg.offline)
    except evals.TaskError as exc:
        raise GateError(str(exc)) from exc
    return suites


def _task_suites(settings: Settings, draw_seed: int | None) -> list[tuple[PromptSuite, bool]]:
    """The configured suites of `gate.task` (`TASK_SUITES`); none, and no task read, without one."""
    cfg = settings.gate
    suites: list[tuple[PromptSuite, bool]] = []
    if not set(TASK_SUITES) & set(cfg.suites):
        return suites  # a deployment without the demo's task needs none (docs/gate.md, Suites)
    task = evals.get_task(cfg.task)
    if "retention" in cfg.suites:
        greedy = cfg.retention.decode == "greedy"
        suites.append((retention_suite(task, cfg.retention.questions, draw_seed, greedy), False))
        if cfg.retention.sampled_k:  # beside the census: the users' sampled answers (docs/gate.md)
            suites.append((retention_sampled_suite(task, cfg.retention.sampled_k), False))
    if "oracle" in cfg.suites:
        preference = evals.load_preference(cfg.preference) if cfg.preference else task.preference
        reward = evals.scorer(preference, get_spec(settings.labeler.reward_spec))
        prompts = tuple(task.heldout_prompts(cfg.eval_prompts, draw_seed))
        suites.append(
            (
                PromptSuite(
                    name="oracle",
                    prompts=prompts,
                    lines=tuple({} for _ in prompts),
                    scorer=lambda prompt, completion, _line: reward(prompt, completion),
                    max_tokens=task.max_tokens,
                    stop=task.stop,
                ),
                True,
            )
        )
    if "judge" in cfg.suites:
        assert cfg.judge is not None  # GateSettings refuses "judge" without it
        suites.append((judge_suite(task, cfg.eval_prompts, cfg.judge, draw_seed), False))
    return suites


def score_prompts(
    suite: PromptSuite,
    challenger: list[list[Generation]],
    champion: list[list[Generation]],
    settings: Settings,
    seed: int | None = None,
) -> SuiteResult:
    """A prompt suite's verdict from both models' generations; `seed` is the bootstrap's (default
    `gate.seed`; the gate passes its run's seed)."""
    if suite.judge is not None:
        result = _score_judged(suite, suite.judge, challenger, champion, settings, seed)
    else:

        def score(i: int, g: Generation) -> float:
            return 0.0 if suite.cut_off_fails and g.finish_reason == "length" else suite.score(i, g.text)

        def per_prompt(generations: list[list[Generation]]) -> list[float]:
            return [sum(score(i, g) for g in gens) / len(gens) for i, gens in enumerate(generations)]

        verdict = census if suite.census else paired
        result = verdict(suite.name, per_prompt(challenger), per_prompt(champion), settings, seed)
    if suite.note:
        result = result.model_copy(update={"note": "; ".join(n for n in (suite.note, result.note) if n)})
    return result


def _score_judged(
    suite: PromptSuite,
    judge: JudgeSettings,
    challenger: list[list[Generation]],
    champion: list[list[Generation]],
    settings: Settings,
    seed: int | None,
) -> SuiteResult:
    """Both models' generations of a prompt suite graded by the judge (`judged`)."""
    items = [
        [[(suite.prompts[i], g.text) for g in gens] for i, gens in enumerate(model)]
        for model in (challenger, champion)
    ]
    return judged(suite.name, items[0], items[1], judge, settings, seed)


Graded = list[
    list[tuple[str, str]]
]  # per prompt (or question), per sample: (what the judge sees, the answer)


def judged(
    name: str,
    challenger: Graded,
    champion: Graded,
    judge: JudgeSettings,
    settings: Settings,
    seed: int | None,
) -> SuiteResult:
    """A suite's verdict from the judge's grades of both models' (prompt, answer) items, paired per
    prompt; prompts without a grade on either side are left out, and an outage follows
    `gate.judge.outage` (docs/gate.md, Judge)."""
    items = [item for model in (challenger, champion) for per_prompt in model for item in per_prompt]
    with Judge(judge) as grader:
        graded = grader.score_many(items)
    verdicts = iter(graded.verdicts)
    means: list[list[float | None]] = []
    for model in (challenger, champion):
        per_prompt: list[float | None] = []
        for samples in model:
            scores = [v.score for v in (next(verdicts) for _ in samples) if v.score is not None]
            per_prompt.append(sum(scores) / len(scores) if scores else None)
        means.append(per_prompt)
    pairs = [(a, b) for a, b in zip(*means, strict=True) if a is not None and b is not None]
    failed = f"{graded.failed} of {len(items)} judgements failed" + (
        f" (first: {graded.first_error()})" if graded.failed else ""
    )
    if graded.outage or len(pairs) < 2:
        block = judge.outage == "block"
        return SuiteResult(
            name=name,
            kind="prompts",
            challenger=None,
            champion=None,
            difference=None,
            conclusive=block,
            passed=False if block else None,
            n=len(pairs),
            margin=margin(settings, name),
            note=f"judge out ({judge.outage}): {failed}",
        )
    result = paired(name, [a for a, _ in pairs], [b for _, b in pairs], settings, seed)
    return result.model_copy(update={"note": f"{len(pairs)} prompts graded by {judge.model}; {failed}"})


def paired(
    name: str, ours: list[float], theirs: list[float], settings: Settings, seed: int | None
) -> SuiteResult:
    """A prompt suite's verdict from per-prompt mean scores of both models (paired bootstrap)."""
    cfg = settings.gate
    interval = paired_interval(
        ours,
        theirs,
        confidence=cfg.confidence,
        resamples=cfg.bootstrap_resamples,
        seed=cfg.seed if seed is None else seed,
    )
    allowed = margin(settings, name)
    return SuiteResult(
        name=name,
        kind="prompts",
        challenger=float(np.mean(ours)),
        champion=float(np.mean(theirs)),
        difference=interval,
        conclusive=True,
        passed=interval.low > -allowed,
        n=len(ours),
        margin=allowed,
    )


# A census's difference is a difference of two shares of the same count: compared in units of one
# question, a loss of exactly the margin (0.98 - 1.0 = -0.020000000000000018 in floating point) passes.
_CENSUS_SLACK = 1e-9


def census(
    name: str, ours: list[float], theirs: list[float], settings: Settings, seed: int | None = None
) -> SuiteResult:
    """A census's verdict from both models' scores of every question of the set, each asked once
    greedily: no sampling noise on that set, so the difference of the shares right is exact, an
    interval with low = high = estimate, and the suite passes iff it is at least −margin (a loss of
    exactly the margin passes). `seed` is unused: nothing is resampled."""
    n = len(ours)
    if n == 0 or len(theirs) != n:
        raise GateError(f"suite {name}: a census needs both models' scores of the same questions")
    lost = sum(theirs) - sum(ours)  # net questions lost, in questions
    estimate = -lost / n
    allowed = margin(settings, name)
    return SuiteResult(
        name=name,
        kind="prompts",
        challenger=float(np.mean(ours)),
        champion=float(np.mean(theirs)),
        difference=Interval(estimate=estimate, low=estimate, high=estimate, n=n),
        conclusive=True,
        passed=census_passes(lost, n, allowed),
        n=n,
        margin=allowed,
        census=True,
    )


def census_passes(lost: float, n: int, allowed: float) -> bool:
    """Whether a census that lost `lost` questions net of `n` is within `allowed` (at most
    allowed × n questions, a loss of exactly the margin included)."""
    return lost <= allowed * n + _CENSUS_SLACK


class OpeVerdicts(NamedTuple):
    """What `ope_suite` found: the verdict on the reward, the alarms it feeds, the estimate against
    the anchor (None without one) and the guard on the spec's primary term (ope_primary)."""

    suite: SuiteResult
    alarms: list[Alarm]
    anchored: SuiteResult | None
    primary: SuiteResult


def ope_suite(
    settings: Settings,
    store: Store,
    challenger: ope.Weights,
    champion: ope.Weights,
    seed: int | None = None,
    anchor: ope.Weights | None = None,
    sample: gate_dr.Sampler | None = None,
    tenant: str | None = None,
) -> OpeVerdicts:
    """The off-policy suite on the store's held-out traffic, the alarms it feeds (kl, no_feedback),
    with `anchor` the same estimate of challenger − anchor (not yet `against_anchor`'s verdict: its
    margin is the caller's), and the ope_primary guard (`_ope_primary`, SNIPS always); `seed` is the
    bootstrap's (default `gate.seed`). The reward verdicts read the episodes ``gate.ope.episodes``
    keeps (`_reward_verdicts`: the rated ones by default), the alarms every usable one. The estimator
    is ``gate.ope.estimator``'s (deployer/gate_dr.py `choose`); the doubly robust one samples the
    held-out prompts with `sample` (deployer/gate.py's, on staging), and without it SNIPS decides.
    `tenant`: the held-out traffic of that tenant's adapter line only (None: the global line's)."""
    cfg = settings.gate
    spec = get_spec(settings.labeler.reward_spec)
    episodes, newest = _heldout(settings, store, spec.spec_id, tenant)
    logged, skipped = ope.usable(episodes)
    skipped_note = f"; {skipped} held-out episodes could not be rescored" if skipped else ""
    if len(logged) < 2:
        note = f"{len(logged)} usable held-out episodes under {spec.spec_id}{skipped_note}"
        empty = _inconclusive("ope", settings, len(logged), note)
        primary = _inconclusive("ope_primary", settings, 0, note, guard=True)
        return OpeVerdicts(empty, [], empty if anchor is not None else None, primary)
    chal_scored = ope.sequence_logprobs(challenger, logged)
    champ_scored = ope.sequence_logprobs(champion, logged)
    chal, champ = ope.challenger_logprobs(chal_scored, champ_scored), champ_scored.processed
    # ope_primary keeps the episodes carrying the primary term: a term of feedback or of the judge,
    # so they are rated ones whatever gate.ope.episodes says.
    primary = _ope_primary(settings, logged, chal, champ, seed, skipped_note)
    logps = {"challenger": chal, "champion": champ}
    if anchor is not None:  # the anchor's weights the same way as the challenger's: from the champion's
        logps["anchor"] = ope.challenger_logprobs(ope.sequence_logprobs(anchor, logged), champ_scored)
    suite, anchored = _reward_verdicts(
        settings, logged, logps, cfg.seed if seed is None else seed, skipped_note, sample, champion
    )
    # The alarms read the newest usable episodes, rated or not (the no_feedback alarm is about the
    # unrated; the older rated ones `_heldout` adds would skew it), and conclude on their own
    # weights' effective sample size: SNIPS's on those.
    sample_ = np.asarray([e.episode_id in newest for e in logged])
    found: list[Alarm] = []
    behaviour = np.asarray([e.behaviour for e in logged])[sample_]
    w0 = importance_weights(np.asarray(champ)[sample_], behaviour, cfg.ope.clip)
    w1 = importance_weights(np.asarray(chal)[sample_], behaviour, cfg.ope.clip)
    ess0, ess1 = effective_sample_size(w0), effective_sample_size(w1)
    if ess0 >= cfg.ope.min_ess:
        # KL(champion || challenger) per token: champion-weighted log-ratio over champion-weighted tokens,
        # on the tempered logprobs (no truncation): a logged token that left the challenger's nucleus
        # is a large move, counted as such, not an infinite one (docs/gate.md, Alarms).
        gap = (np.asarray(champ_scored.tempered) - np.asarray(chal_scored.tempered))[sample_]
        kept = np.isfinite(np.asarray(champ)[sample_])
        tokens = np.asarray([e.tokens for e in logged], dtype=np.float64)[sample_]
        kl = snips(w0[kept], gap[kept]) / max(snips(w0[kept], tokens[kept]), 1.0)
        found.append(alarms.kl_alarm(kl, cfg.alarms, settings.trainer.max_kl))
    if min(ess0, ess1) >= cfg.ope.min_ess:  # the no_feedback alarm weighs by SNIPS's weights
        silent = np.asarray([float(e.no_feedback) for e in logged])[sample_]
        found.append(alarms.no_feedback_alarm(snips(w1, silent), snips(w0, silent), cfg.alarms))
    return OpeVerdicts(suite, found, anchored, primary)


def _heldout(
    settings: Settings, store: Store, spec_id: str, tenant: str | None
) -> tuple[list[TrainingEpisode], set[str]]:
    """The held-out episodes the ope suite scores, and the ids of the alarms' sample among them: the
    newest ``gate.ope.max_episodes`` (the alarms' sample), and under ``gate.ope.episodes`` rated also
    the newest ``max_episodes`` rated ones, which may be older. Selected after the filter, the rated
    verdicts get up to ``max_episodes`` episodes at any feedback rate, not the rated share of the
    newest; the price is up to twice the forward passes when the rated are sparse."""
    cfg = settings.gate.ope
    episodes = store.select_heldout(
        cfg.max_episodes, spec_id=spec_id, holdout_percent=cfg.holdout_percent, tenant=tenant
    )
    newest = {e.episode_id for e in episodes}
    if cfg.episodes == "rated":
        rated = store.select_heldout(
            cfg.max_episodes,
            spec_id=spec_id,
            holdout_percent=cfg.holdout_percent,
            rated_only=True,
            tenant=tenant,
        )
        episodes = episodes + [e for e in rated if e.episode_id not in newest]
    return episodes, newest


def _reward_verdicts(
    settings: Settings,
    logged: list[ope.Logged],
    logps: dict[str, list[float]],
    seed: int,
    skipped_note: str,
    sample: gate_dr.Sampler | None,
    champion: ope.Weights,
) -> tuple[SuiteResult, SuiteResult | None]:
    """The ope verdicts on the reward, against the champion and (with "anchor" in `logps`) the anchor,
    on the episodes ``gate.ope.episodes`` keeps (`rated`): SNIPS's, then ``gate.ope.estimator``'s
    choice (deployer/gate_dr.py `choose`). Rated only, fewer than ``gate.ope.min_ess`` of them is
    inconclusive: no weights on them could reach that effective sample size."""
    cfg = settings.gate.ope
    keep = kept_episodes(settings, logged)
    unrated = len(logged) - len(keep)
    if cfg.episodes == "rated":
        counts = (
            f"rated episodes only (gate.ope.episodes rated): {len(keep)} of {len(logged)} usable held-out "
            f"episodes kept, {unrated} left out as unrated (no feedback, no judge's grade)"
        )
    else:
        silent = sum(not carries_signal(e.no_feedback, e.components) for e in logged)
        counts = f"every usable held-out episode (gate.ope.episodes all), {silent} of them unrated"
    if cfg.episodes == "rated" and len(keep) < max(math.ceil(cfg.min_ess), 2):
        note = f"{counts}: fewer than gate.ope.min_ess {cfg.min_ess:g}{skipped_note}"
        empty = _inconclusive("ope", settings, len(keep), note).model_copy(update={"unrated": unrated})
        return empty, empty if "anchor" in logps else None
    kept = [logged[i] for i in keep]
    kept_logps = {model: [lp[i] for i in keep] for model, lp in logps.items()}
    chal = kept_logps["challenger"]
    suite, _ = _ope_verdict(settings, kept, chal, kept_logps["champion"], seed, skipped_note, "champion")
    anchored = None
    if "anchor" in kept_logps:
        anchored, _ = _ope_verdict(settings, kept, chal, kept_logps["anchor"], seed, skipped_note, "anchor")
    suite, anchored = gate_dr.choose(
        settings,
        kept,
        kept_logps,
        (suite, anchored),
        sample,
        lambda: ope.completion_texts(champion, kept),
        seed,
    )

    def counted(result: SuiteResult) -> SuiteResult:
        return result.model_copy(update={"note": f"{counts}; {result.note}", "unrated": unrated})

    return counted(suite), counted(anchored) if anchored is not None else None


def kept_episodes(settings: Settings, logged: list[ope.Logged]) -> list[int]:
    """Indices of the episodes the ope verdicts estimate on: under ``gate.ope.episodes`` rated those
    whose reward carries a signal (schemas/rewards.py `carries_signal`: user feedback or a judge's
    grade, as the trainer's ``min_signal`` counts), under all every one."""
    if settings.gate.ope.episodes == "all":
        return list(range(len(logged)))
    return [i for i, e in enumerate(logged) if carries_signal(e.no_feedback, e.components)]


def _inconclusive(name: str, settings: Settings, n: int, note: str, guard: bool = False) -> SuiteResult:
    """An off-policy verdict that could not be reached (too little held-out traffic), with why."""
    return SuiteResult(
        name=name,
        kind="ope",
        challenger=None,
        champion=None,
        difference=None,
        conclusive=False,
        passed=None,
        n=n,
        margin=margin(settings, name),
        note=note,
        guard=guard,
    )


def _ope_primary(
    settings: Settings,
    logged: list[ope.Logged],
    challenger: list[float],
    champion: list[float],
    seed: int | None,
    skipped_note: str,
) -> SuiteResult:
    """ope_primary: the off-policy estimate with the reward spec's primary term (`RewardSpec.primary`)
    as each episode's value instead of its reward, on the held-out episodes that carry the term (the
    others left out), inconclusive below ``gate.ope.min_primary`` of them. A guard: it can fail a
    challenger that wins the reward by losing the primary signal, and never passes one alone."""
    spec = get_spec(settings.labeler.reward_spec)
    if spec.primary is None:
        return _inconclusive("ope_primary", settings, 0, f"reward spec {spec.spec_id} names no primary", True)
    keep = [i for i, e in enumerate(logged) if spec.primary_value(e.components) is not None]
    least = settings.gate.ope.min_primary
    if len(keep) < max(least, 2):
        note = (
            f"{len(keep)} of {len(logged)} held-out episodes carry {spec.primary} (the primary of "
            f"{spec.spec_id}), fewer than gate.ope.min_primary {least}"
        )
        return _inconclusive("ope_primary", settings, len(keep), note, guard=True)
    values = [spec.primary_value(logged[i].components) for i in keep]
    suite, _ = _ope_verdict(
        settings,
        [logged[i] for i in keep],
        [challenger[i] for i in keep],
        [champion[i] for i in keep],
        seed,
        skipped_note,
        "champion",
        values=[v for v in values if v is not None],
        name="ope_primary",
    )
    note = (
        f"{spec.primary} (the primary of {spec.spec_id}) on {len(keep)} of {len(logged)} held-out episodes; "
    )
    return suite.model_copy(update={"guard": True, "note": note + suite.note})


def _ope_verdict(
    settings: Settings,
    logged: list[ope.Logged],
    challenger: list[float],
    other: list[float],
    seed: int | None,
    skipped_note: str,
    other_name: str,
    values: list[float] | None = None,
    name: str = "ope",
) -> tuple[SuiteResult, OffPolicy]:
    """The off-policy verdict `name` of challenger − `other` (the champion, or the anchor) on `logged`,
    of each episode's reward, or of `values` (one per episode) when given."""
    cfg = settings.gate
    estimate = off_policy(
        [e.reward for e in logged] if values is None else values,
        [e.behaviour for e in logged],
        challenger,
        other,
        clip=cfg.ope.clip,
        confidence=cfg.confidence,
        resamples=cfg.bootstrap_resamples,
        seed=cfg.seed if seed is None else seed,
    )
    ess = min(estimate.ess_challenger, estimate.ess_champion)
    conclusive = ess >= cfg.ope.min_ess
    note = (
        f"{len(logged)} held-out episodes, effective sample size challenger {estimate.ess_challenger:.1f}, "
        f"{other_name} {estimate.ess_champion:.1f} (min {cfg.ope.min_ess:g}); weights clipped at "
        f"{cfg.ope.clip:g}: {estimate.clipped_challenger:.0%} of the challenger's, "
        f"{estimate.clipped_champion:.0%} of the {other_name}'s, difference without clipping "
        f"{estimate.unclipped_difference:+.4f}{skipped_note}"
    )
    suite = SuiteResult(
        name=name,
        kind="ope",
        challenger=estimate.challenger,
        champion=estimate.champion,
        difference=estimate.difference,
        conclusive=conclusive,
        passed=(estimate.difference.low > -margin(settings, name)) if conclusive else None,
        n=len(logged),
        ess=ess,
        margin=margin(settings, name),
        note=note,
    )
    return suite, estimate


def against_anchor(result: SuiteResult, anchor: int, settings: Settings) -> SuiteResult:
    """A suite's challenger-vs-anchor verdict (a prompt suite's, or ope's), under its `anchor_margin`
    (a census's: at least −margin, as `census`)."""
    allowed = anchor_margin(settings, result.name)
    difference = result.difference
    if not result.conclusive:
        passed: bool | None = None
    elif difference is None:
        passed = False
    elif result.census:
        passed = census_passes(-difference.estimate * result.n, result.n, allowed)
    else:
        passed = difference.low > -allowed
    return result.model_copy(
        update={
            "name": f"{result.name}_anchor",
            "against_anchor": True,
            "margin": allowed,
            "passed": passed,
            "note": (
                f"challenger vs the anchor v{anchor} (the champion column is the anchor's)"
                + (f"; {result.note}" if result.note else "")
            ),
        }
    )
