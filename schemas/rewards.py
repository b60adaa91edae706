"""Reward specs: how feedback signals about an episode become one scalar reward.

Pure functions, no Kafka or SQL: the store scores episodes with them when the labeler settles
them (store/settle.py), and the eval gate and the simulator score completions with the *same* spec
(``get_spec(name)`` + ``score``, through evals/scoring.py), so the oracle that labels training
data is the oracle that judges the challenger.

A spec is versioned (``name@version`` is stored on every episode it labelled): changing a weight
means a new version, never an edit in place, so rewards from different specs are never mixed up.

How signals combine (``score``):

* Event kinds (accepted, rejected, edit_persisted, ...) count **once per kind**: a client that
  retries ``accepted`` three times gets the weight once, not three times. Different kinds add up,
  e.g. accepted + edit_reverted = 0.75 - 0.5 = 0.25 under tab-v1.
* Scored kinds (task_outcome, judge_score) contribute ``weight * value`` of the **last** signal of
  that kind in the order given (the labeler passes feedback ordered by its ``created_at``), so a
  re-judged episode uses the newest judgement.
* No signals at all gives reward 0 with the explicit component ``no_feedback`` - an unlabelled
  episode is a labelled zero, never silently dropped.
* An episode the model did not finish (a trainable segment cut off by ``max_tokens``: finish reason
  ``length``) gets the spec's ``unfinished`` weight as one more component, with or without
  feedback. A response the loop cannot score is a negative example, never dropped and never a
  neutral zero: otherwise failing on a hard prompt would beat answering it and being rejected, and
  the loop would learn to fail (Cursor's second reward hack; docs/gate.md, Alarms).
* A spec may declare ``reward_range``: a sum outside it is clamped into it, and the component
  ``clamped`` records by how much (components always add up to the reward), so that one episode
  with every positive signal cannot outweigh a batch. tab-v1 declares none.

* Two terms come from the labeler's measurements of the episode, not from feedback (`Shaping`):
  PARL's shaping (``parl``: component ``parl_parallel`` = λ₁·r_parallel and ``parl_finish`` =
  λ₂·r_finish, λ annealed linearly to 0 over ``anneal_cycles`` training cycles under the spec) and the judge
  (``judge``: component ``judge`` = weight · (2·grade − 1), the grade in [0, 1]; a judge that could
  not be asked leaves the component ``judge_unavailable`` = 0 instead). docs/methods.md has both.
  They are not feedback: an episode with only these still carries ``no_feedback``.

``correction`` carries text, not reward (schemas/events.py, `TEXT_KINDS`): every built-in spec
weights it 0.0, and a JSON spec that leaves it out reads as giving it 0.0 (`RewardSpec._defaults`,
this kind only), so specs written before the kind existed keep loading with the same rewards. A
correction's text is for the trainer (store/episodes.py, `TrainingEpisode.corrections`). At weight
0 `score` leaves it out: it is no term of the reward, and an episode whose only feedback is a
correction stays unrated (``no_feedback``), not a rated 0. A spec that weights it counts it as an event.
What the trainer does with the text is the spec's ``hindsight`` term (`HindsightTerm`: hindsight
distillation, trainer/hindsight.py): a term of the advantages of the corrected episodes' tokens, not
of any reward, so it needs no version bump; every built-in spec leaves it off (None).

``terminal`` names the kinds that close an episode at once (the labeler settles it without waiting
for the window). ``accepted`` and ``edited`` are not terminal under tab-v1: in the tab flow the
editor later reports whether the accepted text persisted or was reverted, which is the stronger
signal; episodes with only an acceptance settle when the window passes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.errors import OperatorError
from schemas.events import CONTROL_KINDS, SCORED_KINDS, FeedbackKind
from schemas.settings.judge import rubric_problem

NO_FEEDBACK = "no_feedback"
CLAMPED = "clamped"
UNFINISHED = "unfinished"
PARL_PARALLEL = "parl_parallel"
PARL_FINISH = "parl_finish"
JUDGE = "judge"
JUDGE_UNAVAILABLE = "judge_unavailable"
# The components that do not come from feedback signals (everything else is a FeedbackKind's).
SHAPING_COMPONENTS = frozenset(
    {NO_FEEDBACK, CLAMPED, UNFINISHED, PARL_PARALLEL, PARL_FINISH, JUDGE, JUDGE_UNAVAILABLE}
)

# The signal a spec anchors its reward on (`RewardSpec.primary`): a term one click cannot give. Each
# names its reward component (``judge``: the spec's judge term; the others: the FeedbackKind's).
Primary = Literal["task_outcome", "judge_score", "judge", "edit_persisted"]
# Explicit one-click signals: a reward they carry can be won by flattery (a thumbs-up reward made a
# production update sycophantic and it passed offline evals and A/B tests), so a spec that weights
# any of them must name a primary signal the gate and the canary hold the challenger to
# (docs/methods.md, The primary signal; docs/gate.md, Suites: ope_primary, and Live canary: Guards).
EXPLICIT_KINDS = frozenset(
    {FeedbackKind.thumbs_up, FeedbackKind.thumbs_down, FeedbackKind.accepted, FeedbackKind.rejected}
)

DEFAULT_EPISODE_RUBRIC = (
    "You grade the work of an AI assistant on a user's task.\n"
    "Task:\n{prompt}\n"
    "Everything the assistant wrote while working on it, in order:\n{completion}\n"
    "Did it solve the task correctly and completely? Reply with one digit from 1 (not at all) to {scale} "
    "(fully) and nothing else.\n"
    "Grade:"
)


class RewardSpecError(OperatorError, ValueError):
    """A reward spec that is unknown or cannot be read."""


class Signal(Protocol):
    """Anything with a feedback kind and a value: schemas.FeedbackSignal, FeedbackEvent, a stored row."""

    @property
    def kind(self) -> FeedbackKind | str: ...

    @property
    def value(self) -> float: ...


class ParlShaping(BaseModel):
    """Kimi PARL's shaping terms and their schedule (docs/methods.md, PARL).

    r_parallel = min(sub-agents, `parallel_target`) / `parallel_target` counters serial collapse
    (an orchestrator that does everything itself); r_finish = used sub-agents / sub-agents counters
    spurious parallelism (sub-agents spawned whose work is not useful): a sub-agent counts when it
    finished by itself and the orchestrator used its result (schemas/episodes.py,
    ``subagents_used``), so spawning sub-agents that stop at once and are never heard from pays
    r_parallel only. Both are in [0, 1]. λ(k) = λ(0) · max(0, 1 − k / `anneal_cycles`), k the
    number of training cycles trained under this spec (its ``name@version``) before the episode
    settled: the shaping fades and the task's own reward is what remains."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lambda_parallel: float = Field(ge=0, le=10, description="λ₁ at cycle 0 (weight of r_parallel).")
    lambda_finish: float = Field(ge=0, le=10, description="λ₂ at cycle 0 (weight of r_finish).")
    anneal_cycles: int = Field(ge=1, le=100_000, description="Training cycles after which λ₁ and λ₂ are 0.")
    parallel_target: int = Field(4, ge=1, le=1000, description="Sub-agents at which r_parallel reaches 1.")

    def lambdas(self, cycle: int) -> tuple[float, float]:
        """(λ₁, λ₂) for an episode settled after `cycle` training cycles under the spec."""
        left = max(0.0, 1.0 - max(cycle, 0) / self.anneal_cycles)
        return self.lambda_parallel * left, self.lambda_finish * left

    def terms(self, subagents: int, used: int) -> tuple[float, float]:
        """(r_parallel, r_finish) of an episode with `subagents` sub-agents, `used` of them finished
        with a result the orchestrator used."""
        r_parallel = min(subagents, self.parallel_target) / self.parallel_target
        r_finish = used / subagents if subagents else 0.0
        return r_parallel, r_finish


class JudgeTerm(BaseModel):
    """A judge's grade of the whole episode as a reward term (feedback/judging.py; docs/methods.md, Judged
    rewards). The endpoint is the deployment's (``labeler.judge``); what it is asked is the spec's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    weight: float = Field(
        ge=0, le=100, description="Component judge = weight · (2·grade − 1), grade in [0, 1]."
    )
    rubric: str = Field(
        DEFAULT_EPISODE_RUBRIC,
        max_length=20_000,
        description="The judge's instructions: {prompt} (the episode's first prompt) and {completion} (every "
        "completion of the episode, in order, nothing pruned), each exactly once, become delimited data blocks and "
        "{scale} the top grade (docs/gate.md, Judge).",
    )

    @model_validator(mode="after")
    def _placeholders(self) -> JudgeTerm:
        problem = rubric_problem(self.rubric)
        if problem:
            raise ValueError(problem)
        return self


DEFAULT_HINDSIGHT_TEMPLATE = "\n(A user's correction of a previous answer: {correction})\n"


class HindsightTerm(BaseModel):
    """Hindsight distillation from written corrections (trainer/hindsight.py; docs/algorithms.md,
    Hindsight distillation): the policy at the start of the cycle, with the correction in its context,
    is the teacher of its own sampled tokens. Not a reward term: episodes' rewards are the same with
    or without it, so adding, changing or removing it needs no version bump."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    weight: float = Field(
        ge=0,
        le=10,
        description="Added to each completion token's advantage: weight · clip(log π_teacher − log π_student); "
        "0 changes nothing.",
    )
    clip: float = Field(
        5.0,
        gt=0,
        le=50,
        description="Bound of the teacher−student log-probability gap per token, before the weight: one token the "
        "hint makes near-certain (or impossible) moves the policy no more than this.",
    )
    template: str = Field(
        DEFAULT_HINDSIGHT_TEMPLATE,
        min_length=1,
        max_length=2_000,
        description="How the correction is put in the teacher's context: the text, with {correction} (exactly once) "
        "replaced by the user's text, tokenised and inserted after the prompt's tokens, before the completion.",
    )

    @model_validator(mode="after")
    def _placeholder(self) -> HindsightTerm:
        count = self.template.count("{correction}")
        if count != 1:
            raise ValueError(f"hindsight template must contain {{correction}} exactly once (found {count})")
        return self

    def hint(self, texts: Iterable[str]) -> str:
        """The teacher's hint for a segment's corrections (several: one per line, oldest first). Plain
        replacement, not str.format: a user's braces stay text."""
        return self.template.replace("{correction}", "\n".join(texts))


class RewardSpec(BaseModel):
    """A named, versioned weighting of feedback kinds. Every FeedbackKind must have a weight (but the
    control kinds, which carry no reward)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$", description="Spec name.")
    version: int = Field(ge=1, description="Bumped on every change of a weight or of the terminal set.")
    weights: dict[FeedbackKind, float] = Field(
        description="Reward per kind (scored kinds: per unit of value)."
    )
    terminal: frozenset[FeedbackKind] = Field(description="Kinds that settle an episode immediately.")
    value_range: dict[FeedbackKind, tuple[float, float]] = Field(
        default_factory=lambda: {kind: (-1.0, 1.0) for kind in SCORED_KINDS},
        description="Accepted [low, high] value of each scored kind; a value outside is refused at the gateway "
        "and dead-lettered by the labeler, never clamped silently.",
    )
    reward_range: tuple[float, float] | None = Field(
        None,
        description="Declared [low, high] of an episode's reward: a sum of components outside is clamped into it, "
        "the difference recorded as the component 'clamped'. None: unbounded (the sum of the weights).",
    )
    unfinished: float | None = Field(
        None,
        description="Added when a trainable segment of the episode was cut off by max_tokens (component "
        "'unfinished'); None: not counted.",
    )
    parl: ParlShaping | None = Field(
        None, description="PARL's shaping terms and their λ schedule; None: none."
    )
    judge: JudgeTerm | None = Field(
        None, description="A judge's grade of each episode as a term; None: no judge."
    )
    primary: Primary | None = Field(
        None,
        description="The signal the reward is anchored on (task_outcome, judge_score, edit_persisted: that "
        "kind's term; judge: the spec's judge term), held as a non-inferiority guard by the gate (ope_primary) "
        "and the live canary; required when thumbs_up/thumbs_down or accepted/rejected carry a weight, and "
        "must itself carry one. Not part of the weights: naming it needs no version bump.",
    )
    hindsight: HindsightTerm | None = Field(
        None,
        description="Hindsight distillation from written corrections, added to the advantages of the corrected "
        "episodes' tokens by its weight (trainer/hindsight.py); None: off. Not part of the reward: setting it needs "
        "no version bump.",
    )
    description: str = Field("", description="What the spec is for.")

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        """A spec written before ``correction`` existed gives it no weight: it reads as 0.0 (a kind
        that adds nothing changes no reward, so the spec's version stays). Only this kind: any other
        missing weight is still an error (`_complete`)."""
        if isinstance(data, dict) and isinstance(data.get("weights"), dict):
            weights = data["weights"]
            if not any(FeedbackKind.correction == key for key in weights):
                data = {**data, "weights": {**weights, FeedbackKind.correction.value: 0.0}}
        return data

    @model_validator(mode="after")
    def _complete(self) -> RewardSpec:
        # A kind without a weight would be ignored silently; make every spec say what it does with it.
        missing = sorted(set(FeedbackKind) - CONTROL_KINDS - set(self.weights))
        if missing:
            raise ValueError(f"reward spec {self.name!r} gives no weight for {missing}")
        weighted = sorted(k.value for k in CONTROL_KINDS if self.weights.get(k, 0.0) != 0.0)
        if weighted:
            raise ValueError(f"reward spec {self.name!r}: {weighted} carry no reward (weight 0 or none)")
        unranged = sorted(SCORED_KINDS - set(self.value_range))
        if unranged:
            raise ValueError(
                f"reward spec {self.name!r} gives no value_range for the scored kinds {unranged}"
            )
        if self.reward_range is not None and not self.reward_range[0] < self.reward_range[1]:
            raise ValueError(f"reward spec {self.name!r}: reward_range must be [low, high] with low < high")
        for kind, (low, high) in self.value_range.items():
            if kind not in SCORED_KINDS or not low <= high:
                raise ValueError(
                    f"reward spec {self.name!r}: value_range for {kind} must be a scored kind with low <= high"
                )
        self._check_primary()
        return self

    def _check_primary(self) -> None:
        """No single signal rules: explicit thumbs or acceptances are one term, anchored by a primary
        one that itself carries weight (`EXPLICIT_KINDS`)."""
        explicit = sorted(k.value for k in EXPLICIT_KINDS if self.weights.get(k, 0.0) != 0.0)
        if explicit and self.primary is None:
            raise ValueError(
                f"reward spec {self.name!r} weights {explicit} but names no primary signal: set primary to "
                "task_outcome, judge_score, judge or edit_persisted"
            )
        if self.primary is not None and self.primary_weight() <= 0.0:
            # A negative weight would turn the guards on the primary term upside down: a challenger that
            # does better on it would read as worse.
            where = (
                "has no judge term (or its weight is not above 0)"
                if self.primary == JUDGE
                else f"gives it weight {self.primary_weight():g} (it must be above 0)"
            )
            raise ValueError(f"reward spec {self.name!r}: primary {self.primary} {where}")

    def primary_weight(self) -> float:
        """The weight of the primary term (0 without a primary, or for a judge primary without a judge)."""
        if self.primary is None:
            return 0.0
        if self.primary == JUDGE:
            return self.judge.weight if self.judge is not None else 0.0
        return self.weights[FeedbackKind(self.primary)]

    def primary_range(self) -> tuple[float, float]:
        """[low, high] of the primary term's component: a scored kind's weight times its value range,
        the judge's ± weight, edit_persisted's [0, weight] (see `primary_value`)."""
        weight = self.primary_weight()
        if self.primary in (FeedbackKind.task_outcome, FeedbackKind.judge_score):
            low, high = self.value_range[FeedbackKind(self.primary)]
            ends = sorted((weight * low, weight * high))
            return ends[0], ends[1]
        if self.primary == FeedbackKind.edit_persisted:
            return min(0.0, weight), max(0.0, weight)
        return -abs(weight), abs(weight)

    def primary_value(self, components: dict[str, float]) -> float | None:
        """The primary term of an episode's reward components, None when the episode does not carry it.
        edit_persisted is an event: an episode whose edit was reverted carries it as 0 (the edit did not
        persist), one with neither persisted nor reverted edit does not carry it."""
        if self.primary is None:
            return None
        if self.primary == FeedbackKind.edit_persisted:
            if FeedbackKind.edit_reverted.value in components:
                return 0.0
            return components.get(self.primary)
        return components.get(self.primary)

    def value_problem(self, kind: FeedbackKind | str, value: float) -> str | None:
        """Why a feedback value is outside what this spec accepts, or None when it is inside."""
        kind = FeedbackKind(kind)
        if kind not in SCORED_KINDS:
            return None
        low, high = self.value_range[kind]
        if not low <= value <= high:
            return (
                f"{kind.value} value {value:g} is outside [{low:g}, {high:g}] of reward spec {self.spec_id}"
            )
        return None

    @property
    def spec_id(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class Shaping:
    """What the labeler measured of an episode besides its feedback (the module docstring)."""

    parl: tuple[int, int] | None = None  # (sub-agents, sub-agents used) of a PARL episode
    cycle: int = 0  # cycles trained under the spec before this settlement: where PARL's λ schedule is
    judge: float | None = None  # the judge's grade in [0, 1]
    judge_unavailable: bool = False  # the spec has a judge term and the judge could not be asked


NO_SHAPING = Shaping()


@dataclass(frozen=True)
class RewardResult:
    """The reward of one episode and where it came from."""

    reward: float
    components: dict[str, float]
    spec_id: str


TAB_V1 = RewardSpec(
    name="tab-v1",
    # 2: `unfinished` (-0.5). Episodes labelled under @1 are not trained on by @2 cycles.
    version=2,
    description="Code-completion (Cursor Tab style) feedback: acceptance, persistence of edits, tool errors.",
    weights={
        FeedbackKind.accepted: 0.75,
        FeedbackKind.rejected: -0.25,
        # An edit is neutral on its own: edit_persisted / edit_reverted follow and carry the signal.
        FeedbackKind.edited: 0.0,
        FeedbackKind.edit_persisted: 1.0,
        FeedbackKind.edit_reverted: -0.5,
        FeedbackKind.thumbs_up: 0.5,
        FeedbackKind.thumbs_down: -0.5,
        FeedbackKind.followup_dissatisfied: -0.5,
        # A broken tool call is a negative example: discarding it would teach the policy nothing
        # about the failure (and invite reward hacking by crashing on hard inputs).
        FeedbackKind.tool_call_error: -1.0,
        FeedbackKind.task_outcome: 1.0,  # x value (e.g. 1 = tests pass, 0 = fail)
        FeedbackKind.judge_score: 0.5,  # x value; the judge is weaker evidence than the user
        # Text for the trainer, not a reward (the module docstring). Added at weight 0 without a version
        # bump: a kind that adds nothing changes no episode's reward under tab-v1@2.
        FeedbackKind.correction: 0.0,
    },
    # Worse than a rejection (-0.25): running out of tokens must never pay better than answering.
    unfinished=-0.5,
    # The app's outcome anchors the thumbs and acceptances (`EXPLICIT_KINDS`). Naming it changes no weight,
    # so no version bump: episodes labelled under tab-v1@2 have the same rewards.
    primary="task_outcome",
    terminal=frozenset(
        {
            FeedbackKind.rejected,
            FeedbackKind.edit_persisted,
            FeedbackKind.edit_reverted,
            FeedbackKind.thumbs_up,
            FeedbackKind.thumbs_down,
            FeedbackKind.task_outcome,
        }
    ),
)

PARL_V1 = TAB_V1.model_copy(
    update={
        # 2: r_finish counts the sub-agents whose result the orchestrator used, not every one that stopped
        # (@1 paid for spurious parallelism); its λ schedule starts again, as it counts @2's own cycles.
        "name": "parl-v1",
        "version": 2,
        "description": "tab-v1's feedback weights plus Kimi PARL's shaping: r_parallel and r_finish (sub-agents whose "
        "result the orchestrator used), each weighted 0.2 at first and annealed to 0 over the spec's first 10 training "
        "cycles (docs/methods.md, PARL).",
        "parl": ParlShaping(lambda_parallel=0.2, lambda_finish=0.2, anneal_cycles=10, parallel_target=4),
        # tab-v1's primary, task_outcome (weight 1.0), inherited; the weights are unchanged: no version bump.
    }
)
JUDGED_V1 = TAB_V1.model_copy(
    update={
        "name": "judged-v1",
        "version": 1,
        "description": "tab-v1's feedback weights plus a judge's grade of the whole episode, nothing pruned, weighted "
        "0.25 (docs/methods.md, Judged rewards); needs labeler.judge.",
        "judge": JudgeTerm(weight=0.25),
        # The judge anchors this spec (its weights are tab-v1's; naming it changes none: no version bump).
        "primary": "judge",
    }
)

HINDSIGHT_V1 = TAB_V1.model_copy(
    update={
        "name": "hindsight-v1",
        "version": 1,
        "description": "tab-v1's feedback weights plus hindsight distillation of written corrections at weight 0.5 "
        "(docs/algorithms.md, Hindsight distillation): the rewards are tab-v1's, the corrected episodes' tokens also "
        "learn what the correction makes likely.",
        # Not tuned: 0.5 keeps a term clipped at 5 nats within a few RL advantages (bench_learning measures it).
        "hindsight": HindsightTerm(weight=0.5),
    }
)

SPECS: dict[str, RewardSpec] = {spec.name: spec for spec in (TAB_V1, PARL_V1, JUDGED_V1, HINDSIGHT_V1)}


def get_spec(name: str) -> RewardSpec:
    """A built-in spec by name (``tab-v1``), or a spec read from a JSON file path (``*.json``)."""
    if name in SPECS:
        return SPECS[name]
    if name.endswith(".json"):
        path = Path(name)
        try:
            stat = path.stat()
        except OSError as exc:
            raise RewardSpecError(f"reward spec {path}: {exc}") from None
        return _load_spec_cached(path.resolve(), stat.st_mtime_ns, stat.st_size)
    raise RewardSpecError(
        f"unknown reward spec {name!r}; built-in: {sorted(SPECS)}, or give a path to a .json spec "
        "(RTRL_LABELER__REWARD_SPEC)"
    )


@functools.lru_cache(maxsize=32)
def _load_spec_cached(path: Path, mtime_ns: int, size: int) -> RewardSpec:
    """A `.json` spec read once per content on disk (the stages look the spec up by name many times
    a cycle; an edited file is read again, as its mtime or size changes)."""
    return load_spec(path)


def load_spec(path: Path) -> RewardSpec:
    """Read a spec from JSON: ``{"name", "version", "weights": {kind: w}, "terminal": [kinds]}``."""
    try:
        return RewardSpec.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError are ValueErrors
        raise RewardSpecError(f"reward spec {path}: {exc}") from None


def score(
    spec: RewardSpec, signals: Iterable[Signal], unfinished: bool = False, shaping: Shaping = NO_SHAPING
) -> RewardResult:
    """Reward of one episode from its feedback signals, whether the model left it unfinished and what
    the labeler measured of it (see the module docstring for the rules)."""
    event_kinds: set[FeedbackKind] = set()
    last_value: dict[FeedbackKind, float] = {}
    for signal in signals:
        kind = FeedbackKind(signal.kind)
        if kind in CONTROL_KINDS:
            continue
        if kind == FeedbackKind.correction and spec.weights.get(kind, 0.0) == 0.0:
            # Text for the trainer, not a verdict: an episode whose only feedback is a correction the
            # spec does not weight stays unrated (no_feedback), as the labeler and the gate count it.
            continue
        if kind in SCORED_KINDS:
            last_value[kind] = float(signal.value)
        else:
            event_kinds.add(kind)

    components: dict[str, float] = {}
    for kind in FeedbackKind:  # fixed order, so components serialize identically every time
        if kind in event_kinds:
            components[kind.value] = spec.weights[kind]
        elif kind in last_value:
            components[kind.value] = spec.weights[kind] * last_value[kind]
    if not components:
        components[NO_FEEDBACK] = 0.0
    if unfinished and spec.unfinished is not None:
        components[UNFINISHED] = spec.unfinished
    if spec.parl is not None and shaping.parl is not None:
        lambda_parallel, lambda_finish = spec.parl.lambdas(shaping.cycle)
        r_parallel, r_finish = spec.parl.terms(*shaping.parl)
        components[PARL_PARALLEL] = lambda_parallel * r_parallel
        components[PARL_FINISH] = lambda_finish * r_finish
    if spec.judge is not None:
        if shaping.judge is not None:
            components[JUDGE] = spec.judge.weight * (2.0 * shaping.judge - 1.0)
        elif shaping.judge_unavailable:
            components[JUDGE_UNAVAILABLE] = 0.0
    reward = sum(components.values())
    if spec.reward_range is not None:
        low, high = spec.reward_range
        clamped = min(max(reward, low), high)
        if clamped != reward:
            components[CLAMPED] = clamped - reward  # the components still add up to the reward
            reward = clamped
    return RewardResult(reward=reward, components=components, spec_id=spec.spec_id)


def outcome_of(components: dict[str, float]) -> float | None:
    """The part of a reward that came from feedback signals (users, the app), None when there was none:
    what the judge's grade is compared with (`judge_disagrees`)."""
    signal = [v for k, v in components.items() if k not in SHAPING_COMPONENTS]
    return sum(signal) if signal else None


def judge_disagrees(components: dict[str, float], grade: float | None) -> bool | None:
    """Whether the judge's grade and the feedback's outcome disagree: the grade says good (≥ 0.5) and
    the outcome is not positive (a rejection, a task_outcome of 0: a failed task), or the grade says
    bad and the outcome is positive. None when either is missing (no grade, or no feedback at all)."""
    outcome = outcome_of(components)
    if grade is None or outcome is None:
        return None
    return (grade >= 0.5) != (outcome > 0)


def carries_signal(no_feedback: bool, components: Mapping[str, float]) -> bool:
    """Whether an episode's reward says anything: user feedback, or a judge's grade. An episode settled
    by the window with neither (`no_feedback`, the ``no_feedback`` component) has a reward that no user
    gave: what the trainer's ``min_signal`` counts (trainer/batch.py) and what the gate's ope suite
    keeps under ``gate.ope.episodes`` rated (docs/gate.md, Suites: ope)."""
    return not no_feedback or JUDGE in components
