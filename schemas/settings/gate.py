"""Settings of the eval gate between @challenger and @champion: its suites, the off-policy estimate,
the behaviour alarms and the anchor (deployer/gate.py, docs/gate.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from schemas.settings.judge import JudgeSettings
from schemas.settings.section import Section

GateSuite = Literal["ope", "retention", "oracle", "judge"]


class OpeSettings(Section):
    """The gate's off-policy estimate on held-out logged traffic (docs/gate.md, Off-policy evaluation)."""

    holdout_percent: int = Field(
        10,
        ge=0,
        le=50,
        description="Percent of episodes (by a hash of the episode id) kept for the gate and never trained on; "
        "0 turns the held-out slice, and so the suite, off.",
    )
    max_episodes: int = Field(512, ge=1, description="Newest held-out episodes the estimate uses.")
    min_ess: float = Field(
        32.0,
        gt=0,
        description="Below this effective sample size (of the challenger's or the champion's weights) the "
        "estimate is inconclusive and does not decide.",
    )
    clip: float = Field(10.0, gt=1, description="Importance weights are clipped at this value.")


class AlarmSettings(Section):
    """Behaviour alarms on the challenger (docs/gate.md, Alarms): any alarm blocks promotion."""

    length_ratio: float = Field(
        2.0,
        gt=1,
        description="Challenger's mean completion length above this multiple of the champion's (+2 tokens).",
    )
    entropy_ratio: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="Challenger's per-token entropy (estimated from its sampled tokens' logprobs) below this "
        "fraction of the champion's.",
    )
    repetition_rate: float = Field(
        0.2,
        gt=0,
        le=1,
        description="Share of repetitive completions up by more than this over the champion's.",
    )
    truncation_rate: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Share of completions cut off by max_tokens (no answer within the budget) up by more than this.",
    )
    kl_budget: float = Field(
        1.0,
        gt=0,
        description="Per-token KL(champion || challenger) on held-out logged traffic above this (nats).",
    )
    no_action_rate: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Share of non-answers (no_action_pattern) in the challenger's completions, or its estimated "
        "share of episodes without feedback on held-out traffic, up by more than this over the champion's.",
    )
    no_action_pattern: str = Field(
        r"^[^\w]*$|\?\s*$",
        description="Regular expression (Python, searched) that marks a completion as a non-answer: by default "
        "nothing alphanumeric, or a question.",
    )


class OfflineSuiteSettings(Section):
    """A prompt set with a verifiable scorer (docs/gate.md, Offline suites)."""

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    path: Path = Field(
        ...,
        description='JSONL: one {"prompt": ..., "answers": [...]} or {"prompt": ..., '
        '"pattern": ...} object per line.',
    )
    scorer: Literal["exact", "contains", "regex", "function"] = Field(
        "contains",
        description="exact: the stripped completion equals an answer; contains: an answer appears as a whole "
        "word; regex: the line's pattern matches; function: `function` decides.",
    )
    function: str | None = Field(
        None,
        description='"module:function" called as f(prompt, completion, line) -> float in [0, 1] (scorer=function).',
    )
    max_tokens: int = Field(32, ge=1, le=4096)
    stop: tuple[str, ...] = ("\n",)


class GateSettings(Section):
    """The eval gate between @challenger and @champion (deployer/gate.py, docs/gate.md)."""

    tolerance: float = Field(
        0.05,
        ge=0,
        description="Non-inferiority margin: a suite passes when the lower confidence bound of challenger minus "
        "champion is above -tolerance (in the suite's units: mean reward, or share of correct answers).",
    )
    margins: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict,
        description='Per-suite margins that replace `tolerance`, by suite name (e.g. {"retention": 0.1}).',
    )
    confidence: float = Field(
        0.95, gt=0.5, lt=1, description="One-sided confidence of each suite's lower bound."
    )
    bootstrap_resamples: int = Field(1000, ge=100, description="Bootstrap resamples per interval.")
    seed: int = Field(20240917, description="Sampling seed (the same for both models) and bootstrap seed.")
    suites: tuple[GateSuite, ...] = Field(
        ("ope", "retention"),
        description="ope: off-policy estimate on held-out logged traffic (no oracle); retention: the task's "
        "held-out questions scored by their known answers; oracle: the task's preference function (only where "
        "one exists: the demo's simulated users); judge: the task's held-out prompts graded by `judge`. Offline "
        "JSONL suites are added with `offline`.",
    )
    offline: tuple[OfflineSuiteSettings, ...] = Field(
        (), description="Extra prompt sets with verifiable scorers."
    )
    eval_prompts: int = Field(
        48, ge=1, description="Held-out prompts of the task (retention, oracle) per model."
    )
    samples_per_prompt: int = Field(4, ge=1, description="Completions per prompt.")
    task: str = Field(
        "exclaim",
        description="Task (evals/tasks.py) whose held-out questions the retention and oracle suites use.",
    )
    preference: str | None = Field(
        None, description="The oracle suite's preference, \"module:function\" (default: the task's own)."
    )
    ope: OpeSettings = OpeSettings()
    alarms: AlarmSettings = AlarmSettings()
    judge: JudgeSettings | None = Field(
        None, description='The judge suite\'s endpoint (needed when suites has "judge").'
    )
    anchor: str = Field(
        "base",
        pattern=r"^(base|none|[1-9][0-9]*)$",
        description="A fixed version the challenger must also not fall below on `anchor_suites`: base (the first "
        "registered version), a version number, or none. Non-inferiority against the champion alone lets small "
        "losses add up over promotions; the anchor bounds their sum by `anchor_margin`.",
    )
    anchor_suites: tuple[str, ...] = Field(
        ("retention",),
        description="Prompt suites (by name) on which the challenger is also compared with the anchor.",
    )
    anchor_margin: float = Field(0.05, ge=0, description="Non-inferiority margin against the anchor.")

    @model_validator(mode="after")
    def _judge_configured(self) -> GateSettings:
        if "judge" in self.suites and self.judge is None:
            raise ValueError(
                'gate.suites has "judge" but gate.judge is not set (RTRL_GATE__JUDGE__URL and '
                "RTRL_GATE__JUDGE__MODEL)"
            )
        return self
