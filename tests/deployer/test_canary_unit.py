"""The live canary's decision (`deployer.canary.look`) on planted arms, and `reap` of a canary whose
runner died, on a SQLite store (no servers: the canary server's rotation row is all it touches)."""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import pytest
from gating import CANARY, canary_settings

from deployer import canary
from deployer.swap import rollout_lock
from schemas.settings import Settings
from store import LiveEpisode, Store

pytestmark = pytest.mark.unit


def _arm(version: int, n: int, p_up: float, rng: random.Random, **kw: Any) -> list[LiveEpisode]:
    """n rated episodes of `version`: thumbs up (+0.5) with probability p_up, else down (-0.5)."""
    from schemas.clock import utcnow

    now = utcnow()
    return [
        LiveEpisode(
            episode_id=f"{version}-{i}",
            tenant="t",
            policy_number=version,
            reward=0.5 if rng.random() < p_up else -0.5,
            settled_at=now + timedelta(seconds=i),
            completions=(kw.get("text", " 5!"),),
            finish_reasons=(kw.get("finish", "stop"),),
        )
        for i in range(n)
    ]


def _interleave(*arms: list[LiveEpisode]) -> list[LiveEpisode]:
    return sorted([e for arm in arms for e in arm], key=lambda e: e.settled_at)


def test_a_challenger_users_like_less_fails_and_an_equal_one_passes() -> None:
    rng = random.Random(0)
    settings = canary_settings()
    worse = canary.look(settings, _interleave(_arm(2, 200, 0.3, rng), _arm(1, 200, 0.9, rng)), 2, 1)
    assert (worse.decision.outcome, worse.decision.cause) == ("fail", "inferior")
    assert (worse.challenger, worse.champion, worse.clipped) == (200, 200, 0)
    equal = canary.look(settings, _interleave(_arm(2, 1500, 0.9, rng), _arm(1, 1500, 0.9, rng)), 2, 1)
    assert (equal.decision.outcome, equal.decision.cause) == ("pass", "non_inferior")


def test_too_few_episodes_continue_and_other_versions_are_ignored() -> None:
    rng = random.Random(1)
    settings = canary_settings()
    early = canary.look(
        settings, _interleave(_arm(2, 10, 0.0, rng), _arm(1, 10, 1.0, rng), _arm(7, 50, 0, rng)), 2, 1
    )
    assert early.decision.outcome == "continue"
    assert (early.challenger, early.champion) == (10, 10)


def test_a_guard_stops_the_canary_before_min_episodes() -> None:
    rng = random.Random(2)
    settings = canary_settings(min_episodes=1000, max_episodes=5000)
    refusing = _arm(2, 50, 0.9, rng, text="I cannot help with that.")
    looked = canary.look(settings, _interleave(refusing, _arm(1, 50, 0.9, rng)), 2, 1)
    assert (looked.decision.outcome, looked.decision.cause) == ("fail", "guard")
    assert "non_answer" in looked.decision.reason
    cut = _arm(2, 50, 0.9, rng, finish="length")
    looked = canary.look(settings, _interleave(cut, _arm(1, 50, 0.9, rng)), 2, 1)
    assert (looked.decision.outcome, looked.decision.cause) == ("fail", "guard")
    assert "truncation" in looked.decision.reason


def test_rewards_are_normalised_by_the_declared_range_and_outliers_are_clipped_and_counted() -> None:
    rng = random.Random(3)
    settings = canary_settings(reward_range=(-0.25, 0.25))
    looked = canary.look(settings, _interleave(_arm(2, 20, 0.5, rng), _arm(1, 20, 0.5, rng)), 2, 1)
    assert looked.clipped == 40 and looked.reward_range == (-0.25, 0.25)
    assert canary.reward_range(canary_settings()) == (-1.0, 1.0)  # tab-v1 declares none
    record = looked.as_dict()
    assert record["episodes"] == {"challenger": 20, "champion": 20}
    assert record["decision"]["outcome"] == "continue"


def test_reap_ends_a_canary_whose_runner_died_and_takes_its_server_out(store: Store) -> None:
    settings = canary_settings()
    record = store.start_canary("m", 2, 1, CANARY, 0.1, None)
    store.set_rotation(CANARY, True, "canary: serving v2")
    with rollout_lock(store, canary.CANARY_LOCK, "a live runner"):
        assert canary.reap(settings, store) is None  # the runner holds the lock: left alone
        assert store.running_canary() is not None
    did = canary.reap(settings, store)  # the lock is free: its runner is gone
    assert did is not None and f"#{record.id}" in did
    ended = store.canary(record.id)
    assert ended is not None and ended.state == "aborted" and "runner died" in ended.reason
    assert not store.rotation()[CANARY].in_rotation
    assert canary.reap(settings, store) is None  # nothing left to do
    store.set_rotation(CANARY, True, "left in by hand")
    assert canary.reap(settings, store) == f"took {CANARY} out of rotation: no canary runs"
    assert not store.rotation()[CANARY].in_rotation


def test_a_sycophant_that_wins_thumbs_and_loses_the_outcome_fails_on_the_primary_term() -> None:
    """With primary=task_outcome the test reads the outcome the app reports, not the thumbs: a
    challenger users thumb up more often while its tasks succeed less often fails."""
    rng = random.Random(4)

    def arm(version: int, n: int, p_thumb: float, p_success: float) -> list[LiveEpisode]:
        episodes = _arm(version, n, p_thumb, rng)
        out = []
        for e in episodes:
            success = 1.0 if rng.random() < p_success else 0.0
            out.append(
                LiveEpisode(
                    **{
                        **e.__dict__,
                        "components": {"thumbs_up": 0.5, "task_outcome": success},
                        "reward": e.reward + success,
                    }
                )
            )
        return out

    episodes = _interleave(arm(2, 300, 0.95, 0.4), arm(1, 300, 0.6, 0.8))
    thumbs = canary.look(  # primary=reward: no guard on the spec's primary term (test_canary_primary.py)
        canary_settings(primary="reward", reward_range=(-0.5, 0.5)),
        [LiveEpisode(**{**e.__dict__, "reward": 0.5 if e.reward > 0.25 else -0.5}) for e in episodes],
        2,
        1,
    )
    outcome = canary.look(canary_settings(primary="task_outcome"), episodes, 2, 1)
    assert canary.reward_range(canary_settings(primary="task_outcome")) == (
        -1.0,
        1.0,
    )  # tab-v1: weight 1 x [-1, 1]
    assert outcome.decision.outcome == "fail" and outcome.challenger == 300
    assert thumbs.decision.outcome != "fail"


def test_settings_refuse_a_canary_without_its_server_or_longer_than_a_cycle() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="needs vllm.canary_server"):
        Settings(gate={"canary": {"enabled": True}})
    with pytest.raises(ValidationError, match="must be below trainer.max_cycle_s"):
        Settings(vllm={"canary_server": CANARY}, gate={"canary": {"enabled": True, "max_duration_s": 1e9}})
    with pytest.raises(ValidationError, match="is also in vllm.servers"):
        Settings(vllm={"canary_server": "http://127.0.0.1:18000"})
    assert Settings(vllm={"canary_server": CANARY}, gate={"canary": {"enabled": True}}).gate.canary.enabled
