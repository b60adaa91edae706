"""The eval gate's behaviour alarms: what a reward number alone does not show (docs/gate.md, Alarms).

Computed on the completions both models generated for the gate (same prompts, same seed) and on
the off-policy statistics of held-out logged traffic. Each alarm compares the challenger with the
champion, so a base model that already rambles or asks questions is not an alarm; a challenger
that learnt to do so more is:

- ``length``: mean completion tokens above ``length_ratio`` x the champion's (+2 tokens);
- ``entropy``: per-token entropy, estimated as the mean −log p of the sampled tokens (an unbiased
  estimate of the entropy of what it samples), below ``entropy_ratio`` x the champion's: collapse;
- ``repetition``: share of completions that repeat themselves (a 3-token n-gram three times, or
  one word four times in a row) up by more than ``repetition_rate``;
- ``truncation``: share of completions cut off by ``max_tokens`` up by more than ``truncation_rate``:
  the second of Cursor's hacks (a response the loop cannot score, dropped instead of labelled,
  teaches the model to fail on hard prompts; rtrl labels truncations, and the gate refuses a
  challenger that fails to finish more often);
- ``no_action``: share of non-answers up by more than ``no_action_rate``: the first of Cursor's
  reward hacks (a model that stops answering is never rejected). A non-answer matches
  ``no_action_pattern`` (nothing alphanumeric, a question, or a completion that opens with a
  refusal or a request for clarification) or, to a prompt whose known answers
  are all numbers, contains no number at all (`non_answer`: "It is red." answers no arithmetic);
- ``no_action_anchor``: the same share against the anchor version's (deployer/gate.py
  `anchor_version`), on the anchored suites: per-promotion steps under ``no_action_rate`` do not add
  up to a model that stopped answering;
- ``kl``: per-token KL(champion || challenger) on held-out logged traffic above its budget
  (`kl_budget`: ``kl_budget`` when set, else ``kl_budget_factor`` x the trainer's ``max_kl``);
- ``no_feedback``: the estimated share of episodes without any feedback, reweighted to each model,
  up by more than ``no_action_rate`` (only when the off-policy estimate is conclusive).

Any alarm blocks promotion (deployer/gate.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from schemas.settings import AlarmSettings
from schemas.settings.gate import KL_BUDGET_WITHOUT_TRUST_REGION
from serving import Generation


class Behaviour(BaseModel):
    """Statistics of one model's gate generations."""

    model_config = ConfigDict(frozen=True)

    completions: int
    mean_tokens: float
    entropy: float  # nats per token, mean −log p of sampled tokens
    repetition: float  # share
    no_action: float  # share
    truncated: float  # share stopped by max_tokens


class Alarm(BaseModel):
    """One alarm check: the figure, the threshold it is held to, whether it fired, in words."""

    model_config = ConfigDict(frozen=True)

    name: str
    fired: bool
    value: float
    threshold: float
    detail: str


_WORD_RUN = re.compile(r"\b(\w+)(?:\W+\1\b){3}", re.IGNORECASE)


def repetitive(text: str) -> bool:
    """A 3-word n-gram three times or more, or one word four times in a row."""
    if _WORD_RUN.search(text):
        return True
    words = re.findall(r"\w+", text.lower())
    counts: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - 2):
        gram = tuple(words[i : i + 3])
        counts[gram] = counts.get(gram, 0) + 1
        if counts[gram] >= 3:
            return True
    return False


_NUMBER = re.compile(r"\d")


def non_answer(text: str, pattern: re.Pattern[str], answers: Sequence[str] = ()) -> bool:
    """Whether `text` does not try to answer: it matches `pattern`, or every known answer of its prompt
    (`answers`, empty when none is known) is a number and the text has no digit."""
    text = text.strip()
    if pattern.search(text) is not None:
        return True
    numeric = bool(answers) and all(
        str(a).strip().lstrip("+-").replace(".", "", 1).isdigit() for a in answers
    )
    return numeric and _NUMBER.search(text) is None


def behaviour(
    generations: Sequence[Generation],
    no_action_pattern: str,
    answers: Sequence[Sequence[str]] | None = None,
    sampled: Sequence[bool] | None = None,
) -> Behaviour:
    """Length, entropy estimate, repetition, non-answers and truncation over `generations`;
    `answers[i]` are the known answers to generation i's prompt (`non_answer`). The entropy estimate
    reads only the generations `sampled` marks (default: all): a greedy token is the argmax, and the
    mean −log p of argmaxes falls faster than the entropy as a model sharpens (docs/gate.md, Alarms);
    with none sampled it is 0, and the entropy alarm cannot fire."""
    pattern = re.compile(no_action_pattern)
    n = len(generations)
    if answers is not None and len(answers) != n:
        raise ValueError(f"{n} generations but {len(answers)} answer lists")
    known = answers if answers is not None else [()] * n
    if n == 0:
        return Behaviour(
            completions=0, mean_tokens=0.0, entropy=0.0, repetition=0.0, no_action=0.0, truncated=0.0
        )
    drawn = sampled if sampled is not None else [True] * n
    tokens = [
        lp for g, s in zip(generations, drawn, strict=True) if s for lp in g.logprobs if math.isfinite(lp)
    ]
    return Behaviour(
        completions=n,
        mean_tokens=sum(len(g.logprobs) for g in generations) / n,
        entropy=-sum(tokens) / len(tokens) if tokens else 0.0,
        repetition=sum(repetitive(g.text) for g in generations) / n,
        no_action=sum(non_answer(g.text, pattern, a) for g, a in zip(generations, known, strict=True)) / n,
        truncated=sum(g.finish_reason == "length" for g in generations) / n,
    )


def generation_alarms(challenger: Behaviour, champion: Behaviour, cfg: AlarmSettings) -> list[Alarm]:
    """length, entropy, repetition, truncation and no_action, challenger against champion."""
    length_limit = cfg.length_ratio * champion.mean_tokens + 2.0
    entropy_floor = cfg.entropy_ratio * champion.entropy
    return [
        Alarm(
            name="length",
            fired=challenger.mean_tokens > length_limit,
            value=challenger.mean_tokens,
            threshold=length_limit,
            detail=f"mean completion tokens {challenger.mean_tokens:.1f} vs champion {champion.mean_tokens:.1f}",
        ),
        Alarm(
            name="entropy",
            fired=challenger.entropy < entropy_floor,
            value=challenger.entropy,
            threshold=entropy_floor,
            detail=f"entropy {challenger.entropy:.3f} vs champion {champion.entropy:.3f} nats/token",
        ),
        _rise(
            "repetition",
            challenger.repetition,
            champion.repetition,
            cfg.repetition_rate,
            f"repetitive completions {challenger.repetition:.1%} vs champion {champion.repetition:.1%}",
        ),
        _rise(
            "truncation",
            challenger.truncated,
            champion.truncated,
            cfg.truncation_rate,
            f"cut off by max_tokens {challenger.truncated:.1%} vs champion {champion.truncated:.1%}",
        ),
        _rise(
            "no_action",
            challenger.no_action,
            champion.no_action,
            cfg.no_action_rate,
            f"non-answers {challenger.no_action:.1%} vs champion {champion.no_action:.1%}",
        ),
    ]


def no_action_anchor_alarm(
    challenger: Behaviour, anchor: Behaviour, anchor_version: int, cfg: AlarmSettings
) -> Alarm:
    """no_action against the anchor, on the anchored suites' generations of both."""
    return _rise(
        "no_action_anchor",
        challenger.no_action,
        anchor.no_action,
        cfg.no_action_rate,
        f"non-answers {challenger.no_action:.1%} vs anchor v{anchor_version} {anchor.no_action:.1%}",
    )


def kl_budget(cfg: AlarmSettings, max_kl: float | None) -> tuple[float, str]:
    """The `kl` alarm's budget (nats/token) and why: ``kl_budget`` when set, else ``kl_budget_factor``
    x the trainer's trust region ``max_kl``, else 1.0 (schemas/settings/gate.py)."""
    if cfg.kl_budget is not None:
        return cfg.kl_budget, "gate.alarms.kl_budget"
    if max_kl is not None:
        return cfg.kl_budget_factor * max_kl, f"{cfg.kl_budget_factor:g} x trainer.max_kl {max_kl:g}"
    return KL_BUDGET_WITHOUT_TRUST_REGION, f"{KL_BUDGET_WITHOUT_TRUST_REGION:g} (trainer.max_kl is not set)"


def kl_alarm(kl_per_token: float, cfg: AlarmSettings, max_kl: float | None) -> Alarm:
    """KL(champion || challenger) per token above the budget (`kl_budget`), which the detail names."""
    budget, why = kl_budget(cfg, max_kl)
    fired = not math.isfinite(kl_per_token) or kl_per_token > budget
    return Alarm(
        name="kl",
        fired=fired,
        value=kl_per_token,
        threshold=budget,
        detail=f"KL(champion || challenger) {kl_per_token:.3f} nats/token on held-out traffic; "
        f"budget {budget:g} = {why}",
    )


def no_feedback_alarm(challenger: float, champion: float, cfg: AlarmSettings) -> Alarm:
    return _rise(
        "no_feedback",
        challenger,
        champion,
        cfg.no_action_rate,
        f"estimated episodes without feedback {challenger:.1%} vs champion {champion:.1%}",
    )


def _rise(name: str, challenger: float, baseline: float, rate: float, detail: str) -> Alarm:
    """The alarm on a share that fires when the challenger's is up by more than `rate` on the
    baseline's (the champion's, or the anchor's)."""
    rise = challenger - baseline
    return Alarm(name=name, fired=rise > rate, value=rise, threshold=rate, detail=detail)
