"""Simulated tool-using agents: episodes of a tool call, its result and the final answer.

Started by ``rtrl demo --scenario tools`` (every cycle, through the whole loop) or called as
`run_tool_agents(...)`. Each episode is one question of a tool task (`evals.tasks.ToolTask`, e.g.
``lookup``) asked the way an application with tools asks, with the official ``openai`` client
through the gateway:

1. the question as a user message, with the task's ``tools`` and ``tool_choice: auto`` (the model
   decides to call; a forced call is sampled under a grammar and captured untrainable,
   schemas/sampling.py): segment 0;
2. when the answer has tool calls (vLLM parsed them out of the model's text: ``vllm.tool_call_parser``),
   the agent runs each tool and sends the whole conversation back, the assistant's calls and a
   ``tool`` message per result, with the same ``x-rtrl-episode-id``: segment 1, whose answer is final.
   An answer without a call is final at once (an episode of one segment);
3. the users judge the final answer (the task's preference: the looked-up code, ending with "!"),
   send their feedback on its request, then ``episode_end``, which ends the episode.

The gateway captures each call with its prompt and completion token ids (docs/architecture.md,
Multi-segment episodes). Only completions are trained: the tool's result is in segment 1's prompt and
in no completion, so it is never trained on. Every call of the episode trains with its one reward: the
call that looked the code up is reinforced with the answer that used it. docs/methods.md, Tool calls.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from evals import Preference, Task, get_task
from evals.tasks import ToolTask, lookup
from schemas.errors import OperatorError
from schemas.events import FeedbackKind, Role
from schemas.rewards import get_spec, score
from schemas.settings import Settings, VllmSettings
from schemas.versions import parse_version

from .agents import AgentReport, EpisodeOutcome, accepts, agent_report, call_seed, episode_id
from .client import CallFailed, Gateway, Reply, fan_out, feedback_body, open_gateway

SCENARIO = "tools"
# Users accept or reject the final answer, then the client ends the episode: the default spec's kinds.
SPEC = "tab-v1"
# The tools an agent can run, by name: each takes the call's arguments and returns the result's text.
TOOLS = {"lookup": lambda arguments: lookup(str(arguments.get("item", "")))}


# The demo's tool-using model, built beside the default tiny model (`demo_settings`).
MODEL_DIR_NAME = "tiny-lookup"
TASK = "lookup"


class ToolScenarioError(OperatorError, ValueError):
    """A task without tools for the tools scenario."""


def tool_task(task: Task | str) -> ToolTask:
    """`task` as a tool task, or a ToolScenarioError naming one."""
    task = get_task(task) if isinstance(task, str) else task
    if not isinstance(task, ToolTask):
        raise ToolScenarioError(
            f"--scenario tools needs a task with tools (--task lookup), not {task.name!r}"
        )
    return task


def run_tool(call: dict[str, Any]) -> str:
    """What the agent sends back for one tool call: the tool's result, or an error the model reads."""
    function = call.get("function") or {}
    tool = TOOLS.get(str(function.get("name")))
    if tool is None:
        return f"error: no tool {function.get('name')!r}"
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    return tool(arguments) if isinstance(arguments, dict) else "error: the arguments are not an object"


@dataclass
class _ToolEnv:
    """One episode's connection to the gateway."""

    gateway: Gateway
    task: ToolTask
    seed: int
    index: int
    episode: str

    def call(self, prompt: str, messages: list[dict[str, Any]], segment: int) -> Reply:
        headers = {
            "x-rtrl-session-id": f"{SCENARIO}-agent-{self.index}",
            "x-rtrl-episode-id": self.episode,
            "x-rtrl-segment-index": str(segment),
            "x-rtrl-role": Role.policy.value,
        }
        try:
            return self.gateway.converse(
                prompt,
                messages,
                self.task.tools,
                max_tokens=self.task.max_tokens,
                seed=call_seed(self.seed, self.index, segment),
                headers=headers,
            )
        except CallFailed as exc:
            raise _ToolCallFailed(f"episode {self.episode} segment {segment}: {exc}") from exc


class _ToolCallFailed(Exception):
    """A model call of an episode failed: the episode fails (its error is reported), not the run."""


def play(env: _ToolEnv, question: str) -> tuple[list[Reply], str]:
    """Ask `question` with the tools; run the calls and ask again when the model made any. Returns the
    replies in segment order and the prompt the final answer is judged against (with the tools'
    results, as the served chat template renders them: `ToolTask.answer_prompt`)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    first = env.call(env.task.call_prompt(question), messages, 0)
    if not first.tool_calls:
        return [first], first.prompt
    results = [run_tool(call) for call in first.tool_calls]
    messages.append(
        {"role": "assistant", "content": first.text or None, "tool_calls": list(first.tool_calls)}
    )
    messages += [
        {"role": "tool", "tool_call_id": call.get("id"), "content": result}
        for call, result in zip(first.tool_calls, results, strict=True)
    ]
    judged = env.task.answer_prompt(question, results[-1])
    return [first, env.call(judged, messages, 1)], judged


def _episode(env: _ToolEnv, question: str, preference: Preference, settings: Settings) -> EpisodeOutcome:
    replies, judged = play(env, question)
    final = replies[-1]
    signals = preference(judged, final.text)
    events = [feedback_body(final.request_id, s) for s in signals]
    events.append(
        {"request_id": final.request_id, "episode_id": env.episode, "kind": FeedbackKind.episode_end.value}
    )
    try:
        env.gateway.send_feedback(events)
        sent, failed, error = len(events), 0, None
    except httpx.HTTPError as exc:  # counted and reported; the labeler's window settles the episode
        sent, failed, error = 0, len(events), f"feedback for episode {env.episode}: {exc!r}"
    versions = [r.version for r in replies if r.version is not None]
    return EpisodeOutcome(
        ok=True,
        version=min(versions, key=parse_version)
        if versions
        else None,  # the store gives the episode the oldest
        accepted=accepts(signals),
        outcome=score(get_spec(settings.labeler.reward_spec), signals).reward,
        segments=len(replies),
        feedback_sent=sent,
        feedback_failed=failed,
        error=error,
    )


def run_tool_agents(
    settings: Settings,
    gateway_url: str,
    n_episodes: int,
    task: Task | str,
    *,
    api_key: str,
    concurrency: int = 4,
    seed: int = 0,
    preference: Preference | None = None,
    run: str | None = None,
) -> AgentReport:
    """Run `n_episodes` tool-using episodes (module docstring) through the gateway, with feedback.
    Questions are the task's training questions drawn with `seed`; `run` goes into the episode ids
    (simulation.agents.episode_id). The report's ``segments`` counts the calls: 2 an episode whose
    model called the tool, 1 one whose model answered at once."""
    tools_task = tool_task(task)
    chosen = preference or tools_task.preference
    questions = [q.text for q in tools_task.draw_train_questions(n_episodes, seed)]
    started = time.monotonic()
    with open_gateway(settings, gateway_url, api_key) as gateway:

        def one(index: int, question: str) -> EpisodeOutcome:
            env = _ToolEnv(gateway, tools_task, seed, index, episode_id(SCENARIO, seed, index, run))
            try:
                return _episode(env, question, chosen, settings)
            except _ToolCallFailed as exc:  # the episode fails; its sent segments settle by the window
                return EpisodeOutcome(ok=False, error=str(exc))

        episodes = fan_out(one, questions, concurrency, "rtrl-tool-agent")
    return agent_report(SCENARIO, episodes, time.monotonic() - started)


# ---- the demo's model and settings ----------------------------------------------------------------


def demo_settings(settings: Settings) -> Settings:
    """The settings ``rtrl demo --scenario tools`` serves with: the lookup model in its own folder
    beside the default tiny model (unless ``--model-dir`` or RTRL_VLLM__MODEL_DIR named one) and
    vLLM's pythonic tool parser (unless vllm.tool_call_parser names another)."""
    update: dict[str, Any] = {}
    if settings.vllm.model_dir == VllmSettings.model_fields["model_dir"].default:
        update["model_dir"] = settings.vllm.model_dir.with_name(MODEL_DIR_NAME)
    if settings.vllm.tool_call_parser is None:
        update["tool_call_parser"] = "pythonic"
    return settings.model_copy(update={"vllm": settings.vllm.model_copy(update=update)})


def ensure_model(settings: Settings) -> Path:
    """Build the lookup model (``rtrl model init --task lookup --recipe tools``) into vllm.model_dir
    when that is missing or empty; a checkpoint already there is served as it is."""
    from services.tinymodel import build

    path = settings.vllm.model_dir.expanduser().resolve()
    if path.exists() and any(path.iterdir()):
        return path
    partial = path.with_name(path.name + ".partial")  # built aside: an interrupted build is never served
    build(partial, task=TASK, seed=0, recipe="tools")
    if path.exists():
        path.rmdir()
    partial.rename(path)
    return path
