"""Simulated agents: multi-segment episodes of three RL methods, sent through the gateway.

Started by ``rtrl simulate --scenario NAME`` (once) or ``rtrl demo --scenario NAME`` (every cycle,
through the whole loop), or called as `run_agents(...)`. Where simulation/users.py plays users who make
one call each, an *episode* here is several calls of one agent (and its sub-agents), told to the
gateway with the ``x-rtrl-*`` capture headers (ingest/shaping.py): the client's episode id, the
segment index in the episode's order, the segment's role and, for a PARL sub-agent, its agent id.
docs/methods.md describes each method; the labeler ends such an episode when the client says so
(store/settle.py), measures its structure (schemas/episodes.py) and labels it with the scenario's
reward spec (`SCENARIO_SPECS`, schemas/rewards.py).

The agents themselves (what each scenario asks next, given what the model answered) are
evals/agents.py's, shared with the eval gate's episode suite; this module plays them through the
gateway and gives the users' verdict: ``parl`` and ``self-edit`` send the environment's outcome
(``task_outcome`` naming the episode: it ends it), whether the users accept the final answer;
``summarize`` sends the users' feedback on the final work call's request (which does not end a
multi-segment episode), then ``episode_end``. For ``self-edit`` the outcome is judged on the full,
unpruned trajectory, and the labeler's judge (judged-v1) grades the whole episode, nothing pruned, too.

Every call goes through ``/v1/completions`` with the official ``openai`` client and a tenant API key
exactly like simulation/users.py's users, on the same scaffolding (simulation/client.py); feedback
goes to ``/v1/feedback`` with the same key. A failed
call fails its episode (counted, its error kept), never the run; the segments it already sent settle
when the labeler's window passes.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from evals import Preference, Task, get_task
from evals import agents as play_agents
from evals.agents import SCENARIOS as SCENARIOS
from evals.agents import SUMMARY_TRIGGER_CHARS as SUMMARY_TRIGGER_CHARS
from evals.agents import ScenarioError as ScenarioError
from evals.agents import after_summary_prompt as after_summary_prompt
from evals.agents import call_seed as call_seed
from evals.agents import check_scenario as check_scenario
from evals.agents import context_prompt as context_prompt
from evals.agents import continue_prompt as continue_prompt
from evals.agents import episode_rng as episode_rng
from evals.agents import make_chunks as make_chunks
from evals.agents import needs_summary as needs_summary
from evals.agents import orchestrator_final_prompt as orchestrator_final_prompt
from evals.agents import other_prompts as other_prompts
from evals.agents import parl_segments as parl_segments
from evals.agents import prune_action as prune_action
from evals.agents import prune_prompt as prune_prompt
from evals.agents import pruned as pruned
from evals.agents import subagent_calls as subagent_calls
from evals.agents import subagent_count as subagent_count
from evals.agents import summary_prompt as summary_prompt
from schemas.events import FeedbackKind, FeedbackSignal, Role, new_id
from schemas.rewards import get_spec, score
from schemas.settings import Settings
from schemas.versions import parse_version

from .client import MAX_ERRORS_KEPT, CallFailed, Gateway, Reply, fan_out, feedback_body, open_gateway

# The reward spec each scenario's labeler uses (`rtrl demo --scenario` sets labeler.reward_spec).
SCENARIO_SPECS = {"parl": "parl-v1", "summarize": "tab-v1", "self-edit": "judged-v1"}


@dataclass
class AgentReport:
    """What one run of simulated agents sent and how the users judged the episodes' final answers."""

    scenario: str = ""
    episodes: int = 0
    ok: int = 0  # episodes whose every call succeeded
    failed: int = 0
    segments: int = 0  # model calls of the ok episodes
    feedback_sent: int = 0
    feedback_failed: int = 0
    accepted: int = 0  # ok episodes whose final answer the task's preference accepts
    acceptance_rate: float = 0.0  # accepted / ok
    # Mean over ok episodes of the reward of the feedback they got, under settings.labeler.reward_spec,
    # before the labeler's shaping and judge terms (for parl and self-edit: the task_outcome value).
    mean_outcome: float | None = None
    per_version: dict[str, int] = field(
        default_factory=dict
    )  # ok episodes by the oldest version serving them
    elapsed_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few failures, for the operator
    summaries: int = 0  # summarize: summary calls
    subagents: int = 0  # parl: sub-agents spawned
    prunes: int = 0  # self-edit: chunks dropped

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


# ---- the environments' rules: pure functions ----------------------------------------------------


def episode_id(scenario: str, seed: int, index: int, run: str | None = None) -> str:
    """The client's id of episode `index` (the gateway puts it in the tenant's namespace). `run`
    tells runs with the same seed apart: a repeated id would make a new episode's segments late
    segments of the settled one."""
    return f"{scenario}-{seed}-{index}" if run is None else f"{scenario}-{run}-{seed}-{index}"


def accepts(signals: Sequence[FeedbackSignal]) -> bool:
    return any(s.kind == FeedbackKind.accepted for s in signals)


# ---- calls and feedback ---------------------------------------------------------------------------


class _CallFailed(Exception):
    """A model call of an episode failed: the episode fails (its error is reported), not the run."""


@dataclass(frozen=True)
class EpisodeOutcome:
    """What one episode did, for the report (`agent_report`); the tools scenario's episodes too."""

    ok: bool
    version: str | None = None
    accepted: bool = False
    outcome: float | None = None
    segments: int = 0
    feedback_sent: int = 0
    feedback_failed: int = 0
    summaries: int = 0
    subagents: int = 0
    prunes: int = 0
    error: str | None = None


@dataclass
class _Env:
    """One episode's connection to the gateway: its calls in segment order, its feedback."""

    settings: Settings
    gateway: Gateway
    task: Task
    scenario: str
    seed: int
    index: int
    episode: str
    summary_trigger_chars: int = SUMMARY_TRIGGER_CHARS
    calls: list[Reply] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, prompt: str, segment: int, role: Role, agent: str | None = None) -> Reply:
        headers = {
            "x-rtrl-session-id": f"{self.scenario}-agent-{self.index}",
            "x-rtrl-episode-id": self.episode,
            "x-rtrl-segment-index": str(segment),
            "x-rtrl-role": role.value,
        }
        if agent is not None:
            headers["x-rtrl-agent"] = agent
        try:
            made = self.gateway.complete(
                prompt,
                max_tokens=self.task.max_tokens,
                stop=self.task.stop,
                seed=call_seed(self.seed, self.index, segment),
                headers=headers,
            )
        except CallFailed as exc:
            raise _CallFailed(f"episode {self.episode} segment {segment}: {exc}") from exc
        with self.lock:  # sub-agents call from threads of their own
            self.calls.append(made)
        return made

    def oldest_version(self) -> str | None:
        """The oldest policy version among the episode's calls: the one the store gives the episode."""
        versions = [c.version for c in self.calls if c.version is not None]
        return min(versions, key=parse_version) if versions else None

    def send(self, events: list[dict[str, Any]]) -> tuple[int, int, str | None]:
        """POST `events` as one list: (sent, failed, error)."""
        try:
            self.gateway.send_feedback([{"event_id": new_id(), **event} for event in events])
        except httpx.HTTPError as exc:  # counted and reported; the labeler's window settles the episode
            return 0, len(events), f"feedback for episode {self.episode}: {exc!r}"
        return len(events), 0, None


# ---- the scenarios, judged by the users ----------------------------------------------------------


def _finish(
    env: _Env,
    accepted: bool,
    outcome: float,
    events: list[dict[str, Any]],
    played: play_agents.Trajectory[Reply],
) -> EpisodeOutcome:
    """Send the episode's feedback (one POST) and say what it did."""
    sent, failed, error = env.send(events)
    return EpisodeOutcome(
        ok=True,
        version=env.oldest_version(),
        accepted=accepted,
        outcome=outcome,
        segments=len(env.calls),
        feedback_sent=sent,
        feedback_failed=failed,
        error=error,
        summaries=played.summaries,
        subagents=played.subagents,
        prunes=played.prunes,
    )


def _outcome_event(env: _Env, request_id: str, value: float) -> dict[str, Any]:
    # Names the episode: terminal feedback about the whole episode ends it (store/settle.py).
    return {
        "request_id": request_id,
        "episode_id": env.episode,
        "kind": FeedbackKind.task_outcome.value,
        "value": value,
    }


def _episode(env: _Env, question: str, preference: Preference) -> EpisodeOutcome:
    """Play one episode of the env's scenario (evals/agents.py) and send the users' verdict."""
    played = play_agents.play(
        env.scenario,
        env.call,
        env.task,
        question,
        episode_rng(env.scenario, env.seed, env.index),
        lambda prompt, completion: accepts(preference(prompt, completion)),
        env.summary_trigger_chars,
    )
    final = played.final
    signals = preference(played.judged_prompt, final.text)
    if env.scenario != "summarize":
        outcome = 1.0 if accepts(signals) else 0.0
        return _finish(
            env, accepts(signals), outcome, [_outcome_event(env, final.request_id, outcome)], played
        )
    # The users judge the final answer's request (that does not end a multi-segment episode), then
    # the client ends the episode: accepted is not terminal, so without it the episode waits out the window.
    events = [feedback_body(final.request_id, s) for s in signals]
    events.append(
        {"request_id": final.request_id, "episode_id": env.episode, "kind": FeedbackKind.episode_end.value}
    )
    spec = get_spec(env.settings.labeler.reward_spec)
    return _finish(env, accepts(signals), score(spec, signals).reward, events, played)


def run_agents(
    settings: Settings,
    gateway_url: str,
    scenario: str,
    n_episodes: int,
    task: Task | str,
    *,
    api_key: str,
    concurrency: int = 4,
    seed: int = 0,
    preference: Preference | None = None,
    summary_trigger_chars: int = SUMMARY_TRIGGER_CHARS,
    run: str | None = None,
) -> AgentReport:
    """Run `n_episodes` episodes of `scenario` (module docstring) through the gateway, with feedback.

    Each episode starts from one of `task`'s training prompts (``task.train_prompts(n_episodes,
    seed)``); `preference` (default: the task's) plays the users. Calls are sampled with temperature
    1.0 and a per-call seed derived from `seed`, the episode and the segment, so a run is reproducible
    for fixed weights. `api_key` is a tenant key of the gateway (any string when its auth is open).
    `run` goes into the episode ids (`episode_id`): give a fresh one when the same seed may run again
    against the same store. `concurrency` episodes run at once (a PARL episode's sub-agents run in
    threads of their own)."""
    check_scenario(scenario)
    task = get_task(task) if isinstance(task, str) else task
    chosen = preference or task.preference
    questions = task.train_prompts(n_episodes, seed)
    started = time.monotonic()
    with open_gateway(settings, gateway_url, api_key) as gateway:

        def one(index: int, question: str) -> EpisodeOutcome:
            env = _Env(
                settings=settings,
                gateway=gateway,
                task=task,
                scenario=scenario,
                seed=seed,
                index=index,
                episode=episode_id(scenario, seed, index, run),
                summary_trigger_chars=summary_trigger_chars,
            )
            try:
                return _episode(env, question, chosen)
            except _CallFailed as exc:  # the episode fails; its sent segments settle by the labeler's window
                return EpisodeOutcome(ok=False, error=str(exc))

        episodes = fan_out(one, questions, concurrency, "rtrl-agent")
    return agent_report(scenario, episodes, time.monotonic() - started)


def agent_report(scenario: str, episodes: Sequence[EpisodeOutcome], elapsed_s: float) -> AgentReport:
    """The run's report from its episodes (simulation/tools.py reports its agents' the same way)."""
    report = AgentReport(scenario=scenario, episodes=len(episodes), elapsed_s=round(elapsed_s, 3))
    versions: Counter[str] = Counter()
    outcomes: list[float] = []
    errors: list[str] = []
    for episode in episodes:
        report.feedback_sent += episode.feedback_sent
        report.feedback_failed += episode.feedback_failed
        if episode.error is not None:
            errors.append(episode.error)
        if not episode.ok:
            report.failed += 1
            continue
        report.ok += 1
        report.segments += episode.segments
        report.accepted += episode.accepted
        report.summaries += episode.summaries
        report.subagents += episode.subagents
        report.prunes += episode.prunes
        versions[episode.version or "unknown"] += 1
        if episode.outcome is not None:
            outcomes.append(episode.outcome)
    report.acceptance_rate = report.accepted / report.ok if report.ok else 0.0
    report.mean_outcome = sum(outcomes) / len(outcomes) if outcomes else None
    report.per_version = dict(sorted(versions.items()))
    report.errors = errors[:MAX_ERRORS_KEPT]
    return report
