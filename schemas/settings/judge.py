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
        description="The judge's instructions; {prompt}, {completion} and {scale} are replaced (nothing else is "
        "a placeholder). The judge answers with one digit from 1 to `scale`.",
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
        missing = [p for p in ("{prompt}", "{completion}") if p not in value]
        if missing:
            raise ValueError(f"the rubric must contain {' and '.join(missing)}")
        return value
