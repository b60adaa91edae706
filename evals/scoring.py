"""Scoring a completion of a task: the task's preference signals through a reward spec.

The same spec the labeler settles episodes with (schemas/rewards.py), so what the simulated users'
feedback is worth in training is what a completion is worth to the eval gate.
"""

from __future__ import annotations

from collections.abc import Callable

from evals.tasks import Preference
from schemas.rewards import RewardSpec, score

Scorer = Callable[[str, str], float]


def scorer(preference: Preference, spec: RewardSpec) -> Scorer:
    """reward(prompt, completion) = the spec's reward of the preference's signals."""

    def reward(prompt: str, completion: str) -> float:
        return float(score(spec, preference(prompt, completion)).reward)

    return reward
