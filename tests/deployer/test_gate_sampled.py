"""The sampled retention suite beside the greedy census (docs/gate.md, The retention suite's power):
`retention_sampled` asks every held-out question `gate.retention.sampled_k` times at the served
settings, scores each by the share of its samples that are right, and is decided by the paired
bootstrap over questions (`paired`) under `gate.retention.sampled_margin`. A challenger whose argmax
answers are all still right but whose sampled answers are right less often passes the census and
fails this suite. Hand-worked on the exclaim task's 75 held-out questions, no vLLM."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from deployer import gate
from deployer.gate import decide, run_draw
from deployer.gate_margins import anchor_margin, anchored, margin
from deployer.gate_suites import paired, prompt_suites, score_prompts
from evals import get_task
from evals.stats import paired_interval
from evals.suites import PromptSuite, SuiteError, retention_sampled_suite
from rtrl.commands.gate import explain_text
from schemas.settings import RetentionSuiteSettings, Settings, load_settings
from serving import Generation

pytestmark = pytest.mark.unit

TASK = get_task("exclaim")
HELDOUT = len(TASK.heldout_questions())
K = 32  # the default sampled_k


def with_gate(**update: Any) -> Settings:
    settings = Settings()
    vllm = settings.vllm.model_copy(update={"sampling_defaults": {"temperature": 1.0, "top_p": 0.9}})
    return settings.model_copy(update={"gate": settings.gate.model_copy(update=update), "vllm": vllm})


def suites_of(settings: Settings) -> dict[str, PromptSuite]:
    return {s.name: s for s, _ in prompt_suites(settings, 12345)}


def answered(suite: PromptSuite, right: list[int], k: int) -> list[list[Generation]]:
    """k generations per question of `suite`, the first `right[i]` of question i right (its first
    known answer), the rest a wrong number."""
    return [
        [
            Generation(
                text=f" {suite.lines[i]['answers'][0]}" if j < right[i] else " 999",
                logprobs=(-0.5, -0.5),
                finish_reason="stop",
            )
            for j in range(k)
        ]
        for i in range(len(suite.prompts))
    ]


def test_by_default_retention_sampled_runs_beside_the_census_on_every_question() -> None:
    cfg = Settings().gate.retention
    assert (cfg.sampled_k, cfg.sampled_margin) == (K, 0.03)
    settings = with_gate(suites=("ope", "retention"))
    suites = suites_of(settings)
    assert list(suites) == ["retention", "retention_sampled"]
    census, sampled = suites["retention"], suites["retention_sampled"]
    assert census.census and census.greedy
    assert sampled.prompts == census.prompts == tuple(TASK.heldout_prompts(HELDOUT))  # all: no draw
    assert sampled.lines == census.lines and sampled.scorer is census.scorer
    assert not sampled.greedy and not sampled.census and sampled.samples == K
    assert not sampled.in_behaviour  # its 2400 samples stay out of the behaviour alarms
    assert sampled.per_prompt(4) == K and census.per_prompt(4) == 1
    assert sampled.note == f"all 75 held-out questions, {K} samples each at the served settings"
    assert run_draw(settings, "rtrl-policy", 4)[1] == []  # neither suite draws anything


def test_sampled_k_0_turns_it_off_and_it_needs_retention() -> None:
    off = with_gate(suites=("ope", "retention"), retention=RetentionSuiteSettings(sampled_k=0))
    assert list(suites_of(off)) == ["retention"]
    assert "retention_sampled" not in suites_of(with_gate(suites=("ope", "oracle")))
    with pytest.raises(SuiteError, match="at least one sample"):
        retention_sampled_suite(TASK, 0)


def test_its_settings_are_validated_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ({"sampled_k": -1}, {"sampled_k": 257}, {"sampled_margin": -0.01}):
        with pytest.raises(ValidationError):
            RetentionSuiteSettings(**bad)
    monkeypatch.setenv("RTRL_GATE__RETENTION__SAMPLED_K", "64")
    monkeypatch.setenv("RTRL_GATE__RETENTION__SAMPLED_MARGIN", "0.04")
    cfg = load_settings().gate.retention
    assert (cfg.sampled_k, cfg.sampled_margin, cfg.decode) == (64, 0.04, "greedy")


def test_its_margins_and_its_anchoring() -> None:
    settings = with_gate()
    assert margin(settings, "retention_sampled") == 0.03
    assert margin(settings, "retention") == 0.02  # the census keeps its own
    assert margin(with_gate(margins={"retention_sampled": 0.05}), "retention_sampled") == 0.05
    assert (
        margin(with_gate(retention=RetentionSuiteSettings(sampled_margin=0.01)), "retention_sampled") == 0.01
    )
    assert anchor_margin(settings, "retention_sampled") == 0.05  # gate.anchor_margin
    assert anchored(settings, "retention_sampled") and anchored(settings, "retention")  # retention's lead
    assert not anchored(with_gate(anchor_suites=("ope",)), "retention_sampled")
    only = with_gate(anchor_suites=("retention_sampled",))
    assert anchored(only, "retention_sampled") and not anchored(only, "retention")


def test_a_loss_of_sampled_answers_fails_it_and_passes_the_census() -> None:
    """Every argmax still right (the census: 75/75 against 75/75), but each question's sampled answers
    right 22 times in 32 instead of 26: 12.5 points fewer, as users would see."""
    settings = with_gate(suites=("retention",))
    suites = suites_of(settings)
    census, sampled = suites["retention"], suites["retention_sampled"]
    all_right = answered(census, [1] * HELDOUT, 1)
    greedy = score_prompts(census, all_right, all_right, settings, 7)
    assert greedy.census and greedy.passed and greedy.difference is not None
    assert greedy.difference.estimate == 0.0
    challenger, champion = answered(sampled, [22] * HELDOUT, K), answered(sampled, [26] * HELDOUT, K)
    lost = score_prompts(sampled, challenger, champion, settings, 7)
    assert lost.name == "retention_sampled" and not lost.census and lost.margin == 0.03
    assert lost.challenger == pytest.approx(22 / 32) and lost.champion == pytest.approx(26 / 32)
    assert lost.difference is not None and lost.difference.estimate == pytest.approx(-0.125)
    assert lost.note == f"all 75 held-out questions, {K} samples each at the served settings"
    assert not lost.passed
    passed, reason = decide([greedy, lost], [])
    assert not passed and reason.startswith(
        "suite retention_sampled: challenger - champion -0.1250, lower bound"
    )
    # The same scores, the same bootstrap: `paired` on the per-question shares, nothing new.
    mixed = [22 + (i % 5) for i in range(HELDOUT)]  # a loss that differs by question
    result = score_prompts(sampled, answered(sampled, mixed, K), champion, settings, 7)
    cfg = settings.gate
    assert result.difference == paired_interval(
        [m / K for m in mixed],
        [26 / K] * HELDOUT,
        confidence=cfg.confidence,
        resamples=cfg.bootstrap_resamples,
        seed=7,
    )
    same = score_prompts(sampled, champion, champion, settings, 7)
    assert same.passed and decide([greedy, same], [])[0]


class RecordingServer:
    """Records each sampling request and answers `n` completions per prompt."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def sample(self, prompts: list[str], **kwargs: Any) -> list[list[Generation]]:
        self.calls.append({"prompts": prompts, **kwargs})
        return [
            [Generation(text=" 1", logprobs=(-0.1,), finish_reason="stop")] * kwargs["n"] for _ in prompts
        ]


def test_it_is_one_request_of_k_samples_at_the_served_settings() -> None:
    settings = with_gate(suites=("retention",), samples_per_prompt=4)
    suites = list(suites_of(settings).values())
    server = RecordingServer()
    generated = gate._generate(server, settings, suites, seed=5)  # type: ignore[arg-type]
    greedy, sampled = server.calls
    assert (greedy["n"], greedy["sampling"]) == (1, {"temperature": 0.0, "top_p": 0.9})
    assert (sampled["n"], sampled["seed"], sampled["sampling"]) == (K, 5, {"temperature": 1.0, "top_p": 0.9})
    assert len(sampled["prompts"]) == HELDOUT and all(len(g) == K for g in generated[1])
    # A sampled retention of all questions at k samples per prompt is the very same request: shared.
    same = with_gate(
        suites=("retention",), samples_per_prompt=K, retention=RetentionSuiteSettings(decode="sampled")
    )
    server = RecordingServer()
    twice = gate._generate(server, same, list(suites_of(same).values()), seed=5)  # type: ignore[arg-type]
    assert [c["n"] for c in server.calls] == [K] and twice[0] is twice[1]


def _staged(suites: list[PromptSuite], right: dict[str, int]) -> gate._Staged:
    """Each model's generations: the census all right, `right[model]` of K sampled answers right."""
    census, sampled = suites
    staged = gate._Staged()
    for model, hits in right.items():
        staged.generated[model] = [answered(census, [1] * HELDOUT, 1), answered(sampled, [hits] * HELDOUT, K)]
    return staged


def test_the_gate_compares_it_with_the_champion_and_the_anchor_and_records_it() -> None:
    settings = with_gate(suites=("retention",))
    suites = list(suites_of(settings).values())
    plan = gate._Plan(5, 4, 1, suites, [0, 1], 77, True, [])
    staged = _staged(suites, {"challenger": 24, "champion": 24, "anchor": 26})
    results, found, behaviour = gate._score(settings, None, plan, staged)  # type: ignore[arg-type]
    by_name = {r.name: r for r in results}
    assert list(by_name) == ["retention", "retention_sampled", "retention_anchor", "retention_sampled_anchor"]
    assert by_name["retention"].passed and by_name["retention_anchor"].passed  # every argmax right
    assert by_name["retention_sampled"].passed  # equal to the champion
    against = by_name["retention_sampled_anchor"]
    assert against.against_anchor and against.margin == 0.05 and against.n == HELDOUT
    assert against.difference is not None and against.difference.estimate == pytest.approx(-2 / 32)
    assert not against.passed  # 6.25 points below the anchor's sampled answers, beyond 0.05
    passed, reason = decide(results, [a for a in found if a.fired])
    assert not passed and "suite retention_sampled_anchor: challenger - champion -0.0625" in reason
    # The behaviour alarms read the census's 75 generations, not the 2400 samples beside it.
    assert behaviour["challenger"].completions == behaviour["anchor"].completions == HELDOUT
    decision = gate._decision(settings, plan, results, found, behaviour, passed, reason)
    assert decision.census == ["retention"] and decision.n_prompts == 2 * HELDOUT
    assert decision.n_samples == HELDOUT + K * HELDOUT
    text = explain_text(decision.model_dump(mode="json"))
    assert "suite retention_sampled FAIL" not in text and "suite retention_sampled pass" in text
    assert "suite retention_sampled_anchor FAIL" in text
    assert f"all 75 held-out questions, {K} samples each at the served settings" in text


# ---- power (docs/gate.md, The retention suite's power: the sampled suite beside the census) --------

# The v2 tiny base's right answers out of 64 samples (transformers, temperature 1, seeds 0-63) of
# each of exclaim's 75 held-out questions, in order: 54.8 % right, bimodal (21 never, 33 at 50 or
# more), mean p(1-p) 0.055. services/tinymodel.py `build(recipe="v2")` and `answers_correct`.
BASE_RIGHT_OF_64 = [
    41, 57, 0, 3, 62, 62, 54, 14, 61, 61, 2, 60, 63, 0, 58, 58, 62, 62, 0, 57, 61, 0, 5, 61, 62,
    0, 0, 2, 2, 2, 58, 62, 0, 64, 56, 61, 0, 59, 59, 60, 61, 3, 0, 49, 61, 0, 36, 0, 61, 0,
    56, 55, 22, 61, 0, 63, 0, 63, 60, 59, 60, 0, 0, 60, 14, 58, 0, 0, 55, 54, 0, 49, 0, 61, 0,
]  # fmt: skip


def failures(p: np.ndarray, loss: float, runs: int, rng: np.random.Generator) -> float:
    """Share of `runs` simulated gate runs whose retention_sampled verdict fails a challenger that
    lost `loss` of the champion's sampled answers (each question's p scaled down alike), both models
    sampled independently k = the default times per question (the gate's shared seed only helps),
    decided by the gate's own `paired` at the default margin and confidence."""
    settings = with_gate()
    challenger = p * (1 - loss / p.mean())
    failed = 0
    for run in range(runs):
        ours = rng.binomial(K, challenger) / K
        theirs = rng.binomial(K, p) / K
        failed += not paired("retention_sampled", list(ours), list(theirs), settings, run).passed
    return failed / runs


def test_its_default_k_and_margin_reject_a_5_point_loss_and_pass_an_equal_challenger() -> None:
    rng = np.random.default_rng(0)
    measured = np.asarray(BASE_RIGHT_OF_64) / 64
    assert len(measured) == HELDOUT and measured.mean() == pytest.approx(0.548, abs=0.001)
    se = float(np.sqrt(2 * np.mean(measured * (1 - measured)) / (K * HELDOUT)))
    assert se == pytest.approx(0.0068, abs=0.0001)  # the standard error docs/gate.md states
    assert failures(measured, 0.05, 100, rng) >= 0.95  # a 5-point loss: rejected (1.00 in 200 runs)
    assert failures(measured, 0.0, 100, rng) <= 0.05  # an equal challenger: passes (0.99 in 200)
    # The worst case for the noise: every question at the base's mean, p(1-p) 0.238, not 0.055.
    flat = np.full(HELDOUT, 0.61)
    assert failures(flat, 0.05, 100, rng) >= 0.95  # still rejected (1.00 in 200)
    assert failures(flat, 0.0, 100, rng) <= 0.4  # but an equal challenger fails 0.27 of 200 runs
