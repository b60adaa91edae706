"""Validation of consumed Kafka records: each becomes an event to store or a `Rejected` with a reason.

Pure: no Kafka client, no SQL. Beyond the wire schema (schemas/events.py) a record is refused when
its ``created_at`` lies outside the accepted window (``settings.limits``: a skewed or hostile
clock, or data past retention), a scored feedback value lies outside the reward spec's range, or
an interaction carries a token id the serving model has no embedding row for (`vocab_size`: read
once at start-up; such an episode would fail every training cycle that selected it), or its prompt
is over ``limits.max_prompt_bytes`` (a ``cap`` reason). `holdout_key` is the labeler's other
start-up read: the key of the eval gate's held-out buckets. Whether the
event's tenant exists is asked of the store, once per batch (store/events.py).
Text a model produced is never a reason: a NUL or a lone surrogate in it arrives as U+FFFD
(`schemas.events.storable_text`). The reasons' classes are listed in store/events.py, which writes
the results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from schemas.errors import OperatorError
from schemas.events import (
    FeedbackEvent,
    InteractionEvent,
    SchemaError,
    event_time_problem,
    parse_event,
    storable_text,
)
from schemas.rewards import RewardSpec
from schemas.secrets import kept_secret
from schemas.settings import LimitsSettings, Settings
from schemas.versions import parse_version
from store.events import Event, Rejected, SourceRecord


@dataclass(frozen=True)
class Checks:
    """What a record is checked against besides its schema."""

    spec: RewardSpec
    limits: LimitsSettings
    vocab_size: int | None = None  # token ids must be below it; None: not checked (`vocab_size`)


def parse_record(
    record: SourceRecord, expected: type[Event], checks: Checks, now: datetime
) -> Event | Rejected:
    """Validate one record against the topic's schema and `checks`, or say why it is rejected."""
    if record.value is None:
        return Rejected(record, "schema: record has no value (tombstone)")
    try:
        event: Event = parse_event(record.value, expected)
    except SchemaError as exc:
        return Rejected(record, f"schema: {exc}", _readable_event_id(record.value))
    problem = event_time_problem(
        event.created_at, now, checks.limits.max_future_skew_s, checks.limits.max_event_age_s
    )
    if problem is not None:
        return Rejected(record, f"content: {problem}", event.event_id)
    if isinstance(event, FeedbackEvent):
        problem = checks.spec.value_problem(event.kind, event.value)
        if problem is not None:
            return Rejected(record, f"content: {problem}", event.event_id)
    if isinstance(event, InteractionEvent):
        # Settling compares an episode's prompts with each other (schemas/episodes.py): their size is its cost.
        size = len(event.prompt.encode())
        if size > checks.limits.max_prompt_bytes:
            return Rejected(
                record,
                f"cap: prompt of {size} bytes over limits.max_prompt_bytes ({checks.limits.max_prompt_bytes})",
                event.event_id,
            )
        # Its text holds no NUL and no lone surrogate: the schema replaced them (storable_text), so
        # whatever the tokenizer produced is stored, on every backend.
        try:
            parse_version(event.policy_version)
        except ValueError as exc:
            return Rejected(record, f"content: {exc}", event.event_id)
        if checks.vocab_size is not None:
            highest = max(max(event.prompt_token_ids, default=0), max(event.completion_token_ids, default=0))
            if highest >= checks.vocab_size:
                return Rejected(
                    record,
                    f"content: token id outside the vocabulary ({highest} >= {checks.vocab_size})",
                    event.event_id,
                )
    return event


def holdout_key(settings: Settings) -> bytes:
    """The key of the held-out buckets (store/settle.py, `eval_bucket`): ``labeler.holdout_secret``,
    else the one kept in ``<services.run_dir>/labeler.holdout_secret`` (made once, mode 0600)."""
    configured = settings.labeler.holdout_secret
    return kept_secret(
        None if configured is None else configured.get_secret_value(),
        Path(settings.services.run_dir) / "labeler.holdout_secret",
    )


class VocabularyUnknown(OperatorError):
    """Neither ``labeler.vocab_size`` nor the serving model's config.json gives a vocabulary size."""


def vocab_size(settings: Settings) -> int:
    """The serving model's vocabulary: ``labeler.vocab_size``, else ``vocab_size`` of config.json in
    ``vllm.model_dir`` (a multimodal config nests it in ``text_config``). Read once, at start-up:
    plain JSON, no model or tokenizer is loaded. Every version rtrl trains keeps the base model's
    embedding, so the base model's size holds for the whole fleet."""
    if settings.labeler.vocab_size is not None:
        return settings.labeler.vocab_size
    path = Path(settings.vllm.model_dir).expanduser() / "config.json"
    try:
        config: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise VocabularyUnknown(
            f"the labeler cannot read the serving model's vocabulary size from {path} ({exc}): set "
            "RTRL_VLLM__MODEL_DIR to the served model's directory or RTRL_LABELER__VOCAB_SIZE to its vocab_size"
        ) from None
    size = _config_vocab_size(config)
    if size is None:
        raise VocabularyUnknown(
            f"{path} has no vocab_size (nor text_config.vocab_size): set RTRL_LABELER__VOCAB_SIZE to the "
            "rows of the served model's input embedding"
        )
    return size


def _config_vocab_size(config: Any) -> int | None:
    if not isinstance(config, dict):
        return None
    value = config.get("vocab_size")
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _readable_event_id(raw: bytes) -> str | None:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    event_id = data.get("event_id") if isinstance(data, dict) else None
    if not isinstance(event_id, str) or not 0 < len(event_id) <= 200:
        return None
    # Kept only when the dead letter can hold it as it is (no NUL, no lone surrogate): an id is
    # shown to find the producer, never altered.
    return event_id if storable_text(event_id) == event_id else None
