"""The gate's traffic suite (deployer/traffic.py, docs/gate.md): held-out logged prompts drawn per
challenger with the run's seed, scored without a judge by whether the completion answers and
finishes, inconclusive below `gate.traffic.min_prompts`. On the real staging server:
tests/deployer/test_deployer_rollout.py::test_the_traffic_suite_passes_the_same_weights_on_held_out_prompts."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from factories import HOLDOUT_KEY, T0, Feeder, at, interaction
from pydantic import ValidationError

from deployer import traffic
from deployer.gate import decide
from deployer.gate_suites import prompt_suites, score_prompts
from evals.stats import paired_interval
from schemas.settings import GateSettings, JudgeSettings, Settings, TrafficSettings
from serving import Generation
from store import Store
from store.episodes import HeldoutPrompt
from store.settle import eval_bucket

pytestmark = pytest.mark.unit


def with_gate(**update: Any) -> Settings:
    settings = Settings()
    return settings.model_copy(update={"gate": settings.gate.model_copy(update=update)})


def traffic_settings(**update: Any) -> Settings:
    """The traffic suite alone, the held-out slice at half of the buckets."""
    settings = with_gate(suites=("traffic",))
    gate = settings.gate
    return with_gate(
        suites=("traffic",),
        ope=gate.ope.model_copy(update={"holdout_percent": 50}),
        traffic=gate.traffic.model_copy(update=update),
    )


def pool(n: int, tenants: int = 1) -> list[HeldoutPrompt]:
    """`n` distinct prompts, newest first, spread over `tenants` tenants."""
    return [
        HeldoutPrompt(f"e{i}", f"t{i % tenants}", f"prompt {i}", T0 - timedelta(seconds=i)) for i in range(n)
    ]


def gen(text: str, finish: str = "stop") -> Generation:
    return Generation(text=text, logprobs=(-1.0,), finish_reason=finish)


# ---- the draw ------------------------------------------------------------------------------------


def test_the_draw_is_a_seeded_subset_the_same_per_seed_and_another_for_another_seed() -> None:
    prompts = pool(100)
    drawn = traffic.draw(prompts, 10, seed=7)
    assert len(drawn) == 10 and drawn == traffic.draw(prompts, 10, seed=7)  # judged again: the same
    assert [p.episode_id for p in drawn] != [p.episode_id for p in traffic.draw(prompts, 10, seed=8)]
    assert drawn == sorted(drawn, key=lambda p: p.created_at, reverse=True)  # newest first
    assert drawn != prompts[:10]  # not the newest: drawn from the whole pool
    # Ranked by the SHA-256 of the seed and the episode id: the same in every process.
    assert [p.episode_id for p in traffic.draw(pool(20), 3, seed=12345)] == ["e0", "e17", "e18"]  # pinned
    assert traffic.draw(prompts, 10, seed=None) == prompts[:10]  # fresh draws off: the newest
    assert traffic.draw(prompts[:4], 10, seed=7) == prompts[:4]  # fewer than asked: all of them


def test_the_draw_keeps_one_per_prompt_text_and_caps_each_tenant() -> None:
    prompts = pool(30, tenants=3)
    capped = traffic.draw(prompts, 12, seed=3, per_tenant=2)
    assert len(capped) == 6 and all(sum(p.tenant == t for p in capped) == 2 for t in ("t0", "t1", "t2"))
    repeated = [*pool(3), HeldoutPrompt("e9", "t0", "prompt 0", T0 - timedelta(days=1))]
    assert [p.episode_id for p in traffic.draw(repeated, 10, seed=None)] == ["e0", "e1", "e2"]


# ---- scoring without a judge ---------------------------------------------------------------------


def test_without_a_judge_a_completion_scores_1_when_it_answers_and_finishes() -> None:
    settings = traffic_settings()
    score = traffic.answered(settings.gate.alarms.no_action_pattern)
    assert score("p", " It is 7.", {}) == 1.0
    assert score("p", "Could you clarify what you mean?", {}) == 0.0  # a non-answer
    assert score("p", "I'm sorry, I can't help with that.", {}) == 0.0
    assert score("p", "  ", {}) == 0.0
    suite = traffic.PromptSuite(
        name="traffic",
        prompts=("a", "b", "c"),
        lines=({}, {}, {}),
        scorer=score,
        max_tokens=4,
        cut_off_fails=True,
        note="3 prompts",
    )
    challenger = [
        [gen(" 7."), gen(" 7 and then", "length")],  # one cut off by max_tokens: 0
        [gen("Which one?"), gen(" red.")],
        [gen(" yes."), gen(" no.")],
    ]
    champion = [[gen(" 7."), gen(" 8.")], [gen(" blue."), gen(" red.")], [gen(" yes."), gen("?")]]
    result = score_prompts(suite, challenger, champion, settings, seed=5)
    ours, theirs = [0.5, 0.5, 1.0], [1.0, 1.0, 0.5]
    cfg = settings.gate
    assert (result.challenger, result.champion) == (pytest.approx(2 / 3), pytest.approx(5 / 6))
    assert result.difference == paired_interval(
        ours, theirs, confidence=cfg.confidence, resamples=cfg.bootstrap_resamples, seed=5
    )
    assert result.note == "3 prompts" and result.conclusive and result.n == 3
    # The same suite without cut_off_fails scores the cut-off completion by its text.
    kept = score_prompts(
        traffic.PromptSuite("t", ("a",), ({},), score, 4), [challenger[0]], [challenger[0]], settings
    )
    assert kept.challenger == 1.0


# ---- the suite from the store ----------------------------------------------------------------------


def held_out(store: Store, n: int, tenant: str = "default") -> list[str]:
    """`n` held-out episodes (buckets below 50) with distinct prompts, the i-th at T0 + i s."""
    episodes = [f"x{i}" for i in range(400) if eval_bucket(f"x{i}", HOLDOUT_KEY) < 50][:n]
    assert len(episodes) == n
    Feeder(store).send(
        *[
            interaction(e, prompt=f"Q{i}?\nA:", tenant=tenant, created_at=at(i))
            for i, e in enumerate(episodes)
        ]
    )
    return episodes


def test_with_too_little_held_out_traffic_the_suite_is_inconclusive_and_samples_nothing(store: Store) -> None:
    held_out(store, 5)
    settings = traffic_settings(min_prompts=6, max_prompts=8)
    replayed = traffic.traffic_suite(settings, store, seed=1)
    assert replayed.suite is None and replayed.episodes == []
    verdict = replayed.verdict
    assert verdict is not None and not verdict.conclusive and verdict.passed is None and verdict.n == 5
    assert "fewer than gate.traffic.min_prompts 6" in verdict.note
    assert "gate.ope.holdout_percent 50" in verdict.note
    passed, reason = decide([verdict], [])
    assert not passed and reason.startswith("no suite was conclusive: traffic: 5 prompts")


def test_the_suite_holds_the_drawn_prompts_and_the_settings(store: Store) -> None:
    episodes = held_out(store, 12)
    settings = traffic_settings(min_prompts=4, max_prompts=6, max_tokens=16, stop=("\n",))
    replayed = traffic.traffic_suite(settings, store, seed=42)
    suite = replayed.suite
    assert suite is not None and replayed.verdict is None and len(replayed.episodes) == 6
    assert set(replayed.episodes) <= set(episodes)
    assert suite.prompts == tuple(f"Q{episodes.index(e)}?\nA:" for e in replayed.episodes)
    assert [line["episode_id"] for line in suite.lines] == replayed.episodes
    assert (suite.max_tokens, suite.stop, suite.judge, suite.cut_off_fails) == (16, ("\n",), None, True)
    assert "no judge: not a measure of quality" in suite.note
    assert traffic.traffic_suite(settings, store, seed=42).episodes == replayed.episodes
    assert traffic.traffic_suite(settings, store, seed=43).episodes != replayed.episodes
    newest = traffic.traffic_suite(settings, store, seed=None).episodes
    assert newest == episodes[::-1][:6]  # gate.fresh_draws off: the newest
    assert traffic.traffic_suite(with_gate(suites=("ope",)), store, seed=1) == traffic.TrafficDraw()


def test_with_a_judge_the_judge_grades_the_suite(store: Store) -> None:
    held_out(store, 4)
    judge = JudgeSettings(url="http://judge.invalid/v1", model="grader")
    settings = traffic_settings(min_prompts=2, max_prompts=4)
    settings = settings.model_copy(update={"gate": settings.gate.model_copy(update={"judge": judge})})
    suite = traffic.traffic_suite(settings, store, seed=1).suite
    assert suite is not None and suite.judge == judge and not suite.cut_off_fails
    assert "graded by the judge grader" in suite.note


# ---- settings ------------------------------------------------------------------------------------


def test_traffic_is_the_default_and_a_deployment_without_the_task_reads_none() -> None:
    # The tenant's own traffic, nothing tied to a task: a deployment with no `exclaim` task gates as is.
    assert Settings().gate.suites == ("ope", "traffic")
    assert TrafficSettings() == TrafficSettings(
        max_prompts=64, pool=512, min_prompts=16, per_tenant=None, max_tokens=64, stop=()
    )
    with pytest.raises(ValidationError, match="min_prompts"):
        TrafficSettings(min_prompts=20, max_prompts=10)
    with pytest.raises(ValidationError, match="pool"):
        TrafficSettings(max_prompts=100, pool=50)
    assert GateSettings(suites=("ope", "traffic")).suites == ("ope", "traffic")
    # No task suite configured: no task is read, so a missing one is no error.
    assert prompt_suites(with_gate(suites=("ope", "traffic"), task="no-such-task")) == []


def test_a_tenant_lines_gate_replays_its_own_tenants_prompts_only(store: Store) -> None:
    # docs/lora.md, An adapter per tenant: a tenant adapter is judged on its users' traffic, the
    # global adapter on everyone else's.
    acme = held_out(store, 6, tenant="acme")
    store.set_tenant("acme", adapter=True)
    settings = traffic_settings(min_prompts=2, max_prompts=8)
    assert set(traffic.traffic_suite(settings, store, seed=1, tenant="acme").episodes) == set(acme)
    global_draw = traffic.traffic_suite(settings, store, seed=1)
    assert global_draw.suite is None and global_draw.verdict is not None  # nobody else sent any
