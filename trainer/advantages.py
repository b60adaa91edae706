"""Advantages for single production responses and for groups of samples of one prompt.

Pure functions of rewards and prompt keys (no torch, no I/O): the training cycle calls
`compute_advantages` once per cycle and persists the returned `BaselineState` only after the
cycle's model version is registered (trainer/checkpoint.py keeps it as JSON next to the
checkpoints), so a failed cycle leaves the baselines as they were.

* Group baseline (Dr. GRPO, https://arxiv.org/abs/2503.20783): samples that share a prompt (equal
  prompt token ids) form a group; Â = R − mean(group). No division by the group's std: it
  over-weights prompts whose rewards barely vary (docs/algorithms.md, Baselines for single responses).
* Running baseline (REINFORCE with a per-state baseline, Williams 1992): production traffic mostly
  gives one response per prompt, so a lone sample is compared with an exponential moving average
  of the rewards earlier cycles saw for the same prompt, or with the global running mean for a
  prompt never seen before (the batch mean on the very first cycle).

Baselines of a cycle are computed from the state *before* the cycle, then the state is updated
with the cycle's rewards: a sample never baselines against itself.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

# Weight of a cycle's mean reward in the running baselines. High enough that a prompt's baseline
# follows an improving policy within a few cycles, low enough to average out binary feedback.
EMA_ALPHA = 0.3
# Bound on remembered prompts; the least recently updated are forgotten first.
MAX_PROMPT_KEYS = 200_000


def prompt_key(prompt_token_ids: Sequence[int]) -> str:
    """Stable key of a prompt: sha256 of its token ids (equal ids ⇔ same key)."""
    data = ",".join(str(int(t)) for t in prompt_token_ids).encode()
    return hashlib.sha256(data).hexdigest()[:32]


@dataclass
class BaselineState:
    """Running per-prompt reward baselines, carried from cycle to cycle."""

    global_mean: float | None = None
    prompts: dict[str, float] = field(default_factory=dict)
    # key -> the update counter at which the key last changed (for forgetting the oldest).
    touched: dict[str, int] = field(default_factory=dict)
    updates: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "global_mean": self.global_mean,
            "prompts": self.prompts,
            "touched": self.touched,
            "updates": self.updates,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> BaselineState:
        global_mean = data.get("global_mean")
        return cls(
            global_mean=None if global_mean is None else float(global_mean),  # type: ignore[arg-type]
            prompts={str(k): float(v) for k, v in dict(data.get("prompts") or {}).items()},  # type: ignore[call-overload]
            touched={str(k): int(v) for k, v in dict(data.get("touched") or {}).items()},  # type: ignore[call-overload]
            updates=int(data.get("updates") or 0),  # type: ignore[call-overload]
        )


@dataclass(frozen=True)
class Advantages:
    """Per-sample advantages and how each was baselined."""

    values: list[float]  # (N,) Â_i, one per sample, in input order
    baselines: list[float]  # (N,) the b_i subtracted: Â_i = R_i − b_i
    kinds: list[str]  # (N,) "group" | "prompt" | "global"


def group_means(keys: Sequence[str], rewards: Sequence[float]) -> dict[str, tuple[int, float]]:
    """key -> (group size, mean reward) over the batch."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for key, reward in zip(keys, rewards, strict=True):
        sums[key] += reward
        counts[key] += 1
    return {key: (counts[key], sums[key] / counts[key]) for key in sums}


def compute_advantages(
    keys: Sequence[str], rewards: Sequence[float], state: BaselineState, alpha: float = EMA_ALPHA
) -> tuple[Advantages, BaselineState]:
    """Advantages of one cycle's samples and the baseline state to persist after it.

    ``keys[i]`` is `prompt_key` of sample i's prompt, ``rewards[i]`` its scalar reward.
    """
    if len(keys) != len(rewards):
        raise ValueError(f"{len(keys)} keys for {len(rewards)} rewards")
    if not rewards:
        return Advantages([], [], []), state
    groups = group_means(keys, rewards)
    fallback = state.global_mean if state.global_mean is not None else sum(rewards) / len(rewards)

    values: list[float] = []
    baselines: list[float] = []
    kinds: list[str] = []
    for key, reward in zip(keys, rewards, strict=True):
        size, mean = groups[key]
        if size >= 2:
            baseline, kind = mean, "group"
        elif key in state.prompts:
            baseline, kind = state.prompts[key], "prompt"
        else:
            baseline, kind = fallback, "global"
        values.append(reward - baseline)
        baselines.append(baseline)
        kinds.append(kind)
    return Advantages(values, baselines, kinds), update_state(state, groups, rewards, alpha)


def update_state(
    state: BaselineState, groups: dict[str, tuple[int, float]], rewards: Sequence[float], alpha: float
) -> BaselineState:
    """EMA-update each prompt's baseline with its batch mean and the global mean with the batch mean.

    A prompt seen for the first time starts at its batch mean. Returns a new state.
    """
    updates = state.updates + 1
    prompts = dict(state.prompts)
    touched = dict(state.touched)
    for key, (_size, mean) in groups.items():
        prompts[key] = mean if key not in prompts else (1 - alpha) * prompts[key] + alpha * mean
        touched[key] = updates
    batch_mean = sum(rewards) / len(rewards)
    global_mean = (
        batch_mean if state.global_mean is None else (1 - alpha) * state.global_mean + alpha * batch_mean
    )
    if len(prompts) > MAX_PROMPT_KEYS:
        for key in sorted(touched, key=touched.__getitem__)[: len(prompts) - MAX_PROMPT_KEYS]:
            del prompts[key], touched[key]
    return BaselineState(global_mean=global_mean, prompts=prompts, touched=touched, updates=updates)


def overlong_penalty(length: int, max_tokens: int | None, buffer: float) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476 §3.4): 0 up to (1 − buffer)·max_tokens,
    then falling linearly to −1 at max_tokens (−1 beyond). 0 when the request had no max_tokens
    or the buffer is 0."""
    if max_tokens is None or buffer <= 0:
        return 0.0
    cache = buffer * max_tokens
    if length <= max_tokens - cache:
        return 0.0
    if length <= max_tokens:
        return (max_tokens - cache - length) / cache
    return -1.0
