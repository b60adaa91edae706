"""The gate's `episodes` suite: whole agent episodes played through both models (docs/gate.md, Suites).

The other prompt suites judge single calls. An agent's episode is several calls, each built from
what the model answered before (evals/agents.py): a model can answer every single prompt as well as
the champion and still act worse over an episode, pruning the wrong context or answering badly over
a pruned one. This suite plays ``gate.episodes.samples`` episodes of ``gate.episodes.scenario`` from
each of the task's held-out questions (the run's draw, the same questions as the task's other
suites) on the staging server, once with the challenger loaded and once with the champion, and
scores each episode's final answer in the context the scenario judges it in:

- ``verifiable`` (default, no oracle): 0 for an episode whose final answer is a non-answer
  (``gate.alarms.no_action_pattern``, or no digit where every known answer is a number) or any of
  whose own calls was cut off by the task's ``max_tokens`` (a PARL sub-agent's are observations, not
  its actions), as the reward specs' ``unfinished`` term treats an episode the model did not finish;
  otherwise 0.5, plus 0.5 when the final answer contains one of the question's known answers: a
  format term and an accuracy term, so a model that stops answering or finishing shows even where
  neither model is often right;
- ``judge``: ``gate.judge`` grades the final answer against the whole trajectory;
- ``oracle``: the task's preference (``gate.preference``) under the labeler's reward spec, only
  where one exists (the demo's simulated users).

Both models play with the same seeds: each call samples with the served model's defaults and seed
`evals.agents.call_seed` (the run's seed, the episode, the segment), and the environment's draws
(chunks, other questions) come from `evals.agents.episode_rng` of the run's seed, so both meet the
same environment. Calls go one request each, ``gate.episodes.concurrency`` episodes at a time; a
failed call raises, as any generation on staging does. The environment's verdict PARL needs (spawn
more sub-agents after an accepted first answer) is whether the answer contains a known answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import evals
from deployer.alarms import non_answer
from deployer.errors import GateError
from deployer.gate_suites import SuiteResult, judged, paired
from evals.agents import Trajectory, call_seed, episode_rng, play
from evals.suites import contains_answer
from evals.tasks import Question, Task
from schemas.events import Role
from schemas.rewards import get_spec
from schemas.sampling import served_defaults
from schemas.settings import Settings
from serving import VllmClient

NAME = "episodes"


@dataclass(frozen=True)
class Step:
    """One call of an episode played on staging."""

    prompt: str
    text: str
    finish_reason: str | None


Played = Trajectory[Step]


@dataclass(frozen=True)
class EpisodeSuite:
    """What a gate run plays: the scenario, the held-out questions, episodes per question and model."""

    scenario: str
    task: Task
    questions: tuple[Question, ...]
    samples: int
    oracle: evals.Scorer | None = None  # the oracle scorer's reward(prompt, completion), resolved up front

    @property
    def episodes(self) -> int:
        return len(self.questions) * self.samples


def episode_suite(settings: Settings, draw_seed: int | None) -> EpisodeSuite | None:
    """This run's episode suite on the task's held-out questions (the first ``gate.eval_prompts``, or
    drawn with `draw_seed`: the task suites' draw); None when ``gate.suites`` lacks it. Raises
    GateError for a task or an oracle preference that cannot be had."""
    cfg = settings.gate
    if NAME not in cfg.suites:
        return None
    try:
        task = evals.get_task(cfg.task)
        questions = tuple(task.heldout_questions_drawn(cfg.eval_prompts, draw_seed))
        oracle = None
        if cfg.episodes.scorer == "oracle":  # before anything is sampled: a bad preference fails the run now
            preference = evals.load_preference(cfg.preference) if cfg.preference else task.preference
            oracle = evals.scorer(preference, get_spec(settings.labeler.reward_spec))
    except evals.TaskError as exc:
        raise GateError(str(exc)) from exc
    return EpisodeSuite(cfg.episodes.scenario, task, questions, cfg.episodes.samples, oracle)


def play_on(server: VllmClient, settings: Settings, suite: EpisodeSuite, seed: int) -> list[list[Played]]:
    """Every question's episodes played on `server` (module docstring): per question, per sample."""
    task, sampling = suite.task, served_defaults(settings)

    def one(index: int) -> Played:
        question = suite.questions[index // suite.samples]

        def call(prompt: str, segment: int, role: Role, agent: str | None) -> Step:
            ((made,),) = server.sample(
                [prompt],
                max_tokens=task.max_tokens,
                n=1,
                seed=call_seed(seed, index, segment),
                stop=list(task.stop),
                sampling=sampling,
            )
            return Step(prompt, made.text, made.finish_reason)

        return play(
            suite.scenario,
            call,
            task,
            task.format_prompt(question.text),
            episode_rng(suite.scenario, seed, index),
            lambda _prompt, completion: _right(completion, question) > 0,
        )

    workers = settings.gate.episodes.concurrency
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rtrl-gate-episode") as pool:
        played = list(pool.map(one, range(suite.episodes)))
    return [played[i : i + suite.samples] for i in range(0, len(played), suite.samples)]


def _right(completion: str, question: Question) -> float:
    return contains_answer("", completion, {"answers": question.answers})


def verifiable(no_action_pattern: str) -> Callable[[Played, Question], float]:
    """The default score of one episode (module docstring): 0 when the final answer is a non-answer or
    any of the agent's own calls was cut off, 0.5 answered, 1 answered right."""
    pattern = re.compile(no_action_pattern)

    def score(episode: Played, question: Question) -> float:
        final = episode.final
        if non_answer(final.text, pattern, question.answers) or any(
            turn.finish_reason == "length" for _, role, turn in episode.turns if role != Role.subagent
        ):
            return 0.0
        return 0.5 + 0.5 * _right(final.text, question)

    return score


def score_episodes(
    suite: EpisodeSuite,
    challenger: list[list[Played]],
    champion: list[list[Played]],
    settings: Settings,
    seed: int,
) -> SuiteResult:
    """The suite's verdict of challenger − champion, paired per held-out question."""
    cfg = settings.gate
    calls = sum(e.calls for model in (challenger, champion) for per_q in model for e in per_q)
    where = (
        f"{len(suite.questions)} held-out questions x {suite.samples} {suite.scenario} episodes per model "
        f"({calls} calls in all)"
    )
    if cfg.episodes.scorer == "judge":
        assert cfg.judge is not None  # GateSettings refuses the judge scorer without one
        items = [
            [[(e.judged_prompt, e.final.text) for e in per_q] for per_q in model]
            for model in (challenger, champion)
        ]
        result = judged(NAME, items[0], items[1], cfg.judge, settings, seed)
        return result.model_copy(update={"note": f"{where}; {result.note}"})
    score: Callable[[Played, Question], float]
    if cfg.episodes.scorer == "oracle":
        reward = suite.oracle
        assert reward is not None  # `episode_suite` resolves it for the oracle scorer
        score = lambda episode, _question: reward(episode.judged_prompt, episode.final.text)  # noqa: E731
        scored_by = "the task's preference (oracle)"
    else:
        score = verifiable(cfg.alarms.no_action_pattern)
        scored_by = "0 unanswered or a call cut off, 0.5 answered, 1 right"

    def per_question(model: list[list[Played]]) -> list[float]:
        return [
            sum(score(e, q) for e in per_q) / len(per_q)
            for q, per_q in zip(suite.questions, model, strict=True)
        ]

    result = paired(NAME, per_question(challenger), per_question(champion), settings, seed)
    return result.model_copy(update={"note": f"{where}, scored {scored_by}"})
