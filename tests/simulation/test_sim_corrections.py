"""Simulated users who write corrections (issue 39): the signal, the body they post, the flip, and
bench_learning's correct_with_corrections users. The gateway's side is tests/ingest/test_ingest_feedback.py."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import ValidationError

from schemas.events import FeedbackKind, FeedbackSignal
from simulation.client import feedback_body
from simulation.users import _what_the_user_says

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _bench_learning() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_learning", ROOT / "bench" / "bench_learning.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_signal_carries_text_only_where_the_gateway_takes_it() -> None:
    assert FeedbackSignal(kind=FeedbackKind.correction, text="The answer is 7.").text == "The answer is 7."
    with pytest.raises(ValidationError, match="needs its text"):
        FeedbackSignal(kind=FeedbackKind.correction)
    with pytest.raises(ValidationError, match="carries no text"):
        FeedbackSignal(kind=FeedbackKind.accepted, text="nice")


def test_the_posted_body_has_the_text_of_a_correction_and_none_otherwise() -> None:
    correction = feedback_body("req-1", FeedbackSignal(kind=FeedbackKind.correction, text="It is 12."))
    assert correction["kind"] == "correction" and correction["text"] == "It is 12."
    assert correction["request_id"] == "req-1" and correction["event_id"]
    assert "text" not in feedback_body("req-1", FeedbackSignal(kind=FeedbackKind.rejected))


def test_a_flipped_verdict_comes_without_the_correction() -> None:
    said = [
        FeedbackSignal(kind=FeedbackKind.rejected),
        FeedbackSignal(kind=FeedbackKind.correction, text="The answer is 7."),
    ]
    assert _what_the_user_says(said, False, random.Random(0), 1.0, 0.0) == said
    assert _what_the_user_says(said, False, random.Random(0), 1.0, 1.0) == [
        FeedbackSignal(kind=FeedbackKind.accepted)
    ]


def test_bench_users_correct_half_of_the_wrong_answers_and_none_of_the_right_ones() -> None:
    bench = _bench_learning()
    prompts = list(bench._ANSWERS)[:200]
    wrong = [bench.correct_with_corrections(p, " no idea") for p in prompts]
    corrected = [s for s in wrong if len(s) == 2]
    assert all(s[0].kind == FeedbackKind.rejected for s in wrong)
    assert 0.35 < len(corrected) / len(wrong) < 0.65
    for prompt, said in zip(prompts, wrong, strict=True):
        if len(said) == 2:
            assert said[1].kind == FeedbackKind.correction and bench._ANSWERS[prompt][0] in (
                said[1].text or ""
            )
    right = [bench.correct_with_corrections(p, f" {bench._ANSWERS[p][0]}!") for p in prompts]
    assert all(s == [FeedbackSignal(kind=FeedbackKind.accepted)] for s in right)
    assert bench.correct_with_corrections(prompts[0], " no idea") == wrong[0]  # the same again
