"""Simulated agents: multi-segment episodes of three RL methods, sent through the gateway.

Started by ``rtrl simulate --scenario NAME`` (once) or ``rtrl demo --scenario NAME`` (every cycle,
through the whole loop), or called as `run_agents(...)`. Where simulation/users.py plays users who make
one call each, an *episode* here is several calls of one agent (and its sub-agents), told to the
gateway with the ``x-rtrl-*`` capture headers (ingest/shaping.py): the client's episode id, the
segment index in the episode's order, the segment's role and, for a PARL sub-agent, its agent id.
docs/methods.md describes each method; the labeler ends such an episode when the client says so
(store/settle.py), measures its structure (schemas/episodes.py) and labels it with the scenario's
reward spec (`SCENARIO_SPECS`, schemas/rewards.py).

* ``parl`` (Kimi PARL): an orchestrator call; the environment spawns sub-agents (3 when the users
  would accept the orchestrator's first answer, else 1, so that PARL's r_parallel rewards what the
  users also prefer), each making one or two calls of its own concurrently (role ``subagent``: the
  gateway makes them untrainable observations); a final orchestrator call sees their answers. The
  environment's outcome (``task_outcome`` naming the episode: it ends it) is whether the users
  accept the final answer.
* ``summarize`` (Cursor self-summarization): a work call; when its context (prompt + completion)
  passes a trigger, a summary call (role ``summary``) and a work call that continues from the
  summary only, at most `MAX_SUMMARIES` times. The users judge the final work call's request
  (feedback about a request does not end a multi-segment episode), then ``episode_end`` ends it.
* ``self-edit`` (Chroma's self-editing search agent): the agent answers over a context of chunks,
  then prunes it (its completion *is* the prune action, `prune_action`), then answers again over
  the pruned context. The outcome is computed on the full, unpruned trajectory, so pruning cannot
  change it by hiding what the agent was given; the labeler's judge (judged-v1) grades the whole
  episode, nothing pruned, too.

Every call goes through ``/v1/completions`` with the official ``openai`` client and a tenant API key
exactly like simulation/users.py's users, on the same scaffolding (simulation/client.py); feedback
goes to ``/v1/feedback`` with the same key. A failed
call fails its episode (counted, its error kept), never the run; the segments it already sent settle
when the labeler's window passes.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from evals import Preference, Task, get_task
from schemas.errors import OperatorError
from schemas.events import FeedbackKind, FeedbackSignal, Role, new_id
from schemas.rewards import get_spec, score
from schemas.settings import Settings
from schemas.versions import parse_version

from .client import MAX_ERRORS_KEPT, CallFailed, Gateway, Reply, fan_out, open_gateway

SCENARIOS = ("parl", "summarize", "self-edit")
# The reward spec each scenario's labeler uses (`rtrl demo --scenario` sets labeler.reward_spec).
SCENARIO_SPECS = {"parl": "parl-v1", "summarize": "tab-v1", "self-edit": "judged-v1"}

# PARL: sub-agents the environment spawns when the orchestrator's first answer is (not) preferred.
PARL_WIDE = 3
PARL_NARROW = 1
# Self-summarization: summarize once a call's context passes this many characters, at most this often.
SUMMARY_TRIGGER_CHARS = 40
MAX_SUMMARIES = 2
# Self-editing: chunks in the agent's context, labelled [1]..[CHUNKS].
CHUNKS = 4


class ScenarioError(OperatorError, ValueError):
    """An unknown agent scenario."""


def check_scenario(name: str) -> str:
    """`name` if it is one of `SCENARIOS`, else a `ScenarioError` saying which are."""
    if name not in SCENARIOS:
        raise ScenarioError(
            f"unknown scenario {name!r}; known scenarios: {', '.join(SCENARIOS)} (docs/methods.md)"
        )
    return name


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


def call_seed(seed: int, index: int, segment: int) -> int:
    """The sampling seed of one call: reproducible for fixed weights, different for every call."""
    return (seed * 1_000_003 + index) * 101 + segment


def subagent_count(first_accepted: bool) -> int:
    """PARL: how many sub-agents the environment spawns after the orchestrator's first answer."""
    return PARL_WIDE if first_accepted else PARL_NARROW


def subagent_calls(agent: int) -> int:
    """PARL: calls sub-agent `agent` (1, 2, ...) makes: 2 for odd ones, 1 for even ones, so stages have
    branches of different lengths (critical steps count the longest)."""
    return 1 + agent % 2


def parl_segments(calls: Sequence[int]) -> tuple[list[list[int]], int]:
    """PARL segment indices: (each sub-agent's calls' indices, the final orchestrator call's index),
    for sub-agents making `calls[i]` calls; the orchestrator's first call is segment 0."""
    indices: list[list[int]] = []
    next_index = 1
    for n in calls:
        indices.append(list(range(next_index, next_index + n)))
        next_index += n
    return indices, next_index


def continue_prompt(prompt: str, completion: str, next_prompt: str) -> str:
    """A call that continues the previous one: its context, then the next question."""
    return f"{prompt}{completion}\n{next_prompt}"


def orchestrator_final_prompt(question: str, first: str, subagent_answers: Sequence[str]) -> str:
    """PARL's second stage: the question, the orchestrator's first answer, the sub-agents' last
    answers as observations, and the question again, so the prompt still ends where the model answers."""
    notes = " ".join(answer.strip() for answer in subagent_answers)
    return f"{question}{first}\nNotes: {notes}\n{question}"


def needs_summary(prompt: str, completion: str, trigger_chars: int) -> bool:
    """Self-summarization: whether a call's context (prompt + completion) passed the trigger."""
    return len(prompt) + len(completion) > trigger_chars


def summary_prompt(prompt: str, completion: str) -> str:
    """The summary call: the context so far, then the request to summarize it."""
    return f"{prompt}{completion}\nSummary:"


def after_summary_prompt(summary: str, question: str) -> str:
    """The work call after a summary: the summary replaces the context, then the question again."""
    return f"Summary:{summary.strip()}\n{question}"


def episode_rng(scenario: str, seed: int, index: int) -> random.Random:
    """The environment's draws for one episode (other questions, chunks): the same in every run."""
    return random.Random(f"{scenario}:{seed}:{index}")  # a str seed is hashed with SHA-512, not hash()


def other_prompts(task: Task, question: str, rng: random.Random, n: int) -> list[str]:
    """`n` prompts of other training questions than `question` (drawn with replacement)."""
    pool = [task.format_prompt(q.text) for q in task.train_questions()]
    return rng.choices([p for p in pool if p != question] or pool, k=n)


def make_chunks(task: Task, question: str, rng: random.Random, n: int = CHUNKS) -> list[str]:
    """Self-editing: `n` context chunks ``[k] <another training question> <its answer>``, k = 1..n."""
    pool = [q for q in task.train_questions() if task.format_prompt(q.text) != question]
    return [f"[{k}] {q.text} {q.answers[0]}" for k, q in enumerate(rng.sample(pool, n), start=1)]


def context_prompt(chunks: Sequence[str], question: str) -> str:
    """A call over a context of chunks: the chunks, one a line, then the question."""
    return "".join(f"{chunk}\n" for chunk in chunks) + question


def prune_prompt(prompt: str, completion: str) -> str:
    """The prune action's call: the context so far, then the request to prune it."""
    return f"{prompt}{completion}\nPrune:"


def prune_action(completion: str, n: int = CHUNKS) -> tuple[int, ...]:
    """The chunks (0-based) the prune call's completion drops: chunk [k] when the completion contains
    the digit k; when it names none, the chunk at ``len(completion) % n``, so every prune drops one."""
    named = tuple(k - 1 for k in range(1, n + 1) if str(k) in completion)
    return named or (len(completion) % n,)


def pruned(chunks: Sequence[str], dropped: Sequence[int]) -> list[str]:
    """The chunks without the dropped ones, in their order."""
    return [chunk for i, chunk in enumerate(chunks) if i not in set(dropped)]


def accepts(signals: Sequence[FeedbackSignal]) -> bool:
    return any(s.kind == FeedbackKind.accepted for s in signals)


# ---- calls and feedback ---------------------------------------------------------------------------


class _CallFailed(Exception):
    """A model call of an episode failed: the episode fails (its error is reported), not the run."""


@dataclass(frozen=True)
class _Episode:
    """What one episode did, for the report."""

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


# ---- the three scenarios --------------------------------------------------------------------------

_Scenario = Callable[[_Env, str, Preference], _Episode]


def _finish(
    env: _Env,
    accepted: bool,
    outcome: float,
    events: list[dict[str, Any]],
    *,
    summaries: int = 0,
    subagents: int = 0,
    prunes: int = 0,
) -> _Episode:
    """Send the episode's feedback (one POST) and say what it did."""
    sent, failed, error = env.send(events)
    return _Episode(
        ok=True,
        version=env.oldest_version(),
        accepted=accepted,
        outcome=outcome,
        segments=len(env.calls),
        feedback_sent=sent,
        feedback_failed=failed,
        error=error,
        summaries=summaries,
        subagents=subagents,
        prunes=prunes,
    )


def _outcome_event(env: _Env, request_id: str, value: float) -> dict[str, Any]:
    # Names the episode: terminal feedback about the whole episode ends it (store/settle.py).
    return {
        "request_id": request_id,
        "episode_id": env.episode,
        "kind": FeedbackKind.task_outcome.value,
        "value": value,
    }


def _parl(env: _Env, question: str, preference: Preference) -> _Episode:
    first = env.call(question, 0, Role.orchestrator)
    n = subagent_count(accepts(preference(question, first.text)))
    calls = [subagent_calls(agent) for agent in range(1, n + 1)]
    indices, final_index = parl_segments(calls)
    rng = episode_rng(env.scenario, env.seed, env.index)
    own = [other_prompts(env.task, question, rng, len(agent_calls)) for agent_calls in indices]

    def subagent(agent: int) -> str:
        prompt, text = "", ""
        for call, (segment, asked) in enumerate(zip(indices[agent - 1], own[agent - 1], strict=True)):
            prompt = asked if call == 0 else continue_prompt(prompt, text, asked)
            text = env.call(prompt, segment, Role.subagent, agent=f"sub-{agent}").text
        return text

    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="rtrl-subagent") as subagents:
        answers = list(subagents.map(subagent, range(1, n + 1)))  # a failed call raises here
    final = env.call(orchestrator_final_prompt(question, first.text, answers), final_index, Role.orchestrator)
    accepted = accepts(preference(final.prompt, final.text))
    outcome = 1.0 if accepted else 0.0
    return _finish(env, accepted, outcome, [_outcome_event(env, final.request_id, outcome)], subagents=n)


def _summarize(env: _Env, question: str, preference: Preference) -> _Episode:
    prompt, segment, summaries = question, 0, 0
    while True:
        work = env.call(prompt, segment, Role.policy)
        segment += 1
        if summaries == MAX_SUMMARIES or not needs_summary(prompt, work.text, env.summary_trigger_chars):
            break
        summary = env.call(summary_prompt(prompt, work.text), segment, Role.summary)
        segment, summaries = segment + 1, summaries + 1
        prompt = after_summary_prompt(summary.text, question)
    signals = preference(work.prompt, work.text)
    # The users judge the final answer's request (that does not end a multi-segment episode), then
    # the client ends the episode: accepted is not terminal, so without it the episode waits out the window.
    events = [{"request_id": work.request_id, "kind": s.kind.value, "value": s.value} for s in signals]
    events.append(
        {"request_id": work.request_id, "episode_id": env.episode, "kind": FeedbackKind.episode_end.value}
    )
    spec = get_spec(env.settings.labeler.reward_spec)
    return _finish(env, accepts(signals), score(spec, signals).reward, events, summaries=summaries)


def _self_edit(env: _Env, question: str, preference: Preference) -> _Episode:
    chunks = make_chunks(env.task, question, episode_rng(env.scenario, env.seed, env.index))
    first = env.call(context_prompt(chunks, question), 0, Role.policy)
    prune = env.call(prune_prompt(first.prompt, first.text), 1, Role.policy)
    dropped = prune_action(prune.text)
    final = env.call(context_prompt(pruned(chunks, dropped), question), 2, Role.policy)
    # The outcome is judged on the full trajectory with every chunk the agent was given: what it pruned
    # stays in, so pruning cannot change the outcome (only the final answer can).
    unpruned = f"{prune.prompt}{prune.text}\n{context_prompt(chunks, question)}"
    accepted = accepts(preference(unpruned, final.text))
    outcome = 1.0 if accepted else 0.0
    return _finish(
        env, accepted, outcome, [_outcome_event(env, final.request_id, outcome)], prunes=len(dropped)
    )


SCENARIO_RUNNERS: dict[str, _Scenario] = {"parl": _parl, "summarize": _summarize, "self-edit": _self_edit}


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
    runner = SCENARIO_RUNNERS[check_scenario(scenario)]
    task = get_task(task) if isinstance(task, str) else task
    chosen = preference or task.preference
    questions = task.train_prompts(n_episodes, seed)
    started = time.monotonic()
    with open_gateway(settings, gateway_url, api_key) as gateway:

        def one(index: int, question: str) -> _Episode:
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
                return runner(env, question, chosen)
            except _CallFailed as exc:  # the episode fails; its sent segments settle by the labeler's window
                return _Episode(ok=False, error=str(exc))

        episodes = fan_out(one, questions, concurrency, "rtrl-agent")
    return _report(scenario, episodes, time.monotonic() - started)


def _report(scenario: str, episodes: Sequence[_Episode], elapsed_s: float) -> AgentReport:
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
