"""Simulated users: send a task's prompts through the gateway and give feedback like a user would.

Started by ``rtrl simulate`` or called as `simulate(...)` (the demo does). Each request goes through
the gateway with the official ``openai`` client and an API key, exactly like an application would
(simulation/client.py),
from one of a small population of users (``x-rtrl-session-id: sim-user-<k>``); the tenant is the
key's (the demo's key is tenant ``sim``). The completion is judged by the task's preference
function (evals/tasks.py) and every returned signal is sent to ``/v1/feedback`` for the gateway's
request id, with the same key. The report counts what was sent and what the users thought of it,
per serving policy version.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import httpx

from evals import Preference, Task, get_task
from schemas.events import FeedbackKind, FeedbackSignal
from schemas.rewards import RewardSpec, get_spec, score
from schemas.settings import Settings

from .client import MAX_ERRORS_KEPT, CallFailed, Gateway, fan_out, feedback_body, open_gateway

USERS = 8  # size of the simulated population (sessions)


@dataclass
class SimulationReport:
    """What one simulation run sent and how the simulated users judged the completions."""

    requests: int = 0
    ok: int = 0
    failed: int = 0
    feedback_sent: int = 0
    feedback_failed: int = 0
    accepted: int = 0
    silent: int = 0  # answers the preference had nothing to say about (a non-answer, to most users)
    acceptance_rate: float = 0.0  # accepted / ok
    mean_reward: float | None = None  # under settings.labeler.reward_spec
    per_version: dict[str, int] = field(default_factory=dict)  # ok requests by serving policy version
    accepted_per_version: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few failures, for the operator

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


@dataclass(frozen=True)
class _Outcome:
    ok: bool
    version: str | None = None
    accepted: bool = False
    silent: bool = False
    reward: float | None = None
    feedback_sent: int = 0
    feedback_failed: int = 0
    error: str | None = None  # the request's failure, or its feedback's


def _what_the_user_says(
    signals: list[FeedbackSignal], accepted: bool, rng: random.Random, feedback_rate: float, flip_rate: float
) -> list[FeedbackSignal]:
    """The signals a user sends: nothing (1 − feedback_rate), the opposite verdict (flip_rate of
    the rest), or what they think."""
    if rng.random() >= feedback_rate:
        return []
    if signals and rng.random() < flip_rate:  # the opposite verdict alone: no correction comes with it
        return [FeedbackSignal(kind=FeedbackKind.rejected if accepted else FeedbackKind.accepted)]
    return signals


def simulate(
    settings: Settings,
    gateway_url: str,
    n_requests: int,
    task: Task | str,
    preference: Preference | None = None,
    concurrency: int = 4,
    seed: int = 0,
    *,
    api_key: str,
    feedback_rate: float = 1.0,
    flip_rate: float = 0.0,
    api: Literal["completions", "chat"] = "completions",
) -> SimulationReport:
    """Send `n_requests` of `task`'s training prompts through the gateway and feedback on each.

    `preference` defaults to the task's. With ``api="completions"`` the task's formatted prompt is
    sent to /v1/completions, sampled at temperature 1.0; with ``api="chat"`` the question alone is
    sent to /v1/chat/completions as one user message, as an application would, and the model's own
    chat template and sampling defaults (its generation_config.json, which the gateway fills in)
    apply. Either way with a per-request seed derived from `seed`, so a run is reproducible for
    fixed weights. `api_key` is a tenant key of the gateway (any string when its auth is open).

    Real users are less obliging: only `feedback_rate` of them say anything, and `flip_rate` of
    those say the opposite of what they think (an accepted answer rejected, anything else accepted).
    Both draws are seeded per request. The report's acceptance is what the users *think* (the
    preference's verdict on every answer), whatever they sent.
    """
    if not (0.0 <= feedback_rate <= 1.0 and 0.0 <= flip_rate <= 1.0):
        raise ValueError(f"feedback_rate and flip_rate are in [0, 1]; got {feedback_rate}, {flip_rate}")
    task = get_task(task) if isinstance(task, str) else task
    users = _Users(
        task=task,
        preference=preference or task.preference,
        spec=get_spec(settings.labeler.reward_spec),
        seed=seed,
        feedback_rate=feedback_rate,
        flip_rate=flip_rate,
        api=api,
    )
    questions = task.draw_train_questions(n_requests, seed)
    started = time.monotonic()
    with open_gateway(settings, gateway_url, api_key) as gateway:
        outcomes = fan_out(
            lambda index, question: users.ask(gateway, index, question.text),
            questions,
            concurrency,
            "rtrl-sim",
        )
    return _report(n_requests, outcomes, time.monotonic() - started)


@dataclass(frozen=True)
class _Users:
    """The simulated population of one run: how each asks, judges the answer and gives feedback."""

    task: Task
    preference: Preference
    spec: RewardSpec
    seed: int
    feedback_rate: float
    flip_rate: float
    api: Literal["completions", "chat"]

    def ask(self, gateway: Gateway, index: int, question: str) -> _Outcome:
        """Request `index`: one call from user ``sim-user-<index mod USERS>``, the user's verdict on the
        answer and the feedback they give on it."""
        prompt = self.task.format_prompt(question)
        request_seed = self.seed * 1_000_003 + index
        task, headers = self.task, {"x-rtrl-session-id": f"sim-user-{index % USERS}"}
        try:
            if self.api == "chat":
                reply = gateway.chat(
                    prompt,
                    question,
                    max_tokens=task.max_tokens,
                    stop=task.stop,
                    seed=request_seed,
                    headers=headers,
                )
            else:
                reply = gateway.complete(
                    prompt, max_tokens=task.max_tokens, stop=task.stop, seed=request_seed, headers=headers
                )
        except CallFailed as exc:  # a failed user request is counted and reported, not fatal
            return _Outcome(ok=False, error=f"request {index}: {exc}")
        signals: list[FeedbackSignal] = self.preference(prompt, reply.text)
        accepted = any(s.kind == FeedbackKind.accepted for s in signals)
        said = _what_the_user_says(
            signals, accepted, random.Random(request_seed), self.feedback_rate, self.flip_rate
        )
        sent, failed, error = _send(gateway, reply.request_id, said)
        return _Outcome(
            ok=True,
            version=reply.version,
            accepted=accepted,
            silent=not signals,
            reward=score(self.spec, signals).reward,
            feedback_sent=sent,
            feedback_failed=failed,
            error=error,
        )


def _send(gateway: Gateway, request_id: str, said: Sequence[FeedbackSignal]) -> tuple[int, int, str | None]:
    """Feedback on one request, what the user said: (sent, failed, error)."""
    events = [feedback_body(request_id, s) for s in said]
    if not events:
        return 0, 0, None
    try:
        gateway.send_feedback(events)
    except httpx.HTTPError as exc:
        return 0, len(events), f"feedback for {request_id}: {exc!r}"
    return len(events), 0, None


def _report(n_requests: int, outcomes: Sequence[_Outcome], elapsed_s: float) -> SimulationReport:
    report = SimulationReport(requests=n_requests, elapsed_s=round(elapsed_s, 3))
    versions: Counter[str] = Counter()
    accepted_versions: Counter[str] = Counter()
    rewards: list[float] = []
    errors: list[str] = []
    for outcome in outcomes:
        report.feedback_sent += outcome.feedback_sent
        report.feedback_failed += outcome.feedback_failed
        if outcome.error is not None or not outcome.ok:
            errors.append(outcome.error or "unknown error")
        if not outcome.ok:
            report.failed += 1
            continue
        report.ok += 1
        versions[outcome.version or "unknown"] += 1
        report.silent += outcome.silent
        if outcome.accepted:
            report.accepted += 1
            accepted_versions[outcome.version or "unknown"] += 1
        if outcome.reward is not None:
            rewards.append(outcome.reward)
    report.acceptance_rate = report.accepted / report.ok if report.ok else 0.0
    report.mean_reward = sum(rewards) / len(rewards) if rewards else None
    report.per_version = dict(sorted(versions.items()))
    report.accepted_per_version = dict(sorted(accepted_versions.items()))
    report.errors = errors[:MAX_ERRORS_KEPT]
    return report
