"""Settings of the feedback labeler (`rtrl labeler`, feedback/labeler.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from schemas.settings.judge import JudgeSettings
from schemas.settings.section import Section


class LabelerSettings(Section):
    """The feedback labeler: consume, store, join, settle, reward."""

    settle_window_s: float = Field(
        30.0, description="An episode with no terminal feedback settles this long after its last event."
    )
    poll_timeout_ms: int = Field(500, description="Kafka poll timeout.")
    max_poll_records: int = Field(500, description="Records per poll (one DB transaction).")
    session_timeout_ms: int = Field(
        45_000,
        ge=6_000,
        le=300_000,
        description="How long the labeler group waits for a member that stopped heartbeating (a killed or "
        "hung labeler) before its partitions go to the others: a killed labeler's partitions stall this "
        "long. Kafka's default; the broker refuses less than its group.min.session.timeout.ms (6 s by "
        "default). Heartbeats go every third of it, at most every 3 s.",
    )
    reward_spec: str = Field(
        "tab-v1", description="Name of the reward spec (schemas/rewards.py) or a path to a .json spec."
    )
    judge: JudgeSettings | None = Field(
        None,
        description="The endpoint that grades episodes under a reward spec with a judge term (feedback/judging.py); "
        "its rubric is the spec's. Needed by such a spec, unused otherwise.",
    )
    judge_batch: int = Field(
        64, ge=1, le=10_000, description="Episodes graded per judge pass of the labeler."
    )
    unknown_tenants: Literal["refuse", "accept"] = Field(
        "refuse",
        description="What the labeler does with an interaction or feedback event whose tenant has no row in the "
        "store's tenants table (`rtrl tenants set`, or a tenant key, creates one): refuse = dead-letter it "
        "(`unknown tenant: <id>`), so a record forged on Kafka for a made-up tenant never trains; accept = store "
        "it, and it trains as a tenant with training on (docs/security.md, Forged events).",
    )
    vocab_size: int | None = Field(
        None,
        ge=1,
        lt=2**31,
        description="Token ids at or above this are refused (dead letter `content: token id outside the "
        "vocabulary`): the rows of the serving model's embedding. None: vocab_size of config.json in "
        "vllm.model_dir (or its text_config), read once at start-up; set it where the labeler cannot read that "
        "directory.",
    )
    holdout_secret: SecretStr | None = Field(
        None,
        description="Key of the HMAC-SHA256 of an episode's id that decides whether the episode is in the eval "
        "gate's held-out slice (gate.ope.holdout_percent): a client that chooses its episode ids cannot choose "
        "which are held out. The same on every labeler replica. Unset: one is made in "
        "<services.run_dir>/labeler.holdout_secret (mode 0600; enough for labelers on one host).",
    )
