"""The live canary's guard on the reward spec's primary term (``gate.canary.primary`` "spec", the
default: docs/gate.md, Guards): the reward decides, and a challenger confidently worse on the primary
term ends failed; an app that never reports the term gets canaries decided on the reward, noted."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from gating import canary_settings

from deployer import canary
from evals.sequential import Guard, SequentialTest
from schemas.clock import utcnow
from schemas.settings import Settings
from store import LiveEpisode

pytestmark = pytest.mark.unit


def _arm(version: int, n: int, p_up: float, p_success: float | None, rng: random.Random) -> list[LiveEpisode]:
    """n episodes of `version` under tab-v1: a thumbs up (+0.5) with probability p_up, else down
    (-0.5), and with `p_success` a task_outcome of 1 (success) or 0 per episode, else none."""
    now = utcnow()
    out = []
    for i in range(n):
        up = rng.random() < p_up
        components = {"thumbs_up": 0.5} if up else {"thumbs_down": -0.5}
        if p_success is not None:
            components["task_outcome"] = 1.0 if rng.random() < p_success else 0.0
        out.append(
            LiveEpisode(
                episode_id=f"{version}-{i}",
                tenant="t",
                policy_number=version,
                reward=sum(components.values()),
                settled_at=now + timedelta(seconds=i, milliseconds=version),
                completions=(" 5!",),
                finish_reasons=("stop",),
                components=components,
            )
        )
    return out


def _interleave(*arms: list[LiveEpisode]) -> list[LiveEpisode]:
    return sorted([e for arm in arms for e in arm], key=lambda e: e.settled_at)


def test_the_default_is_the_specs_primary_term_as_a_guard() -> None:
    assert Settings().gate.canary.primary == "spec"
    assert canary.reward_range(canary_settings()) == (
        -1.0,
        1.0,
    )  # the reward decides: tab-v1 declares no range


def test_a_sycophant_better_on_the_reward_but_worse_on_the_outcome_ends_failed_by_the_guard() -> None:
    """Thumbs up far more often (the reward rises) while its tasks succeed half as often: the reward
    test alone would pass it; the primary guard (tab-v1: task_outcome) fails it."""
    rng = random.Random(7)
    episodes = _interleave(_arm(2, 400, 0.95, 0.4, rng), _arm(1, 400, 0.6, 0.8, rng))
    thumbs_only = [
        LiveEpisode(**{**e.__dict__, "reward": e.reward - e.components["task_outcome"]}) for e in episodes
    ]
    by_reward = canary.look(canary_settings(primary="reward", reward_range=(-0.5, 0.5)), thumbs_only, 2, 1)
    assert by_reward.decision.outcome == "pass"  # what the reward alone says
    guarded = canary.look(canary_settings(reward_range=(-0.5, 0.5)), thumbs_only, 2, 1)
    assert (guarded.decision.outcome, guarded.decision.cause) == ("fail", "guard")
    assert guarded.decision.reason.startswith("guard primary: challenger − champion ≤ ")
    assert guarded.primary["term"] == "task_outcome" and guarded.primary["status"] == "tripped"
    assert guarded.as_dict()["primary"]["episodes"]["challenger"] >= 30


def test_without_primary_data_the_reward_decides_and_the_guard_is_noted_no_data() -> None:
    rng = random.Random(8)
    episodes = _interleave(_arm(2, 1500, 0.9, None, rng), _arm(1, 1500, 0.9, None, rng))
    looked = canary.look(canary_settings(), episodes, 2, 1)
    assert (looked.decision.outcome, looked.decision.cause) == ("pass", "non_inferior")
    assert looked.primary == {
        "term": "task_outcome",
        "episodes": {"challenger": 0, "champion": 0},
        "status": "no data",
    }
    assert looked.decision.reason.endswith(
        "guard primary (task_outcome): no data, n 0 challenger / 0 champion below min_episodes 30"
    )


def test_the_guard_waits_for_min_episodes_carrying_the_term_in_both_arms() -> None:
    """A challenger whose every task fails, but with fewer outcome episodes than min_episodes in one
    arm: the guard does not trip (and the reward test, with too few episodes, goes on)."""
    rng = random.Random(9)
    few = _arm(2, 20, 0.9, 0.0, rng)
    episodes = _interleave(few, _arm(1, 200, 0.9, 1.0, rng))
    looked = canary.look(canary_settings(min_episodes=30), episodes, 2, 1)
    assert looked.decision.outcome == "continue"
    assert looked.primary["status"] == "no data" and looked.primary["episodes"]["challenger"] == 20
    assert "no data" not in looked.decision.reason  # said only beside a final verdict


def test_an_explicit_primary_keeps_deciding_on_its_term_without_the_guard() -> None:
    rng = random.Random(10)
    episodes = _interleave(_arm(2, 300, 0.95, 0.4, rng), _arm(1, 300, 0.6, 0.8, rng))
    looked = canary.look(canary_settings(primary="task_outcome"), episodes, 2, 1)
    assert (looked.decision.outcome, looked.decision.cause) == ("fail", "inferior")
    assert looked.primary == {"status": "off (gate.canary.primary=task_outcome decides)"}
    assert [r.guard.name for r in looked.decision.guards] == ["non_answer", "truncation", "errors"]


def test_a_decrease_guard_trips_on_the_upper_bound_and_only_after_min_n() -> None:
    guard = Guard("primary", 0.05, 0.01, decrease=True, min_n=50)
    test = SequentialTest(alpha=0.05, margin=0.05, min_n=10_000, max_n=20_000, guards=(guard,))
    assert test.update_guard("primary", [0.0] * 49, [1.0] * 49).outcome == "continue"  # below min_n
    decision = test.update_guard("primary", [0.0], [1.0])
    assert (decision.outcome, decision.cause) == ("fail", "guard")
    reading = decision.guards[0]
    assert reading.tripped and reading.difference.high < -0.05
    with pytest.raises(ValueError, match="min_n must be an int"):
        Guard("x", 0.05, 0.01, min_n=-1)
