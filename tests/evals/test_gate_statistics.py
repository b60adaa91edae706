"""The eval gate's statistics, suites and alarms without any service: bootstrap intervals, the
off-policy estimator against exact values, suite files, scorers and behaviour alarms."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from deployer.alarms import (
    behaviour,
    generation_alarms,
    kl_alarm,
    no_action_anchor_alarm,
    non_answer,
    repetitive,
)
from evals import get_task
from evals.stats import effective_sample_size, importance_weights, off_policy, paired_interval
from evals.suites import SuiteError, load_offline, retention_suite
from schemas.settings import AlarmSettings, OfflineSuiteSettings
from serving import Generation

pytestmark = pytest.mark.unit


def test_paired_interval_of_identical_scores_is_exactly_zero() -> None:
    interval = paired_interval([1.0, 0.0, 0.5], [1.0, 0.0, 0.5], confidence=0.95, resamples=500, seed=1)
    assert (interval.estimate, interval.low, interval.high, interval.n) == (0.0, 0.0, 0.0, 3)


def test_paired_interval_covers_a_shift_and_is_seeded() -> None:
    rng = np.random.default_rng(0)
    champion = rng.random(200)
    challenger = champion - 0.1 + rng.normal(0, 0.05, 200)
    first = paired_interval(list(challenger), list(champion), confidence=0.95, resamples=1000, seed=7)
    again = paired_interval(list(challenger), list(champion), confidence=0.95, resamples=1000, seed=7)
    assert first == again
    assert first.low < -0.1 < first.high and first.high < 0
    with pytest.raises(ValueError):
        paired_interval([1.0], [1.0, 2.0], confidence=0.95, resamples=100, seed=0)


def bandit(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Logged traffic of a contextual bandit: 20 contexts x 4 actions, action (context mod 4) earns
    +1 and the others -1; behaviour is a random softmax policy. Returns (probs μ, rewards table,
    contexts, actions)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1, (20, 4))
    mu = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    table = -np.ones((20, 4))
    table[np.arange(20), np.arange(20) % 4] = 1.0
    contexts = rng.integers(0, 20, n)
    actions = np.array([rng.choice(4, p=mu[c]) for c in contexts])
    return mu, table, contexts, actions


def policy(mass_on_best: float) -> np.ndarray:
    """A policy putting `mass_on_best` on each context's rewarded action, the rest spread evenly."""
    p = np.full((20, 4), (1 - mass_on_best) / 3)
    p[np.arange(20), np.arange(20) % 4] = mass_on_best
    return p


def test_off_policy_ranks_a_better_and_a_worse_challenger_and_recovers_their_values() -> None:
    mu, table, contexts, actions = bandit(seed=3, n=3000)
    rewards = table[contexts, actions]
    behaviour = np.log(mu[contexts, actions])
    champion = policy(0.4)
    true = {
        name: float((p * table).sum(1).mean())
        for name, p in (("better", policy(0.8)), ("worse", policy(0.1)), ("champion", champion))
    }
    for name, sign in (("better", 1), ("worse", -1)):
        target = policy(0.8) if name == "better" else policy(0.1)
        estimate = off_policy(
            list(rewards),
            list(behaviour),
            list(np.log(target[contexts, actions])),
            list(np.log(champion[contexts, actions])),
            clip=20.0,
            confidence=0.95,
            resamples=1000,
            seed=0,
        )
        diff = estimate.difference
        print(name, estimate.model_dump_json())
        if sign > 0:
            assert diff.low > 0  # clearly better: the whole interval above 0
        else:
            assert diff.high < 0  # clearly worse: the whole interval below 0
        assert abs(estimate.challenger - true[name]) < 0.1
        assert abs(estimate.champion - true["champion"]) < 0.1
        # (The interval need not cover the true difference: clipping biases both estimates a little.)
        assert estimate.ess_challenger > 300 and estimate.ess_champion > 300
    same = off_policy(
        list(rewards),
        list(behaviour),
        list(np.log(champion[contexts, actions])),
        list(np.log(champion[contexts, actions])),
        clip=20.0,
        confidence=0.95,
        resamples=500,
        seed=0,
    )
    assert same.difference.estimate == same.difference.low == same.difference.high == 0.0


def test_importance_weights_clip_and_impossible_sequences() -> None:
    w = importance_weights([0.0, 10.0, -math.inf], [0.0, 0.0, 0.0], clip=5.0)
    assert list(w) == pytest.approx([1.0, 5.0, 0.0])
    assert effective_sample_size(np.ones(10)) == pytest.approx(10)
    assert effective_sample_size(np.array([1.0, 0.0, 0.0])) == pytest.approx(1)


# ---- suites -------------------------------------------------------------------------------------


def test_retention_suite_scores_the_answer_in_any_shape() -> None:
    suite = retention_suite(get_task("exclaim"), 48)
    assert len(suite.prompts) == 48
    index = next(i for i, p in enumerate(suite.prompts) if " plus " in p)
    answer = suite.lines[index]["answers"][0]
    assert suite.score(index, f" The answer is {answer}!") == 1.0
    assert suite.score(index, f" {answer}.") == 1.0
    assert suite.score(index, f" {answer}1.") == 0.0  # a whole word, not a prefix
    assert suite.score(index, " I do not know?") == 0.0


def write(tmp_path: Path, text: str, name: str = "suite.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_offline_suite_scorers(tmp_path: Path) -> None:
    path = write(
        tmp_path, '{"prompt": "2+2=", "answers": ["4"]}\n\n{"prompt": "Red?", "answers": ["Red", 5]}\n'
    )
    exact = load_offline(OfflineSuiteSettings(name="math", path=path, scorer="exact"))
    assert [exact.score(0, " 4 "), exact.score(0, "4!"), exact.score(1, "5")] == [1.0, 0.0, 1.0]
    contains = load_offline(OfflineSuiteSettings(name="math", path=path))
    assert [contains.score(0, "it is 4!"), contains.score(1, "red it is"), contains.score(0, "44")] == [
        1.0,
        1.0,
        0.0,
    ]
    regex = load_offline(
        OfflineSuiteSettings(
            name="dates",
            path=write(tmp_path, '{"prompt": "d:", "pattern": "^\\\\d{4}"}', "dates.jsonl"),
            scorer="regex",
        )
    )
    assert [regex.score(0, "2026-12-01"), regex.score(0, "soon")] == [1.0, 0.0]
    function = load_offline(
        OfflineSuiteSettings(name="f", path=path, scorer="function", function="evals.suites:contains_answer")
    )
    assert function.score(0, "4") == 1.0


@pytest.mark.parametrize(
    ("text", "scorer", "message"),
    [
        ("{not json", "contains", "suite.jsonl:1: not JSON"),
        (
            '{"prompt": "a", "answers": ["x"]}\n{"answers": ["x"]}',
            "contains",
            'suite.jsonl:2: each line is an object with a non-empty string "prompt"',
        ),
        ('{"prompt": "a"}', "exact", 'needs a non-empty list "answers"'),
        ('{"prompt": "a", "pattern": "("}', "regex", '"pattern" is not a regular expression'),
        ("\n\n", "contains", "has no prompts"),
    ],
)
def test_offline_suite_errors_name_the_file_and_line(
    tmp_path: Path, text: str, scorer: str, message: str
) -> None:
    with pytest.raises(SuiteError, match=message.replace("(", r"\(").replace('"', '"')):
        load_offline(OfflineSuiteSettings(name="s", path=write(tmp_path, text), scorer=scorer))  # type: ignore[arg-type]


def test_offline_suite_missing_file_and_bad_function(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match="cannot read"):
        load_offline(OfflineSuiteSettings(name="s", path=tmp_path / "missing.jsonl"))
    path = write(tmp_path, '{"prompt": "a", "answers": ["x"]}')
    with pytest.raises(SuiteError, match="cannot be loaded"):
        load_offline(
            OfflineSuiteSettings(name="s", path=path, scorer="function", function="evals.suites:nope")
        )
    with pytest.raises(SuiteError, match="needs `function`"):
        load_offline(OfflineSuiteSettings(name="s", path=path, scorer="function"))
    broken = load_offline(
        OfflineSuiteSettings(name="s", path=path, scorer="function", function="builtins:max")
    )
    with pytest.raises(SuiteError, match="failed on line 1"):
        broken.score(0, "b")


# ---- alarms -------------------------------------------------------------------------------------


def gen(text: str, logprob: float = -1.0, tokens: int = 4, finish: str = "stop") -> Generation:
    return Generation(text=text, logprobs=(logprob,) * tokens, finish_reason=finish)


def fired(challenger: list[Generation], champion: list[Generation]) -> set[str]:
    cfg = AlarmSettings()
    alarms = generation_alarms(
        behaviour(challenger, cfg.no_action_pattern), behaviour(champion, cfg.no_action_pattern), cfg
    )
    return {a.name for a in alarms if a.fired}


def test_alarms_are_quiet_for_the_same_behaviour_and_name_each_hack() -> None:
    champion = [gen(" 7!"), gen(" It is red."), gen(" The answer is 4.")] * 4
    assert fired(champion, champion) == set()
    assert fired([gen(" Which one do you mean?")] * 12, champion) == {"no_action"}
    assert fired([gen(" ...", tokens=4)] * 12, champion) == {"no_action"}
    assert fired([gen(" 7 7 7 7 7", tokens=10)] * 12, champion) == {"repetition"}
    assert fired([gen(" 7!", logprob=-0.01)] * 12, champion) == {"entropy"}
    assert fired([gen(" The answer is 7, and " * 1, tokens=40, finish="length")] * 12, champion) == {
        "length",
        "truncation",
    }
    assert fired([gen(" Let me think about", tokens=5, finish="length")] * 12, champion) == {"truncation"}
    assert repetitive("the cat sat the cat sat the cat sat") and not repetitive("It is 7!")


def test_an_answer_of_the_wrong_kind_is_a_non_answer_and_the_anchor_sees_the_ratchet() -> None:
    """To a question whose known answers are numbers, "It is red." does not answer (the --hack run's
    users said nothing to such answers and the default pattern did not see them); and steps under the
    threshold against each champion add up against the anchor."""
    cfg = AlarmSettings()
    pattern = re.compile(cfg.no_action_pattern)
    assert non_answer(" It is red.", pattern, ["7"]) and non_answer(" Seven?", pattern, ["7"])
    assert not non_answer(" It is 8.", pattern, ["7"])  # wrong, but an answer
    assert not non_answer(" It is red.", pattern, ["red", "blue"]) and not non_answer(
        " It is red.", pattern, ()
    )
    assert non_answer(" ...", pattern, ())
    numeric = [["7"], ["12"], ["3"], ["0"]] * 5
    anchor = behaviour([gen(" 7!")] * 20, cfg.no_action_pattern, numeric)
    step1 = behaviour([gen(" It is red.")] * 2 + [gen(" 7!")] * 18, cfg.no_action_pattern, numeric)
    step2 = behaviour([gen(" It is red.")] * 4 + [gen(" 7!")] * 16, cfg.no_action_pattern, numeric)
    assert (anchor.no_action, step1.no_action, step2.no_action) == (0.0, 0.1, 0.2)
    assert "no_action" not in {a.name for a in generation_alarms(step2, step1, cfg) if a.fired}
    alarm = no_action_anchor_alarm(step2, anchor, 1, cfg)
    assert alarm.fired and alarm.detail == "non-answers 20.0% vs anchor v1 0.0%"
    assert not no_action_anchor_alarm(step1, anchor, 1, cfg).fired
    with pytest.raises(ValueError, match="answer lists"):
        behaviour([gen(" 7!")], cfg.no_action_pattern, [])


def test_kl_alarm() -> None:
    cfg = AlarmSettings(kl_budget=0.5)
    assert not kl_alarm(0.1, cfg, 0.1).fired  # an explicit budget wins over the trust region's
    assert kl_alarm(0.6, cfg, 1.0).fired
    assert kl_alarm(math.inf, cfg, None).fired and kl_alarm(math.nan, cfg, None).fired


def test_the_gates_prompt_suites_score_every_prompt() -> None:
    from deployer.gate_suites import prompt_suites
    from schemas.settings import Settings

    settings = Settings()
    settings = settings.model_copy(
        update={"gate": settings.gate.model_copy(update={"suites": ("oracle", "retention", "ope")})}
    )
    suites = {suite.name: suite for suite, _ in prompt_suites(settings)}
    assert set(suites) == {"oracle", "retention", "retention_sampled"}  # ope is not a prompt suite
    retention = suites["retention"]  # a census by default: every held-out question, greedy
    assert retention.census and retention.greedy and len(retention.prompts) == 75
    assert set(suites["oracle"].prompts) < set(retention.prompts)  # the oracle's 48 drawn among them
    oracle = suites["oracle"]
    assert all(oracle.score(i, " 7!") > oracle.score(i, " 7.") for i in range(len(oracle.prompts)))


def test_the_challengers_weight_survives_a_token_leaving_its_nucleus() -> None:
    """Under top-k the challenger's processed logprob of an episode is −inf as soon as one logged
    token left its nucleus: its exact weight is 0 for the challenger only. The gate tilts the
    champion's nucleus by the challenger's tempered change instead (deployer/ope.py)."""
    from deployer.ope import Scored, challenger_logprobs

    champion = Scored(processed=[-2.0, -3.0, -math.inf], tempered=[-2.5, -3.5, -9.0])
    challenger = Scored(processed=[-2.0, -math.inf, -1.0], tempered=[-2.5, -3.9, -8.0])
    got = challenger_logprobs(challenger, champion)
    assert got[0] == -2.0  # unchanged policy: the champion's own
    assert got[1] == pytest.approx(-3.0 + (-3.9 + 3.5))  # finite: moved 0.4 nats away
    assert got[2] == -math.inf  # the champion cannot produce it either: left out for both
    untruncated = Scored(processed=[-2.5, -3.5], tempered=[-2.5, -3.5])
    moved = Scored(processed=[-2.0, -4.0], tempered=[-2.0, -4.0])
    assert challenger_logprobs(moved, untruncated) == pytest.approx(
        moved.processed
    )  # exact without truncation


def test_the_off_policy_estimate_reports_what_clipping_moved() -> None:
    """Without a clipped weight the unclipped difference is the estimate itself; with one it is the
    self-normalised estimate of the raw weights, computed without overflow for any log-ratio."""
    rewards = [1.0, 0.0, 1.0, 0.0]
    behaviour = [-2.0, -2.0, -2.0, -2.0]
    champion = [-2.0, -2.0, -2.0, -2.0]
    near = off_policy(
        rewards,
        behaviour,
        [-1.5, -2.5, -2.0, -2.0],
        champion,
        clip=20.0,
        confidence=0.95,
        resamples=200,
        seed=0,
    )
    assert near.clipped_challenger == 0.0
    assert near.unclipped_difference == pytest.approx(near.difference.estimate)
    far = off_policy(
        rewards,
        behaviour,
        [1000.0, -2.0, -2.0, -2.0],
        champion,
        clip=5.0,
        confidence=0.95,
        resamples=200,
        seed=0,
    )
    assert far.clipped_challenger == 0.25
    # Raw weights: e^1002 on a rewarded episode and 1 on the rest: the raw estimate is 1 - 0.5.
    assert far.unclipped_difference == pytest.approx(0.5)
    assert far.difference.estimate == pytest.approx((5 + 1) / 8 - 0.5)
