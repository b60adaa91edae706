"""The retention suite as a census (docs/gate.md, The retention suite's power): every held-out
question asked once greedily, an exact verdict (pass iff challenger − champion ≥ −margin), its
margins (`gate.retention`), its requests (n=1, temperature 0), nothing drawn for it; and the sampled
mode, the paired bootstrap as before. Hand-worked on the exclaim task's 75 held-out questions."""

from __future__ import annotations

from typing import Any

import pytest
from factories import gate_decision

from deployer import alarms, gate
from deployer.gate import decide, run_draw
from deployer.gate_margins import margin
from deployer.gate_suites import against_anchor, census, prompt_suites, score_prompts
from evals import get_task
from evals.stats import paired_interval
from rtrl.commands.gate import explain_text
from schemas.settings import RetentionSuiteSettings, Settings
from serving import Generation

pytestmark = pytest.mark.unit

TASK = get_task("exclaim")
HELDOUT = len(TASK.heldout_questions())


def with_gate(**update: Any) -> Settings:
    """Settings with `update` on the gate; the census alone, without retention_sampled beside it
    (tests/deployer/test_gate_sampled.py has that), unless `update` sets `retention`."""
    update.setdefault("retention", RetentionSuiteSettings(sampled_k=0))
    settings = Settings()
    vllm = settings.vllm.model_copy(update={"sampling_defaults": {"temperature": 1.0, "top_p": 0.9}})
    return settings.model_copy(update={"gate": settings.gate.model_copy(update=update), "vllm": vllm})


def right(n: int, wrong: int) -> list[float]:
    """Scores of `n` questions with the last `wrong` of them wrong."""
    return [1.0] * (n - wrong) + [0.0] * wrong


def test_the_defaults_make_retention_a_greedy_census_of_every_heldout_question() -> None:
    cfg = Settings().gate
    assert (cfg.retention.decode, cfg.retention.questions) == ("greedy", 0)
    assert (cfg.retention.margin, cfg.retention.anchor_margin) == (0.02, 0.03)
    assert (cfg.retention.sampled_k, cfg.retention.sampled_margin) == (32, 0.03)  # beside it: on
    settings = with_gate(suites=("ope", "retention"))
    ((suite, _),) = prompt_suites(settings, 12345)
    assert HELDOUT == 75 and suite.census and suite.greedy and len(suite.prompts) == HELDOUT
    assert suite.prompts == tuple(TASK.heldout_prompts(HELDOUT))  # all of them, in order: no draw
    assert suite.note == "census of 75 held-out questions, greedy"
    assert run_draw(settings, "rtrl-policy", 4)[1] == []  # a census draws nothing


def test_a_census_passes_one_lost_question_of_75_and_fails_two() -> None:
    settings = with_gate()
    one = census("retention", right(75, 11), right(75, 10), settings)  # 64/75 vs 65/75
    assert one.census and one.passed and one.margin == 0.02
    assert one.difference is not None
    assert one.difference.estimate == one.difference.low == one.difference.high == pytest.approx(-1 / 75)
    assert one.challenger == pytest.approx(64 / 75) and one.champion == pytest.approx(65 / 75)
    two = census("retention", right(75, 12), right(75, 10), settings)  # -2.67 points
    assert not two.passed
    # Questions won and lost cancel: the verdict is on the net difference.
    swapped = census("retention", [0.0, 1.0] + right(73, 0), [1.0, 0.0] + right(73, 0), settings)
    assert swapped.passed and swapped.difference is not None and swapped.difference.estimate == 0.0


def test_a_census_loss_of_exactly_the_margin_passes_and_beyond_it_fails() -> None:
    settings = with_gate()
    # 49/50 - 50/50 is -0.020000000000000018 in floating point: still exactly the margin, so it passes.
    assert census("retention", right(50, 1), right(50, 0), settings).passed
    assert not census("retention", right(50, 2), right(50, 0), settings).passed  # -0.04
    assert not census("retention", right(100, 3), right(100, 0), settings).passed  # -0.03
    exact = with_gate(retention=RetentionSuiteSettings(margin=0.04, sampled_k=0))
    assert census("retention", right(75, 3), right(75, 0), exact).passed  # -0.04 against 0.04
    assert not census("retention", right(75, 4), right(75, 0), exact).passed


def test_gate_margins_naming_retention_take_precedence() -> None:
    assert margin(with_gate(), "retention") == 0.02
    assert margin(with_gate(), "oracle") == 0.05  # the others keep gate.tolerance
    named = with_gate(margins={"retention": 0.0})
    assert margin(named, "retention") == 0.0
    assert not census("retention", right(75, 1), right(75, 0), named).passed  # no loss allowed
    assert census("retention", right(75, 0), right(75, 0), named).passed


def test_the_census_decides_and_its_failure_reads_as_exact() -> None:
    settings = with_gate()
    lost = census("retention", right(75, 2), right(75, 0), settings)
    passed, reason = decide([lost], [])
    assert not passed
    assert reason == "suite retention: challenger - champion -0.0267, census -0.0267 < -0.02"
    passed, reason = decide([census("retention", right(75, 1), right(75, 0), settings)], [])
    assert passed and reason == "non-inferior on retention -0.0133 (lower bound -0.0133); no alarm"


def test_the_retention_suite_against_the_anchor_has_its_own_margin() -> None:
    settings = with_gate()
    two = against_anchor(census("retention", right(75, 2), right(75, 0), settings), 1, settings)
    assert two.name == "retention_anchor" and two.margin == 0.03 and two.passed  # -2.67 points
    three = against_anchor(census("retention", right(75, 3), right(75, 0), settings), 1, settings)
    assert not three.passed  # -4 points
    # Exactly the anchor margin passes: 97/100 against 100/100 under 0.03.
    exact = against_anchor(census("retention", right(100, 3), right(100, 0), settings), 1, settings)
    assert exact.passed
    # The other anchored suites keep gate.anchor_margin.
    oracle = census("oracle", right(75, 3), right(75, 0), settings)
    assert against_anchor(oracle, 1, settings).margin == 0.05


def test_the_sampled_retention_suite_against_the_anchor_keeps_its_bootstrap() -> None:
    settings = with_gate(retention=RetentionSuiteSettings(decode="sampled", questions=48, sampled_k=0))
    ((suite, _),) = prompt_suites(with_gate(suites=("retention",), retention=settings.gate.retention), 7)
    ours, theirs = right(48, 6), right(48, 4)
    gens = [
        [[Generation(text=" 7" if x else " no", logprobs=(-1.0,), finish_reason="stop")] * 4 for x in side]
        for side in (ours, theirs)
    ]
    anchored = against_anchor(score_prompts(suite, gens[0], gens[1], settings, 7), 1, settings)
    assert anchored.margin == 0.03 and not anchored.census
    assert anchored.difference is not None and anchored.passed == (anchored.difference.low > -0.03)


def test_the_sampled_mode_is_the_paired_bootstrap_on_a_draw() -> None:
    settings = with_gate(
        suites=("ope", "retention"),
        retention=RetentionSuiteSettings(decode="sampled", questions=48, sampled_k=0),
    )
    ((suite, _),) = prompt_suites(settings, 99)
    assert not suite.census and not suite.greedy and len(suite.prompts) == 48 and suite.note == ""
    seed, drawn = run_draw(settings, "rtrl-policy", 4)
    assert drawn == TASK.heldout_draw(48, seed) and len(drawn) == 48
    ours, theirs = [1.0, 0.5, 0.0, 1.0] * 12, [1.0, 1.0, 0.0, 0.5] * 12
    gens = [
        [
            [
                Generation(text=" 7" if k < x * 4 else " no", logprobs=(-1.0,), finish_reason="stop")
                for k in range(4)
            ]
            for x in side
        ]
        for side in (ours, theirs)
    ]
    answered = type(suite)(
        name="retention",
        prompts=suite.prompts,
        lines=suite.lines,
        scorer=lambda _p, c, _l: float("7" in c),
        max_tokens=8,
    )
    result = score_prompts(answered, gens[0], gens[1], settings, 99)
    cfg = settings.gate
    assert not result.census and result.margin == 0.02
    assert result.difference == paired_interval(
        ours, theirs, confidence=cfg.confidence, resamples=cfg.bootstrap_resamples, seed=99
    )
    # Greedy on a draw of fewer than all questions: asked greedily, still decided by the bootstrap.
    greedy_few = with_gate(suites=("retention",), retention=RetentionSuiteSettings(questions=20, sampled_k=0))
    ((few, _),) = prompt_suites(greedy_few, 99)
    assert few.greedy and not few.census and len(few.prompts) == 20
    assert run_draw(greedy_few, "rtrl-policy", 4)[1] == TASK.heldout_draw(
        20, run_draw(greedy_few, "rtrl-policy", 4)[0]
    )


class RecordingServer:
    """Records each sampling request and answers `n` completions per prompt."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def sample(self, prompts: list[str], **kwargs: Any) -> list[list[Generation]]:
        self.calls.append({"prompts": prompts, **kwargs})
        return [
            [Generation(text=" 1", logprobs=(-0.1,), finish_reason="stop")] * kwargs["n"] for _ in prompts
        ]


def test_a_greedy_suite_is_asked_once_per_prompt_at_temperature_0_with_the_runs_seed() -> None:
    settings = with_gate(suites=("retention", "oracle"), samples_per_prompt=4)
    suites = [s for s, _ in prompt_suites(settings, 5)]
    server = RecordingServer()
    generated = gate._generate(server, settings, suites, seed=5)  # type: ignore[arg-type]
    greedy, sampled = server.calls  # the oracle's prompts are a subset, asked at the served settings
    assert (greedy["n"], greedy["seed"], greedy["sampling"]) == (1, 5, {"temperature": 0.0, "top_p": 0.9})
    assert len(greedy["prompts"]) == HELDOUT and all(len(g) == 1 for g in generated[0])
    assert (sampled["n"], sampled["seed"], sampled["sampling"]) == (4, 5, {"temperature": 1.0, "top_p": 0.9})
    assert all(len(g) == 4 for g in generated[1])


def test_the_same_prompts_greedy_and_sampled_are_two_requests() -> None:
    settings = with_gate(
        suites=("retention",), retention=RetentionSuiteSettings(decode="sampled", sampled_k=0)
    )
    ((sampled, _),) = prompt_suites(settings, 5)
    ((greedy, _),) = prompt_suites(with_gate(suites=("retention",)), 5)
    assert sampled.prompts == greedy.prompts
    server = RecordingServer()
    gate._generate(server, settings, [sampled, greedy, greedy], seed=5)  # type: ignore[arg-type]
    assert [c["n"] for c in server.calls] == [4, 1]


def test_the_census_is_recorded_as_nothing_drawn() -> None:
    decision = gate_decision(
        n_prompts=75, n_samples=75, seed=125499512, fresh_draw=True, draw=[], census=["retention"]
    )
    text = explain_text(decision.model_dump(mode="json"))
    assert "draw: seed 125499512 (drawn for this challenger); retention: census, nothing drawn" in text


def test_the_entropy_estimate_reads_only_sampled_suites() -> None:
    """A greedy token is the argmax: its −log p is not a sample of the entropy, so a census's tokens
    stay out of the entropy alarm; with no sampled suite it has nothing to read and cannot fire."""
    settings = with_gate(suites=("retention", "oracle"))
    retention, oracle = (s for s, _ in prompt_suites(settings, 5))

    def model(greedy_lp: float, sampled_lp: float) -> list[list[list[Generation]]]:
        return [
            [
                [Generation(text=" 1", logprobs=(greedy_lp,) * 2, finish_reason="stop")]
                for _ in retention.prompts
            ],
            [
                [Generation(text=" 1", logprobs=(sampled_lp,), finish_reason="stop")] * 4
                for _ in oracle.prompts
            ],
        ]

    sharp = gate._behaviour([retention, oracle], model(-0.001, -0.5), settings)
    assert sharp.entropy == pytest.approx(0.5)  # the argmaxes' -0.001 left out
    assert sharp.mean_tokens == pytest.approx((75 * 2 + 48 * 4) / (75 + 48 * 4))  # the rest reads all
    only_greedy = gate._behaviour([retention], model(-0.001, -0.5)[:1], settings)
    champion = gate._behaviour([retention], model(-0.5, -0.5)[:1], settings)
    assert only_greedy.entropy == champion.entropy == 0.0
    entropy = next(
        a
        for a in alarms.generation_alarms(only_greedy, champion, settings.gate.alarms)
        if a.name == "entropy"
    )
    assert not entropy.fired
