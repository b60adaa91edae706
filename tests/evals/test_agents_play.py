"""The agents of evals/agents.py played against a scripted model (a function of the prompt), and the
gate's episode scoring (deployer/episodes.py) on such episodes. No server: the episode suite on the
staging vLLM server is tests/deployer/test_gate_episodes.py."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import pytest

from deployer.episodes import EpisodeSuite, Played, Step, score_episodes, verifiable
from evals.agents import CHUNKS, PARL_NARROW, PARL_WIDE, SCENARIOS, ScenarioError, episode_rng, play
from evals.tasks import EXCLAIM, Question
from schemas.events import Role
from schemas.settings import EpisodeSuiteSettings, GateSettings, JudgeSettings, Settings
from schemas.settings.gate import NO_ACTION_PATTERN

pytestmark = pytest.mark.unit

QUESTION = EXCLAIM.format_prompt("What is 3 plus 4?")


@dataclass
class Script:
    """A model that answers by rule, recording every call as (segment, role, agent, prompt)."""

    answer: str = " 7!"
    prune: str = " 2"
    summary: str = " short"
    finish: str = "stop"  # the answers' finish reason

    def __post_init__(self) -> None:
        self.calls: list[tuple[int, Role, str | None, str]] = []
        self.lock = threading.Lock()

    def __call__(self, prompt: str, segment: int, role: Role, agent: str | None) -> Step:
        with self.lock:
            self.calls.append((segment, role, agent, prompt))
        if prompt.endswith("Prune:"):
            return Step(prompt, self.prune, "stop")
        if role == Role.summary:
            return Step(prompt, self.summary, "stop")
        return Step(prompt, self.answer, self.finish)


def test_self_edit_answers_prunes_and_answers_again_judged_on_the_unpruned_trajectory() -> None:
    model = Script(prune=" drop 2")
    played = play("self-edit", model, EXCLAIM, QUESTION, episode_rng("self-edit", 1, 0), lambda p, c: True)
    assert [(s, r) for s, r, _, _ in model.calls] == [(0, Role.policy), (1, Role.policy), (2, Role.policy)]
    first, prune, final = (prompt for _, _, _, prompt in model.calls)
    assert first.count("\n[") == CHUNKS - 1 and first.endswith(QUESTION)
    assert prune == f"{first} 7!\nPrune:"
    assert "[2]" not in final and final.count("[") == CHUNKS - 1 and final.endswith(QUESTION)
    assert played.prunes == 1 and played.calls == 3 and played.final.prompt == final
    assert played.judged_prompt.startswith(prune) and "[2]" in played.judged_prompt  # nothing pruned


def test_the_same_seed_gives_the_same_environment_to_both_models() -> None:
    a, b = Script(answer=" 7!"), Script(answer=" 8.")
    play("self-edit", a, EXCLAIM, QUESTION, episode_rng("self-edit", 5, 3), lambda p, c: True)
    play("self-edit", b, EXCLAIM, QUESTION, episode_rng("self-edit", 5, 3), lambda p, c: True)
    assert a.calls[0][3] == b.calls[0][3]  # the same chunks
    c = Script()
    play("self-edit", c, EXCLAIM, QUESTION, episode_rng("self-edit", 6, 3), lambda p, c: True)
    assert c.calls[0][3] != a.calls[0][3]


@pytest.mark.parametrize(("first_accepted", "spawned"), [(True, PARL_WIDE), (False, PARL_NARROW)])
def test_parl_spawns_sub_agents_by_the_environments_verdict(first_accepted: bool, spawned: int) -> None:
    model = Script()
    played = play("parl", model, EXCLAIM, QUESTION, random.Random(0), lambda p, c: first_accepted)
    agents = {agent for _, role, agent, _ in model.calls if role == Role.subagent}
    assert played.subagents == spawned and len(agents) == spawned
    segments = sorted(s for s, _, _, _ in model.calls)
    assert segments == list(range(len(segments))) and played.calls == len(segments)
    assert played.final.prompt.startswith(QUESTION) and played.final.prompt.endswith(QUESTION)


def test_summarize_summarizes_a_long_context_at_most_twice() -> None:
    model = Script(answer=" a long answer that passes the trigger")
    played = play("summarize", model, EXCLAIM, QUESTION, random.Random(0), lambda p, c: True, 40)
    assert played.summaries == 2 and played.calls == 5
    assert [r for _, r, _, _ in model.calls] == [Role.policy, Role.summary] * 2 + [Role.policy]
    assert played.final.prompt == f"Summary:short\n{QUESTION}" == played.judged_prompt


def test_an_unknown_scenario_is_named_with_the_known_ones() -> None:
    with pytest.raises(ScenarioError, match="known scenarios: parl, summarize, self-edit"):
        play("chat", Script(), EXCLAIM, QUESTION, random.Random(0), lambda p, c: True)
    assert SCENARIOS == ("parl", "summarize", "self-edit")


# ---- the gate's score of an episode ---------------------------------------------------------------

SEVEN = Question("What is 3 plus 4?", ("7",))


def _episode(text: str, finish: str = "stop") -> Played:
    return play(
        "self-edit",
        Script(answer=text, finish=finish),
        EXCLAIM,
        QUESTION,
        random.Random(0),
        lambda p, c: True,
    )


@pytest.mark.parametrize(
    ("text", "finish", "score"),
    [
        (" It is 7!", "stop", 1.0),  # answered, right
        (" It is 8.", "stop", 0.5),  # answered, wrong
        (" I don't know.", "stop", 0.0),  # a non-answer
        (" Which one?", "stop", 0.0),
        (" It is", "stop", 0.0),  # no digit where the answer is a number
        (" It is 7 and then more and more", "length", 0.0),  # cut off, right or not
    ],
)
def test_verifiable_scores_format_then_accuracy(text: str, finish: str, score: float) -> None:
    assert verifiable(NO_ACTION_PATTERN)(_episode(text, finish), SEVEN) == score


def test_an_episode_whose_prune_was_cut_off_scores_zero_whatever_its_answer() -> None:
    model = Script(answer=" It is 7!", prune=" Let me think about which chunks to drop, one by one")
    rambling = play(
        "self-edit",
        lambda p, s, r, a: _cut_prune(model(p, s, r, a)),
        EXCLAIM,
        QUESTION,
        random.Random(0),
        lambda p, c: True,
    )
    assert [turn.finish_reason for _, _, turn in rambling.turns] == ["stop", "length", "stop"]
    assert verifiable(NO_ACTION_PATTERN)(rambling, SEVEN) == 0.0


def _cut_prune(step: Step) -> Step:
    return Step(step.prompt, step.text, "length") if step.prompt.endswith("Prune:") else step


def test_the_verdict_pairs_episodes_per_question_and_says_what_it_played() -> None:
    settings = Settings(gate=GateSettings(suites=("episodes",), bootstrap_resamples=200))
    questions = tuple(Question(f"What is {a} plus 4?", (str(a + 4),)) for a in range(8))
    suite = EpisodeSuite("self-edit", EXCLAIM, questions, samples=2)
    right = [[_episode(f" It is {a + 4}!")] * 2 for a in range(8)]
    silent = [[_episode(" I don't know.")] * 2 for _ in range(8)]
    same = score_episodes(suite, right, right, settings, seed=3)
    assert same.passed and same.difference is not None and same.difference.estimate == 0.0
    assert (
        same.n == 8 and "8 held-out questions x 2 self-edit episodes per model (96 calls in all)" in same.note
    )
    worse = score_episodes(suite, silent, right, settings, seed=3)
    assert worse.name == "episodes" and worse.conclusive and worse.passed is False
    assert worse.challenger == 0.0 and worse.champion == 1.0


def test_the_judge_scorer_needs_a_judge() -> None:
    with pytest.raises(ValueError, match='gate.episodes.scorer is "judge" but gate.judge is not set'):
        GateSettings(suites=("episodes",), episodes={"scorer": "judge"})
    judge = JudgeSettings(url="http://127.0.0.1:9/v1", model="judge")
    assert GateSettings(suites=("episodes",), episodes={"scorer": "judge"}, judge=judge)


def test_the_oracle_scorer_is_resolved_before_anything_is_sampled() -> None:
    from deployer.episodes import episode_suite
    from deployer.errors import GateError

    episodes = EpisodeSuiteSettings(scorer="oracle")
    ok = episode_suite(Settings(gate=GateSettings(suites=("episodes",), episodes=episodes)), draw_seed=1)
    assert ok is not None and ok.oracle is not None and len(ok.questions) == 48
    bad = Settings(gate=GateSettings(suites=("episodes",), episodes=episodes, preference="no_such_module:f"))
    with pytest.raises(GateError, match="cannot import module 'no_such_module'"):
        episode_suite(bad, draw_seed=1)
    assert episode_suite(Settings(), draw_seed=1) is None  # not configured
