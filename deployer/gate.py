"""The eval gate: does the challenger score at least as well as the champion on held-out prompts?

Both models generate on the *staging* vLLM server (``settings.vllm.staging_server``, never in
front of users): the gate swaps the staging server to the challenger with the same verified
swap the fleet gets (so a checkpoint that does not load or does not match its probe fails here,
before any user sees it), samples the task's held-out prompts, then does the same for the
champion. Both sample with the served model's defaults (`schemas.sampling.served_defaults`,
what a user who sets no sampling parameters gets), and with a fixed seed, so both models see the
same sampling noise and the comparison is not swamped by it. Each completion is scored by the oracle the simulator uses: the
task's preference through the labeler's reward spec (evals/scoring.py).

The challenger passes unless ``challenger_score < champion_score - tolerance``. While it is
loaded, the staging server's `/weight_checker` digests are recorded as the version's baseline
for `deployer.rollout`'s swap verification. The decision is recorded in MLflow: metrics and the
decision JSON on the challenger's run (when its run is known) and tags on the model version.

Called by the trainer chain after a cycle registers a challenger, and by ``rtrl deploy gate``.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

import evals
from deployer import metrics, rollout
from deployer.errors import GateError
from registry import Registry
from schemas.clock import utcnow
from schemas.rewards import get_spec
from schemas.sampling import served_defaults
from schemas.settings import Settings
from serving import VllmClient

# Same seed for both models: identical sampling noise, so score differences come from the weights.
GATE_SEED = 20240917


class GateDecision(BaseModel):
    """The gate's verdict on one challenger, with the numbers behind it."""

    model_config = ConfigDict(frozen=True)

    passed: bool
    challenger_version: int
    champion_version: int
    challenger_score: float | None = Field(
        description="Mean reward over prompts x samples; None if it never ran."
    )
    champion_score: float | None
    tolerance: float
    n_prompts: int
    n_samples: int = Field(description="Completions per model (prompts x samples per prompt).")
    reason: str
    decided_at: datetime


def decide(challenger_score: float, champion_score: float, tolerance: float) -> tuple[bool, str]:
    """Pass unless the challenger is worse than the champion by more than `tolerance`."""
    margin = challenger_score - champion_score
    if challenger_score < champion_score - tolerance:
        return (
            False,
            f"challenger {challenger_score:.4f} < champion {champion_score:.4f} - tolerance {tolerance:g}",
        )
    return True, f"challenger {challenger_score:.4f} vs champion {champion_score:.4f} (margin {margin:+.4f})"


def mean(values: list[float]) -> float:
    if not values:
        raise GateError("no completions were scored")
    return sum(values) / len(values)


def _score_version(
    settings: Settings, registry: Registry, server: VllmClient, version: int, prompts: list[str]
) -> tuple[float, dict[str, str]]:
    """Swap the staging server to `version` (verified), sample, score; returns (mean, digests)."""
    task = evals.get_task(settings.gate.task)
    target = rollout.target(settings, registry, version)
    step, digests = rollout.swap_server(server, target, settings, restore=None)
    if not step.verified:
        raise GateError(f"v{version} does not load correctly on the staging server: {step.error}")
    samples = server.complete(
        prompts,
        max_tokens=task.max_tokens,
        n=settings.gate.samples_per_prompt,
        seed=GATE_SEED,
        sampling=served_defaults(settings),  # as users are served when they set nothing themselves
        stop=list(task.stop),
    )
    scorer = evals.scorer(task.preference, get_spec(settings.labeler.reward_spec))
    return mean(
        [scorer(p, c) for p, completions in zip(prompts, samples, strict=True) for c in completions]
    ), digests


def evaluate(settings: Settings, registry: Registry, version: int) -> GateDecision:
    """Score challenger `version` against the champion on the staging server and record the decision.

    A challenger that does not load and verify on staging fails the gate (recorded, no raise).
    Raises GateError when the gate cannot run at all (no staging server, the champion fails to load).
    """
    staging = settings.vllm.staging_server
    if staging is None:
        raise GateError("settings.vllm.staging_server is not set; the gate never generates on serving servers")
    champion = registry.champion()
    prompts = evals.get_task(settings.gate.task).heldout_prompts(settings.gate.eval_prompts)
    n_samples = len(prompts) * settings.gate.samples_per_prompt
    tolerance = settings.gate.tolerance
    challenger_score: float | None = None
    load_failure: str | None = None
    with rollout.rollout_lock(settings, "staging"):
        with rollout.server_client(settings, staging) as server:
            try:
                challenger_score, digests = _score_version(settings, registry, server, version, prompts)
                if digests:  # none for an adapter (rollout._digests)
                    rollout.save_digests(settings, version, digests)
            except GateError as exc:
                load_failure = str(exc)  # a challenger that does not load fails the gate; recorded below
            # The champion runs last so the staging server ends on it, matching the fleet.
            champion_score, _ = _score_version(settings, registry, server, champion, prompts)
    if challenger_score is None:
        passed, reason = False, load_failure or "challenger was not scored"
    else:
        passed, reason = decide(challenger_score, champion_score, tolerance)
    decision = GateDecision(
        passed=passed,
        challenger_version=version,
        champion_version=champion,
        challenger_score=challenger_score,
        champion_score=champion_score,
        tolerance=tolerance,
        n_prompts=len(prompts),
        n_samples=n_samples,
        reason=reason,
        decided_at=utcnow(),
    )
    metrics.record_gate(passed, challenger_score, champion_score)
    record(settings, registry, decision)
    return decision


def record(settings: Settings, registry: Registry, decision: GateDecision) -> None:
    """Model version tags always; metrics, the decision and the digests on the version's run if known."""
    version = decision.challenger_version
    tags = {
        "gate": "pass" if decision.passed else "fail",
        "gate_reason": decision.reason[:4000],
        "gate_champion_version": str(decision.champion_version),
        "gate_challenger_score": f"{decision.challenger_score}",
        "gate_champion_score": f"{decision.champion_score}",
        "gate_decided_at": decision.decided_at.isoformat(),
    }
    registry.tag_version(version, tags)
    run_id = registry.version_run_id(version)
    if run_id is None:
        return
    figures = {"gate/passed": float(decision.passed)}
    for key, value in (
        ("gate/challenger_score", decision.challenger_score),
        ("gate/champion_score", decision.champion_score),
    ):
        if value is not None:
            figures[key] = value
    registry.log_metrics(run_id, figures)
    files: dict[str, object] = {f"gate/decision-v{version}.json": decision.model_dump(mode="json")}
    digests = rollout.load_digests(settings, version)
    if digests is not None:
        files[f"gate/weight_digests-v{version}.json"] = digests
    registry.log_json(run_id, files)
