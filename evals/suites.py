"""Prompt suites with verifiable scorers for the eval gate (docs/gate.md, Offline suites).

A suite is a list of prompts, each with what makes a completion right, and a scorer that turns a
completion into a score in [0, 1]. The gate samples every prompt under both models with the same
seed and compares the per-prompt mean scores (evals/stats.py `paired_interval`). The task's suites
take `gate.eval_prompts` of its held-out questions, drawn afresh per challenger (`Task.heldout_draw`).

- ``retention``: the task's held-out questions (never sent by the simulator, never trained on),
  scored by their known answers: does the model still know what it knew? (For the demo task: is the
  arithmetic still right, whatever the answer's shape.) By default all of them, each asked once
  greedily (`gate.retention`): a census of the held-out set, whose verdict is exact
  (docs/gate.md, The retention suite's power).
- ``retention_sampled``: beside that census (``gate.retention.sampled_k`` > 0), the same questions
  each sampled k times at the served settings, scored by the share of samples right: the users'
  view of what the model knows, which the greedy census does not see.
- offline suites from JSONL files (``gate.offline``), one object per line::

      {"prompt": "Q: What is 2 plus 2?\\nA:", "answers": ["4"]}
      {"prompt": "Write a date:", "pattern": "^\\\\s*\\\\d{4}-\\\\d{2}-\\\\d{2}"}

  scored by ``exact`` (the stripped completion equals an answer), ``contains`` (an answer appears
  as a whole word, case-insensitively), ``regex`` (the line's pattern is found) or ``function``
  (``"module:function"`` called as f(prompt, completion, line) -> float in [0, 1]).
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from evals.tasks import Task, TaskError
from schemas.settings import JudgeSettings, OfflineSuiteSettings

ItemScorer = Callable[[str, str, Mapping[str, Any]], float]


class SuiteError(TaskError):
    """A suite file that cannot be read or has a malformed line, or a scorer that cannot be loaded."""


@dataclass(frozen=True)
class PromptSuite:
    """Prompts, what each needs, and how a completion is scored."""

    name: str
    prompts: tuple[str, ...]
    lines: tuple[Mapping[str, Any], ...]  # per prompt: the suite line (answers, pattern, anything else)
    scorer: ItemScorer
    max_tokens: int
    stop: tuple[str, ...] = field(default=("\n",))
    judge: JudgeSettings | None = None  # graded by this judge (evals/judge.py) instead of `scorer`
    # A completion cut off by max_tokens (finish reason "length") scores 0 whatever `scorer` says.
    cut_off_fails: bool = False
    note: str = ""  # what the suite measures and on what, copied into its verdict's note
    # Asked once per prompt at temperature 0 instead of `gate.samples_per_prompt` samples (deployer/gate.py).
    greedy: bool = False
    # Greedy on every question of its set: nothing sampled, nothing drawn, so the verdict is the exact
    # difference of the shares right, not a bootstrap interval (deployer/gate_suites.py `census`).
    census: bool = False
    # Completions per prompt at the served settings when set, instead of `gate.samples_per_prompt`
    # (`retention_sampled`: `gate.retention.sampled_k`); a greedy suite's prompts are asked once.
    samples: int | None = None
    # Whether its generations count in the gate's behaviour alarms (deployer/gate.py `_behaviour`):
    # `retention_sampled`'s k samples of every held-out question would outweigh the other suites'.
    in_behaviour: bool = True

    def score(self, index: int, completion: str) -> float:
        return self.scorer(self.prompts[index], completion, self.lines[index])

    def per_prompt(self, samples_per_prompt: int) -> int:
        """Completions asked per prompt: one when greedy, `samples` when set, else `samples_per_prompt`
        (``gate.samples_per_prompt``)."""
        if self.greedy:
            return 1
        return self.samples if self.samples is not None else samples_per_prompt


def _word(answer: str) -> re.Pattern[str]:
    return re.compile(rf"(?<!\w){re.escape(answer)}(?!\w)", re.IGNORECASE)


def contains_answer(prompt: str, completion: str, line: Mapping[str, Any]) -> float:
    """1 when one of the line's answers appears in the completion as a whole word (any case)."""
    return float(any(_word(str(a)).search(completion) for a in line.get("answers", ())))


def exact_answer(prompt: str, completion: str, line: Mapping[str, Any]) -> float:
    return float(completion.strip() in {str(a).strip() for a in line.get("answers", ())})


def regex_answer(prompt: str, completion: str, line: Mapping[str, Any]) -> float:
    return float(re.search(str(line["pattern"]), completion) is not None)


def retention_suite(task: Task, n: int, seed: int | None = None, greedy: bool = False) -> PromptSuite:
    """`n` of the task's held-out questions (0: all of them; else the first `n`, or drawn with `seed`:
    `Task.heldout_draw`), right when the completion contains an answer; `greedy`: asked once each at
    temperature 0, and with all the questions a census (`PromptSuite.census`)."""
    everything = len(task.heldout_questions())
    questions = task.heldout_questions_drawn(n or everything, seed)
    census = greedy and len(questions) == everything
    return PromptSuite(
        name="retention",
        prompts=tuple(task.format_prompt(q.text) for q in questions),
        lines=tuple({"answers": list(q.answers)} for q in questions),
        scorer=contains_answer,
        max_tokens=task.max_tokens,
        stop=task.stop,
        greedy=greedy,
        census=census,
        note=f"census of {len(questions)} held-out questions, greedy" if census else "",
    )


def retention_sampled_suite(task: Task, k: int) -> PromptSuite:
    """`retention_sampled`: every held-out question of the task (nothing drawn), sampled `k` times at
    the served settings, scored by the share of its samples containing an answer: what the greedy
    census cannot see, a loss of the answers users are sampled (docs/gate.md, The retention suite's
    power). Decided by the paired bootstrap over questions (deployer/gate_suites.py `paired`)."""
    if k < 1:
        raise SuiteError(f"retention_sampled needs at least one sample per question, not {k}")
    questions = task.heldout_questions()
    return PromptSuite(
        name="retention_sampled",
        prompts=tuple(task.format_prompt(q.text) for q in questions),
        lines=tuple({"answers": list(q.answers)} for q in questions),
        scorer=contains_answer,
        max_tokens=task.max_tokens,
        stop=task.stop,
        samples=k,
        in_behaviour=False,
        note=f"all {len(questions)} held-out questions, {k} samples each at the served settings",
    )


def judge_suite(task: Task, n: int, judge: JudgeSettings, seed: int | None = None) -> PromptSuite:
    """`n` of the task's held-out prompts (the first, or drawn with `seed`), graded by `judge`."""
    prompts = tuple(task.heldout_prompts(n, seed))

    def unused(prompt: str, completion: str, line: Mapping[str, Any]) -> float:
        raise SuiteError("the judge suite is graded by its judge (Judge.score_many), not item by item")

    return PromptSuite(
        name="judge",
        prompts=prompts,
        lines=tuple({} for _ in prompts),
        scorer=unused,
        max_tokens=task.max_tokens,
        stop=task.stop,
        judge=judge,
    )


def _function(spec: str) -> ItemScorer:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SuiteError(f"scorer function {spec!r}: expected 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise SuiteError(f"scorer function {spec!r} cannot be loaded: {exc}") from exc
    if not callable(obj):
        raise SuiteError(f"scorer function {spec!r} is not callable")
    function: Callable[..., Any] = obj

    def score(prompt: str, completion: str, line: Mapping[str, Any]) -> float:
        try:
            value = float(function(prompt, completion, line))
        except Exception as exc:  # a user's scorer: its failure is named, not a traceback from the gate
            raise SuiteError(
                f"scorer function {spec!r} failed on line {line.get('_line', '?')}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise SuiteError(f"scorer function {spec!r} returned {value!r}; scores are in [0, 1]")
        return value

    return score


def load_offline(cfg: OfflineSuiteSettings) -> PromptSuite:
    """The suite described by `cfg`; raises SuiteError naming the file and line of any problem."""
    path = cfg.path.expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SuiteError(f"gate suite {cfg.name!r}: cannot read {path}: {exc}") from exc
    prompts: list[str] = []
    lines: list[Mapping[str, Any]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"gate suite {cfg.name!r}: {path}:{number}"
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{where}: not JSON: {exc.msg}") from None
        if not isinstance(line, dict) or not isinstance(line.get("prompt"), str) or not line["prompt"]:
            raise SuiteError(f'{where}: each line is an object with a non-empty string "prompt"')
        if cfg.scorer in ("exact", "contains"):
            answers = line.get("answers")
            if (
                not isinstance(answers, list)
                or not answers
                or not all(isinstance(a, str | int | float) for a in answers)
            ):
                raise SuiteError(f'{where}: scorer {cfg.scorer} needs a non-empty list "answers"')
        if cfg.scorer == "regex":
            try:
                re.compile(str(line.get("pattern")))
            except re.error as exc:
                raise SuiteError(f'{where}: "pattern" is not a regular expression: {exc}') from None
            if not isinstance(line.get("pattern"), str):
                raise SuiteError(f'{where}: scorer regex needs a string "pattern"')
        prompts.append(line["prompt"])
        lines.append({**line, "_line": number})
    if not prompts:
        raise SuiteError(f"gate suite {cfg.name!r}: {path} has no prompts")
    scorers: dict[str, ItemScorer] = {
        "exact": exact_answer,
        "contains": contains_answer,
        "regex": regex_answer,
    }
    if cfg.scorer == "function":
        if not cfg.function:
            raise SuiteError(f"gate suite {cfg.name!r}: scorer=function needs `function` (module:function)")
        scorer = _function(cfg.function)
    else:
        scorer = scorers[cfg.scorer]
    return PromptSuite(
        name=cfg.name,
        prompts=tuple(prompts),
        lines=tuple(lines),
        scorer=scorer,
        max_tokens=cfg.max_tokens,
        stop=tuple(cfg.stop),
    )
