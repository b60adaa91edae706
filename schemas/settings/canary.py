"""Settings of the live canary: after the offline gate passes, the challenger serves a share of live
traffic on a canary server and an always-valid sequential test of the users' reward decides
(deployer/canary.py, evals/sequential.py, docs/gate.md, Live canary).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.settings.section import Section

# A gateway keeps the canary's users on the canary server while its view of the store is younger than
# this many gateway.rotation_refresh_s (ingest/routing.py), and the deployer waits that long after
# taking the canary out of rotation before it changes the server (deployer/canary.py).
CANARY_STALE_REFRESHES = 10

# The arms a gateway counts a live canary's requests under (ingest/canary_traffic.py): "canary" when the
# canary server served the request, "fleet" when a fleet server did (store/canaries.py canary_traffic).
TRAFFIC_ARMS = ("canary", "fleet")
# Upper bounds (seconds) of the latency buckets the gateways count a canary's requests in, from the
# handler's start to the last byte sent; one more bucket, +inf, follows. The gateways and the deployer's
# latency guard (deployer/canary.py) must agree on them, so they live here.
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CanarySettings(Section):
    """The live canary between the offline gate and the fleet (docs/gate.md, Live canary)."""

    enabled: bool = Field(
        False,
        description="Run a live canary after the offline gate passes: the challenger serves `share` of live "
        "traffic on `vllm.canary_server`, and only a canary that passes promotes it. Needs `vllm.canary_server`.",
    )
    share: float = Field(
        0.1,
        gt=0,
        le=0.5,
        description="Share of users (else of episodes) routed to the canary server; sticky per user and per "
        "episode for the canary's whole run.",
    )
    alpha: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Error rate of the sequential test on the users' reward: a challenger more than `margin` "
        "worse passes with probability at most alpha, at whatever time the canary stops.",
    )
    margin: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Non-inferiority margin on the normalised reward (0..1, see `reward_range`): the canary "
        "passes once challenger − champion is above −margin with confidence 1 − alpha.",
    )
    primary: Literal["spec", "reward", "task_outcome", "judge_score", "judge"] = Field(
        "spec",
        description="What the test compares. spec: the episode's whole reward decides, and the reward spec's "
        "primary term (RewardSpec.primary) is a guard: the canary fails when challenger − champion on it is "
        "confidently below −margin (at guard_alpha, once both arms have min_episodes episodes carrying it; "
        "without them it is noted 'no data' and the reward decides alone). reward: the whole reward, no such "
        "guard. Or one scored term decides (task_outcome: an outcome the app reports; judge_score: a judge's "
        "score sent as feedback; judge: the labeler's judge term), episodes without it left out of the arms; "
        "so thumbs alone cannot carry a challenger that loses on the outcome.",
    )
    reward_range: tuple[float, float] | None = Field(
        None,
        description="[low, high] that maps an episode's reward onto 0..1 for the test (a reward outside is "
        "clipped and counted). None: the reward spec's reward_range, else [-1, 1].",
    )
    min_episodes: int = Field(
        50, ge=1, description="Rated episodes per arm before the primary test may decide."
    )
    max_episodes: int = Field(
        20_000,
        ge=1,
        description="Rated episodes per arm after which an undecided canary ends inconclusive (not promoted). "
        "An equal challenger needs about 10,000 at margin 0.05 (docs/gate.md, Measured: twelve planted challengers); `max_duration_s` "
        "bounds the wall time either way.",
    )
    min_duration_s: float = Field(
        0.0,
        ge=0,
        description="Wall time before a canary may pass (a fail or a guard ends it sooner): set it to a day "
        "where users' behaviour follows the time of day, so both arms see every hour.",
    )
    max_duration_s: float = Field(
        4 * 3600.0,
        gt=0,
        description="Wall time after which an undecided canary ends inconclusive (not promoted) and its traffic "
        "returns to the champion.",
    )
    check_every_s: float = Field(
        10.0, gt=0, description="How often the canary reads the store's settled episodes and looks again."
    )
    guard_alpha: float = Field(
        0.01, gt=0, lt=1, description="Error rate of each guard (a guard trips at most this often by chance)."
    )
    non_answer_increase: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Guard: the challenger's share of non-answers (gate.alarms' no_action_pattern) may exceed "
        "the champion's by at most this.",
    )
    truncation_increase: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Guard: the challenger's share of completions cut off by max_tokens may exceed the "
        "champion's by at most this.",
    )

    error_increase: float = Field(
        0.01,
        ge=0,
        lt=1,
        description="Guard: the share of the canary server's requests the gateways answered with an upstream "
        "failure (5xx, timeout, connection lost, no server reachable) may exceed the fleet's by at most this, "
        "at guard_alpha (an always-valid test on the gateways' counts, docs/gate.md Guards).",
    )
    latency_min_requests: int = Field(
        200,
        ge=1,
        description="Guard: requests each arm needs (counted by the gateways) before the latency guard may trip.",
    )
    latency_ratio: float = Field(
        1.5,
        gt=1,
        description="Guard: the canary trips when its p95 latency (handler start to last byte) is more than "
        "this times the fleet's p95 and more than latency_min_increase_s slower (a threshold, not a "
        "sequential test).",
    )
    latency_min_increase_s: float = Field(
        0.25,
        ge=0,
        description="Guard: the least p95 difference in seconds (canary − fleet) for the latency guard to trip.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> CanarySettings:
        if self.min_episodes > self.max_episodes:
            raise ValueError(
                f"gate.canary.min_episodes ({self.min_episodes}) must not exceed max_episodes ({self.max_episodes})"
            )
        if self.reward_range is not None and not self.reward_range[0] < self.reward_range[1]:
            raise ValueError("gate.canary.reward_range must be [low, high] with low < high")
        return self
