"""The eval gate: does the challenger score at least as well as the champion on held-out prompts?

Both models generate on the *staging* vLLM server (``settings.vllm.staging_server``, never in
front of users): the gate swaps the staging server to the challenger with the same verified
swap the fleet gets (so a checkpoint that does not load or does not match its probe fails here,
before any user sees it), samples the task's held-out prompts, then does the same for the
champion. The sampling seed is fixed, so both models see the same sampling noise and the
comparison is not swamped by it. Each completion is scored by the oracle the simulator uses:
``task.preference(prompt, completion)`` through the labeler's reward spec.

The challenger passes unless ``challenger_score < champion_score - tolerance``. While it is
loaded, the staging server's `/weight_checker` digests are recorded as the version's baseline
for `deployer.rollout`'s swap verification. The decision is recorded in MLflow: metrics and the
decision JSON on the challenger's run (when its run is known) and tags on the model version.

Called by the trainer chain after a cycle registers a challenger, and by ``rtrl deploy gate``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field

from deployer import registry, rollout
from deployer.errors import GateError
from deployer.fleet import VllmServer
from schemas.settings import Settings

# Same seed for both models: identical sampling noise, so score differences come from the weights.
GATE_SEED = 20240917
GATE_TEMPERATURE = 1.0

Scorer = Callable[[str, str], float]


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


def task_scorer(settings: Settings) -> Scorer:
    """reward(prompt, completion) = reward spec applied to the task's preference signals."""
    from feedback import rewards
    from rtrl.tasks import get_task

    task = get_task(settings.gate.task)
    spec = rewards.get_spec(settings.labeler.reward_spec)

    def scorer(prompt: str, completion: str) -> float:
        return float(rewards.score(spec, task.preference(prompt, completion)).reward)

    return scorer


def _score_version(
    settings: Settings, server: VllmServer, version: int, prompts: list[str]
) -> tuple[float, dict[str, str]]:
    """Swap the staging server to `version` (verified), sample, score; returns (mean, digests)."""
    from rtrl.tasks import get_task

    task = get_task(settings.gate.task)
    step, digests = rollout.swap_server(server, rollout.target(settings, version), settings, restore=None)
    if not step.verified:
        raise GateError(f"v{version} does not load correctly on the staging server: {step.error}")
    samples = server.complete(
        prompts,
        max_tokens=task.max_tokens,
        n=settings.gate.samples_per_prompt,
        temperature=GATE_TEMPERATURE,
        seed=GATE_SEED,
        stop=list(task.stop),
    )
    scorer = task_scorer(settings)
    return mean(
        [scorer(p, c) for p, completions in zip(prompts, samples, strict=True) for c in completions]
    ), digests


def evaluate(settings: Settings, version: int) -> GateDecision:
    """Score challenger `version` against the champion on the staging server and record the decision.

    A challenger that does not load and verify on staging fails the gate (recorded, no raise).
    Raises GateError when the gate cannot run at all (no staging server, the champion fails to load).
    """
    from rtrl.tasks import get_task

    staging = settings.vllm.staging_server
    if staging is None:
        raise GateError(
            "settings.vllm.staging_server is not set; the gate never generates on serving servers"
        )
    champion = registry.champion(settings)
    prompts = get_task(settings.gate.task).heldout_prompts(settings.gate.eval_prompts)
    n_samples = len(prompts) * settings.gate.samples_per_prompt
    tolerance = settings.gate.tolerance
    challenger_score: float | None = None
    load_failure: str | None = None
    with rollout.rollout_lock(settings, "staging"):
        with VllmServer(
            staging, timeout=settings.vllm.request_timeout_s, model=settings.vllm.served_model_name
        ) as server:
            try:
                challenger_score, digests = _score_version(settings, server, version, prompts)
                rollout.save_digests(settings, version, digests)
            except GateError as exc:
                load_failure = str(exc)  # a challenger that does not load fails the gate; recorded below
            # The champion runs last so the staging server ends on it, matching the fleet.
            champion_score, _ = _score_version(settings, server, champion, prompts)
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
        decided_at=datetime.now(UTC),
    )
    record(settings, decision)
    return decision


def record(settings: Settings, decision: GateDecision) -> None:
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
    registry.tag_version(settings, version, tags)
    run_id = registry.run_id(settings, version)
    if run_id is None:
        return
    mlflow_client = registry.client(settings)
    for key, value in (
        ("gate/challenger_score", decision.challenger_score),
        ("gate/champion_score", decision.champion_score),
    ):
        if value is not None:
            mlflow_client.log_metric(run_id, key, value)
    mlflow_client.log_metric(run_id, "gate/passed", float(decision.passed))
    mlflow_client.log_dict(run_id, decision.model_dump(mode="json"), f"gate/decision-v{version}.json")
    digests = rollout.load_digests(settings, version)
    if digests is not None:
        mlflow_client.log_dict(run_id, digests, f"gate/weight_digests-v{version}.json")
