"""Simulated users: send a task's prompts through the gateway and give feedback like a user would.

Started by ``rtrl simulate`` or called as `simulate(...)` (the demo does). Each request goes through
the gateway with the official ``openai`` client and an API key, exactly like an application would,
from one of a small population of users (``x-rtrl-session-id: sim-user-<k>``); the tenant is the
key's (the demo's key is tenant ``sim``). The completion is judged by the task's preference
function (evals/tasks.py) and every returned signal is sent to ``/v1/feedback`` for the gateway's
request id, with the same key. The report counts what was sent and what the users thought of it,
per serving policy version.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import httpx

from evals import Preference, Task, get_task
from schemas.clock import wait_until
from schemas.events import FeedbackKind, FeedbackSignal, new_id
from schemas.rewards import get_spec, score
from schemas.settings import Settings

if TYPE_CHECKING:
    from store import Store

USERS = 8  # size of the simulated population (sessions)
TENANT = "sim"  # the tenant of the keys `rtrl simulate` and the demo make for their users
MAX_ERRORS_KEPT = 20


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
    error: str | None = None


def _what_the_user_says(
    signals: list[FeedbackSignal], accepted: bool, rng: random.Random, feedback_rate: float, flip_rate: float
) -> list[FeedbackSignal]:
    """The signals a user sends: nothing (1 − feedback_rate), the opposite verdict (flip_rate of
    the rest), or what they think."""
    if rng.random() >= feedback_rate:
        return []
    if signals and rng.random() < flip_rate:
        return [FeedbackSignal(kind=FeedbackKind.rejected if accepted else FeedbackKind.accepted)]
    return signals


@contextmanager
def simulation_key(store: Store, gateway_url: str, timeout_s: float = 60.0) -> Iterator[str]:
    """A key of tenant `TENANT` for one simulation, revoked when the block ends. Waits until the
    gateway has loaded it (it reloads its keys every ``gateway.keys_refresh_s``)."""
    # Unlimited: the key stands for a crowd of simulated users, not one client a rate limit is for.
    record, key = store.create_api_key(role="tenant", tenant=TENANT, name="simulated users", rate_per_s=0)
    try:

        def known() -> bool:
            try:
                response = httpx.get(f"{gateway_url.rstrip('/')}/v1/whoami", headers={"authorization": f"Bearer {key}"},
                                     timeout=5)  # fmt: skip
            except httpx.HTTPError:
                return False
            return response.status_code == 200

        wait_until(known, timeout_s=timeout_s, interval_s=0.5, what="the gateway has not loaded the new API key")
        yield key
    finally:
        store.revoke_api_key(record.id)


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
    from openai import OpenAI, OpenAIError

    task = get_task(task) if isinstance(task, str) else task
    preference = preference or task.preference
    spec = get_spec(settings.labeler.reward_spec)
    base = gateway_url.rstrip("/")
    timeout = settings.vllm.request_timeout_s + 10
    client = OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=timeout)
    http = httpx.Client(timeout=timeout, headers={"authorization": f"Bearer {api_key}"})
    questions = task.draw_train_questions(n_requests, seed)
    prompts = [task.format_prompt(q.text) for q in questions]
    lock = threading.Lock()
    errors: list[str] = []

    def one(index: int, prompt: str) -> _Outcome:
        user = f"sim-user-{index % USERS}"
        model, stop, request_seed = settings.vllm.served_model_name, list(task.stop), seed * 1_000_003 + index
        headers = {"x-rtrl-session-id": user}
        raw: Any
        try:
            if api == "chat":
                raw = client.chat.completions.with_raw_response.create(
                    model=model, messages=[{"role": "user", "content": questions[index].text}],
                    max_tokens=task.max_tokens, stop=stop, seed=request_seed, extra_headers=headers,
                )  # fmt: skip
            else:
                raw = client.completions.with_raw_response.create(
                    model=model, prompt=prompt, max_tokens=task.max_tokens, stop=stop, temperature=1.0,
                    seed=request_seed, extra_headers=headers,
                )  # fmt: skip
            completion = raw.parse()
        except OpenAIError as exc:  # a failed user request is counted and reported, not fatal
            return _Outcome(ok=False, error=f"request {index}: {exc!r}")
        request_id = raw.headers.get("x-rtrl-request-id")
        if not request_id:
            return _Outcome(ok=False, error=f"request {index}: no x-rtrl-request-id header (not an rtrl gateway?)")
        try:  # the client parses leniently: an answer without the fields a completion has fails here
            choice = completion.choices[0]
            text = (choice.message.content or "") if api == "chat" else choice.text
            version = ((completion.model_extra or {}).get("rtrl") or {}).get("policy_version")
        except (AttributeError, IndexError, TypeError) as exc:
            return _Outcome(ok=False, error=f"request {index}: not a completion ({exc!r}): {raw.http_response.text[:200]!r}")
        signals: list[FeedbackSignal] = preference(prompt, text)
        accepted = any(s.kind == FeedbackKind.accepted for s in signals)
        said = _what_the_user_says(signals, accepted, random.Random(seed * 1_000_003 + index), feedback_rate, flip_rate)
        events = [{"event_id": new_id(), "request_id": request_id, "kind": s.kind.value, "value": s.value}
                  for s in said]  # fmt: skip
        sent = failed = 0
        if events:
            body = json.dumps(events)
            try:
                response = http.post(f"{base}/v1/feedback", content=body, headers={"content-type": "application/json"})
                response.raise_for_status()
                sent = len(events)
            except httpx.HTTPError as exc:
                failed = len(events)
                with lock:
                    errors.append(f"feedback for {request_id}: {exc!r}")
        return _Outcome(
            ok=True,
            version=version,
            accepted=accepted,
            silent=not signals,
            reward=score(spec, signals).reward,
            feedback_sent=sent,
            feedback_failed=failed,
        )

    started = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="rtrl-sim") as pool:
            outcomes = list(pool.map(one, range(n_requests), prompts))
    finally:
        client.close()
        http.close()

    report = SimulationReport(requests=n_requests, elapsed_s=round(time.monotonic() - started, 3))
    versions: Counter[str] = Counter()
    accepted_versions: Counter[str] = Counter()
    rewards: list[float] = []
    for outcome in outcomes:
        report.feedback_sent += outcome.feedback_sent
        report.feedback_failed += outcome.feedback_failed
        if not outcome.ok:
            report.failed += 1
            errors.append(outcome.error or "unknown error")
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
