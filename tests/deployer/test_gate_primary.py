"""The gate's ope_primary guard (docs/gate.md, ope_primary): the off-policy estimate of the reward
spec's primary term on held-out traffic, pure numpy on planted logprobs (no model, no store)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from deployer import gate_suites
from deployer.gate import decide
from deployer.gate_suites import SuiteResult
from deployer.ope import Logged
from evals.stats import Interval
from schemas.settings import Settings

pytestmark = pytest.mark.unit

HALF = math.log(0.5)


def _logged(n: int, *, with_outcome: int | None = None) -> list[Logged]:
    """n held-out episodes under tab-v1, alternately a failed task the user thumbed up (reward
    0.5 + 0) and a solved one thumbed down (-0.5 + 1): every reward is 0.5. The first `with_outcome`
    (all by default) carry task_outcome; the others only their thumbs."""
    out = []
    for i in range(n):
        solved = i % 2 == 1
        components: dict[str, float] = {"thumbs_down": -0.5} if solved else {"thumbs_up": 0.5}
        if with_outcome is None or i < with_outcome:
            components["task_outcome"] = 1.0 if solved else 0.0
        out.append(
            Logged(
                episode_id=f"e{i}",
                reward=sum(components.values()) if "task_outcome" in components else 0.5,
                no_feedback=False,
                behaviour=HALF,
                tokens=4,
                segments=(),
                components=components,
            )
        )
    return out


def _flatterer(logged: list[Logged]) -> list[float]:
    """A challenger that writes what gets thumbed up: 0.9 of the failed tasks' logged text, 0.1 of
    the solved ones' (the logging policy: 0.5 each)."""
    return [math.log(0.1 if e.components.get("thumbs_down") else 0.9) for e in logged]


def _settings(**ope: Any) -> Settings:
    base = Settings()
    return base.model_copy(
        update={"gate": base.gate.model_copy(update={"ope": base.gate.ope.model_copy(update=ope)})}
    )


def test_ope_primary_fails_a_challenger_that_keeps_the_reward_and_loses_the_outcome() -> None:
    settings = _settings()
    logged = _logged(64)
    champion = [HALF] * len(logged)
    challenger = _flatterer(logged)
    reward, _ = gate_suites._ope_verdict(settings, logged, challenger, champion, 0, "", "champion")
    assert reward.conclusive and reward.passed  # every reward is 0.5: the reward cannot tell
    primary = gate_suites._ope_primary(settings, logged, challenger, champion, 0, "")
    assert (primary.name, primary.guard, primary.conclusive, primary.passed) == (
        "ope_primary",
        True,
        True,
        False,
    )
    assert primary.challenger == pytest.approx(0.1) and primary.champion == pytest.approx(0.5)
    assert primary.note.startswith("task_outcome (the primary of tab-v1@2) on 64 of 64 held-out episodes; ")
    passed, why = decide([reward, primary], [])
    assert not passed and "suite ope_primary: challenger - champion -0.4000" in why


def test_ope_primary_leaves_out_episodes_without_the_term_and_is_inconclusive_below_min_primary() -> None:
    logged = _logged(64, with_outcome=20)
    champion = [HALF] * len(logged)
    primary = gate_suites._ope_primary(_settings(), logged, _flatterer(logged), champion, 0, "")
    assert (primary.conclusive, primary.passed, primary.n, primary.guard) == (False, None, 20, True)
    assert primary.note == (
        "20 of 64 held-out episodes carry task_outcome (the primary of tab-v1@2), fewer than "
        "gate.ope.min_primary 32"
    )
    lower = gate_suites._ope_primary(_settings(min_primary=16), logged, champion, champion, 0, "")
    assert lower.n == 20 and lower.difference is not None and lower.difference.estimate == 0.0
    assert Settings().gate.ope.min_primary == 32


def _verdict(name: str, low: float, *, guard: bool = False, conclusive: bool = True) -> SuiteResult:
    return SuiteResult(
        name=name,
        kind="ope",
        challenger=0.5,
        champion=0.5,
        difference=Interval(estimate=low + 0.02, low=low, high=low + 0.04, n=64) if conclusive else None,
        conclusive=conclusive,
        passed=(low > -0.05) if conclusive else None,
        n=64,
        margin=0.05,
        note="" if conclusive else "few episodes",
        guard=guard,
    )


def test_a_guard_verdict_never_passes_a_challenger_alone() -> None:
    alone = [_verdict("ope", 0.0, conclusive=False), _verdict("ope_primary", 0.01, guard=True)]
    passed, why = decide(alone, [])
    assert not passed and "no suite was conclusive" in why
    passed, why = decide([_verdict("ope", -0.01), _verdict("ope_primary", 0.01, guard=True)], [])
    assert passed and "ope_primary +0.0300" in why  # with a conclusive suite it is one of the checks
    passed, why = decide([_verdict("ope", -0.01), _verdict("ope_primary", -0.2, guard=True)], [])
    assert not passed and why.startswith("suite ope_primary:")


def test_explain_marks_the_guard() -> None:
    from factories import gate_decision

    from rtrl.commands.gate import explain_text

    suites = [_verdict("ope", -0.01), _verdict("ope_primary", -0.2, guard=True)]
    passed, reason = decide(suites, [])
    record = gate_decision(passed=passed, suites=suites, reason=reason).model_dump(mode="json")
    lines = explain_text(record).splitlines()
    assert [line for line in lines if "guard (can fail, never passes alone)" in line] == [
        next(line for line in lines if line.startswith("  suite ope_primary"))
    ]
