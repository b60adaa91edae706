"""The ope suite's estimator choice (deployer/gate_dr.py, docs/gate.md Suites: ope): SNIPS when it is
conclusive, with nothing sampled; the doubly robust estimate when it is not and the reward model
explains something; SNIPS, inconclusive, when it explains nothing; the note and fields say which
decided. The staging sampling is injected at the `Sampler` boundary, the decoded completions at the
`Texts` one, so no service runs. On the real staging server: tests/deployer/test_deployer_rollout.py
::test_the_ope_suite_with_dr_samples_the_held_out_prompts_on_staging."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deployer import gate, gate_dr, gate_suites, ope
from deployer.gate_suites import SuiteResult, _ope_verdict
from schemas.clock import utcnow
from schemas.events import SamplingParams
from schemas.settings import Settings
from serving import Generation
from store.episodes import TrainingEpisode, TrainingSegment

pytestmark = pytest.mark.unit


def with_ope(**update: Any) -> Settings:
    settings = Settings()
    gate_cfg = settings.gate.model_copy(update={"ope": settings.gate.ope.model_copy(update=update)})
    return settings.model_copy(update={"gate": gate_cfg})


def episode(i: int, reward: float, segments: int = 1, max_tokens: int | None = 16) -> ope.Logged:
    sampling = SamplingParams(temperature=0.7, max_tokens=max_tokens, stop=["\n"])
    segment = ((1, 2), (3, 4, 5), (-1.0, -1.0, -1.0), object())
    return ope.Logged(
        episode_id=f"e{i}",
        reward=reward,
        no_feedback=False,
        behaviour=-3.0,
        tokens=3,
        segments=(segment,) * segments,
        prompt=f"prompt {i}" if segments == 1 else None,
        sampling=sampling if segments == 1 else None,
    )


class FakeSampler:
    """What the staging server would answer: the challenger always says yes, the others half the time."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[gate_dr.DrPrompt]]] = []

    def __call__(
        self, models: Sequence[str], prompts: Sequence[gate_dr.DrPrompt]
    ) -> Mapping[str, list[list[Generation]]]:
        self.calls.append((list(models), list(prompts)))

        def gens(model: str, i: int) -> list[Generation]:
            text = "yes indeed" if model == "challenger" or i % 2 else "no way"
            return [Generation(text=text, logprobs=(-1.0, -1.0), finish_reason="stop")] * 2

        return {model: [gens(model, i) for i in range(len(prompts))] for model in models}


def world(
    settings: Settings, n: int = 50, explained: bool = True, multi: int = 0, shift: float = 2.0
) -> dict[str, Any]:
    """`n` logged episodes (the last `multi` of them multi-segment) whose reward is 1 for a "yes"
    completion (with `explained`; otherwise noise unrelated to the text), the challenger's weights far
    from the logging policy's (SNIPS's ESS below 32), and the SNIPS verdicts of both comparisons."""
    rng = np.random.default_rng(0)
    yes = rng.random(n) < 0.5
    rewards = yes.astype(float) if explained else rng.random(n)
    logged = [episode(i, float(rewards[i]), 2 if i >= n - multi else 1) for i in range(n)]
    texts = [("yes indeed" if y else "no way", "stop") for y in yes]
    behaviour = [e.behaviour for e in logged]
    chal = [b + (shift if y else -shift) for b, y in zip(behaviour, yes, strict=True)]
    champ = list(behaviour)
    verdict, _ = _ope_verdict(settings, logged, chal, champ, 1, "", "champion")
    anchored, _ = _ope_verdict(settings, logged, chal, champ, 1, "", "anchor")
    return {
        "logged": logged,
        "texts": texts,
        "logps": {"challenger": chal, "champion": champ, "anchor": champ},
        "snips": (verdict, anchored),
    }


def choose(
    settings: Settings, w: dict[str, Any], sampler: Any, anchored: bool = False
) -> tuple[SuiteResult, Any]:
    decoded: list[int] = []

    def texts() -> list[tuple[str, str]]:
        decoded.append(1)
        return list(w["texts"])

    snips = w["snips"] if anchored else (w["snips"][0], None)
    result = gate_dr.choose(settings, w["logged"], w["logps"], snips, sampler, texts, 1)
    w["decoded"] = bool(decoded)
    return result


def test_auto_keeps_a_conclusive_snips_verdict_and_samples_nothing() -> None:
    settings = with_ope()
    w = world(settings, shift=0.0)
    sampler = FakeSampler()
    verdict, _ = choose(settings, w, sampler)
    assert w["snips"][0].conclusive
    assert verdict.estimator == "snips" and verdict.r2 is None and verdict.conclusive
    assert verdict.difference == w["snips"][0].difference
    assert sampler.calls == [] and not w["decoded"]
    assert verdict.note.startswith("estimator snips (conclusive: nothing sampled)")


def test_auto_turns_to_dr_when_snips_is_inconclusive_and_the_reward_model_explains_the_rewards() -> None:
    settings = with_ope()
    w = world(settings)
    sampler = FakeSampler()
    verdict, anchored = choose(settings, w, sampler)
    assert not w["snips"][0].conclusive and w["snips"][0].ess is not None and w["snips"][0].ess < 32
    assert anchored is None
    assert [models for models, _ in sampler.calls] == [["challenger", "champion"]]
    assert verdict.estimator == "dr" and verdict.r2 is not None and verdict.r2 > 0.5
    assert verdict.conclusive  # ESS above 32 x (1 - R²)
    assert verdict.ess == w["snips"][0].ess  # the same weights
    assert verdict.passed  # the challenger says yes, the champion half the time
    assert verdict.difference is not None and verdict.difference.estimate > 0.3
    for part in (
        "estimator dr",
        "out-of-fold R²",
        "effective sample size",
        "clipped at 10",
        "without clipping",
    ):
        assert part in verdict.note
    assert "SNIPS: " in verdict.note  # SNIPS's figures stay in the note


def test_auto_keeps_snips_inconclusive_when_the_reward_model_explains_nothing() -> None:
    settings = with_ope()
    w = world(settings, explained=False)
    sampler = FakeSampler()
    verdict, _ = choose(settings, w, sampler)
    assert sampler.calls == []  # the reward model is fitted before anything is sampled
    assert verdict.estimator == "snips" and not verdict.conclusive and verdict.passed is None
    assert verdict.r2 is not None and verdict.r2 <= 0
    assert "doubly robust not used" in verdict.note


def test_dr_always_uses_the_doubly_robust_estimate() -> None:
    settings = with_ope(estimator="dr")
    w = world(settings, explained=False, shift=0.0)
    sampler = FakeSampler()
    verdict, _ = choose(settings, w, sampler)
    assert len(sampler.calls) == 1
    assert verdict.estimator == "dr"
    assert verdict.r2 is not None and verdict.r2 <= 0


def test_snips_never_samples() -> None:
    settings = with_ope(estimator="snips")
    w = world(settings)
    sampler = FakeSampler()
    verdict, _ = choose(settings, w, sampler)
    assert sampler.calls == [] and verdict.estimator == "snips" and not verdict.conclusive


def test_without_a_sampler_snips_decides_and_says_why() -> None:
    settings = with_ope(estimator="dr")
    w = world(settings)
    verdict, _ = choose(settings, w, None)
    assert verdict.estimator == "snips" and "no staging sampler" in verdict.note


def test_the_anchor_is_sampled_and_judged_with_the_same_estimator() -> None:
    settings = with_ope()
    w = world(settings)
    sampler = FakeSampler()
    verdict, anchored = choose(settings, w, sampler, anchored=True)
    assert [models for models, _ in sampler.calls] == [["challenger", "champion", "anchor"]]
    assert verdict.estimator == anchored.estimator == "dr"
    assert "anchor" in anchored.note


def test_multi_segment_episodes_keep_snips_terms_and_lower_the_r2_by_their_share() -> None:
    settings = with_ope()
    w = world(settings, multi=10)
    sampler = FakeSampler()
    verdict, _ = choose(settings, w, sampler)
    assert len(sampler.calls[0][1]) == 40  # only single-segment prompts are sampled
    assert verdict.estimator == "dr"
    assert "10 multi-segment with SNIPS terms" in verdict.note
    assert "x 80% single-segment" in verdict.note


def test_prompts_keep_their_logged_sampling_and_requests_are_grouped_by_it() -> None:
    settings = Settings()
    logged = [episode(0, 1.0), episode(1, 0.0, max_tokens=None), episode(2, 1.0, segments=2)]
    prompts = gate_dr.dr_prompts(settings, logged)
    assert [p.prompt for p in prompts] == ["prompt 0", "prompt 1"]
    assert prompts[0].max_tokens == 16 and prompts[1].max_tokens == settings.gate.traffic.max_tokens
    assert dict(prompts[0].sampling)["temperature"] == 0.7 and prompts[0].stop == ("\n",)

    class Server:
        def __init__(self) -> None:
            self.requests: list[dict[str, Any]] = []

        def sample(self, prompts: list[str], **kwargs: Any) -> list[list[Generation]]:
            self.requests.append({"prompts": prompts, **kwargs})
            return [[Generation(text=p, logprobs=(), finish_reason="stop")] * kwargs["n"] for p in prompts]

    server = Server()
    out = gate_dr.sample_on(server, prompts, 2, seed=5)  # type: ignore[arg-type]
    assert [[g.text for g in gens] for gens in out] == [["prompt 0"] * 2, ["prompt 1"] * 2]
    assert len(server.requests) == 2  # two max_tokens: two requests
    assert server.requests[0]["sampling"]["temperature"] == 0.7 and server.requests[0]["seed"] == 5
    many = [prompts[0]] * (2 * gate_dr.DR_REQUEST_PROMPTS + 1)  # one sampling, in three requests
    server.requests.clear()
    assert len(gate_dr.sample_on(server, many, 1, seed=5)) == len(many)  # type: ignore[arg-type]
    assert [len(r["prompts"]) for r in server.requests] == [64, 64, 1]


def test_the_settings_defaults() -> None:
    ope_settings = Settings().gate.ope
    assert ope_settings.estimator == "auto" and ope_settings.dr_samples == 2
    with pytest.raises(ValueError):
        with_ope().gate.ope.model_validate({"dr_samples": 0})


def test_the_records_name_the_estimator_and_the_r2() -> None:
    class Registry:
        model_name = "rtrl-policy"

        def __init__(self) -> None:
            self.tags: dict[str, str] = {}
            self.metrics: dict[str, float] = {}

        def tag_version(self, version: int, tags: dict[str, str]) -> None:
            self.tags.update(tags)

        def version_run_id(self, version: int) -> str:
            return "run"

        def log_metrics(self, run_id: str, figures: dict[str, float]) -> None:
            self.metrics.update(figures)

        def log_json(self, run_id: str, files: dict[str, object]) -> None:
            pass

    settings = with_ope()
    w = world(settings)
    verdict, _ = choose(settings, w, FakeSampler())
    decision = gate.GateDecision(
        passed=True,
        challenger_version=2,
        champion_version=1,
        challenger_score=verdict.challenger,
        champion_score=verdict.champion,
        tolerance=0.02,
        confidence=0.95,
        n_prompts=0,
        n_samples=0,
        suites=[verdict],
        reason="",
        decided_at=utcnow(),
    )
    registry = Registry()
    gate.record(settings, registry, decision)  # type: ignore[arg-type]
    assert registry.tags["gate_suite_ope_estimator"] == "dr"
    assert registry.metrics["gate/ope/dm_r2"] == pytest.approx(verdict.r2)


def test_the_ope_suite_hands_its_snips_verdict_and_logprobs_to_the_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ope_suite` end to end with the store, the forward passes and the decoding faked at their
    function boundaries: the held-out episodes' prompts reach the sampler, and the verdict is DR's."""
    rng = np.random.default_rng(2)
    yes = rng.random(50) < 0.5
    sampling = SamplingParams(temperature=0.7, max_tokens=16, logprobs_mode="processed")
    episodes = [
        TrainingEpisode(
            episode_id=f"e{i}",
            reward=float(y),
            policy_version=1,
            created_at=datetime(2026, 1, 1, tzinfo=UTC),
            segments=[
                TrainingSegment(f"prompt {i}", [1, 2], [3, 4], [-1.0, -1.0], True, "assistant", 1, sampling)
            ],
        )
        for i, y in enumerate(yes)
    ]

    class FakeStore:
        def select_heldout(self, n: int, **kwargs: Any) -> list[TrainingEpisode]:
            return episodes

    def scored(weights: ope.Weights, logged: list[ope.Logged]) -> ope.Scored:
        shift = 2.0 if weights.path.name == "challenger" else 0.0
        lp = [e.behaviour + (shift if y else -shift) for e, y in zip(logged, yes, strict=True)]
        return ope.Scored(lp, lp)

    monkeypatch.setattr(ope, "sequence_logprobs", scored)
    texts = [("yes indeed" if y else "no way", "stop") for y in yes]
    monkeypatch.setattr(ope, "completion_texts", lambda weights, logged: texts)
    sampler = FakeSampler()
    suite, _, anchored, _ = gate_suites.ope_suite(
        with_ope(),
        FakeStore(),  # type: ignore[arg-type]
        ope.Weights(Path("challenger")),
        ope.Weights(Path("champion")),
        seed=1,
        sample=sampler,
    )
    assert anchored is None and suite.n == 50, suite.note
    assert [p.prompt for p in sampler.calls[0][1]] == [f"prompt {i}" for i in range(50)]
    assert suite.estimator == "dr" and suite.conclusive and suite.passed
