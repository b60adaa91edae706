"""A judge: an OpenAI-compatible chat model that grades a completion against a rubric (docs/gate.md, Judge).

The judge is asked on ``<url>/chat/completions`` for one token at temperature 0 with the top 20
logprobs. The grade is the expected score over the digits 1..scale among those tokens (their
probabilities renormalised: a judge unsure between 3 and 4 gives 3.5), normalised to [0, 1]. An
endpoint that returns no logprobs is read from its text (the first digit in range). Anything else
is a failed judgement with the reason, never a guess.

Failures are expected and bounded: a timeout, a refused connection, 429 and 5xx are tried again
(`retries`, backing off, honouring a short ``Retry-After``); other answers fail at once. `score_many`
grades with `concurrency` requests in flight and stops asking once more judgements have failed than
`max_failure_rate` allows (an outage: the rest are marked as not asked), so a dead judge costs one
round of timeouts, not one per item. What the caller does with an outage is its policy (the gate:
`gate.judge.outage`).

The judge is an external system of its own, and this module is its one client: it talks httpx
directly rather than through serving/ (evals' sibling in the layers, which it does not import),
and its retry policy is written against httpx's errors.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from schemas.settings import JudgeSettings

TOP_LOGPROBS = 20  # OpenAI's maximum, and vLLM's default --max-logprobs
RETRY_AFTER_CAP_S = 10.0
NOT_ASKED = "not asked: the judge is out"


@dataclass(frozen=True)
class Verdict:
    """One judgement: a score in [0, 1], or why there is none."""

    score: float | None
    error: str | None = None


@dataclass(frozen=True)
class Judgements:
    """`score_many`'s result: a verdict per item, in order, and whether the judge was out."""

    verdicts: list[Verdict]
    outage: bool

    @property
    def failed(self) -> int:
        return sum(v.score is None for v in self.verdicts)

    def first_error(self) -> str | None:
        return next((v.error for v in self.verdicts if v.error and v.error != NOT_ASKED), None)


class Judge:
    """Grades (prompt, completion) pairs with the judge at `cfg.url`. Thread-safe; close when done."""

    def __init__(self, cfg: JudgeSettings) -> None:
        self.cfg = cfg
        headers = {"authorization": f"Bearer {cfg.api_key.get_secret_value()}"} if cfg.api_key else {}
        self._client = httpx.Client(
            base_url=cfg.url.rstrip("/"),
            headers=headers,
            timeout=cfg.timeout_s,
            limits=httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency),
        )
        self._digits = {str(d): d for d in range(1, cfg.scale + 1)}

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def instructions(self, prompt: str, completion: str) -> str:
        """The rubric with this item in it (plain replacement: braces elsewhere in the rubric are text)."""
        return (
            self.cfg.rubric.replace("{scale}", str(self.cfg.scale))
            .replace("{prompt}", prompt)
            .replace("{completion}", completion)
        )

    def score(self, prompt: str, completion: str) -> Verdict:
        """One judgement, tried up to 1 + `retries` times."""
        body = {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": self.instructions(prompt, completion)}],
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": TOP_LOGPROBS,
        }
        error = "not tried"
        for attempt in range(self.cfg.retries + 1):
            wait = min(0.5 * 2**attempt, RETRY_AFTER_CAP_S)
            try:
                response = self._client.post("/chat/completions", json=body)
            except httpx.TimeoutException:
                error = f"timed out after {self.cfg.timeout_s:g} s"
            except httpx.TransportError as exc:
                error = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    return self._read(response)
                error = f"HTTP {response.status_code}: {response.text[:200]}"
                if response.status_code != 429 and response.status_code < 500:
                    return Verdict(None, error)  # a request the judge will never accept: no retry
                wait = _retry_after(response, wait)
            if attempt < self.cfg.retries:
                time.sleep(wait)
        return Verdict(None, f"{error} ({self.cfg.retries + 1} tries)")

    def _read(self, response: httpx.Response) -> Verdict:
        try:
            choice = response.json()["choices"][0]
            text = choice.get("message", {}).get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return Verdict(None, f"not a chat completion: {response.text[:200]}")
        expected = self._from_logprobs(choice.get("logprobs"))
        if expected is None:
            found = next((self._digits[d] for d in re.findall(r"\d", str(text)) if d in self._digits), None)
            if found is None:
                return Verdict(None, f"the judge answered {str(text)[:80]!r}, not a grade 1-{self.cfg.scale}")
            expected = float(found)
        return Verdict((expected - 1) / (self.cfg.scale - 1))

    def _from_logprobs(self, logprobs: Any) -> float | None:
        """Expected grade over the digit tokens among the first token's top logprobs, if any."""
        try:
            top = logprobs["content"][0]["top_logprobs"]
        except (TypeError, KeyError, IndexError):
            return None
        weights: dict[int, float] = {}
        for entry in top if isinstance(top, list) else []:
            token, logprob = str(entry.get("token", "")).strip(), entry.get("logprob")
            if token in self._digits and isinstance(logprob, int | float) and math.isfinite(logprob):
                grade = self._digits[token]
                weights[grade] = weights.get(grade, 0.0) + math.exp(logprob)
        total = sum(weights.values())
        if total <= 0:
            return None
        return sum(grade * p for grade, p in weights.items()) / total

    def score_many(self, items: Sequence[tuple[str, str]]) -> Judgements:
        """Every item judged, `concurrency` at a time; after an outage the rest are not asked."""
        budget = math.floor(self.cfg.max_failure_rate * len(items))
        failed = 0
        lock = threading.Lock()

        def one(item: tuple[str, str]) -> Verdict:
            nonlocal failed
            with lock:
                if failed > budget:
                    return Verdict(None, NOT_ASKED)
            verdict = self.score(*item)
            if verdict.score is None:
                with lock:
                    failed += 1
            return verdict

        with ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix="judge") as pool:
            verdicts = list(pool.map(one, items))
        return Judgements(verdicts=verdicts, outage=sum(v.score is None for v in verdicts) > budget)


def _retry_after(response: httpx.Response, default: float) -> float:
    try:
        return min(max(float(response.headers.get("retry-after", "")), 0.0), RETRY_AFTER_CAP_S)
    except ValueError:
        return default
