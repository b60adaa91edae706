"""Wire schemas: strict validation, versioning, JSON Schema export; import-light."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from factories import interaction
from pydantic import ValidationError

from schemas import (
    DeadLetterRecord,
    FeedbackEvent,
    FeedbackKind,
    InteractionEvent,
    Role,
    SchemaError,
    format_version,
    parse_event,
    parse_version,
)
from schemas.events import MAX_CORRECTION_CHARS, MAX_EVENT_BYTES, storable_text

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_interaction_round_trips_through_the_wire() -> None:
    event = interaction()
    parsed = parse_event(event.model_dump_json().encode(), InteractionEvent)
    assert parsed == event
    assert parsed.schema_version == "rtrl.interaction.v1"


def test_events_are_frozen() -> None:
    event = interaction()
    with pytest.raises(ValidationError):
        event.completion = "changed"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"completion_logprobs": [-0.5]}, "1 logprobs for 2 completion tokens"),
        ({"completion_logprobs": [-0.5, float("nan")]}, "finite"),
        ({"completion_logprobs": [-0.5, 0.7]}, "<= 0"),
        ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
        ({"prompt_token_ids": [-1]}, "greater than or equal to 0"),
        ({"role": "subagent"}, "trainable must be false"),
        ({"request_id": "x" * 201}, "at most 200"),
        ({"request_id": "bad id with spaces"}, "pattern"),
        ({"created_at": datetime(2026, 1, 1)}, "timezone"),
        ({"unexpected": 1}, "Extra inputs"),
    ],
)
def test_interaction_rejects_bad_input(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        interaction(**overrides)


def test_subagent_segment_may_be_frozen() -> None:
    assert interaction(role="subagent", trainable=False).role is Role.subagent


def test_feedback_kinds_are_a_closed_set() -> None:
    assert {k.value for k in FeedbackKind} == {
        "accepted",
        "rejected",
        "edited",
        "edit_persisted",
        "edit_reverted",
        "thumbs_up",
        "thumbs_down",
        "followup_dissatisfied",
        "tool_call_error",
        "task_outcome",
        "judge_score",
        "episode_end",
        "correction",
    }
    with pytest.raises(ValidationError):
        FeedbackEvent(event_id="f1", request_id="r", kind="loved_it")  # type: ignore[arg-type]
    for bad in (float("inf"), float("nan"), 1e7):
        with pytest.raises(ValidationError, match="value"):
            FeedbackEvent(event_id="f1", request_id="r", kind=FeedbackKind.judge_score, value=bad)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xff\xfe not json", "not JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"schema_version": "rtrl.interaction.v9"}', "unknown schema_version"),
        (b'{"request_id": "r"}', "unknown schema_version None"),
        (b"x" * (MAX_EVENT_BYTES + 1), "exceeds"),
    ],
)
def test_parse_event_gives_a_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(SchemaError, match=reason):
        parse_event(raw)


def test_parse_event_refuses_a_message_on_the_wrong_topic() -> None:
    feedback = FeedbackEvent(event_id="f1", request_id="r", kind=FeedbackKind.accepted)
    with pytest.raises(SchemaError, match="on a topic for InteractionEvent"):
        parse_event(feedback.model_dump_json().encode(), InteractionEvent)


def test_dead_letter_keeps_the_payload_and_reason() -> None:
    record = DeadLetterRecord(source="rtrl.feedback.v1:0:42", reason="not JSON", payload="\ufffd")
    assert parse_event(record.model_dump_json().encode()) == record


def test_versions() -> None:
    assert format_version(3) == "v3"
    assert parse_version("v12") == 12
    for bad in ("3", "v0", "v-1", "v1.2", "V1", ""):
        with pytest.raises(ValueError):
            parse_version(bad)


def test_schemas_do_not_import_torch_or_kafka() -> None:
    code = "import sys, schemas; print(sorted(m for m in ('torch', 'kafka') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_schema_export_writes_json_schema(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "rtrl.cli", "schemas", "export", str(tmp_path)], check=True, cwd=REPO
    )
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["rtrl.dead_letter.v1.json", "rtrl.feedback.v1.json", "rtrl.interaction.v1.json"]
    interaction_schema = json.loads((tmp_path / "rtrl.interaction.v1.json").read_text())
    assert "completion_logprobs" in interaction_schema["required"]


@pytest.mark.parametrize(
    ("text", "stored"),
    [
        ("plain ascii\ttext\n", "plain ascii\ttext\n"),
        ("a\x00b\x00", "a\ufffdb\ufffd"),
        ("\x01\x07\x1b\x1f\x7f\x85\u2028 kept", "\x01\x07\x1b\x1f\x7f\x85\u2028 kept"),  # other controls
        ("é\ud800x", "é\ufffdx"),
        ("\udfff\ud83d", "\ufffd\ufffd"),  # a low surrogate first, a high one last: neither pairs
        ("\ud83d\ude00!", "\U0001f600!"),  # a pair written as two code points: the character it encodes
        ("日本\x00\udc80", "日本\ufffd\ufffd"),
    ],
)
def test_storable_text_replaces_only_nul_and_lone_surrogates(text: str, stored: str) -> None:
    assert (
        storable_text(text).encode("utf-8").decode("utf-8") == stored
    )  # with a UTF-8 form: encode raises if not


def test_text_a_tokenizer_produced_makes_an_event_the_gateway_can_publish() -> None:
    """vLLM's answer is read leniently (serving.aio.loads), so its text can carry a lone surrogate:
    the event is built, with U+FFFD, and its JSON is UTF-8 for Kafka; the token ids are untouched."""
    event = interaction(
        prompt="q\x00",
        completion="\ud800a",
        finish_reason="\x00",
        sampling={"stop": ["\udc00", "\x00"]},
        completion_token_ids=[0, 255],
    )
    assert (event.prompt, event.completion, event.finish_reason) == ("q\ufffd", "\ufffda", "\ufffd")
    assert event.sampling.stop == ["\ufffd", "\ufffd"]
    wire = event.model_dump_json().encode("utf-8")
    assert parse_event(wire, InteractionEvent) == event
    assert event.completion_token_ids == [0, 255]


def test_a_wire_event_carries_its_own_event_id() -> None:
    data = json.loads(interaction().model_dump_json())
    del data["event_id"]
    with pytest.raises(SchemaError, match="event_id"):
        parse_event(json.dumps(data).encode())  # a reader never invents the idempotency key


def test_deeply_nested_json_is_a_schema_error_not_a_crash() -> None:
    with pytest.raises(SchemaError, match="nested too deeply"):
        parse_event(b"[" * 5000)


def test_event_time_window() -> None:
    from datetime import UTC, timedelta

    from schemas.events import event_time_problem

    now = datetime(2026, 6, 1, tzinfo=UTC)
    assert event_time_problem(now + timedelta(seconds=299), now, 300, 86400) is None
    assert "ahead" in (event_time_problem(now + timedelta(seconds=301), now, 300, 86400) or "")
    assert "before" in (event_time_problem(now - timedelta(days=2), now, 300, 86400) or "")
    far_future = datetime.fromisoformat("9999-12-31T23:59:59-01:00")  # overflows if converted to UTC
    assert "ahead" in (event_time_problem(far_future, now, 300, 86400) or "")


def _variants() -> list[bytes]:
    """A valid interaction and feedback on the wire, and ways of bending each."""
    wire = json.loads(interaction().model_dump_json())
    feedback = json.loads(
        FeedbackEvent(event_id="f1", request_id="r", kind=FeedbackKind.accepted).model_dump_json()
    )
    bent: list[dict[str, object] | str] = [
        wire,
        feedback,
        {k: v for k, v in wire.items() if k != "schema_version"},
        {**wire, "prompt_token_ids": ["1", "2"]},
        {**wire, "prompt_token_ids": [1.0, 2.0]},
        {**wire, "prompt_token_ids": [True]},
        {**wire, "prompt_token_ids": [10**30]},
        {**wire, "prompt_token_ids": None},
        {**wire, "created_at": 1764690000},
        {**wire, "created_at": "2026-12-02 10:00:00+05:30"},
        {**wire, "created_at": "2026-12-02T10:00:00"},
        {**wire, "role": "Agent"},
        {**wire, "trainable": "yes"},
        {**wire, "trainable": 1},
        {**wire, "segment_index": "3"},
        {**wire, "sampling": {"temperature": "0.5"}},
        {**wire, "completion_logprobs": [-0.5, "-0.1"]},
        {**wire, "unexpected": 1},
        {**feedback, "value": "0.5"},
        {**feedback, "kind": "ACCEPTED"},
        {**feedback, "episode_id": 7},
    ]
    raws = [json.dumps(b).encode() for b in bent]
    text = json.dumps(wire)
    raws += [
        text[:-1].encode() + b', "event_id": "other"}',  # a key twice: the last one counts
        text.replace(
            '"schema_version": "rtrl.interaction.v1"', '"schema_version": "rtrl.interaction.v1 "'
        ).encode(),
        text.replace(f'"{wire["request_id"]}"', '"r\\ud800"', 1).encode(),  # a lone surrogate
        text.replace(f'"{wire["request_id"]}"', '"r\\u0000"', 1).encode(),
        text.replace(f'"{wire["prompt"]}"', '"p\\ud800\\u0000\\udfff"', 1).encode(),  # in text: U+FFFD
        text.replace(f'"{wire["completion"]}"', '"\\ud83d\\ude00\\u0000\\u0001"', 1).encode(),
        json.dumps(wire, ensure_ascii=False).encode("utf-16"),
        text.encode()[:-1],
        b"NaN",
        b'{"schema_version": "rtrl.interaction.v1", "completion_logprobs": [NaN]}',
        b"[" * 5000,
        b"{}",
        b"",
    ]
    return raws


@pytest.mark.parametrize("raw", _variants())
def test_the_fast_reader_accepts_and_refuses_what_the_full_one_does(raw: bytes) -> None:
    """parse_event with the topic's model reads a record in one pass with pydantic's JSON reader and
    falls back to json.loads for the reason; the two must agree on every record."""
    expected = FeedbackEvent if b"rtrl.feedback.v1" in raw else InteractionEvent
    try:
        full: object = parse_event(raw)
        if type(full) is not expected:
            full = SchemaError
    except SchemaError:
        full = SchemaError
    try:
        fast: object = parse_event(raw, expected)
    except SchemaError:
        fast = SchemaError
    assert fast == full


def test_a_correction_carries_its_text_on_the_v1_wire() -> None:
    event = FeedbackEvent(
        event_id="f1", request_id="r", kind=FeedbackKind.correction, text="the answer is 12"
    )
    raw = event.model_dump_json().encode()
    assert b'"schema_version":"rtrl.feedback.v1"' in raw
    assert parse_event(raw, FeedbackEvent) == event
    edited = FeedbackEvent(
        event_id="f2", request_id="r", kind=FeedbackKind.edited, text="def f():\n    return 1"
    )
    assert edited.text == "def f():\n    return 1"
    assert FeedbackEvent(event_id="f3", request_id="r", kind=FeedbackKind.edited).text is None
    # An event written before the field existed reads as one without text.
    old = b'{"schema_version":"rtrl.feedback.v1","event_id":"f4","request_id":"r","kind":"accepted"}'
    assert parse_event(old, FeedbackEvent).text is None


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"kind": "correction"}, "a correction needs its text"),
        ({"kind": "accepted", "text": "great"}, "feedback of kind accepted carries no text"),
        ({"kind": "judge_score", "value": 0.5, "text": "meh"}, "only correction, edited do"),
        ({"kind": "correction", "text": ""}, "at least 1 character"),
        ({"kind": "correction", "text": "x" * (MAX_CORRECTION_CHARS + 1)}, f"at most {MAX_CORRECTION_CHARS}"),
        ({"kind": "correction", "text": "a\u0000b"}, "NUL"),
        ({"kind": "correction", "text": "\ud800"}, "string"),  # a lone surrogate: not UTF-8 text
        ({"kind": "correction", "text": 12}, "string"),
    ],
)
def test_hostile_text_is_a_schema_error_with_its_reason(fields: dict[str, object], reason: str) -> None:
    body = {"schema_version": "rtrl.feedback.v1", "event_id": "f1", "request_id": "r", **fields}
    raw = json.dumps(body).encode()
    with pytest.raises(SchemaError, match=reason):
        parse_event(raw, FeedbackEvent)
    with pytest.raises(SchemaError, match=reason):  # the second reader, which says why in rtrl's words
        parse_event(raw)
