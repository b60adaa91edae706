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

``terminal`` names the kinds that close an episode at once (the labeler settles it without waiting
for the window). ``accepted`` and ``edited`` are not terminal under tab-v1: in the tab flow the
editor later reports whether the accepted text persisted or was reverted, which is the stronger
signal; episodes with only an acceptance settle when the window passes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.errors import OperatorError
from schemas.events import SCORED_KINDS, FeedbackKind

NO_FEEDBACK = "no_feedback"
CLAMPED = "clamped"
UNFINISHED = "unfinished"


class RewardSpecError(OperatorError, ValueError):
    """A reward spec that is unknown or cannot be read."""


class Signal(Protocol):
    """Anything with a feedback kind and a value: schemas.FeedbackSignal, FeedbackEvent, a stored row."""

    @property
    def kind(self) -> FeedbackKind | str: ...

    @property
    def value(self) -> float: ...


class RewardSpec(BaseModel):
    """A named, versioned weighting of feedback kinds. Every FeedbackKind must have a weight."""

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
    description: str = Field("", description="What the spec is for.")

    @model_validator(mode="after")
    def _complete(self) -> RewardSpec:
        # A kind without a weight would be ignored silently; make every spec say what it does with it.
        missing = sorted(set(FeedbackKind) - set(self.weights))
        if missing:
            raise ValueError(f"reward spec {self.name!r} gives no weight for {missing}")
        unranged = sorted(SCORED_KINDS - set(self.value_range))
        if unranged:
            raise ValueError(f"reward spec {self.name!r} gives no value_range for the scored kinds {unranged}")
        if self.reward_range is not None and not self.reward_range[0] < self.reward_range[1]:
            raise ValueError(f"reward spec {self.name!r}: reward_range must be [low, high] with low < high")
        for kind, (low, high) in self.value_range.items():
            if kind not in SCORED_KINDS or not low <= high:
                raise ValueError(f"reward spec {self.name!r}: value_range for {kind} must be a scored kind with low <= high")
        return self

    def value_problem(self, kind: FeedbackKind | str, value: float) -> str | None:
        """Why a feedback value is outside what this spec accepts, or None when it is inside."""
        kind = FeedbackKind(kind)
        if kind not in SCORED_KINDS:
            return None
        low, high = self.value_range[kind]
        if not low <= value <= high:
            return f"{kind.value} value {value:g} is outside [{low:g}, {high:g}] of reward spec {self.spec_id}"
        return None

    @property
    def spec_id(self) -> str:
        return f"{self.name}@{self.version}"


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
    },
    # Worse than a rejection (-0.25): running out of tokens must never pay better than answering.
    unfinished=-0.5,
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

SPECS: dict[str, RewardSpec] = {TAB_V1.name: TAB_V1}


def get_spec(name: str) -> RewardSpec:
    """A built-in spec by name (``tab-v1``), or a spec read from a JSON file path (``*.json``)."""
    if name in SPECS:
        return SPECS[name]
    if name.endswith(".json"):
        return load_spec(Path(name))
    raise RewardSpecError(
        f"unknown reward spec {name!r}; built-in: {sorted(SPECS)}, or give a path to a .json spec "
        "(RTRL_LABELER__REWARD_SPEC)"
    )


def load_spec(path: Path) -> RewardSpec:
    """Read a spec from JSON: ``{"name", "version", "weights": {kind: w}, "terminal": [kinds]}``."""
    try:
        return RewardSpec.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError are ValueErrors
        raise RewardSpecError(f"reward spec {path}: {exc}") from None


def score(spec: RewardSpec, signals: Iterable[Signal], unfinished: bool = False) -> RewardResult:
    """Reward of one episode from its feedback signals and whether the model left it unfinished (see
    the module docstring for the rules)."""
    event_kinds: set[FeedbackKind] = set()
    last_value: dict[FeedbackKind, float] = {}
    for signal in signals:
        kind = FeedbackKind(signal.kind)
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
    reward = sum(components.values())
    if spec.reward_range is not None:
        low, high = spec.reward_range
        clamped = min(max(reward, low), high)
        if clamped != reward:
            components[CLAMPED] = clamped - reward  # the components still add up to the reward
            reward = clamped
    return RewardResult(reward=reward, components=components, spec_id=spec.spec_id)
