"""Redaction detectors (ingest/redaction.py): what they mask, what they leave alone, plug-ins."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from ingest.redaction import RedactionError, Redactor
from schemas.keys import new_key

pytestmark = pytest.mark.unit

DEFAULT = Redactor(("email", "phone", "api_key"))


@pytest.mark.parametrize(
    ("text", "expected", "kinds"),
    [
        ("mail ana.lopez+rl@example.co.uk today", "mail [REDACTED:email] today", {"email"}),
        ("call +44 20 7946 0958 now", "call [REDACTED:phone] now", {"phone"}),
        ("call (415) 555-0132.", "call [REDACTED:phone].", {"phone"}),
        ("tel 030-1234-5678", "tel [REDACTED:phone]", {"phone"}),
        ("key sk-proj-abcdefghijklmnop1234 ok", "key [REDACTED:api_key] ok", {"api_key"}),
        ("AKIAABCDEFGHIJKLMNOP", "[REDACTED:api_key]", {"api_key"}),
        (
            "Authorization: Bearer abc.def-ghi_jkl012345",
            "Authorization: Bearer [REDACTED:api_key]",
            {"api_key"},
        ),
        ("token 9f8e7d6c5b4a39281706f5e4d3c2b1a0ffeeddcc", "token [REDACTED:api_key]", {"api_key"}),
        ("ana@example.com, +1 415 555 0132", "[REDACTED:email], [REDACTED:phone]", {"email", "phone"}),
        ("tel:+14155550132 or +33612345678", "tel:[REDACTED:phone] or [REDACTED:phone]", {"phone"}),
        ("mobile +44 7700 900123", "mobile [REDACTED:phone]", {"phone"}),
        ("50%off%deal@example.com", "[REDACTED:email]", {"email"}),
    ],
)
def test_detectors_mask_what_they_find(text: str, expected: str, kinds: set[str]) -> None:
    result = DEFAULT(text)
    assert result.text == expected and result.kinds == kinds


def test_rtrl_keys_are_masked() -> None:
    key = new_key()
    result = DEFAULT(f"my key is {key}")
    assert key not in result.text and result.kinds == {"api_key"}


@pytest.mark.parametrize(
    "text",
    [
        "Q: What is 3 plus 4?\nA: 7",
        "Q: What is 123456 times 789?\nA: 97406784",  # bare digits: arithmetic, not a phone number
        "order 20261130 shipped on 2026-11-30 at 17:48",
        "the host at 192.168.100.200 answers",
        "see https://example.com/docs/getting-started and the user@ handle",
        "a_very_long_identifier_name_without_any_digits_in_it_at_all",
        "",
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    result = DEFAULT(text)
    assert result.text == text and result.kinds == frozenset()


def shouting(text: str) -> Iterable[tuple[int, int]]:
    """A plug-in detector for the test: words in capitals of four letters or more."""
    import re

    return (m.span() for m in re.finditer(r"\b[A-Z]{4,}\b", text))


def test_a_plugged_in_detector_is_loaded_by_module_and_name() -> None:
    redactor = Redactor(("email", f"{__name__}:shouting"))
    result = redactor("HELLO ana@example.com")
    assert result.text == "[REDACTED:shouting] [REDACTED:email]" and result.kinds == {"shouting", "email"}


def test_overlapping_spans_are_masked_once() -> None:
    redactor = Redactor((f"{__name__}:shouting", "api_key"))
    result = redactor("XXXXAKIAABCDEFGHIJKLMNOP is not a word; AKIAABCDEFGHIJKLMNOP is a key")
    assert "AKIA" not in result.text and result.text.count("[REDACTED:") == 2


@pytest.mark.parametrize(
    "name", ["nope", "no_such_module_xyz:f", "ingest.redaction:NO_SUCH", "ingest.redaction:EMAIL"]
)
def test_a_detector_that_cannot_be_loaded_is_one_clear_error(name: str) -> None:
    with pytest.raises(RedactionError, match="gateway.redaction"):
        Redactor((name,))


def test_redaction_can_be_turned_off() -> None:
    assert Redactor(()).__call__("ana@example.com").kinds == frozenset()


def test_json_is_redacted_string_by_string() -> None:
    from ingest.redaction import redact_json

    value = {"prompt": "line one\n+44 20 7946 0958", "n": 3, "list": ["ana@example.com", None]}
    assert redact_json(DEFAULT, value) == {
        "prompt": "line one\n[REDACTED:phone]",
        "n": 3,
        "list": ["[REDACTED:email]", None],
    }


def test_only_built_in_detectors_over_short_texts_run_on_the_event_loop() -> None:
    from ingest.redaction import INLINE_CHARS

    assert DEFAULT.cheap(INLINE_CHARS) and not DEFAULT.cheap(INLINE_CHARS + 1)
    assert not Redactor(("email", f"{__name__}:shouting")).cheap(10)  # a plug-in's cost is unknown
