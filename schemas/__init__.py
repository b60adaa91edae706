"""The bottom layer: what every rtrl process shares. Imports neither torch nor Kafka.

- `schemas.settings`: the one configuration model (``RTRL_*`` environment, `load_settings`).
- `schemas.events`: the versioned wire messages on Kafka (JSON Schema via ``rtrl schemas export``).
- `schemas.versions`: policy versions, ``int`` in code and ``"vN"`` on the wire and in the store.
- `schemas.rewards`: versioned reward specs and the scoring of feedback signals.
- `schemas.clock`: ``utcnow`` and ``wait_until``.
- `schemas.errors`: `OperatorError`, the errors an operator fixes.
"""

from schemas.errors import OperatorError
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
from schemas.settings import Settings, load_settings
from schemas.versions import format_version, parse_version

__all__ = [
    "DeadLetterRecord",
    "FeedbackEvent",
    "FeedbackKind",
    "FeedbackSignal",
    "InteractionEvent",
    "OperatorError",
    "Role",
    "SamplingParams",
    "SchemaError",
    "Settings",
    "format_version",
    "load_settings",
    "parse_event",
    "parse_version",
]
