"""What an episode's structure says: the per-episode measurements of the seed methods.

Pure functions of an episode's segments in segment order, no SQL or torch. The labeler computes
them when it settles an episode (store/settle.py) and stores them on it (``episodes.metrics``); the
reward spec's PARL shaping reads two of them (schemas/rewards.py); the trainer summarises them per
cycle in the cycle's MLflow run (trainer/cycle.py). docs/methods.md describes each method.

Every episode gets:

* ``segments``, ``trainable_segments``, ``summaries`` (segments of role ``summary``: Cursor's
  self-summarization), ``max_context_tokens`` (the longest context one call saw: its prompt plus
  its completion), ``completion_tokens`` (everything the model generated in the episode);
* ``context_edits`` and ``rewritten_chars``: how often an agent's next call did not continue its
  previous context (prompt + completion text) as a prefix — the context was pruned (Chroma's
  self-editing agent) or replaced by a summary — and how many characters of those previous
  contexts the next call did not carry over as a prefix. Compared as text, not token ids: a
  client that continues a context re-sends it as text, and the server may tokenize the seam
  differently from how the completion was sampled. Calls are compared within one agent (a PARL
  sub-agent has its own context).

An episode with orchestrator or sub-agent segments (Kimi PARL) also gets:

* ``stages``: a stage begins at each orchestrator call; the sub-agent calls after it, up to the
  next orchestrator call, run in that stage (sub-agent calls before the first orchestrator call
  form a stage of their own);
* ``critical_steps`` C = Σ_stages (orchestrator calls + the most calls of one sub-agent): the cost
  of the longest branch of each stage (docs/methods.md, PARL);
* ``subagents`` (distinct sub-agent ids; a sub-agent call without an ``agent`` id counts as its own
  sub-agent) and ``subagents_finished`` (those whose last call stopped by itself, finish reason
  ``stop``, rather than at ``max_tokens`` or cut off);
* ``subagents_used``: the finished sub-agents whose result the orchestrator used — the last answer
  of the sub-agent (its last call's completion, stripped, not empty) is in the prompt of an
  orchestrator call after that call, and was not already in the orchestrator's context (prompt +
  completion of its last call before the sub-agent's first call). PARL's r_finish counts these
  (schemas/rewards.py): a sub-agent whose answer never reached the orchestrator, or brought it
  nothing it did not have, did no useful work. Compared as text, like the context edits; an answer
  the orchestrator's context already held cannot be told from one it received, so it does not count;
* ``subagent_calls_off_pin``: sub-agent calls served by another weight version than the one the
  episode's first call other than a sub-agent's was served by (the version the sub-agents are pinned to; 0 when
  the versions are unknown). The fleet serves the champion of the moment, so a server swapped
  mid-episode serves the rest of it from the new version: counted here, not hidden
  (docs/methods.md, PARL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ORCHESTRATOR = "orchestrator"
SUBAGENT = "subagent"
SUMMARY = "summary"


@dataclass(frozen=True)
class SegmentShape:
    """What the measurements need of one segment: lengths in tokens; the text only to compare one
    call's context with the next (an episode of one segment can leave it out)."""

    role: str
    agent: str | None
    prompt_len: int
    completion_len: int
    finish_reason: str | None
    trainable: bool
    prompt: str = ""
    completion: str = ""
    version: str | None = None  # the weight version that served the call ("v3"), None when not known


def is_parl(segments: Sequence[SegmentShape]) -> bool:
    """Whether the episode is a PARL episode (it has orchestrator or sub-agent calls)."""
    return any(s.role in (ORCHESTRATOR, SUBAGENT) for s in segments)


def episode_metrics(segments: Sequence[SegmentShape]) -> dict[str, int]:
    """The measurements of the module docstring for one episode's segments (in segment order)."""
    metrics = {
        "segments": len(segments),
        "trainable_segments": sum(s.trainable for s in segments),
        "summaries": sum(s.role == SUMMARY for s in segments),
        "max_context_tokens": max((s.prompt_len + s.completion_len for s in segments), default=0),
        "completion_tokens": sum(s.completion_len for s in segments),
    }
    metrics |= _context_edits(segments)
    if is_parl(segments):
        metrics |= parl_metrics(segments)
    return metrics


def _agent_key(index: int, segment: SegmentShape) -> str:
    if segment.role == SUBAGENT:
        return f"sub:{segment.agent}" if segment.agent is not None else f"sub#{index}"
    return f"main:{segment.agent}" if segment.agent is not None else "main"


def _context_edits(segments: Sequence[SegmentShape]) -> dict[str, int]:
    previous: dict[str, str] = {}  # agent -> its last call's context (prompt + completion)
    edits = rewritten = 0
    for index, segment in enumerate(segments):
        key = _agent_key(index, segment)
        before = previous.get(key)
        if before is not None and not segment.prompt.startswith(before):
            edits += 1
            rewritten += len(before) - _common_prefix(before, segment.prompt)
        previous[key] = segment.prompt + segment.completion
    return {"context_edits": edits, "rewritten_chars": rewritten}


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b`: a binary search of slice comparisons
    (memory compares in C, O(n log n)), not a Python loop over characters, which took seconds per
    segment on prompts of a few hundred kilobytes (docs/security.md, Caps per episode)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:  # the first `lo` characters are known to agree
            lo = mid
        else:
            hi = mid - 1
    return lo


def parl_metrics(segments: Sequence[SegmentShape]) -> dict[str, int]:
    """Stages, critical steps and sub-agents of a PARL episode (module docstring)."""
    stages: list[tuple[int, dict[str, int]]] = []  # (orchestrator calls, calls per sub-agent)
    first_call: dict[str, int] = {}  # sub-agent -> index of its first call
    last_call: dict[str, int] = {}  # sub-agent -> index of its last call
    for index, segment in enumerate(segments):
        if segment.role == SUBAGENT:
            if not stages:
                stages.append((0, {}))
            key = _agent_key(index, segment)
            stages[-1][1][key] = stages[-1][1].get(key, 0) + 1
            first_call.setdefault(key, index)
            last_call[key] = index
        else:
            if segment.role == ORCHESTRATOR or not stages:
                stages.append((0, {}))
            main, subs = stages[-1]
            stages[-1] = (main + 1, subs)
    finished = {key for key, index in last_call.items() if segments[index].finish_reason == "stop"}
    pin = next((s.version for s in segments if s.role != SUBAGENT), None)
    return {
        "stages": len(stages),
        "critical_steps": sum(main + max(subs.values(), default=0) for main, subs in stages),
        "subagents": len(last_call),
        "subagents_finished": len(finished),
        "subagents_used": sum(_used(segments, first_call[key], last_call[key]) for key in finished),
        "subagent_calls_off_pin": 0
        if pin is None
        else sum(s.role == SUBAGENT and s.version is not None and s.version != pin for s in segments),
    }


def _used(segments: Sequence[SegmentShape], first: int, last: int) -> bool:
    """Whether the orchestrator used the answer of the sub-agent whose calls run from segment `first`
    to `last`: it is in a later orchestrator call's prompt and was new to the orchestrator (module
    docstring). The main agent's calls are every call that is not a sub-agent's."""
    answer = segments[last].completion.strip()
    if not answer:
        return False
    before = next((s for s in reversed(segments[:first]) if s.role != SUBAGENT), None)
    if before is not None and answer in before.prompt + before.completion:
        return False
    return any(s.role != SUBAGENT and answer in s.prompt for s in segments[last + 1 :])


def batch_metrics(episodes: Sequence[tuple[Mapping[str, Any], Mapping[str, float]]]) -> dict[str, float]:
    """A training batch's measurements for its MLflow run: each episode's (metrics, reward components).

    Means over the episodes that have the measurement (rows older than it have none): segments,
    summaries, context length and edits; for PARL episodes the critical steps, sub-agents, the share
    finished and the share used, the sub-agent calls served off the pinned version, the λ they were
    labelled with and the shaping they got; for judged episodes how many the judge could not grade
    and how often grade and feedback disagreed."""
    measured = [(m, c) for m, c in episodes if m]
    out: dict[str, float] = {}
    if not measured:
        return out

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    metrics = [m for m, _ in measured]
    out["episode_segments_mean"] = mean([m["segments"] for m in metrics])
    out["episode_summaries_mean"] = mean([m["summaries"] for m in metrics])
    out["episode_context_tokens_mean"] = mean([m["max_context_tokens"] for m in metrics])
    out["episode_context_tokens_max"] = float(max(m["max_context_tokens"] for m in metrics))
    out["episode_context_edits_mean"] = mean([m.get("context_edits", 0) for m in metrics])
    parl = [(m, c) for m, c in measured if "critical_steps" in m]
    if parl:
        out["parl_episodes"] = float(len(parl))
        out["parl_critical_steps_mean"] = mean([m["critical_steps"] for m, _ in parl])
        out["parl_critical_steps_max"] = float(max(m["critical_steps"] for m, _ in parl))
        out["parl_subagents_mean"] = mean([m["subagents"] for m, _ in parl])
        spawned = sum(m["subagents"] for m, _ in parl)
        out["parl_subagents_finished_share"] = (
            sum(m["subagents_finished"] for m, _ in parl) / spawned if spawned else 0.0
        )
        measured_use = [m for m, _ in parl if "subagents_used" in m]  # episodes settled before it have none
        if measured_use:
            spawned = sum(m["subagents"] for m in measured_use)
            used = sum(m["subagents_used"] for m in measured_use)
            out["parl_subagents_used_share"] = used / spawned if spawned else 0.0
            out["parl_subagent_calls_off_pin_mean"] = mean(
                [m["subagent_calls_off_pin"] for m in measured_use]
            )
        shaped = [(m, c) for m, c in parl if "lambda_parallel" in m]
        if shaped:
            out["parl_episode_lambda_parallel_mean"] = mean([m["lambda_parallel"] for m, _ in shaped])
            out["parl_episode_lambda_finish_mean"] = mean([m["lambda_finish"] for m, _ in shaped])
            out["parl_parallel_reward_mean"] = mean([c.get("parl_parallel", 0.0) for _, c in shaped])
            out["parl_finish_reward_mean"] = mean([c.get("parl_finish", 0.0) for _, c in shaped])
    judged = [m for m in metrics if "judge" in m]
    if judged:
        out["judge_episodes"] = float(len(judged))
        out["judge_unavailable"] = float(sum(m["judge"] is None for m in judged))
        grades = [m["judge"] for m in judged if m["judge"] is not None]
        if grades:
            out["judge_grade_mean"] = mean(grades)
        compared = [m["judge_disagrees"] for m in judged if m.get("judge_disagrees") is not None]
        out["judge_compared"] = float(len(compared))
        if compared:
            out["judge_disagreement_rate"] = sum(compared) / len(compared)
    return out
