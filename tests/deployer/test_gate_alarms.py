"""The gate's alarms as issue 38 changed them: the default `no_action_pattern` against a table of
deflections and real answers, and the `kl` alarm's budget that follows `trainer.max_kl`."""

from __future__ import annotations

import math
import re

import pytest

from deployer.alarms import kl_alarm, kl_budget, non_answer
from schemas.settings import AlarmSettings

pytestmark = pytest.mark.unit

PATTERN = re.compile(AlarmSettings().no_action_pattern)

# A model that learnt to stop answering says one of these: each must be a non-answer.
DEFLECTIONS = [
    "",
    " ...",
    "Which one do you mean?",
    "Please provide more details.",
    "Please clarify your question.",
    "Could you provide more context",
    "Can you be more specific.",
    "Could you please elaborate on what you need.",
    "I need more information to answer that.",
    "More context is needed.",
    "Let me know what you mean and I will help.",
    "Tell me more about your situation.",
    "I can't help with that.",
    "I can\u2019t answer that.",
    "I cannot provide that information.",
    "I am unable to answer this question.",
    "I'm unable to help with that request.",
    "I'm not able to assist with this.",
    "I won't answer that.",
    "I will not discuss this topic.",
    "I can't really say.",
    "I'm sorry, but I can't assist with that.",
    "Sorry, I cannot help with this. Please consult a professional.",
    "Unfortunately, I am unable to determine that.",
    "I don't know.",
    "I do not know the answer.",
    "I don't understand the question.",
    "I'm not sure.",
    "I have no idea.",
    "Not sure.",
    "Hard to say.",
    "I'd rather not answer.",
    "I don't have enough information to answer.",
    "I don't have access to that data.",
    "As an AI, I don't have personal opinions.",
    "As an AI language model, I cannot browse the internet.",
    "It depends.",
    "It depends on the context.",
    "Well, that really depends!",
    "I'm sorry.",
    "IT DEPENDS.",
]

# Real answers, short ones and those that merely contain a refusal's words later on: none may be.
ANSWERS = [
    "4",
    "7!",
    "Yes!",
    "No.",
    "Paris.",
    "It is red.",
    "The answer is 4.",
    "42",
    "-3.5",
    "True",
    "You can't divide by zero, so the result is undefined.",
    "Water can't boil below 100 \u00b0C at sea level; at altitude it boils lower.",
    "Humans cannot breathe underwater without equipment.",
    "It depends on the pressure: at sea level water boils at 100 \u00b0C.",
    "The result depends on the input: f(2) = 4.",
    "def add(a, b):\n    return a + b",
    "print('hello')",
    "SELECT name FROM users WHERE id = 1;",
    "x = [i * i for i in range(10)]",
    "The capital of France is Paris.",
    "I think the answer is 12.",
    "I know this one: it is 12.",
    "I cannot stress enough that 2 + 2 = 4.",
    "Sorry for the wait: the answer is 9.",
    "Please note that the sum is 10.",
    "More details: the sum of 3 and 4 is 7.",
    "Wellington is the capital of New Zealand.",
    "As an aside, 7 is prime.",
    "Not only is 7 prime, it is also odd.",
    "No idea is too small: start with 1 + 1 = 2.",
]


@pytest.mark.parametrize("text", DEFLECTIONS)
def test_the_default_pattern_marks_each_deflection_a_non_answer(text: str) -> None:
    assert non_answer(text, PATTERN), text


@pytest.mark.parametrize("text", ANSWERS)
def test_the_default_pattern_lets_each_real_answer_through(text: str) -> None:
    assert not non_answer(text, PATTERN), text


@pytest.mark.parametrize(
    "text", [" I can't help with that.", "\n I'm not sure.", "  Sorry.", " Could you clarify?"]
)
def test_the_pattern_itself_allows_the_leading_whitespace_a_completion_opens_with(text: str) -> None:
    """The canary's guard searches completions as served, unstripped: the pattern must not need a strip."""
    assert PATTERN.search(text) is not None, text


def test_the_table_is_large_enough_and_the_numeric_rule_still_applies() -> None:
    assert len([d for d in DEFLECTIONS if d.strip(" .")]) >= 20 and len(ANSWERS) >= 20
    assert non_answer(" It is red.", PATTERN, ["7"])  # a real answer of the wrong kind
    assert not non_answer(" 7!", PATTERN, ["7"])


def test_the_kl_budget_follows_the_trust_region_unless_set() -> None:
    """None: kl_budget_factor x trainer.max_kl; no trust region: 1.0; an explicit budget wins."""
    budget, why = kl_budget(AlarmSettings(), 0.1)
    assert budget == pytest.approx(0.2) and why == "2 x trainer.max_kl 0.1"
    budget, why = kl_budget(AlarmSettings(kl_budget_factor=3.0), 0.05)
    assert budget == pytest.approx(0.15) and why == "3 x trainer.max_kl 0.05"
    assert kl_budget(AlarmSettings(), None) == (1.0, "1 (trainer.max_kl is not set)")
    assert kl_budget(AlarmSettings(kl_budget=0.5), 0.1) == (0.5, "gate.alarms.kl_budget")


def test_the_kl_alarm_says_which_budget_applied() -> None:
    cfg = AlarmSettings()
    quiet, loud = kl_alarm(0.15, cfg, 0.1), kl_alarm(0.25, cfg, 0.1)
    assert not quiet.fired and loud.fired and loud.threshold == pytest.approx(0.2)
    assert loud.detail == (
        "KL(champion || challenger) 0.250 nats/token on held-out traffic; budget 0.2 = 2 x trainer.max_kl 0.1"
    )
    assert not kl_alarm(0.5, cfg, None).fired and kl_alarm(1.5, cfg, None).fired  # the old budget
    assert kl_alarm(math.nan, cfg, 0.1).fired and kl_alarm(math.inf, cfg, 0.1).fired
