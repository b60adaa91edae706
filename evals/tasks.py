"""Synthetic tasks: prompts, a held-out split and a simulated user's preference.

A task is what `rtrl simulate` sends through the gateway and what the eval gate scores on: short
questions formatted as completion prompts (``"Q: What is 3 plus 4?\\nA:"``), a fixed held-out
split the simulator never draws from, and a *preference function* that plays the user:

    preference(prompt: str, completion: str) -> list[schemas.events.FeedbackSignal]

The simulator turns each returned signal into a ``FeedbackEvent`` for the request; the eval gate
scores a completion by passing the signals through the reward spec (evals/scoring.py).
``rtrl model init --task`` uses the same questions to supervise the tiny base model, so it answers
in the task's shape and already meets the preference some of the time (docs/algorithms.md,
Calibration on the tiny model: single production responses only teach behaviours the base model
already shows).

Custom preferences load from ``"package.module:function"`` with `load_preference`.

The tasks: ``exclaim``, arithmetic and naming questions answered with a short phrase; the user
accepts an answer that ends with ``!`` and rejects a plain one. The base model is tuned to end with
``!`` about one time in five. ``lookup`` (a `ToolTask`): codes of items, which the model finds by
calling the ``lookup`` tool and states from its result (``rtrl demo --scenario tools``,
docs/methods.md, Tool calls); the user accepts the right code ending with ``!``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from schemas.errors import OperatorError
from schemas.events import FeedbackKind, FeedbackSignal

Preference = Callable[[str, str], list[FeedbackSignal]]


class TaskError(OperatorError, ValueError):
    """An unknown task, an impossible request for prompts, or a preference that cannot be loaded."""


@dataclass(frozen=True)
class Question:
    """One question of a task and the answers a reasonable model could give (any one will do)."""

    text: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Task:
    """A synthetic task: what prompts look like, which are held out, and what the user prefers."""

    name: str
    description: str
    questions: tuple[Question, ...]
    preference: Preference
    # How a question becomes the plain prompt the gateway sends to /v1/completions.
    prompt_template: str = "Q: {question}\nA:"
    max_tokens: int = 16
    stop: tuple[str, ...] = ("\n",)
    # Supervised shapes of an answer: mostly plain, sometimes the preferred one.
    plain_shapes: tuple[str, ...] = ()
    preferred_shapes: tuple[str, ...] = ()
    preferred_fraction: float = 0.0
    # One question in `heldout_every` (picked by a hash of its text) is held out.
    heldout_every: int = 4

    def format_prompt(self, question: str) -> str:
        return self.prompt_template.format(question=question)

    def _split(self) -> tuple[tuple[Question, ...], tuple[Question, ...]]:
        """(train, held-out), each in a fixed order that does not depend on PYTHONHASHSEED."""
        ranked = sorted(self.questions, key=lambda q: hashlib.sha256(q.text.encode()).hexdigest())
        heldout = tuple(q for i, q in enumerate(ranked) if i % self.heldout_every == 0)
        train = tuple(q for i, q in enumerate(ranked) if i % self.heldout_every != 0)
        return train, heldout

    def train_questions(self) -> tuple[Question, ...]:
        return self._split()[0]

    def heldout_questions(self) -> tuple[Question, ...]:
        return self._split()[1]

    def train_prompts(self, n: int, seed: int) -> list[str]:
        """`n` prompts drawn uniformly, with replacement, from the training split."""
        return [self.format_prompt(q.text) for q in self.draw_train_questions(n, seed)]

    def draw_train_questions(self, n: int, seed: int) -> list[Question]:
        """The questions behind `train_prompts(n, seed)`, in the same order (a chat user sends the
        question itself; the model's chat template does the formatting)."""
        if n < 0:
            raise TaskError(f"n must be >= 0, got {n}")
        return random.Random(seed).choices(self.train_questions(), k=n)

    def heldout_draw(self, n: int, seed: int | None = None) -> list[int]:
        """Indices of `n` held-out questions (into `heldout_questions()`, ascending): the first `n`
        without a seed; with one, the `n` whose SHA-256 of seed and text ranks lowest, a draw without
        replacement that is the same in every process and Python version (docs/gate.md, Fresh draws)."""
        heldout = self.heldout_questions()
        if not 0 <= n <= len(heldout):
            raise TaskError(f"task {self.name!r} has {len(heldout)} held-out prompts; asked for {n}")
        if seed is None:
            return list(range(n))
        ranked = sorted(
            range(len(heldout)),
            key=lambda i: hashlib.sha256(f"{seed}\0{heldout[i].text}".encode()).hexdigest(),
        )
        return sorted(ranked[:n])

    def heldout_questions_drawn(self, n: int, seed: int | None = None) -> list[Question]:
        """The questions of `heldout_draw(n, seed)`, in held-out order."""
        heldout = self.heldout_questions()
        return [heldout[i] for i in self.heldout_draw(n, seed)]

    def heldout_prompts(self, n: int, seed: int | None = None) -> list[str]:
        """`n` held-out prompts, never drawn by `train_prompts`: the first `n` (the same list every
        time) without a seed, the draw `heldout_draw(n, seed)` with one."""
        return [self.format_prompt(q.text) for q in self.heldout_questions_drawn(n, seed)]

    def sft_example(self, question: Question, rng: random.Random) -> tuple[str, str]:
        """One supervised (prompt, completion) of `question` for `rtrl model init --task`."""
        return self.format_prompt(question.text), self.sft_completion(question, rng)

    def sft_completion(self, question: Question, rng: random.Random) -> str:
        """A supervised completion for `question`: a random answer in a random shape."""
        preferred = rng.random() < self.preferred_fraction
        shape = rng.choice(self.preferred_shapes if preferred else self.plain_shapes)
        return " " + shape.format(answer=rng.choice(question.answers))


# ---- the exclaim task -------------------------------------------------------------------------

MAX_ANSWER_CHARS = 48


def exclaim_preference(prompt: str, completion: str) -> list[FeedbackSignal]:
    """Accept a short, one-line answer that ends with "!"; reject anything else.

    Empty output or output without a single letter or digit (or with undecodable bytes) is
    garbage: the simulated user rejects it and asks again (``followup_dissatisfied``).
    """
    text = completion.strip()
    if not any(ch.isalnum() for ch in text) or "\ufffd" in text:
        return [
            FeedbackSignal(kind=FeedbackKind.rejected),
            FeedbackSignal(kind=FeedbackKind.followup_dissatisfied),
        ]
    if "\n" in text or len(text) > MAX_ANSWER_CHARS:
        return [FeedbackSignal(kind=FeedbackKind.rejected)]
    if text.endswith("!"):
        return [FeedbackSignal(kind=FeedbackKind.accepted)]
    return [FeedbackSignal(kind=FeedbackKind.rejected)]


COLORS = ("red", "blue", "green", "yellow", "black", "white")
ANIMALS = ("cat", "dog", "bird", "fish", "horse", "cow")
FRUITS = ("apple", "pear", "plum", "lemon", "orange", "banana")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _exclaim_questions() -> tuple[Question, ...]:
    questions: list[Question] = []
    for a in range(10):
        for b in range(10):
            questions.append(Question(f"What is {a} plus {b}?", (str(a + b),)))
            questions.append(Question(f"What is {a} times {b}?", (str(a * b),)))
            if a >= b:
                questions.append(Question(f"What is {a} minus {b}?", (str(a - b),)))
    for n in range(20):
        questions.append(Question(f"What comes after {n}?", (str(n + 1),)))
        if n > 0:
            questions.append(Question(f"What comes before {n}?", (str(n - 1),)))
    for kind, options in (("a color", COLORS), ("an animal", ANIMALS), ("a fruit", FRUITS)):
        questions.append(Question(f"Name {kind}.", options))
    questions.append(Question("Name a day of the week.", DAYS))
    return tuple(questions)


EXCLAIM = Task(
    name="exclaim",
    description='Short answers; the user accepts answers that end with "!".',
    questions=_exclaim_questions(),
    preference=exclaim_preference,
    plain_shapes=("{answer}.", "It is {answer}.", "The answer is {answer}."),
    preferred_shapes=("{answer}!", "It is {answer}!", "The answer is {answer}!"),
    preferred_fraction=0.2,
)


# ---- the lookup task: answered by calling a tool ----------------------------------------------

# 12 x 16 = 192 items, 48 of them held out: the gate's default `eval_prompts` (48) of held-out questions.
ITEM_COLORS = (*COLORS, "pink", "brown", "gray", "orange", "purple", "gold")
THINGS = (
    "box", "cup", "door", "car", "hat", "bag", "key", "pen",
    "book", "ball", "lamp", "shoe", "bell", "coin", "ring", "sock",
)  # fmt: skip
LOOKUP_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The code of an item, e.g. lookup(item='red box').",
        "parameters": {
            "type": "object",
            "properties": {"item": {"type": "string", "description": "The item, e.g. red box."}},
            "required": ["item"],
        },
    },
}
_LOOKUP_QUESTION = re.compile(r"What is the code of the (.+)\?")


def lookup(item: str) -> str:
    """The lookup tool: an item's two-digit code (from a hash of its name, the same everywhere), or
    "unknown" for anything that is not one of the task's items."""
    name = " ".join(item.lower().split())
    if name not in {f"{color} {thing}" for color in ITEM_COLORS for thing in THINGS}:
        return "unknown"
    return str(10 + int(hashlib.sha256(name.encode()).hexdigest(), 16) % 90)


def tool_result(prompt: str) -> str | None:
    """The last tool result in a rendered conversation (its ``R: ...`` line), None when it has none."""
    results = [line[3:] for line in prompt.splitlines() if line.startswith("R: ")]
    return results[-1].strip() if results else None


def lookup_preference(prompt: str, completion: str) -> list[FeedbackSignal]:
    """Accept a short, one-line answer that states the looked-up code and ends with "!"; reject an
    answer given without looking it up (the prompt has no tool result), a wrong one, or a plain one.
    Garbage is rejected and asked again, as for exclaim."""
    text = completion.strip()
    if not any(ch.isalnum() for ch in text) or "\ufffd" in text:
        return [
            FeedbackSignal(kind=FeedbackKind.rejected),
            FeedbackSignal(kind=FeedbackKind.followup_dissatisfied),
        ]
    result = tool_result(prompt)
    right = (
        result is not None
        and result.isdigit()
        and re.search(rf"(?<!\w){re.escape(result)}(?!\w)", text) is not None
    )
    if right and "\n" not in text and len(text) <= MAX_ANSWER_CHARS and text.endswith("!"):
        return [FeedbackSignal(kind=FeedbackKind.accepted)]
    return [FeedbackSignal(kind=FeedbackKind.rejected)]


@dataclass(frozen=True)
class ToolTask(Task):
    """A task answered in two model calls: the model calls the tool (its completion is the call, in
    vLLM's pythonic format, which the served model's chat template renders and ``--tool-call-parser
    pythonic`` parses: services/tinymodel.py), the client runs it and sends the result, and the model
    answers from it. `format_prompt` is the *answer's* prompt, the tool's result included, as the chat
    template renders the conversation (without its leading <s>): what the user judges and the eval
    gate's suites score. `call_prompt` is the first call's."""

    tools: tuple[dict[str, Any], ...] = ()

    def tools_line(self) -> str:
        names = [
            f"{t['function']['name']}({', '.join(t['function']['parameters']['properties'])})"
            for t in self.tools
        ]
        return f"Tools: {', '.join(names)}\n"

    def call_prompt(self, question: str) -> str:
        return f"{self.tools_line()}Q: {question}\nA:"

    def call_completion(self, question: str) -> str:
        """The tool call that answers `question`, as the model writes it."""
        return f"[lookup(item={json.dumps(self.item(question))})]"

    def item(self, question: str) -> str:
        match = _LOOKUP_QUESTION.fullmatch(question)
        if match is None:
            raise TaskError(f"not a question of task {self.name!r}: {question!r}")
        return match.group(1)

    def answer_prompt(self, question: str, result: str) -> str:
        """The second call's prompt: the question, the model's call and the tool's `result`."""
        return f"{self.call_prompt(question)} {self.call_completion(question)}</s>\nR: {result}\nA:"

    def format_prompt(self, question: str) -> str:
        return self.answer_prompt(question, lookup(self.item(question)))

    def sft_example(self, question: Question, rng: random.Random) -> tuple[str, str]:
        """Half the time the call; half the time an answer that states the tool's result, which is a
        random code (not the item's): the model learns to read the result, not to recall the code."""
        if rng.random() < 0.5:
            return self.call_prompt(question.text), self.call_completion(question.text)
        result = str(rng.randrange(10, 100))
        return self.answer_prompt(question.text, result), self.sft_completion(
            Question(question.text, (result,)), rng
        )


def _lookup_questions() -> tuple[Question, ...]:
    return tuple(
        Question(f"What is the code of the {color} {thing}?", (lookup(f"{color} {thing}"),))
        for color in ITEM_COLORS
        for thing in THINGS
    )


LOOKUP = ToolTask(
    name="lookup",
    description='Codes of items, answered by calling the lookup tool; the user accepts the looked-up code ending with "!".',
    questions=_lookup_questions(),
    preference=lookup_preference,
    plain_shapes=("{answer}.", "It is {answer}.", "The code is {answer}."),
    preferred_shapes=("{answer}!", "It is {answer}!", "The code is {answer}!"),
    preferred_fraction=0.2,
    max_tokens=32,  # a call is about 25 tokens
    tools=(LOOKUP_TOOL,),
)

TASKS: dict[str, Task] = {EXCLAIM.name: EXCLAIM, LOOKUP.name: LOOKUP}


def get_task(name: str) -> Task:
    """The registered task called `name`."""
    try:
        return TASKS[name]
    except KeyError:
        raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


def load_preference(spec: str) -> Preference:
    """A preference function from ``"package.module:function"``, or a task name for its default.

    The function is called as ``preference(prompt, completion)`` and must return a list of
    `FeedbackSignal`. Raises `TaskError` when the module does not import, the attribute is
    missing or it is not callable.
    """
    if ":" not in spec:
        if spec in TASKS:
            return TASKS[spec].preference
        raise TaskError(
            f"preference {spec!r} is neither 'module:function' nor a task ({', '.join(sorted(TASKS))})"
        )
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise TaskError(f"preference {spec!r}: expected 'module:function'")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"preference {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TaskError(f"preference {spec!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise TaskError(f"preference {spec!r}: {type(obj).__name__} object is not callable")
    return cast(Preference, obj)
