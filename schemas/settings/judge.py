"""Settings of a judge: an OpenAI-compatible model that grades completions against a rubric (the
labeler's judge-term rewards and the gate's judge suite).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator

from schemas.settings.section import Section

DEFAULT_RUBRIC = (
    "You grade an assistant's answer to a user's request.\n"
    "Request: {prompt}\n"
    "Answer: {completion}\n"
    "Is the answer correct, helpful and complete? Reply with one digit from 1 (useless or wrong) to {scale} "
    "(excellent) and nothing else.\n"
    "Grade:"
)


class JudgeSettings(Section):
    """An OpenAI-compatible model that grades completions against a rubric (evals/judge.py; docs/gate.md, Judge)."""

    url: str = Field(
        ...,
        min_length=1,
        description="Base URL of an OpenAI-compatible API, up to and including /v1 (http://judge:8000/v1); "
        "the judge is asked on <url>/chat/completions.",
    )
    model: str = Field(..., min_length=1, description="The judge's model name at that endpoint.")
    api_key: SecretStr | None = Field(None, description="Bearer key for the judge endpoint (never printed).")
    rubric: str = Field(
        DEFAULT_RUBRIC,
        max_length=20_000,
        description="The judge's instructions: {prompt} and {completion} (each exactly once) become delimited data "
        "blocks and {scale} the top grade, in one pass (nothing else is a placeholder, and the text put in is never "
        "read for placeholders; docs/gate.md, Judge). The judge answers with one digit from 1 to `scale`.",
    )
    max_prompt_chars: int = Field(
        8_000,
        ge=100,
        le=1_000_000,
        description="The most characters of a prompt the judge is shown: a longer one is cut in the middle (its "
        "first and last halves kept, the cut marked in the text), so no item makes a huge judge request.",
    )
    max_completion_chars: int = Field(
        16_000,
        ge=100,
        le=1_000_000,
        description="The most characters of a completion (an episode's whole trajectory) the judge is shown, cut "
        "in the middle like a prompt.",
    )
    scale: int = Field(5, ge=2, le=9, description="Scores run from 1 to this; normalised to [0, 1].")
    timeout_s: float = Field(30.0, gt=0, description="Per judgement, each try.")
    retries: int = Field(
        2, ge=0, le=10, description="Further tries after a timeout, a refused connection, 429 or 5xx."
    )
    concurrency: int = Field(4, ge=1, le=64, description="Judgements in flight at once.")
    max_failure_rate: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="More failed judgements than this share (after retries) is an outage: see `outage`.",
    )
    outage: Literal["inconclusive", "block"] = Field(
        "inconclusive",
        description="When the judge is out: inconclusive (the suite does not decide; the others still do) or block "
        "(the gate fails).",
    )

    @field_validator("rubric")
    @classmethod
    def _placeholders(cls, value: str) -> str:
        problem = rubric_problem(value)
        if problem:
            raise ValueError(problem)
        return value


def rubric_problem(rubric: str) -> str | None:
    """Why `rubric` cannot be a judge's rubric, or None: it must show the judge the prompt and the
    completion, each once (so a judge request is bounded by the rubric and the two limits)."""
    wrong = [f"{p} (found {rubric.count(p)})" for p in ("{prompt}", "{completion}") if rubric.count(p) != 1]
    if wrong:
        return f"the judge rubric must contain each of {{prompt}} and {{completion}} exactly once: {', '.join(wrong)}"
    return None
