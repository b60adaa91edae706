"""Fresh evaluation draws (docs/gate.md, Fresh draws): each challenger's gate run gets its own seed
(a hash of gate.seed, the registry model and the version) and its own draw of the task's held-out
questions; both models of one run share them; the decision records both."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from typing import Any

import pytest
from factories import gate_decision

from deployer.gate import draw_seed, run_draw
from deployer.gate_suites import prompt_suites, score_prompts
from evals import TaskError, get_task
from evals.stats import paired_interval
from evals.suites import PromptSuite
from rtrl.commands.gate import explain_text
from schemas.settings import RetentionSuiteSettings, Settings
from serving import Generation

pytestmark = pytest.mark.unit

TASK = get_task("exclaim")


def with_gate(**update: Any) -> Settings:
    settings = Settings()
    return settings.model_copy(update={"gate": settings.gate.model_copy(update=update)})


def test_the_seed_is_a_sha256_of_the_base_the_model_and_the_version() -> None:
    expected = (
        int.from_bytes(hashlib.sha256(b"rtrl gate draw\x0020240917\x00rtrl\x002").digest()[:4], "big") >> 1
    )
    assert draw_seed(20240917, "rtrl", 2) == expected == 125499512
    seeds = {draw_seed(base, model, v) for base in (0, 1) for model in ("a", "b") for v in range(1, 6)}
    assert len(seeds) == 20 and all(0 <= s < 2**31 for s in seeds)  # each challenger its own
    assert draw_seed(7, "a", 3) == draw_seed(7, "a", 3)  # judged again: the same draw


def test_the_draw_is_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from deployer.gate import draw_seed; from evals import get_task; "
        "print(draw_seed(5, 'm', 9), get_task('exclaim').heldout_draw(10, draw_seed(5, 'm', 9)))"
    )
    here = f"{draw_seed(5, 'm', 9)} {TASK.heldout_draw(10, draw_seed(5, 'm', 9))}"
    for hash_seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert out.stdout.strip() == here


def test_a_heldout_draw_is_a_seeded_subset_and_without_a_seed_the_first_questions() -> None:
    pool = len(TASK.heldout_questions())
    assert pool == 75 and TASK.heldout_draw(8) == list(range(8))
    drawn = TASK.heldout_draw(8, 12345)
    assert drawn == [26, 30, 34, 51, 52, 55, 58, 74]  # pinned: stable across versions
    assert drawn == TASK.heldout_draw(8, 12345) and drawn != TASK.heldout_draw(8, 12346)
    big = TASK.heldout_draw(48, 1)
    assert len(set(big)) == 48 and big == sorted(big) and all(0 <= i < pool for i in big)
    assert TASK.heldout_draw(pool, 3) == list(range(pool))  # the whole pool: nothing to draw
    assert TASK.heldout_prompts(8, 12345) == [
        TASK.format_prompt(TASK.heldout_questions()[i].text) for i in drawn
    ]
    with pytest.raises(TaskError, match="75 held-out prompts; asked for 76"):
        TASK.heldout_draw(76, 1)


# The retention suite drawn and sampled, as before its census (docs/gate.md, The retention suite's power).
SAMPLED_12 = RetentionSuiteSettings(decode="sampled", questions=12)


def test_the_task_suites_use_the_draw_and_the_run_records_it() -> None:
    settings = with_gate(suites=("retention", "oracle", "ope"), eval_prompts=12, retention=SAMPLED_12)
    seed, drawn = run_draw(settings, "rtrl-policy", 4)
    assert seed == draw_seed(settings.gate.seed, "rtrl-policy", 4) and drawn == TASK.heldout_draw(12, seed)
    suites = {s.name: s for s, _ in prompt_suites(settings, seed)}
    expected = tuple(TASK.format_prompt(TASK.heldout_questions()[i].text) for i in drawn)
    assert suites["retention"].prompts == suites["oracle"].prompts == expected  # one draw for both
    assert suites["retention"].lines[0]["answers"] == list(TASK.heldout_questions()[drawn[0]].answers)
    other_seed, other = run_draw(settings, "rtrl-policy", 5)
    assert other_seed != seed and other != drawn  # the next challenger, another draw


def test_fresh_draws_off_pins_the_base_seed_and_the_first_questions() -> None:
    settings = with_gate(suites=("ope", "retention"), fresh_draws=False, retention=SAMPLED_12)
    assert run_draw(settings, "rtrl-policy", 4) == (settings.gate.seed, list(range(12)))
    assert prompt_suites(settings)[0][0].prompts == tuple(TASK.heldout_prompts(12))
    assert run_draw(with_gate(suites=("ope",)), "rtrl-policy", 4)[1] == []  # no task suite, no draw


def test_a_prompt_suite_bootstraps_with_the_runs_seed() -> None:
    """That both models of a run also sample with it is shown on a real staging server:
    tests/deployer/test_deployer_rollout.py::test_gate_passes_the_same_weights_and_rejects_noised_ones_in_seeded_runs
    (the same weights score exactly alike)."""
    settings = with_gate(suites=("ope", "retention"), retention=SAMPLED_12)
    suites = [s for s, _ in prompt_suites(settings, 99)]
    ours, theirs = [1.0, 0.0, 1.0, 1.0] * 3, [0.0, 0.0, 1.0, 1.0] * 3
    gens = [
        [[Generation(text=" 7!" if x else " red", logprobs=(-1.0,), finish_reason="stop")] for x in side]
        for side in (ours, theirs)
    ]
    suite = suites[0]
    answered = PromptSuite(
        name="t",
        prompts=suite.prompts,
        lines=suite.lines,
        scorer=lambda _p, c, _l: float("7" in c),
        max_tokens=8,
    )
    result = score_prompts(answered, gens[0], gens[1], settings, 99)
    cfg = settings.gate
    assert result.difference == paired_interval(
        ours, theirs, confidence=cfg.confidence, resamples=cfg.bootstrap_resamples, seed=99
    )


def test_the_seed_and_the_draw_are_recorded_in_words() -> None:
    """In MLflow's tags and the store: the real-service gate test named above."""
    decision = gate_decision(n_prompts=3, n_samples=12, seed=125499512, fresh_draw=True, draw=[4, 9, 70])
    data = decision.model_dump(mode="json")
    assert (data["seed"], data["fresh_draw"], data["draw"]) == (125499512, True, [4, 9, 70])
    text = explain_text(data)
    assert "draw: seed 125499512 (drawn for this challenger), held-out questions 4, 9, 70" in text
    old = {k: v for k, v in data.items() if k not in ("seed", "fresh_draw", "draw")}
    assert "draw:" not in explain_text(old)  # a record from before fresh draws still reads


def test_the_defaults() -> None:
    cfg = Settings().gate
    assert cfg.fresh_draws and cfg.alarms.kl_budget is None and cfg.alarms.kl_budget_factor == 2.0
