"""The eval gate: may the challenger replace the champion? (docs/gate.md)

Suites, each an estimate of challenger − champion with a one-sided lower confidence bound
(evals/stats.py), and behaviour alarms (deployer/alarms.py). The challenger passes when every
*conclusive* suite is non-inferior (lower bound above ``−gate.tolerance``), at least one suite is
conclusive, and no alarm fired. The suites (``gate.suites``, plus ``gate.offline``):

- ``ope``: off-policy evaluation on held-out logged traffic, the one that needs no oracle. A fixed
  slice of episodes (``gate.ope.holdout_percent`` by a hash of the episode id) is never trained on;
  the challenger's and the champion's sequence log-probabilities of those logged completions
  (deployer/ope.py, a transformers forward pass) reweight the users' rewards, on the rated episodes
  by default (``gate.ope.episodes``). Inconclusive below ``gate.ope.min_ess`` effective samples (too
  little traffic, or a challenger too far from what was logged: the KL alarm covers the latter).
- ``retention``: the task's held-out questions scored by their known answers (evals/suites.py); by
  default all of them asked once greedily, a census whose verdict is exact (``gate.retention``), and
  beside it ``retention_sampled``: each sampled ``gate.retention.sampled_k`` times, bootstrapped.
- ``oracle``: the task's preference function (``gate.preference``): only where one exists, such as
  the demo's simulated users.
- ``traffic``: the prompts of held-out logged traffic, drawn per challenger (deployer/traffic.py),
  graded by the judge, or without one by whether the answer is one and finishes.
- ``episodes``: whole agent episodes (``gate.episodes.scenario``) from the task's held-out questions,
  played through each model and scored on their final answers (deployer/episodes.py).
- offline JSONL suites with exact / contains / regex / function scorers.

Each suite's verdict is scored in deployer/gate_suites.py; this module samples, decides and records.

Prompt suites generate on the *staging* vLLM server (``settings.vllm.staging_server``, never in
front of users): the gate swaps it to the challenger with the same verified swap the fleet gets (so
a checkpoint that does not load or does not match its probe fails here, before any user sees it),
samples every suite's prompts, then does the same for the champion. Both sample with the served
model's defaults and the same seed, so both see the same sampling noise; a greedy suite's prompts
are asked once each at temperature 0. The seed, and the task's
held-out questions the suites use, are drawn afresh per challenger (`draw_seed`: a hash of
``gate.seed``, the registry model and the version; ``gate.fresh_draws`` off pins ``gate.seed`` and
the first questions), so no challenger is tuned to one fixed set; both are in the decision. While
the challenger is loaded, the staging server's `/weight_checker` digests are recorded in the store
as the version's baseline for the fleet's swap verification. One gate run at a time per store, on
any host: the staging server is held by the store's "staging" lock. The gate uses the one-server swap's
public interface (deployer/swap.py: `target`, `swap_server`, `server_client`, `rollout_lock`,
`save_digests` / `load_digests`), never the fleet's rollout.

Every decision is kept in the store (`rtrl gate explain VERSION` prints it) and in MLflow: tags on
the model version, and metrics and the decision JSON on the challenger's run when it is known.
Called by the worker's chain (worker/chain.py) after a cycle registers a challenger, and by
``rtrl gate run``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

import evals
from deployer import alarms, episodes, gate_dr, gate_margins, metrics, ope, swap, traffic, trust
from deployer.alarms import Alarm, Behaviour
from deployer.errors import GateError
from deployer.gate_suites import (
    TASK_SUITES,
    SuiteResult,
    against_anchor,
    ope_suite,
    prompt_suites,
    score_prompts,
)
from deployer.swap import NO_WAIT, LockWait
from evals.suites import PromptSuite
from registry import Registry
from schemas.clock import utcnow
from schemas.sampling import served_defaults
from schemas.settings import Settings
from serving import AdapterError, Generation, VllmClient
from store import Store


class GateDecision(BaseModel):
    """The gate's verdict on one challenger, with the numbers behind it."""

    model_config = ConfigDict(frozen=True)

    passed: bool
    challenger_version: int
    champion_version: int
    anchor_version: int | None = Field(
        None, description="The fixed version also compared on `gate.anchor_suites`."
    )
    challenger_score: float | None = Field(
        description="The first suite's challenger figure (the headline; every suite is in `suites`)."
    )
    champion_score: float | None
    tolerance: float
    confidence: float
    n_prompts: int = Field(description="Prompts sampled per model over all prompt suites.")
    n_samples: int = Field(description="Completions per model (prompts x samples per prompt).")
    seed: int | None = Field(
        None, description="This run's sampling and bootstrap seed, the same for every model (`draw_seed`)."
    )
    fresh_draw: bool = Field(False, description="Whether `seed` and `draw` were drawn for this challenger.")
    draw: list[int] = Field(
        default_factory=list,
        description="The task's held-out questions its drawn suites used: indices into `Task.heldout_questions()` "
        "(empty without a task suite, or when the only one is a census).",
    )
    census: list[str] = Field(
        default_factory=list,
        description="The suites that were a census: every held-out question asked greedily, nothing drawn "
        "for them (`draw` is the other task suites').",
    )
    traffic_draw: list[str] = Field(
        default_factory=list,
        description="The held-out episodes whose first prompts the traffic suite replayed (empty without it).",
    )
    suites: list[SuiteResult] = Field(default_factory=list)
    alarms: list[Alarm] = Field(default_factory=list)
    behaviour: dict[str, Behaviour] = Field(
        default_factory=dict,
        description="challenger / champion: their generations; anchor: the anchor's on the anchored suites.",
    )
    reason: str
    decided_at: datetime


def decide(suites: list[SuiteResult], fired: list[Alarm]) -> tuple[bool, str]:
    """Pass when at least one suite against the champion that is not a guard is conclusive, every
    conclusive one (the anchored ones and the guards too) is non-inferior (lower bound above −its
    margin), no alarm fired."""
    problems = [f"alarm {a.name}: {a.detail} (threshold {a.threshold:.3g})" for a in fired]
    for suite in suites:
        if suite.conclusive and not suite.passed:
            if suite.difference is None:  # it could not measure and its policy is to block (a judge outage)
                problems.append(f"suite {suite.name}: {suite.note}")
            else:
                bound = "census" if suite.census else "lower bound"
                problems.append(
                    f"suite {suite.name}: challenger - champion {suite.difference.estimate:+.4f}, "
                    f"{bound} {suite.difference.low:+.4f} {'<' if suite.census else '<='} -{suite.margin:g}"
                )
    # A verdict against the anchor bounds losses, and a guard (ope_primary) holds one term: neither stands
    # in for a comparison of the whole with the champion.
    if not any(s.conclusive for s in suites if not s.against_anchor and not s.guard):
        problems.append("no suite was conclusive: " + "; ".join(f"{s.name}: {s.note}" for s in suites))
    if problems:
        return False, "; ".join(problems)
    parts = [
        f"{s.name} {s.difference.estimate:+.4f} (lower bound {s.difference.low:+.4f})"
        for s in suites
        if s.conclusive and s.difference is not None
    ]
    return True, "non-inferior on " + ", ".join(parts) + "; no alarm"


def draw_seed(base: int, model: str, version: int) -> int:
    """The gate's seed for version `version` of registry model `model`: 31 bits of the SHA-256 of
    ``gate.seed`` and the two, the same in every process and Python version (not `hash()`), different
    for each challenger, and the same when one challenger is judged again (docs/gate.md, Fresh draws)."""
    digest = hashlib.sha256(f"rtrl gate draw\0{base}\0{model}\0{version}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def _generate(
    server: VllmClient, settings: Settings, suites: list[PromptSuite], seed: int
) -> list[list[list[Generation]]]:
    """Every suite's prompts sampled on `server` (`PromptSuite.per_prompt`: a greedy suite's once each at
    temperature 0, the served defaults' penalties kept); suites with the same prompts, decoding and
    count share one request."""
    cache: dict[tuple[tuple[str, ...], int, tuple[str, ...], bool, int], list[list[Generation]]] = {}
    out = []
    for suite in suites:
        n = suite.per_prompt(settings.gate.samples_per_prompt)
        key = (suite.prompts, suite.max_tokens, suite.stop, suite.greedy, n)
        if key not in cache:
            defaults = served_defaults(settings)
            cache[key] = server.sample(
                list(suite.prompts),
                max_tokens=suite.max_tokens,
                n=n,
                seed=seed,
                stop=list(suite.stop),
                sampling={**defaults, "temperature": 0.0} if suite.greedy else defaults,
            )
        out.append(cache[key])
    return out


def _behaviour(
    suites: list[PromptSuite], generated: list[list[list[Generation]]], settings: Settings
) -> Behaviour:
    """One model's behaviour over the generations of every suite that counts in it
    (`PromptSuite.in_behaviour`: not retention_sampled's many samples of the same questions), each
    judged with its prompt's known answers; the entropy estimate from the sampled suites' only (not a
    greedy suite's argmaxes)."""
    flat = [
        (g, suite.lines[i].get("answers", ()), not suite.greedy)
        for suite, per_suite in zip(suites, generated, strict=True)
        if suite.in_behaviour
        for i, per_prompt in enumerate(per_suite)
        for g in per_prompt
    ]
    return alarms.behaviour(
        [g for g, _, _ in flat],
        settings.gate.alarms.no_action_pattern,
        [a for _, a, _ in flat],
        [s for _, _, s in flat],
    )


def _load(server: VllmClient, target: swap.Target, settings: Settings, store: Store) -> None:
    """`target` on the staging server with the verified swap (GateError when it does not verify);
    its digests recorded as the version's baseline for the fleet's swaps."""
    step, digests = swap.swap_server(server, target, settings, restore=None)
    if not step.verified:
        raise GateError(f"v{target.version} does not load correctly on the staging server: {step.error}")
    if digests:  # none for an adapter (`swap.swap_server`)
        swap.save_digests(settings, store, target.version, digests)


def anchor_version(settings: Settings, registry: Registry, champion: int) -> int | None:
    """The version `gate.anchor` names, unless it is the champion itself (or none is configured)."""
    spec = settings.gate.anchor
    if spec == "none":
        return None
    versions = registry.versions()
    anchor = min(versions) if spec == "base" else int(spec)
    if anchor not in versions:
        raise GateError(
            f"gate.anchor names v{anchor}, which is not registered under {settings.mlflow.model_name!r}"
        )
    return None if anchor == champion else anchor


@dataclass(frozen=True)
class _Plan:
    """What one gate run compares: the versions, the prompt suites, and the run's draw."""

    challenger: int
    champion: int
    anchor: int | None  # the anchor version, None when no suite runs on one
    suites: list[PromptSuite]
    anchored: list[int]  # indices into `suites` of those also sampled on the anchor
    seed: int  # sampling and bootstrap seed of every model in this run
    fresh: bool  # `seed` and `draw` drawn for this challenger (gate.fresh_draws)
    draw: list[int]  # the task's held-out questions (Task.heldout_draw) its suites use
    traffic_draw: list[str] = field(default_factory=list)  # held-out episodes the traffic suite replays
    # Verdicts reached with nothing to sample: the traffic suite with too little held-out traffic.
    unsampled: list[SuiteResult] = field(default_factory=list)
    episodes: episodes.EpisodeSuite | None = None  # the agent episodes each model plays (not the anchor)
    lock_wait: LockWait = NO_WAIT  # how to wait for the "staging" lock (`swap.rollout_lock`)


@dataclass
class _Staged:
    """What the staging server produced for each model ("challenger", "anchor", "champion")."""

    generated: dict[str, list[list[list[Generation]]]] = field(default_factory=dict)  # per suite, per prompt
    played: dict[str, list[list[episodes.Played]]] = field(default_factory=dict)  # per question, per sample
    targets: dict[str, swap.Target] = field(default_factory=dict)
    load_failure: str | None = None  # why the challenger did not load; nothing generated for it then


def evaluate(
    settings: Settings, registry: Registry, version: int, store: Store, *, lock_wait: LockWait = NO_WAIT
) -> GateDecision:
    """Judge challenger `version` against the champion and record the decision (docs/gate.md).

    A challenger that does not load and verify on staging fails the gate (recorded, no raise).
    Raises GateError when the gate cannot run at all (no staging server, a suite that cannot be
    loaded, the champion fails to load), and RolloutBusy when another process (a gate run, the
    reconciler aligning staging) holds the staging server past `lock_wait` (`NO_WAIT`: at once;
    `WaitStopped` when its `stopping` ended the wait). The `store` holds the staging lock, the
    recorded digests, the held-out traffic of the ope and traffic suites and the decision.
    """
    staging = settings.vllm.staging_server
    if staging is None:
        raise GateError(
            "settings.vllm.staging_server is not set; the gate never generates on serving servers"
        )
    plan = replace(_plan(settings, registry, version, store), lock_wait=lock_wait)
    staged = _sample_on_staging(settings, registry, store, staging, plan)
    if staged.load_failure is None:
        results, found, behaviour = _score(settings, store, plan, staged)
        passed, reason = decide(results, [a for a in found if a.fired])
    else:
        results, found, behaviour = [], [], {}
        passed, reason = False, staged.load_failure
    decision = _decision(settings, plan, results, found, behaviour, passed, reason)
    metrics.record_gate(passed, cause(decision), decision.challenger_score, decision.champion_score)
    record(settings, registry, decision, store)
    return decision


def _plan(settings: Settings, registry: Registry, version: int, store: Store) -> _Plan:
    """The champion, the anchor (`gate.anchor`) when a suite of `gate.anchor_suites` is configured,
    the run's seed and draw, and the prompt suites; raises GateError on a bad suite or anchor."""
    cfg = settings.gate
    champion = trust.champion(registry, store)  # rtrl's record, not an alias moved by hand
    anchor = anchor_version(settings, registry, champion)
    seed, drawn = run_draw(settings, registry.model_name, version)
    suites = [s for s, _ in prompt_suites(settings, seed if cfg.fresh_draws else None)]
    replayed = traffic.traffic_suite(settings, store, seed if cfg.fresh_draws else None, registry.tenant)
    suites.extend([replayed.suite] if replayed.suite is not None else [])
    anchored = (
        [i for i, s in enumerate(suites) if gate_margins.anchored(settings, s.name)]
        if anchor is not None
        else []
    )
    ope_anchored = "ope" in cfg.suites and "ope" in cfg.anchor_suites
    return _Plan(
        version,
        champion,
        anchor if anchored or ope_anchored else None,
        suites,
        anchored,
        seed,
        cfg.fresh_draws,
        drawn,
        replayed.episodes,
        [replayed.verdict] if replayed.verdict is not None else [],
        episodes.episode_suite(settings, seed if cfg.fresh_draws else None),
    )


def run_draw(settings: Settings, model: str, version: int) -> tuple[int, list[int]]:
    """The seed of a gate run on `version` and the task's held-out questions its drawn task suites
    use (`Task.heldout_draw` indices; none without a task suite, or when the only one is a
    retention census): drawn for the challenger under ``gate.fresh_draws``, else ``gate.seed`` and
    the first ones. Draws of several sizes are nested (the lowest-ranked `n`), so the largest is
    the union of what every suite asked."""
    cfg = settings.gate
    seed = draw_seed(cfg.seed, model, version) if cfg.fresh_draws else cfg.seed
    if not set(TASK_SUITES) & set(cfg.suites):
        return seed, []
    try:  # what prompt_suites takes with the same seed
        task = evals.get_task(cfg.task)
        sizes = [cfg.eval_prompts] if {"oracle", "judge", "episodes"} & set(cfg.suites) else []
        everything = len(task.heldout_questions())
        asked = cfg.retention.questions or everything
        if "retention" in cfg.suites and not (cfg.retention.decode == "greedy" and asked == everything):
            sizes.append(asked)  # a census draws nothing
        return seed, task.heldout_draw(max(sizes), seed if cfg.fresh_draws else None) if sizes else []
    except evals.TaskError as exc:
        raise GateError(str(exc)) from exc


def _sample_on_staging(
    settings: Settings, registry: Registry, store: Store, staging: str, plan: _Plan
) -> _Staged:
    """Under the store's "staging" lock, swap the staging server to the challenger, the anchor (when
    a suite is anchored) and the champion in turn, with the verified swap, and sample the suites on
    each. A challenger that does not load is recorded in `load_failure`; the others must load."""
    staged = _Staged()
    with plan.lock_wait.hold(store, "staging", f"gate v{plan.challenger}"):
        with swap.server_client(settings, staging) as server:
            try:
                staged.targets["challenger"] = swap.target(settings, registry, store, plan.challenger)
                _load(server, staged.targets["challenger"], settings, store)
                _sample(server, settings, plan, staged, "challenger")
            except (GateError, AdapterError) as exc:
                staged.load_failure = str(exc)  # a challenger that does not load fails the gate; recorded
            if plan.anchor is not None and staged.load_failure is None:
                staged.targets["anchor"] = swap.target(settings, registry, store, plan.anchor)
            if plan.anchored and "anchor" in staged.targets:  # ope's anchor needs its weights, not staging
                _load(server, staged.targets["anchor"], settings, store)
                staged.generated["anchor"] = _generate(
                    server, settings, [plan.suites[i] for i in plan.anchored], plan.seed
                )
            # The champion runs last so the staging server ends on it, matching the fleet.
            staged.targets["champion"] = swap.target(settings, registry, store, plan.champion)
            _load(server, staged.targets["champion"], settings, store)
            _sample(server, settings, plan, staged, "champion")
    return staged


def _sample(server: VllmClient, settings: Settings, plan: _Plan, staged: _Staged, model: str) -> None:
    """`model`'s generations of every prompt suite and its episodes, on the server it is loaded on."""
    staged.generated[model] = _generate(server, settings, plan.suites, plan.seed)
    if plan.episodes is not None:
        staged.played[model] = episodes.play_on(server, settings, plan.episodes, plan.seed)


def _score(
    settings: Settings, store: Store, plan: _Plan, staged: _Staged
) -> tuple[list[SuiteResult], list[Alarm], dict[str, Behaviour]]:
    """Every suite's verdict (the prompt suites, their anchored copies, ope) in ``gate.suites`` order,
    the alarms (behaviour first, then ope's), and each model's behaviour."""
    cfg = settings.gate
    generated = staged.generated
    results = [
        score_prompts(suite, generated["challenger"][i], generated["champion"][i], settings, plan.seed)
        for i, suite in enumerate(plan.suites)
    ]
    for position, index in enumerate(plan.anchored):
        assert plan.anchor is not None
        versus = score_prompts(
            plan.suites[index],
            generated["challenger"][index],
            generated["anchor"][position],
            settings,
            plan.seed,
        )
        results.append(against_anchor(versus, plan.anchor, settings))
    if plan.episodes is not None:
        played = staged.played
        results.append(
            episodes.score_episodes(
                plan.episodes, played["challenger"], played["champion"], settings, plan.seed
            )
        )
    behaviour, found = _behaviour_alarms(settings, plan, generated)
    if "ope" in cfg.suites:
        chal, champ = staged.targets["challenger"], staged.targets["champion"]
        anchor = staged.targets.get("anchor") if "ope" in cfg.anchor_suites else None
        verdicts = ope_suite(
            settings,
            store,
            ope.Weights(chal.path, chal.base),
            ope.Weights(champ.path, champ.base),
            plan.seed,
            anchor=ope.Weights(anchor.path, anchor.base) if anchor is not None else None,
            sample=_ope_sampler(settings, store, plan, staged),
            tenant=chal.tenant,  # a tenant line's own held-out traffic (docs/lora.md)
        )
        results.extend((verdicts.suite, verdicts.primary))  # ope_primary: a guard on the spec's primary term
        if verdicts.anchored is not None and plan.anchor is not None:  # the users' reward, against the anchor
            results.append(against_anchor(verdicts.anchored, plan.anchor, settings))
        found.extend(verdicts.alarms)
    results.extend(plan.unsampled)
    order: dict[str, int] = {name: i for i, name in enumerate(cfg.suites)}
    results.sort(key=lambda s: order.get(s.name, len(order)))
    return results, found, behaviour


def _ope_sampler(settings: Settings, store: Store, plan: _Plan, staged: _Staged) -> gate_dr.Sampler:
    """The ope suite's staging sampler for its doubly robust estimate (deployer/gate_dr.py): called
    only when SNIPS is not enough, after the prompt suites' sampling; under the "staging" lock again,
    each model asked for is loaded with the verified swap and samples ``gate.ope.dr_samples``
    completions of each held-out prompt with the run's seed, the champion last so that staging ends
    on it, as `_sample_on_staging` leaves it."""
    staging = settings.vllm.staging_server
    assert staging is not None  # `evaluate` refuses to run without one

    def sample(
        models: Sequence[str], prompts: Sequence[gate_dr.DrPrompt]
    ) -> dict[str, list[list[Generation]]]:
        out: dict[str, list[list[Generation]]] = {}
        with plan.lock_wait.hold(store, "staging", f"gate v{plan.challenger} ope"):
            with swap.server_client(settings, staging) as server:
                for model in sorted(models, key=lambda m: m == "champion"):
                    _load(server, staged.targets[model], settings, store)
                    out[model] = gate_dr.sample_on(server, prompts, settings.gate.ope.dr_samples, plan.seed)
        return out

    return sample


def _behaviour_alarms(
    settings: Settings, plan: _Plan, generated: dict[str, list[list[list[Generation]]]]
) -> tuple[dict[str, Behaviour], list[Alarm]]:
    """Each model's behaviour over its generations, and the alarms on them: challenger vs champion
    on every prompt suite, and challenger vs anchor on the anchored ones."""
    cfg = settings.gate
    behaviour: dict[str, Behaviour] = {}
    found: list[Alarm] = []
    if plan.suites:
        for model in ("challenger", "champion"):
            behaviour[model] = _behaviour(plan.suites, generated[model], settings)
        found.extend(alarms.generation_alarms(behaviour["challenger"], behaviour["champion"], cfg.alarms))
    if plan.anchor is not None and plan.anchored:
        on_anchored = [plan.suites[i] for i in plan.anchored]
        behaviour["anchor"] = _behaviour(on_anchored, generated["anchor"], settings)
        challenger_anchored = _behaviour(
            on_anchored, [generated["challenger"][i] for i in plan.anchored], settings
        )
        found.append(
            alarms.no_action_anchor_alarm(challenger_anchored, behaviour["anchor"], plan.anchor, cfg.alarms)
        )
    return behaviour, found


def _decision(
    settings: Settings,
    plan: _Plan,
    results: list[SuiteResult],
    found: list[Alarm],
    behaviour: dict[str, Behaviour],
    passed: bool,
    reason: str,
) -> GateDecision:
    """The decision with the numbers behind it; the first suite with a challenger figure is the headline."""
    cfg = settings.gate
    headline = next((s for s in results if s.challenger is not None), None)
    n_prompts = sum(len(s.prompts) for s in plan.suites)
    n_samples = sum(len(s.prompts) * s.per_prompt(cfg.samples_per_prompt) for s in plan.suites)
    return GateDecision(
        passed=passed,
        challenger_version=plan.challenger,
        champion_version=plan.champion,
        anchor_version=plan.anchor,
        challenger_score=headline.challenger if headline else None,
        champion_score=headline.champion if headline else None,
        tolerance=cfg.tolerance,
        confidence=cfg.confidence,
        n_prompts=n_prompts,
        n_samples=n_samples,
        seed=plan.seed,
        fresh_draw=plan.fresh,
        draw=plan.draw,
        census=[s.name for s in plan.suites if s.census],
        traffic_draw=plan.traffic_draw,
        suites=results,
        alarms=found,
        behaviour=behaviour,
        reason=reason,
        decided_at=utcnow(),
    )


def cause(decision: GateDecision) -> str:
    """Why, in one word: non_inferior, alarm, inferior, inconclusive or challenger_not_loaded."""
    if decision.passed:
        return "non_inferior"
    if not decision.suites:
        return "challenger_not_loaded"
    if any(a.fired for a in decision.alarms):
        return "alarm"
    if any(s.conclusive and not s.passed for s in decision.suites):
        return "inferior"
    return "inconclusive"


def record(
    settings: Settings, registry: Registry, decision: GateDecision, store: Store | None = None
) -> None:
    """The decision in the store (when given), as model version tags, and on the version's run."""
    version = decision.challenger_version
    if store is not None:
        store.record_gate_decision(
            version,
            decision.champion_version,
            decision.passed,
            decision.reason,
            decision.model_dump(mode="json"),
            decision.decided_at,
            model=registry.model_name,
        )
    drawn = [",".join(map(str, decision.draw))] if decision.draw else []  # "fresh 3,7; retention: census"
    drawn += [f"{name}: census" for name in decision.census]
    tags = {
        "gate": "pass" if decision.passed else "fail",
        "gate_cause": cause(decision),
        "gate_reason": decision.reason[:4000],
        "gate_champion_version": str(decision.champion_version),
        "gate_challenger_score": f"{decision.challenger_score}",
        "gate_champion_score": f"{decision.champion_score}",
        "gate_decided_at": decision.decided_at.isoformat(),
        "gate_alarms": ",".join(a.name for a in decision.alarms if a.fired),
        "gate_seed": f"{decision.seed}",
        "gate_draw": ("fresh " if decision.fresh_draw else "fixed ") + "; ".join(drawn),
    }
    for suite in decision.suites:
        verdict = "inconclusive" if not suite.conclusive else "pass" if suite.passed else "fail"
        interval = suite.difference
        tags[f"gate_suite_{suite.name}"] = verdict + (
            f" {interval.estimate:+.4f} [{interval.low:+.4f}, {interval.high:+.4f}]" if interval else ""
        )
        if suite.estimator is not None:  # ope: the estimator that decided (docs/gate.md, Records)
            tags[f"gate_suite_{suite.name}_estimator"] = suite.estimator
    registry.tag_version(version, tags)
    run_id = registry.version_run_id(version)
    if run_id is None:
        return
    figures = {"gate/passed": float(decision.passed)}
    for suite in decision.suites:
        for key, value in (
            (f"gate/{suite.name}/challenger", suite.challenger),
            (f"gate/{suite.name}/champion", suite.champion),
            (f"gate/{suite.name}/low", suite.difference.low if suite.difference else None),
            (f"gate/{suite.name}/ess", suite.ess),
            (f"gate/{suite.name}/dm_r2", suite.r2),
        ):
            if value is not None and math.isfinite(value):
                figures[key] = value
    for alarm in decision.alarms:
        if math.isfinite(alarm.value):
            figures[f"gate/alarm/{alarm.name}"] = alarm.value
    for key, value in (
        ("gate/challenger_score", decision.challenger_score),
        ("gate/champion_score", decision.champion_score),
    ):
        if value is not None:
            figures[key] = value
    registry.log_metrics(run_id, figures)
    files: dict[str, object] = {f"gate/decision-v{version}.json": decision.model_dump(mode="json")}
    digests = swap.load_digests(settings, store, version) if store is not None else None
    if digests is not None:
        files[f"gate/weight_digests-v{version}.json"] = digests
    registry.log_json(run_id, files)
