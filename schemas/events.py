"""Wire messages of the loop: what the gateway publishes to Kafka and the labeler consumes.

Every message is a frozen pydantic model with a ``schema_version`` literal; a consumer that sees a
version it does not know dead-letters the record instead of guessing. Validation is strict: sizes
are bounded (a hostile client cannot make the labeler allocate gigabytes), numbers are finite and
token ids and logprobs line up, and every event carries the ``event_id`` its producer gave it (a
reader never invents the idempotency key). Text a model produced is the exception: whatever its
tokenizer made is accepted, a NUL or a lone surrogate replaced by U+FFFD (`storable_text`), since
the token ids are the truth. ``rtrl schemas export DIR`` writes these as JSON Schema.
"""

from __future__ import annotations

import math
import uuid
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from schemas.clock import utcnow

# Bounds on untrusted input. Large enough for real coding traffic, small enough that one record
# cannot exhaust the labeler.
MAX_TEXT_CHARS = 1_000_000
MAX_TOKENS = 131_072
MAX_ID_CHARS = 200
MAX_EVENT_BYTES = 16 * 1024 * 1024
# A correction or an edit as a user writes it: the corrected answer, a hint, an edited snippet of
# code. Long enough for a rewritten function, short enough to sit in a prompt as a hindsight hint.
MAX_CORRECTION_CHARS = 8_000

INTERACTION_SCHEMA: Final = "rtrl.interaction.v1"
FEEDBACK_SCHEMA: Final = "rtrl.feedback.v1"
DEAD_LETTER_SCHEMA: Final = "rtrl.dead_letter.v1"

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=r"^[A-Za-z0-9_.:@/+=-]+$")]


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("value must be finite")
    return value


# What stands for a character a text field cannot hold: the character a UTF-8 decoder writes for
# bytes it cannot decode.
REPLACEMENT_CHARACTER = "\ufffd"


def storable_text(text: str) -> str:
    """`text` with every NUL and every lone surrogate replaced by U+FFFD; anything else unchanged.

    A served call's text is the server's rendering of its tokens, and a byte-level tokenizer can
    produce any byte: a NUL, or (through a lenient JSON reader) a surrogate code point with no
    partner. PostgreSQL text cannot hold NUL, and a lone surrogate has no UTF-8 form (orjson,
    psycopg and SQLite refuse it, pydantic refuses it in a str). Both are replaced, so such a call
    is stored, never dead-lettered; its token ids, which are what trains, stay exact. Two
    surrogates written as a pair become the one character they encode, as a JSON reader makes of
    them. Lossy on purpose: the exact text is the tokenizer's decoding of the token ids
    (docs/internals.md, Text of an interaction). Other control characters are kept as they are."""
    if not text.isascii():  # O(1) on CPython: no surrogate in an ASCII string
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return text.replace("\x00", REPLACEMENT_CHARACTER) if "\x00" in text else text


def _storable(value: Any, info: ValidationInfo) -> Any:
    if not isinstance(value, str):
        return value  # refused by the str validator after this one
    if info.mode == "json":  # pydantic's JSON reader refuses lone surrogates itself: only NUL is left
        return value.replace("\x00", REPLACEMENT_CHARACTER) if "\x00" in value else value
    return storable_text(value)


# A feedback score as the wire and the gateway's intake accept it (the reward spec may bound it further).
FeedbackValue = Annotated[float, Field(ge=-1e6, le=1e6), AfterValidator(_finite)]
# Text a model produced or was prompted with: stored whatever the tokenizer made of it (storable_text).
Text = Annotated[str, BeforeValidator(_storable), Field(max_length=MAX_TEXT_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=MAX_TOKENS)]
Logprobs = Annotated[list[float], Field(max_length=MAX_TOKENS)]


def new_id() -> str:
    """A fresh random event / request id (uuid4 hex)."""
    return uuid.uuid4().hex


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=False)

    @field_validator("created_at", check_fields=False)
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("created_at must carry a timezone (use UTC)")
        return value


class Role(StrEnum):
    """What a segment of an episode is (docs/architecture.md, Multi-segment episodes)."""

    policy = "policy"  # an ordinary model call of the policy being trained
    summary = "summary"  # Cursor self-summarization: trained like any policy tokens
    orchestrator = "orchestrator"  # Kimi PARL orchestrator: trainable
    subagent = "subagent"  # Kimi PARL sub-agent: frozen observation, masked from the loss


class SamplingParams(_Message):
    """The sampling parameters the segment was generated with (needed to judge on-policyness)."""

    temperature: float = Field(1.0, ge=0, le=100, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k cutoff, -1 (or 0) for none.")
    min_p: float = Field(
        0.0, ge=0, le=1, description="Min-p cutoff relative to the most likely token, 0 for none."
    )
    repetition_penalty: float = Field(1.0, gt=0, le=100, description="vLLM repetition penalty, 1 for none.")
    presence_penalty: float = Field(0.0, ge=-100, le=100, description="OpenAI presence penalty, 0 for none.")
    frequency_penalty: float = Field(
        0.0, ge=-100, le=100, description="OpenAI frequency penalty, 0 for none."
    )
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="Completion token limit.")
    seed: int | None = Field(None, description="Sampling seed, if the client pinned one.")
    stop: list[Annotated[str, BeforeValidator(_storable), Field(max_length=1000)]] = Field(
        default_factory=list, max_length=16, description="Stop strings."
    )
    logprobs_mode: Literal["raw", "processed"] = Field(
        "raw",
        description="What the behaviour logprobs are: processed (after temperature and truncation, what the "
        "token was drawn with; vLLM --logprobs-mode processed_logprobs) or raw (the untempered softmax; events "
        "without this field). See schemas/sampling.py.",
    )

    @field_validator(
        "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"
    )
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class InteractionEvent(_Message):
    """One served model call: the exact tokens, behaviour logprobs and weight version behind it."""

    schema_version: Literal["rtrl.interaction.v1"] = Field(INTERACTION_SCHEMA, description="Wire schema tag.")
    event_id: Id = Field(description="Idempotency key of this event, given by its producer (the gateway).")
    request_id: Id = Field(description="Id the gateway gave the request; feedback refers to it.")
    session_id: Id | None = Field(None, description="Client session, if the app sends one.")
    tenant: Id = Field("default", description="Tenant / application the request belongs to.")
    created_at: datetime = Field(default_factory=utcnow, description="When the response was served (UTC).")
    model: Id = Field(description="Served model name.")
    policy_version: Id = Field(description="Weight version of the server that generated the completion.")
    prompt: Text = Field(
        description="Prompt text as sent to the model (chat templates applied); a NUL or a lone surrogate in it is "
        "U+FFFD (storable_text), the prompt token ids are exact."
    )
    prompt_token_ids: TokenIds = Field(description="Prompt token ids as the server tokenized them.")
    completion: Text = Field(
        description="Completion text; a NUL or a lone surrogate in it is U+FFFD (storable_text), the completion "
        "token ids are exact."
    )
    completion_token_ids: TokenIds = Field(description="Sampled completion token ids.")
    completion_logprobs: Logprobs = Field(description="Behaviour logprob of each sampled completion token.")
    finish_reason: Annotated[str, BeforeValidator(_storable), Field(max_length=32)] | None = Field(
        None, description="stop, length, ..."
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Sampling parameters.")
    episode_id: Id = Field(description="Episode this segment belongs to (= request_id for single calls).")
    segment_index: int = Field(0, ge=0, le=10_000, description="Position of the segment in its episode.")
    role: Role = Field(Role.policy, description="What the segment is; subagent segments are not trained.")
    agent: Id | None = Field(
        None,
        description="Which agent of the episode made the call: a PARL sub-agent's id (the critical-steps metric "
        "counts each sub-agent's calls per stage; docs/methods.md); None: the episode's main agent.",
    )
    trainable: bool = Field(True, description="Whether the completion tokens enter the loss.")
    untrainable_reason: Annotated[str, Field(min_length=1, max_length=64)] | None = Field(
        None,
        description="Why the gateway captured it as not trainable although nothing else forbade it: sampling "
        "the trainer cannot reproduce (penalty, logit_bias, guided_decoding, ...; schemas/sampling.py).",
    )
    truncated: bool = Field(
        False,
        description="The stream ended before the generation did (the client went away, or vLLM failed "
        "mid-stream): the completion is only a prefix, and the segment is never trained on.",
    )
    redacted: list[Annotated[str, Field(min_length=1, max_length=32)]] = Field(
        default_factory=list,
        max_length=16,
        description="Kinds of text the gateway redacted from prompt/completion (e.g. email); the token ids still "
        "carry the original text, so such a segment trains only where its tenant allows it.",
    )

    @field_validator("completion_logprobs")
    @classmethod
    def _finite_logprobs(cls, value: list[float]) -> list[float]:
        for lp in value:
            if not math.isfinite(lp) or lp > 1e-4:
                raise ValueError(f"logprobs must be finite and <= 0, got {lp!r}")
        return value

    @model_validator(mode="after")
    def _aligned(self) -> InteractionEvent:
        if len(self.completion_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"{len(self.completion_logprobs)} logprobs for {len(self.completion_token_ids)} completion tokens"
            )
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if self.truncated and self.trainable:
            raise ValueError("a truncated segment cannot be trainable")
        if self.untrainable_reason is not None and self.trainable:
            raise ValueError(f"untrainable_reason is {self.untrainable_reason!r} but trainable is true")
        if self.role == Role.subagent and self.trainable:
            raise ValueError("subagent segments are frozen observations: trainable must be false")
        return self


class FeedbackKind(StrEnum):
    """The closed set of feedback signals rtrl understands."""

    accepted = "accepted"
    rejected = "rejected"
    edited = "edited"
    edit_persisted = "edit_persisted"
    edit_reverted = "edit_reverted"
    thumbs_up = "thumbs_up"
    thumbs_down = "thumbs_down"
    followup_dissatisfied = "followup_dissatisfied"
    tool_call_error = "tool_call_error"
    task_outcome = "task_outcome"
    judge_score = "judge_score"
    episode_end = "episode_end"
    # What the right answer was, in the user's words (``text``): the corrected answer or a hint. No
    # reward of its own; a client that also judges the answer wrong sends ``rejected`` beside it.
    correction = "correction"


# Kinds whose value is a score the sender chooses; the others are events and ignore value.
SCORED_KINDS = frozenset({FeedbackKind.task_outcome, FeedbackKind.judge_score})
# Kinds that steer the labeler and carry no reward: `episode_end` says the client's episode is over
# and settles it at once (docs/methods.md, Episodes). Reward specs give them no weight.
CONTROL_KINDS = frozenset({FeedbackKind.episode_end})
# Kinds that may carry ``text`` (`FeedbackEvent.text`): a correction must, an edit may (the edited
# code); any other kind with text is refused, so text never rides along unread.
TEXT_KINDS = frozenset({FeedbackKind.correction, FeedbackKind.edited})


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("text must not contain NUL characters")
    return value


# Text a user wrote (a correction): unlike a model's text it is refused, not repaired, when a store
# cannot hold it (a NUL; pydantic refuses a lone surrogate itself).
UserText = Annotated[str, Field(min_length=1, max_length=MAX_CORRECTION_CHARS), AfterValidator(_no_nul)]


def text_problem(kind: FeedbackKind, text: str | None) -> str | None:
    """Why `text` cannot go with feedback of `kind`, or None: a correction needs text, and only
    the `TEXT_KINDS` may carry it."""
    if kind == FeedbackKind.correction and text is None:
        return "a correction needs its text (the corrected answer or a hint)"
    if text is not None and kind not in TEXT_KINDS:
        allowed = ", ".join(sorted(k.value for k in TEXT_KINDS))
        return f"feedback of kind {kind.value} carries no text (only {allowed} do)"
    return None


class FeedbackEvent(_Message):
    """A signal about a served request or a whole episode, from the app, the user or a judge."""

    schema_version: Literal["rtrl.feedback.v1"] = Field(FEEDBACK_SCHEMA, description="Wire schema tag.")
    event_id: Id = Field(description="Idempotency key of this event, given by its producer (the gateway).")
    request_id: Id = Field(description="The request the feedback is about (x-rtrl-request-id).")
    episode_id: Id | None = Field(None, description="Episode, when the feedback is about the whole episode.")
    tenant: Id = Field("default", description="Tenant / application.")
    kind: FeedbackKind = Field(description="What happened.")
    value: FeedbackValue = Field(1.0, description="Score for task_outcome / judge_score; 1 otherwise.")
    created_at: datetime = Field(default_factory=utcnow, description="When it happened (UTC).")
    text: UserText | None = Field(
        None,
        description="What the user wrote: required on correction (the corrected answer or a hint), allowed on "
        f"edited (the edited text), refused on any other kind; at most {MAX_CORRECTION_CHARS} characters, no NUL, "
        "redacted by the gateway like prompts. Added to rtrl.feedback.v1 as an optional field (events without it "
        "read as before).",
    )

    @model_validator(mode="after")
    def _text_fits_kind(self) -> FeedbackEvent:
        problem = text_problem(self.kind, self.text)
        if problem is not None:
            raise ValueError(problem)
        return self


class DeadLetterRecord(_Message):
    """A record rtrl could not use, kept with the reason instead of being dropped."""

    schema_version: Literal["rtrl.dead_letter.v1"] = Field(DEAD_LETTER_SCHEMA, description="Wire schema tag.")
    event_id: Id = Field(default_factory=new_id, description="Id of this dead-letter record.")
    source: Annotated[str, Field(max_length=200)] = Field(
        description="Where it came from: topic:partition:offset or a component."
    )
    original_event_id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = Field(
        None, description="event_id of the rejected record, if it had a readable one."
    )
    reason: Annotated[str, Field(max_length=10_000)] = Field(description="Why it was rejected.")
    payload: Annotated[str, Field(max_length=MAX_EVENT_BYTES)] = Field(
        description="The original bytes, decoded as UTF-8 with replacement."
    )
    created_at: datetime = Field(default_factory=utcnow, description="When it was dead-lettered (UTC).")


WIRE_MODELS: dict[str, type[_Message]] = {
    INTERACTION_SCHEMA: InteractionEvent,
    FEEDBACK_SCHEMA: FeedbackEvent,
    DEAD_LETTER_SCHEMA: DeadLetterRecord,
}


class SchemaError(ValueError):
    """A wire record that is not a valid, known rtrl message."""


def parse_event(raw: bytes, expected: type[_Message] | None = None) -> Any:
    """Decode one Kafka record value into its model, or raise SchemaError with the reason."""
    import json

    if len(raw) > MAX_EVENT_BYTES:
        raise SchemaError(f"record of {len(raw)} bytes exceeds {MAX_EVENT_BYTES}")
    if expected is not None:
        # The usual record, read and validated in one pass by pydantic's JSON reader (half the time of
        # json.loads and then validating the dict). Anything it refuses, and a record without a
        # schema_version (which the model's default would fill in), is read again below, which
        # says why in rtrl's words (tests/schemas/test_schemas_events.py: both readers agree).
        try:
            event = expected.model_validate_json(raw)
        except ValueError:
            pass
        else:
            if "schema_version" in event.model_fields_set:
                return event
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SchemaError(f"not JSON: {exc}") from exc
    except RecursionError:  # json.loads recurses per nesting level (docs/platform.md, Per-record failures)
        raise SchemaError("not JSON rtrl can read: nested too deeply") from None
    if not isinstance(data, dict):
        raise SchemaError(f"expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    model = WIRE_MODELS.get(version) if isinstance(version, str) else None
    if model is None:
        raise SchemaError(f"unknown schema_version {version!r}")
    if expected is not None and model is not expected:
        raise SchemaError(f"{version} on a topic for {expected.__name__}")
    try:
        return model.model_validate(data)
    except ValueError as exc:
        raise SchemaError(str(exc)) from exc


def event_time_problem(
    created_at: datetime, now: datetime, max_future_skew_s: float, max_age_s: float
) -> str | None:
    """Why an event's ``created_at`` is outside the window rtrl accepts, or None when it is inside.

    Too far ahead is a skewed or hostile clock; too old is past the retention of the loop's data.
    Compared without converting to UTC, which overflows near year 9999 (docs/platform.md,
    Per-record failures).
    """
    if created_at > now + timedelta(seconds=max_future_skew_s):
        return f"created_at {created_at.isoformat()} is more than {max_future_skew_s:g}s ahead of {now.isoformat()}"
    if created_at < now - timedelta(seconds=max_age_s):
        return f"created_at {created_at.isoformat()} is more than {max_age_s:g}s before {now.isoformat()}"
    return None


class FeedbackSignal(_Message):
    """What a preference function returns for one completion: a feedback kind and its value.

    The simulator turns each signal into a FeedbackEvent for the request it sent; the eval gate
    scores a completion by passing the signals through the reward spec.
    """

    kind: FeedbackKind = Field(description="What the simulated user did.")
    value: float = Field(1.0, ge=-1e6, le=1e6, description="Score for task_outcome / judge_score.")
    text: UserText | None = Field(
        None, description="What the user wrote: a correction's corrected answer or hint (`text_problem`)."
    )

    @model_validator(mode="after")
    def _text_fits_kind(self) -> FeedbackSignal:
        problem = text_problem(self.kind, self.text)
        if problem:
            raise ValueError(problem)
        return self
