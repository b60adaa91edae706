"""The simulated agents' environment rules (simulation/agents.py): prune actions, prompts, PARL's sub-agent
plan, the scenarios' reward specs and the demo's labeler settings for them. No server: the calls
themselves are exercised by the demo through the real loop."""

from __future__ import annotations

import pytest

from evals.tasks import EXCLAIM
from schemas.errors import OperatorError
from schemas.rewards import get_spec
from schemas.settings import JudgeSettings, Settings
from simulation.agents import (
    SCENARIO_SPECS,
    SCENARIOS,
    ScenarioError,
    after_summary_prompt,
    call_seed,
    check_scenario,
    context_prompt,
    continue_prompt,
    episode_id,
    episode_rng,
    make_chunks,
    needs_summary,
    orchestrator_final_prompt,
    other_prompts,
    parl_segments,
    prune_action,
    prune_prompt,
    pruned,
    subagent_calls,
    subagent_count,
    summary_prompt,
)
from simulation.demo import _scenario_labeler

pytestmark = pytest.mark.unit

Q = "Q: What is 3 plus 4?\nA:"


def test_every_scenario_has_a_spec_that_resolves() -> None:
    assert set(SCENARIO_SPECS) == set(SCENARIOS) == {"parl", "summarize", "self-edit"}
    assert get_spec(SCENARIO_SPECS["parl"]).parl is not None
    assert get_spec(SCENARIO_SPECS["self-edit"]).judge is not None
    assert get_spec(SCENARIO_SPECS["summarize"]).spec_id == "tab-v1@2"


def test_an_unknown_scenario_is_an_operator_error() -> None:
    assert check_scenario("parl") == "parl"
    with pytest.raises(ScenarioError, match="known scenarios: parl, summarize, self-edit") as caught:
        check_scenario("tree-search")
    assert isinstance(caught.value, OperatorError)


# ---- self-edit: the prune action -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "dropped"),
    [
        (" [2]", (1,)),  # names chunk 2
        (" 1 and 3", (0, 2)),  # names chunks 1 and 3
        (" 4321", (0, 1, 2, 3)),  # names all of them
        (" 7.", (3,)),  # names none: len 3 % 4 = 3
        ("", (0,)),  # names none: len 0 % 4 = 0
        (" It is 9.", (1,)),  # names none (9 is no chunk): len 9 % 4 = 1
    ],
)
def test_prune_action(completion: str, dropped: tuple[int, ...]) -> None:
    assert prune_action(completion) == dropped


def test_the_pruned_context_lacks_exactly_the_dropped_chunks() -> None:
    chunks = ["[1] a 1", "[2] b 2", "[3] c 3", "[4] d 4"]
    first = context_prompt(chunks, Q)
    assert first == "[1] a 1\n[2] b 2\n[3] c 3\n[4] d 4\n" + Q
    action = prune_prompt(first, " 7.")
    assert action == first + " 7.\nPrune:"
    kept = pruned(chunks, prune_action(" 2 and 4"))
    assert kept == ["[1] a 1", "[3] c 3"]
    third = context_prompt(kept, Q)
    assert third == "[1] a 1\n[3] c 3\n" + Q and third.endswith("A:")
    assert [c for c in chunks if c not in third] == ["[2] b 2", "[4] d 4"]


def test_chunks_are_other_questions_numbered_and_deterministic() -> None:
    chunks = make_chunks(EXCLAIM, Q, episode_rng("self-edit", 3, 7))
    assert chunks == make_chunks(EXCLAIM, Q, episode_rng("self-edit", 3, 7))
    assert chunks != make_chunks(EXCLAIM, Q, episode_rng("self-edit", 3, 8))
    assert [c[:4] for c in chunks] == ["[1] ", "[2] ", "[3] ", "[4] "]
    assert len(set(chunks)) == 4 and not any("What is 3 plus 4?" in c for c in chunks)
    assert "\n" not in "".join(chunks)  # one chunk a line: pruning removes whole lines


# ---- parl --------------------------------------------------------------------------------------------


def test_parl_spawns_wide_when_the_first_answer_is_preferred() -> None:
    assert (subagent_count(True), subagent_count(False)) == (3, 1)
    assert [subagent_calls(agent) for agent in (1, 2, 3)] == [2, 1, 2]


def test_parl_segment_indices_follow_the_episode_order() -> None:
    # Orchestrator 0; sub-1 makes 2 calls, sub-2 1, sub-3 2; the final orchestrator call last.
    assert parl_segments([2, 1, 2]) == ([[1, 2], [3], [4, 5]], 6)
    assert parl_segments([2]) == ([[1, 2]], 3)


def test_parl_prompts_end_where_the_model_answers() -> None:
    own = other_prompts(EXCLAIM, Q, episode_rng("parl", 0, 1), 3)
    assert len(own) == 3 and Q not in own and all(p.startswith("Q: ") and p.endswith("\nA:") for p in own)
    second = continue_prompt(own[0], " 5!", own[1])
    assert second == f"{own[0]} 5!\n{own[1]}" and second.startswith(own[0]) and second.endswith("\nA:")
    final = orchestrator_final_prompt(Q, " 7.", [" 5!", " It is 2."])
    assert final == "Q: What is 3 plus 4?\nA: 7.\nNotes: 5! It is 2.\nQ: What is 3 plus 4?\nA:"


# ---- summarize ---------------------------------------------------------------------------------------


def test_summaries_start_past_the_trigger_and_work_continues_from_the_summary() -> None:
    assert len(Q) == 23
    assert not needs_summary(Q, " 7!", 40)  # 26 characters
    assert not needs_summary(Q, " The answer is 7!", 40)  # exactly 40: not past it
    assert needs_summary(Q, " The answer is 70!", 40)  # 41
    assert summary_prompt(Q, " 7!") == Q + " 7!\nSummary:"
    after = after_summary_prompt(" three and four ", Q)
    assert after == "Summary:three and four\n" + Q and after.endswith("A:")


# ---- ids and seeds -------------------------------------------------------------------------------------


def test_episode_ids_and_call_seeds() -> None:
    assert episode_id("self-edit", 1001, 7) == "self-edit-1001-7"
    assert episode_id("parl", 2, 0, run="abc") == "parl-abc-2-0"
    seeds = {
        call_seed(seed, index, segment) for seed in range(3) for index in range(50) for segment in range(8)
    }
    assert len(seeds) == 3 * 50 * 8


# ---- the demo's labeler for a scenario ----------------------------------------------------------------


def test_the_demo_sets_the_scenarios_spec_and_a_judge_for_self_edit() -> None:
    settings = Settings()
    assert _scenario_labeler(settings, "parl") == {"reward_spec": "parl-v1"}
    assert _scenario_labeler(settings, "summarize") == {"reward_spec": "tab-v1"}
    self_edit = _scenario_labeler(settings, "self-edit")
    assert self_edit["reward_spec"] == "judged-v1"
    assert self_edit["judge"] == JudgeSettings(
        url=f"{settings.vllm.servers[0]}/v1", model=settings.vllm.served_model_name
    )
    configured = JudgeSettings(url="http://judge:8000/v1", model="big")
    mine = settings.model_copy(update={"labeler": settings.labeler.model_copy(update={"judge": configured})})
    assert _scenario_labeler(mine, "self-edit") == {"reward_spec": "judged-v1"}  # the configured judge stays
    with pytest.raises(OperatorError, match="unknown scenario"):
        _scenario_labeler(settings, "nope")
