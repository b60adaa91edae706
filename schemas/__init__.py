"""Wire models and settings shared by every rtrl process. Imports neither torch nor Kafka."""

from schemas.events import (
    DeadLetterRecord,
    FeedbackEvent,
    FeedbackKind,
    FeedbackSignal,
    InteractionEvent,
    Role,
    SamplingParams,
    SchemaError,
    parse_event,
)
from schemas.settings import Settings
from schemas.versions import format_version, parse_version

__all__ = [
    "DeadLetterRecord",
    "FeedbackEvent",
    "FeedbackKind",
    "FeedbackSignal",
    "InteractionEvent",
    "Role",
    "SamplingParams",
    "SchemaError",
    "Settings",
    "format_version",
    "parse_event",
    "parse_version",
]
