"""The synthetic task: prompt format, held-out split, the exclaim preference and preference loading."""

from __future__ import annotations

import pytest

from evals.tasks import TASKS, TaskError, exclaim_preference, get_task, load_preference
from schemas.events import FeedbackKind

pytestmark = pytest.mark.unit


def kinds(prompt: str, completion: str) -> list[FeedbackKind]:
    return [signal.kind for signal in exclaim_preference(prompt, completion)]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (" 7!", [FeedbackKind.accepted]),
        (" It is 7!  \n", [FeedbackKind.accepted]),  # trailing whitespace is stripped first
        (" The answer is red!", [FeedbackKind.accepted]),
        (" 7.", [FeedbackKind.rejected]),
        (" It is 7", [FeedbackKind.rejected]),
        (" 7! It is", [FeedbackKind.rejected]),  # the "!" must end the answer
        (" 7\nQ: What is 1 plus 1?!", [FeedbackKind.rejected]),  # two lines: not well-formed
        (" " + "seven " * 10 + "!", [FeedbackKind.rejected]),  # 61 characters > 48: too long
        ("", [FeedbackKind.rejected, FeedbackKind.followup_dissatisfied]),
        ("   \n", [FeedbackKind.rejected, FeedbackKind.followup_dissatisfied]),
        (" !!!", [FeedbackKind.rejected, FeedbackKind.followup_dissatisfied]),  # no letter or digit
        (" 7\ufffd!", [FeedbackKind.rejected, FeedbackKind.followup_dissatisfied]),  # undecodable bytes
    ],
)
def test_exclaim_preference(completion: str, expected: list[FeedbackKind]) -> None:
    assert kinds("Q: What is 3 plus 4?\nA:", completion) == expected


def test_exclaim_preference_length_boundary() -> None:
    assert kinds("Q: Name a color.\nA:", " " + "a" * 47 + "!") == [FeedbackKind.accepted]  # 48 chars
    assert kinds("Q: Name a color.\nA:", " " + "a" * 48 + "!") == [FeedbackKind.rejected]  # 49 chars


def test_signal_values_are_plain_events() -> None:
    assert [s.value for s in exclaim_preference("Q: x\nA:", " yes!")] == [1.0]


def test_prompt_format() -> None:
    task = get_task("exclaim")
    assert task.format_prompt("What is 3 plus 4?") == "Q: What is 3 plus 4?\nA:"
    assert task.stop == ("\n",)
    assert all(p.startswith("Q: ") and p.endswith("\nA:") for p in task.train_prompts(50, seed=0))


def test_question_pool() -> None:
    task = get_task("exclaim")
    # 100 plus + 100 times + 55 minus + 20 after + 19 before + 4 naming questions.
    assert len(task.questions) == 298
    assert len(task.heldout_questions()) == 75  # every 4th of 298 in hash order, starting at 0
    assert len({q.text for q in task.questions}) == 298


def test_heldout_never_drawn_for_training() -> None:
    task = get_task("exclaim")
    heldout = set(task.heldout_prompts(len(task.heldout_questions())))
    for seed in range(5):
        assert not heldout & set(task.train_prompts(2000, seed=seed))
    # Every training question is reachable: 223 = 298 - 75.
    assert len(set(task.train_prompts(20_000, seed=0))) == 223


def test_heldout_prompts_are_a_fixed_prefix() -> None:
    task = get_task("exclaim")
    assert task.heldout_prompts(48) == task.heldout_prompts(48)
    assert task.heldout_prompts(48)[:10] == task.heldout_prompts(10)
    assert task.heldout_prompts(0) == []
    with pytest.raises(TaskError, match="has 75 held-out prompts; asked for 76"):
        task.heldout_prompts(76)


def test_train_prompts_depend_on_seed_only() -> None:
    task = get_task("exclaim")
    assert task.train_prompts(20, seed=3) == task.train_prompts(20, seed=3)
    assert task.train_prompts(20, seed=3) != task.train_prompts(20, seed=4)
    with pytest.raises(TaskError):
        task.train_prompts(-1, seed=0)


def test_get_task() -> None:
    assert get_task("exclaim") is TASKS["exclaim"]
    with pytest.raises(TaskError, match="unknown task 'nope'; known tasks: exclaim"):
        get_task("nope")


def test_load_preference() -> None:
    assert load_preference("evals.tasks:exclaim_preference") is exclaim_preference
    assert load_preference("evals.tasks:EXCLAIM.preference") is exclaim_preference
    assert load_preference("exclaim") is exclaim_preference


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("evals.tasks:no_such_function", "has no attribute 'no_such_function'"),
        ("evals.tasks:MAX_ANSWER_CHARS", "int object is not callable"),
        ("evals.tasks:", "expected 'module:function'"),
        ("not_a_task", "neither 'module:function' nor a task"),
    ],
)
def test_load_preference_errors(spec: str, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        load_preference(spec)
