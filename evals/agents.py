"""The agents of the three RL methods' episodes, as functions of a model call (docs/methods.md).

An *episode* is several calls of one agent (and its sub-agents). What the agent asks next depends on
what the model answered, so the agent is code, not data: `play` runs one episode of a scenario
against any `Call` and returns its `Trajectory` (the final call, and the prompt the episode's
outcome is judged on). Two callers:

* the simulated agents (simulation/agents.py) call the model through the gateway, with the capture
  headers, and let simulated users judge the final answer;
* the eval gate's episode suite (deployer/episodes.py) calls the staging vLLM server directly, once
  with the challenger's weights and once with the champion's, on held-out questions, and scores
  whole episodes: a model that answers single prompts as well as the champion but acts worse over
  an episode (a worse prune, a worse answer over a pruned context) shows only here.

The scenarios (``gate.episodes.scenario``, ``rtrl simulate --scenario``):

* ``parl`` (Kimi PARL): an orchestrator call; the environment spawns sub-agents (3 when it accepts the
  orchestrator's first answer, else 1), each making one or two calls of its own concurrently; a
  final orchestrator call sees their answers. Judged: the final call.
* ``summarize`` (Cursor self-summarization): a work call; when its context (prompt + completion)
  passes a trigger, a summary call and a work call that continues from the summary only, at most
  `MAX_SUMMARIES` times. Judged: the last work call.
* ``self-edit`` (Chroma's self-editing search agent): the agent answers over a context of chunks,
  then prunes it (its completion *is* the prune action, `prune_action`), then answers again over
  the pruned context. Judged: the final answer against the full, unpruned trajectory, so pruning
  cannot change the outcome by hiding what the agent was given.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, get_args

from evals.tasks import Task
from schemas.errors import OperatorError
from schemas.events import Role
from schemas.settings.gate import Scenario

SCENARIOS: tuple[str, ...] = get_args(Scenario)

# PARL: sub-agents the environment spawns when the orchestrator's first answer is (not) accepted.
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


class Turn(Protocol):
    """What one model call of an episode gave: the prompt sent and the completion's text."""

    @property
    def prompt(self) -> str: ...

    @property
    def text(self) -> str: ...


T = TypeVar("T", bound=Turn)

# One model call: (prompt, segment index in the episode, role, sub-agent id or None) -> its turn. A
# call that fails raises; the episode fails with it.
Call = Callable[[str, int, Role, str | None], T]
# The environment's verdict on an answer (PARL spawns more sub-agents after an accepted first answer).
Accept = Callable[[str, str], bool]


@dataclass(frozen=True)
class Trajectory(Generic[T]):
    """One played episode: the call whose answer is judged, what it is judged against, its structure."""

    final: T
    judged_prompt: str  # the context the final answer is judged in (the whole trajectory for self-edit)
    turns: tuple[tuple[int, Role, T], ...] = ()  # every call: (segment, role, turn), in segment order
    summaries: int = 0  # summarize: summary calls
    subagents: int = 0  # parl: sub-agents spawned
    prunes: int = 0  # self-edit: chunks dropped

    @property
    def calls(self) -> int:
        return len(self.turns)


# ---- the environments' rules: pure functions ----------------------------------------------------


def call_seed(seed: int, index: int, segment: int) -> int:
    """The sampling seed of one call: reproducible for fixed weights, different for every call."""
    return (seed * 1_000_003 + index) * 101 + segment


def episode_rng(scenario: str, seed: int, index: int) -> random.Random:
    """The environment's draws for one episode (other questions, chunks): the same in every run."""
    return random.Random(f"{scenario}:{seed}:{index}")  # a str seed is hashed with SHA-512, not hash()


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


# ---- the three agents ---------------------------------------------------------------------------


def parl(call: Call[T], task: Task, question: str, rng: random.Random, accept: Accept) -> Trajectory[T]:
    """One Kimi PARL episode (module docstring); sub-agents call from threads of their own."""
    first = call(question, 0, Role.orchestrator, None)
    n = subagent_count(accept(question, first.text))
    indices, final_index = parl_segments([subagent_calls(agent) for agent in range(1, n + 1)])
    own = [other_prompts(task, question, rng, len(agent_calls)) for agent_calls in indices]

    def subagent(agent: int) -> str:
        prompt, text = "", ""
        for step, (segment, asked) in enumerate(zip(indices[agent - 1], own[agent - 1], strict=True)):
            prompt = asked if step == 0 else continue_prompt(prompt, text, asked)
            text = call(prompt, segment, Role.subagent, f"sub-{agent}").text
        return text

    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="rtrl-subagent") as subagents:
        answers = list(subagents.map(subagent, range(1, n + 1)))  # a failed call raises here
    final = call(
        orchestrator_final_prompt(question, first.text, answers), final_index, Role.orchestrator, None
    )
    return Trajectory(final, final.prompt, subagents=n)


def summarize(call: Call[T], question: str, trigger_chars: int = SUMMARY_TRIGGER_CHARS) -> Trajectory[T]:
    """One Cursor self-summarization episode (module docstring)."""
    prompt, segment, summaries = question, 0, 0
    while True:
        work = call(prompt, segment, Role.policy, None)
        segment += 1
        if summaries == MAX_SUMMARIES or not needs_summary(prompt, work.text, trigger_chars):
            break
        summary = call(summary_prompt(prompt, work.text), segment, Role.summary, None)
        segment, summaries = segment + 1, summaries + 1
        prompt = after_summary_prompt(summary.text, question)
    return Trajectory(work, work.prompt, summaries=summaries)


def self_edit(call: Call[T], task: Task, question: str, rng: random.Random) -> Trajectory[T]:
    """One self-editing episode (module docstring): answer, prune, answer over the pruned context."""
    chunks = make_chunks(task, question, rng)
    first = call(context_prompt(chunks, question), 0, Role.policy, None)
    prune = call(prune_prompt(first.prompt, first.text), 1, Role.policy, None)
    dropped = prune_action(prune.text)
    final = call(context_prompt(pruned(chunks, dropped), question), 2, Role.policy, None)
    # Judged on the full trajectory with every chunk the agent was given: what it pruned stays in.
    unpruned = f"{prune.prompt}{prune.text}\n{context_prompt(chunks, question)}"
    return Trajectory(final, unpruned, prunes=len(dropped))


def play(
    scenario: str,
    call: Call[T],
    task: Task,
    question: str,
    rng: random.Random,
    accept: Accept,
    summary_trigger_chars: int = SUMMARY_TRIGGER_CHARS,
) -> Trajectory[T]:
    """One episode of `scenario` starting from the prompt `question` (module docstring), with every
    call it made; `rng` is the environment's (`episode_rng`), `accept` the environment's verdict on
    an answer (PARL's)."""
    turns: list[tuple[int, Role, T]] = []
    lock = threading.Lock()  # PARL's sub-agents call from threads of their own

    def recorded(prompt: str, segment: int, role: Role, agent: str | None) -> T:
        made = call(prompt, segment, role, agent)
        with lock:
            turns.append((segment, role, made))
        return made

    if check_scenario(scenario) == "parl":
        played = parl(recorded, task, question, rng, accept)
    elif scenario == "summarize":
        played = summarize(recorded, question, summary_trigger_chars)
    else:
        played = self_edit(recorded, task, question, rng)
    return dataclasses.replace(played, turns=tuple(sorted(turns, key=lambda turn: turn[0])))
