"""Settings of the eval gate between @challenger and @champion: its suites, the off-policy estimate,
the behaviour alarms and the anchor (deployer/gate.py, docs/gate.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from schemas.settings.canary import CanarySettings
from schemas.settings.judge import JudgeSettings
from schemas.settings.section import Section

GateSuite = Literal["ope", "retention", "oracle", "judge", "traffic", "episodes"]
# Samples per held-out question of the `retention_sampled` suite by default (docs/gate.md, The
# retention suite's power: the power argument behind it).
SAMPLED_K = 32
# The agents whose multi-call episodes rtrl knows (evals/agents.py, docs/methods.md).
Scenario = Literal["parl", "summarize", "self-edit"]

# The `kl` alarm's budget when neither gate.alarms.kl_budget nor trainer.max_kl is set (nats/token).
KL_BUDGET_WITHOUT_TRUST_REGION = 1.0

# The default no_action_pattern, built from named parts (docs/gate.md, Alarms); case-insensitive.
# _ALONE counts only as the whole completion; the deflections only where the completion opens with
# one: a refusal or a deflection opens a non-answer, while a real answer may say "can't" or "more
# details" further on ("You can't divide by zero, so the result is undefined."). Leading whitespace is
# allowed, because a completion usually opens with one (" I can't help with that." after "A:") and
# not every reader strips it (the canary's guard searches the completion as served).
_A = "['\u2019]"  # an apostrophe, straight or curly
_LEAD_IN = (  # what may come before the refusal: an apology, a hedge, "as an AI"
    rf"(?:(?:i{_A}m |i am )?(?:very |so )?sorry|apologies|i apologi[sz]e|unfortunately|hmm+|well"
    r"|as an ai(?: language model| assistant| model)?)\W*(?:but\W+)?"
)
_REFUSAL = (  # I can't / cannot / am unable to / won't ... (at most one word) help, answer, ...
    rf"i(?: can{_A}?t| cannot| can not| won{_A}t| will not| am unable to|{_A}m unable to| am not able to"
    rf"|{_A}m not able to)(?: \w+)?? (?:help|assist|answer|respond|reply|provide|give|tell|say|share|comply"
    r"|do that|discuss|comment|determine|know|be sure|fulfil+|complete|access|offer|support|continue|engage)"
)
_UNKNOWING = (  # I don't know / understand, not sure, no idea, would rather not
    rf"i (?:do not|don{_A}t) (?:know|understand|follow)|i(?:{_A}m| am) not (?:sure|certain)"
    rf"|i (?:do not|don{_A}t) have (?:enough (?:information|context|details?)|access to|the ability to)"
    rf"|i have no idea|i(?:{_A}d| would) rather not|i prefer not to"
)
_CLARIFY = (  # a request for clarification or more details
    r"(?:could|can|would) you (?:please )?(?:clarify|elaborate|specify|rephrase|provide|give|share"
    r"|be more specific|tell me more)"
    r"|please (?:clarify|elaborate|specify|rephrase|provide|give|share|be more specific|tell me more)"
    r"|(?:i|we) (?:need|would need|require) more (?:information|context|details?)"
    r"|(?:more|additional) (?:information|context|details?) (?:is|are|would be) (?:needed|required)"
    r"|(?:let me know|tell me) (?:what|which|more)"
)
_ALONE = (  # non-answers only when they are the whole completion
    r"[^\w]*"  # nothing alphanumeric
    r"|(?:well\W*)?(?:it|that) (?:all |really )?depends(?: on (?:the |your )?(?:context|situation"
    r"|circumstances|case|many factors|what you mean|your needs))?\W*"
    rf"|(?:i{_A}m |i am )?(?:very |so )?sorry\W*"
    r"|(?:no idea|not sure|hard to say|no comment|who knows)\W*"
)
NO_ACTION_PATTERN = (
    rf"(?i)^\s*(?:{_ALONE})$"  # on its own
    r"|\?\s*$"  # ends in a question
    rf"|^\s*(?:{_LEAD_IN})?(?:as an ai\b|(?:{_REFUSAL}|{_UNKNOWING}|{_CLARIFY})\b)"  # opens with a deflection
)


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
    episodes: Literal["rated", "all"] = Field(
        "rated",
        description="Which held-out episodes the ope verdicts (against the champion and the anchor) estimate "
        "the reward on. rated: those whose reward carries user feedback or a judge's grade (the trainer's "
        "signal, schemas/rewards.py carries_signal), the units of the live canary; below `min_ess` of them the "
        "suite is inconclusive. all: every usable one, the unrated at their settled reward, which dilutes a "
        "loss by the feedback rate (at 30 % feedback a 12.5-point acceptance loss reads about 0.04, inside a "
        "0.05 margin). The kl and no_feedback alarms read every episode either way (docs/gate.md, Suites: ope).",
    )
    min_ess: float = Field(
        32.0,
        gt=0,
        description="Below this effective sample size (of the challenger's or the champion's weights) the "
        "estimate is inconclusive and does not decide.",
    )
    clip: float = Field(10.0, gt=1, description="Importance weights are clipped at this value.")
    min_primary: int = Field(
        32,
        ge=2,
        description="Held-out episodes carrying the reward spec's primary term (RewardSpec.primary) the "
        "ope_primary guard needs; below, it is inconclusive (noted) and does not decide.",
    )
    estimator: Literal["snips", "dr", "auto"] = Field(
        "auto",
        description="snips: self-normalised importance sampling; dr: doubly robust, a cross-fitted reward "
        "model plus `dr_samples` completions per held-out prompt sampled from both models on staging; auto: "
        "snips when its effective sample size reaches `min_ess` (nothing sampled), else dr when the reward "
        "model's out-of-fold R² is above 0, else snips (inconclusive). docs/gate.md, Suites: ope.",
    )
    dr_samples: int = Field(
        2,
        ge=1,
        le=16,
        description="Completions per held-out prompt sampled from each model on staging for the doubly "
        "robust estimate's direct method.",
    )


class TrafficSettings(Section):
    """The `traffic` suite: the prompts of held-out logged traffic replayed through both models on
    staging (docs/gate.md, Suites)."""

    max_prompts: int = Field(
        64,
        ge=1,
        description="Distinct held-out prompts per gate run, drawn per challenger from the newest `pool` "
        "(gate.fresh_draws; without, the newest `max_prompts`).",
    )
    pool: int = Field(
        512,
        ge=1,
        description="Newest distinct held-out prompts the draw picks `max_prompts` from.",
    )
    min_prompts: int = Field(
        16,
        ge=2,
        description="Fewer distinct held-out prompts than this and the suite is inconclusive (it does not "
        "decide), as ope is with too little traffic.",
    )
    per_tenant: int | None = Field(
        None,
        ge=1,
        description="At most this many of one tenant's prompts in a draw, so one busy tenant does not speak "
        "for every user; None: no cap.",
    )
    max_tokens: int = Field(
        64,
        ge=1,
        le=4096,
        description="Completion budget per prompt. Without a judge a completion cut off by it scores 0, so set "
        "it near what your users' requests allow.",
    )
    stop: tuple[str, ...] = Field(
        (),
        description="Stop strings. Chat requests' prompts are recorded chat-templated and end at the model's "
        'end-of-turn token, so none is needed; raw completion prompts may need one (the demo: ["\\n"]).',
    )

    @model_validator(mode="after")
    def _bounds(self) -> TrafficSettings:
        if self.min_prompts > self.max_prompts:
            raise ValueError(f"min_prompts ({self.min_prompts}) exceeds max_prompts ({self.max_prompts})")
        if self.max_prompts > self.pool:
            raise ValueError(f"max_prompts ({self.max_prompts}) exceeds pool ({self.pool})")
        return self


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
    kl_budget: float | None = Field(
        None,
        gt=0,
        description="Per-token KL(champion || challenger) on held-out logged traffic above this (nats). None: "
        "`kl_budget_factor` x `trainer.max_kl` when the trainer has a trust region, else "
        f"{KL_BUDGET_WITHOUT_TRUST_REGION:g}. A fixed 1.0 against a trust region of 0.1 could only fire once "
        "the trust region was broken tenfold.",
    )
    kl_budget_factor: float = Field(
        2.0,
        gt=0,
        description="The default `kl_budget` as a multiple of `trainer.max_kl`. Above 1 because the two do not "
        "measure the same thing: the trust region caps KL on the cycle's own training batch (k3 estimate), "
        "the alarm estimates it on held-out traffic the challenger never saw, reweighted and noisier; 2 leaves "
        "room for that and still fires long before the old 1.0 (docs/gate.md, Alarms).",
    )
    no_action_rate: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Share of non-answers (no_action_pattern) in the challenger's completions, or its estimated "
        "share of episodes without feedback on held-out traffic, up by more than this over the champion's.",
    )
    no_action_pattern: str = Field(
        NO_ACTION_PATTERN,
        description="Regular expression (Python, searched in the stripped completion) that marks a completion as "
        "a non-answer. The default, case-insensitive: nothing alphanumeric; a question; or a completion that "
        "opens (after an optional apology, 'unfortunately' or 'as an AI') with a refusal (I can't / cannot / "
        "am unable to / won't + help, answer, provide...), 'I don't know', 'I'm not sure', 'as an AI', or a "
        "request for clarification or more details; or 'it depends' on its own. A real answer that merely "
        'contains "can\'t" later on is an answer (docs/gate.md, Alarms).',
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


class EpisodeSuiteSettings(Section):
    """The `episodes` suite: whole agent episodes on the task's held-out questions, played through both
    models on staging (evals/agents.py, docs/gate.md, Suites: episodes)."""

    scenario: Scenario = Field(
        "self-edit",
        description="The agent that plays each episode: parl, summarize or self-edit (docs/methods.md). Set it to "
        "the method your agents run, so the gate judges what their episodes do, not single calls.",
    )
    scorer: Literal["verifiable", "judge", "oracle"] = Field(
        "verifiable",
        description="How a whole episode is scored. verifiable (no oracle): 0 when its final answer is a "
        "non-answer or one of the agent's calls was cut off by max_tokens, 0.5 when it answers, 1 when it also "
        "contains one of the question's known answers; judge: `gate.judge` grades the final answer in the context of the whole trajectory; oracle: the task's "
        "preference (`gate.preference`), only where one exists.",
    )
    samples: int = Field(2, ge=1, description="Episodes per held-out question and model.")
    concurrency: int = Field(
        8,
        ge=1,
        le=64,
        description="Episodes played at once on the staging server (each call is one request).",
    )


class RetentionSuiteSettings(Section):
    """The `retention` suite: how the task's held-out questions are asked and its margins (docs/gate.md,
    Suites: retention, and The retention suite's power)."""

    decode: Literal["greedy", "sampled"] = Field(
        "greedy",
        description="greedy: each question once at temperature 0 (the served defaults otherwise), the same for "
        "every model; with all questions (`questions` 0) the suite is a census of the held-out set and its "
        "verdict is exact, no bootstrap. sampled: `gate.samples_per_prompt` completions per question at the "
        "served sampling settings, decided by the paired bootstrap (the behaviour before the census).",
    )
    questions: int = Field(
        0,
        ge=0,
        description="Held-out questions the suite asks per model: 0, all of the task's (nothing is drawn); "
        "else that many, drawn per challenger like `gate.eval_prompts` (`gate.fresh_draws`).",
    )
    margin: float = Field(
        0.02,
        ge=0,
        description="Non-inferiority margin against the champion, in share of questions right, when "
        '`gate.margins` does not name "retention" (it takes precedence). A census passes a loss of exactly '
        "the margin: 0.02 on 75 questions allows one net lost question (1.33 points), not two.",
    )
    anchor_margin: float = Field(
        0.03,
        ge=0,
        description="Non-inferiority margin of this suite against the anchor (`gate.anchor`); the other "
        "anchored suites keep `gate.anchor_margin`. 0.03 on 75 questions allows two net lost questions.",
    )
    sampled_k: int = Field(
        SAMPLED_K,
        ge=0,
        le=256,
        description="The `retention_sampled` suite beside the greedy census: every held-out question sampled "
        "this many times at the served sampling settings (what users get), each question scored by the share "
        "of its samples that are right, decided by the paired bootstrap over questions under `sampled_margin`; "
        "0 turns it off. It costs k x the held-out questions completions per model and gate run (75 x 32 = "
        "2400 on the demo's task; three models with the anchor, as `retention` is anchored). At 32, in "
        "simulated gate runs on the v2 base's measured per-question rates, a 5-point loss of sampled answers "
        "fails it every time and an equal challenger passes 99 % of the time (73 % if every question sat at "
        "the same rate, the worst case for the noise); 16 halves the cost (91 %, 46 %) (docs/gate.md, The "
        "retention suite's power).",
    )
    sampled_margin: float = Field(
        0.03,
        ge=0,
        description="Non-inferiority margin of `retention_sampled` against the champion, in share of sampled "
        'answers right, when `gate.margins` does not name "retention_sampled"; against the anchor it keeps '
        "`gate.anchor_margin`.",
    )


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
        description='Per-suite margins that replace `tolerance`, by suite name (e.g. {"retention": 0.1}); '
        "retention's default is `retention.margin`, retention_sampled's `retention.sampled_margin`, not `tolerance`.",
    )
    confidence: float = Field(
        0.95, gt=0.5, lt=1, description="One-sided confidence of each suite's lower bound."
    )
    bootstrap_resamples: int = Field(1000, ge=100, description="Bootstrap resamples per interval.")
    seed: int = Field(
        20240917,
        description="Base of every gate run's seed: with `fresh_draws`, each challenger's sampling and bootstrap "
        "seed is a hash of this, the registry model and the version; without, this is that seed.",
    )
    fresh_draws: bool = Field(
        True,
        description="Draw each challenger's seed and the task's held-out questions (`eval_prompts` of them) "
        "afresh from `seed` and its version, so no challenger is tuned to one fixed set; both are recorded with "
        "the decision. Off: every challenger gets `seed` and the first `eval_prompts` questions, for comparing "
        "a series of versions on the very same prompts and noise, or reproducing a decision made before "
        "fresh draws (docs/gate.md, Fresh draws).",
    )
    suites: tuple[GateSuite, ...] = Field(
        ("ope", "traffic"),
        description="Default: the tenant's own held-out traffic, nothing tied to a task (a fresh deployment "
        "passes nothing until that traffic is enough to conclude: add an offline retention suite to judge from "
        "day one; docs/gate.md, A gate that does not depend on the demo's task). "
        "ope: off-policy estimate on held-out logged traffic (no oracle); retention: the task's "
        "held-out questions scored by their known answers; episodes: whole agent episodes (`episodes`) on those "
        "questions; oracle: the task's preference function (only where "
        "one exists: the demo's simulated users); judge: the task's held-out prompts graded by `judge`; traffic: the "
        "prompts of held-out logged traffic, graded by `judge` when it is set, else by whether the answer is one "
        "and finishes (`traffic`). Offline JSONL suites are added with `offline`.",
    )
    offline: tuple[OfflineSuiteSettings, ...] = Field(
        (), description="Extra prompt sets with verifiable scorers."
    )
    eval_prompts: int = Field(
        48,
        ge=1,
        description="Held-out prompts of the task (oracle, judge, episodes) per model, drawn from its held-out "
        "questions (`fresh_draws`); the retention suite asks `retention.questions` (default all).",
    )
    samples_per_prompt: int = Field(
        4,
        ge=1,
        description="Completions per prompt (a greedy suite's prompts are asked once: `retention.decode`).",
    )
    retention: RetentionSuiteSettings = RetentionSuiteSettings()
    task: str = Field(
        "exclaim",
        description="Task (evals/tasks.py) whose held-out questions the retention and oracle suites use.",
    )
    preference: str | None = Field(
        None, description="The oracle suite's preference, \"module:function\" (default: the task's own)."
    )
    ope: OpeSettings = OpeSettings()
    traffic: TrafficSettings = TrafficSettings()
    episodes: EpisodeSuiteSettings = EpisodeSuiteSettings()
    alarms: AlarmSettings = AlarmSettings()
    canary: CanarySettings = CanarySettings()
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
        ("retention", "ope"),
        description="Suites (by name) on which the challenger is also compared with the anchor: prompt suites "
        "sampled on the anchor too (retention brings retention_sampled with it), and ope, the users' reward on held-out traffic reweighted to the anchor, so "
        "neither what the task measures nor what users reward can slide by tolerance on every promotion.",
    )
    anchor_margin: float = Field(
        0.05,
        ge=0,
        description="Non-inferiority margin against the anchor (the retention suite's is `retention.anchor_margin`).",
    )

    @model_validator(mode="after")
    def _judge_configured(self) -> GateSettings:
        if "judge" in self.suites and self.judge is None:
            raise ValueError(
                'gate.suites has "judge" but gate.judge is not set (RTRL_GATE__JUDGE__URL and '
                "RTRL_GATE__JUDGE__MODEL)"
            )
        if "episodes" in self.suites and self.episodes.scorer == "judge" and self.judge is None:
            raise ValueError(
                'gate.episodes.scorer is "judge" but gate.judge is not set (RTRL_GATE__JUDGE__URL and '
                "RTRL_GATE__JUDGE__MODEL)"
            )
        return self
