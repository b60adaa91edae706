"""Reward specs: hand-worked rewards under tab-v1, combination rules, spec files."""

import json

import pytest

from schemas.errors import OperatorError
from schemas.events import FeedbackEvent, FeedbackKind, FeedbackSignal
from schemas.rewards import (
    JUDGED_V1,
    NO_FEEDBACK,
    PARL_V1,
    TAB_V1,
    JudgeTerm,
    ParlShaping,
    RewardSpec,
    RewardSpecError,
    Shaping,
    get_spec,
    judge_disagrees,
    outcome_of,
    score,
)

pytestmark = pytest.mark.unit

K = FeedbackKind


def sig(kind: FeedbackKind, value: float = 1.0) -> FeedbackSignal:
    text = "The answer is 7." if kind == K.correction else None  # a correction carries its text
    return FeedbackSignal(kind=kind, value=value, text=text)


def test_single_signals_take_their_weight() -> None:
    assert score(TAB_V1, [sig(K.accepted)]).reward == 0.75
    assert score(TAB_V1, [sig(K.rejected)]).reward == -0.25
    assert score(TAB_V1, [sig(K.edit_persisted)]).reward == 1.0
    assert score(TAB_V1, [sig(K.followup_dissatisfied)]).reward == -0.5
    assert score(TAB_V1, [sig(K.tool_call_error)]).reward == -1.0


def test_kinds_add_up_and_repeats_count_once() -> None:
    # accepted (0.75) + edit_reverted (-0.5); the retried 'accepted' does not count twice.
    result = score(TAB_V1, [sig(K.accepted), sig(K.accepted), sig(K.edit_reverted)])
    assert result.reward == pytest.approx(0.25)
    assert result.components == {"accepted": 0.75, "edit_reverted": -0.5}
    assert result.spec_id == "tab-v1@2"


def test_scored_kinds_use_value_times_weight_of_the_last_signal() -> None:
    # task_outcome 1.0 x 0.4 (the later of 0.9 and 0.4) + judge_score 0.5 x 0.8 + accepted 0.75 = 1.55
    result = score(
        TAB_V1, [sig(K.task_outcome, 0.9), sig(K.accepted), sig(K.judge_score, 0.8), sig(K.task_outcome, 0.4)]
    )
    assert result.components == {
        "accepted": 0.75,
        "task_outcome": pytest.approx(0.4),
        "judge_score": pytest.approx(0.4),
    }
    assert result.reward == pytest.approx(1.55)


def test_no_feedback_is_an_explicit_zero() -> None:
    result = score(TAB_V1, [])
    assert result.reward == 0.0
    assert result.components == {NO_FEEDBACK: 0.0}


def test_feedback_events_and_plain_strings_are_signals_too() -> None:
    event = FeedbackEvent(event_id="f1", request_id="r1", kind=K.thumbs_down)
    assert score(TAB_V1, [event]).reward == -0.5

    class Row:
        kind = "thumbs_up"
        value = 1.0

    assert score(TAB_V1, [Row()]).reward == 0.5


def test_terminal_kinds() -> None:
    assert {K.edit_persisted, K.task_outcome, K.rejected} <= TAB_V1.terminal
    assert not {K.accepted, K.edited, K.judge_score} & TAB_V1.terminal


def test_spec_must_weight_every_kind() -> None:
    with pytest.raises(ValueError, match="no weight"):
        RewardSpec(name="partial", version=1, weights={K.accepted: 1.0}, terminal=frozenset())


def test_spec_from_json_file(tmp_path) -> None:
    weights = {kind.value: 0.0 for kind in K} | {"accepted": 2.0, "task_outcome": 1.0}
    path = tmp_path / "mine.json"
    path.write_text(
        json.dumps(
            {
                "name": "mine",
                "version": 3,
                "weights": weights,
                "terminal": ["accepted"],
                "primary": "task_outcome",
            }
        )
    )
    spec = get_spec(str(path))
    assert spec.spec_id == "mine@3"
    assert score(spec, [sig(K.accepted), sig(K.rejected)]).reward == 2.0
    assert get_spec("tab-v1") is TAB_V1
    with pytest.raises(RewardSpecError, match="unknown reward spec 'nope'.*RTRL_LABELER__REWARD_SPEC"):
        get_spec("nope")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(OperatorError, match="broken.json"):
        get_spec(str(tmp_path / "broken.json"))


def test_a_json_spec_is_read_once_until_the_file_changes(tmp_path) -> None:
    weights = {kind.value: 0.0 for kind in K} | {"accepted": 1.0, "task_outcome": 1.0}
    path = tmp_path / "mine.json"
    path.write_text(
        json.dumps(
            {
                "name": "mine",
                "version": 1,
                "weights": weights,
                "terminal": ["accepted"],
                "primary": "task_outcome",
            }
        )
    )
    first = get_spec(str(path))
    assert get_spec(str(path)) is first  # no second read of the same file
    path.write_text(
        json.dumps(
            {
                "name": "mine",
                "version": 22,
                "weights": weights,
                "terminal": ["accepted"],
                "primary": "task_outcome",
            }
        )
    )
    assert get_spec(str(path)).spec_id == "mine@22"  # an edited file is read again
    path.unlink()
    with pytest.raises(RewardSpecError, match="mine.json"):
        get_spec(str(path))


def test_rewards_module_is_import_light() -> None:
    import subprocess
    import sys

    code = "import sys, schemas.rewards; bad = {'kafka', 'sqlalchemy', 'torch'} & set(sys.modules); print(sorted(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_scored_values_outside_the_declared_range_are_refused_not_clamped() -> None:
    assert TAB_V1.value_problem(K.task_outcome, 1.0) is None
    assert TAB_V1.value_problem(K.accepted, 5.0) is None  # event kinds ignore their value
    assert (
        TAB_V1.value_problem(K.judge_score, 1e6)
        == "judge_score value 1e+06 is outside [-1, 1] of reward spec tab-v1@2"
    )
    with pytest.raises(ValueError, match="value_range"):
        RewardSpec(
            name="x",
            version=1,
            weights=TAB_V1.weights,
            terminal=frozenset(),
            value_range={K.task_outcome: (0, 1)},
        )


def test_a_declared_reward_range_clamps_and_says_by_how_much() -> None:
    spec = TAB_V1.model_copy(update={"name": "tab-clamped", "reward_range": (-1.0, 1.0)})
    result = score(spec, [sig(K.accepted), sig(K.edit_persisted), sig(K.thumbs_up)])
    assert result.reward == 1.0
    assert result.components["clamped"] == pytest.approx(-1.25)  # 0.75 + 1.0 + 0.5 = 2.25
    assert sum(result.components.values()) == pytest.approx(result.reward)
    assert "clamped" not in score(spec, [sig(K.accepted)]).components
    assert score(TAB_V1, [sig(K.accepted), sig(K.edit_persisted)]).reward == 1.75  # tab-v1 declares none
    with pytest.raises(ValueError, match="reward_range"):
        RewardSpec.model_validate(TAB_V1.model_dump() | {"reward_range": (1.0, 1.0)})


def test_unfinished_adds_its_weight_with_or_without_feedback() -> None:
    assert TAB_V1.unfinished == -0.5 and TAB_V1.spec_id == "tab-v1@2"
    alone = score(TAB_V1, [], unfinished=True)
    assert (alone.reward, alone.components) == (-0.5, {"no_feedback": 0.0, "unfinished": -0.5})
    assert score(TAB_V1, [sig(K.accepted)], unfinished=True).reward == 0.25
    # A spec that does not count it leaves the reward alone.
    assert score(TAB_V1.model_copy(update={"unfinished": None}), [], unfinished=True).reward == 0.0


# ---- PARL shaping and the judge term ---------------------------------------------------------------


def test_parl_lambdas_anneal_linearly_to_zero() -> None:
    shaping = ParlShaping(lambda_parallel=0.2, lambda_finish=0.4, anneal_cycles=10)
    assert shaping.lambdas(0) == (0.2, 0.4)
    assert shaping.lambdas(5) == pytest.approx((0.1, 0.2))  # half-way
    assert shaping.lambdas(10) == (0.0, 0.0)
    assert shaping.lambdas(25) == (0.0, 0.0)  # past the schedule: never negative
    assert shaping.lambdas(-3) == (0.2, 0.4)


def test_parl_terms_cap_parallelism_at_the_target() -> None:
    shaping = ParlShaping(lambda_parallel=0.2, lambda_finish=0.2, anneal_cycles=10, parallel_target=4)
    assert shaping.terms(2, 1) == (0.5, 0.5)
    assert shaping.terms(4, 3) == (1.0, 0.75)
    assert shaping.terms(6, 6) == (1.0, 1.0)  # more sub-agents than the target earn no more
    assert shaping.terms(0, 0) == (0.0, 0.0)  # nothing spawned: nothing used either
    assert shaping.terms(4, 0) == (
        1.0,
        0.0,
    )  # four sub-agents none of whose results was used: r_parallel only


def test_parl_shaping_adds_components_that_sum_into_the_reward() -> None:
    # parl-v1 at cycle 5: λ₁ = λ₂ = 0.2 · (1 − 5/10) = 0.1; 2 sub-agents of target 4, 1 used: 0.5 and 0.5.
    result = score(PARL_V1, [sig(K.rejected)], shaping=Shaping(parl=(2, 1), cycle=5))
    assert result.components == pytest.approx({"rejected": -0.25, "parl_parallel": 0.05, "parl_finish": 0.05})
    assert result.reward == pytest.approx(-0.15)
    assert result.spec_id == "parl-v1@2"
    # Not a PARL episode, or a spec without the shaping: no components.
    assert score(PARL_V1, [sig(K.rejected)]).components == {"rejected": -0.25}
    assert score(TAB_V1, [sig(K.rejected)], shaping=Shaping(parl=(2, 1))).components == {"rejected": -0.25}


def test_parl_shaping_is_inside_the_clamp_of_the_reward_range() -> None:
    spec = PARL_V1.model_copy(update={"name": "parl-clamped", "reward_range": (-1.0, 1.0)})
    assert "clamped" not in score(spec, [sig(K.edit_persisted)]).components  # 1.0 alone is inside
    result = score(spec, [sig(K.edit_persisted)], shaping=Shaping(parl=(4, 4), cycle=0))  # 1.0 + 0.2 + 0.2
    assert result.reward == 1.0
    assert result.components["clamped"] == pytest.approx(-0.4)
    assert sum(result.components.values()) == pytest.approx(result.reward)


def test_the_judge_term_is_weight_times_two_grade_minus_one() -> None:
    assert JUDGED_V1.judge is not None and JUDGED_V1.judge.weight == 0.25
    result = score(JUDGED_V1, [sig(K.accepted)], shaping=Shaping(judge=0.75))
    assert result.components == {"accepted": 0.75, "judge": 0.125}  # 0.25 · (2 · 0.75 − 1)
    assert result.reward == 0.875
    assert score(JUDGED_V1, [], shaping=Shaping(judge=0.0)).components == {"no_feedback": 0.0, "judge": -0.25}
    assert score(JUDGED_V1, [], shaping=Shaping(judge=1.0)).reward == 0.25
    # The judge could not be asked: flagged, worth nothing.
    unavailable = score(JUDGED_V1, [sig(K.rejected)], shaping=Shaping(judge_unavailable=True))
    assert (unavailable.reward, unavailable.components) == (
        -0.25,
        {"rejected": -0.25, "judge_unavailable": 0.0},
    )
    # A spec without a judge has no judge component whatever the labeler measured.
    assert score(TAB_V1, [sig(K.accepted)], shaping=Shaping(judge=0.9)).components == {"accepted": 0.75}
    assert score(TAB_V1, [], shaping=Shaping(judge_unavailable=True)).components == {NO_FEEDBACK: 0.0}


def test_shaping_alone_is_not_feedback() -> None:
    parl = score(PARL_V1, [], shaping=Shaping(parl=(1, 1), cycle=0))  # 0.2 · 1/4 and 0.2 · 1
    assert parl.components == {NO_FEEDBACK: 0.0, "parl_parallel": 0.05, "parl_finish": 0.2}
    assert parl.reward == pytest.approx(0.25)
    judged = score(JUDGED_V1, [], shaping=Shaping(judge=0.75))
    assert judged.components == {NO_FEEDBACK: 0.0, "judge": 0.125}


def test_episode_end_carries_no_reward() -> None:
    assert score(TAB_V1, [sig(K.episode_end)]).components == {NO_FEEDBACK: 0.0}
    assert score(TAB_V1, [sig(K.rejected), sig(K.episode_end)]).components == {"rejected": -0.25}
    assert K.episode_end not in TAB_V1.weights  # the control kinds need no weight


def test_a_json_spec_may_give_episode_end_weight_zero_but_no_other(tmp_path) -> None:
    weights = {kind.value: 0.0 for kind in K} | {"accepted": 1.0, "task_outcome": 1.0}
    path = tmp_path / "zero.json"
    path.write_text(
        json.dumps(
            {
                "name": "zero",
                "version": 1,
                "weights": weights,
                "terminal": ["rejected"],
                "primary": "task_outcome",
            }
        )
    )
    assert score(get_spec(str(path)), [sig(K.accepted), sig(K.episode_end)]).reward == 1.0
    path = tmp_path / "paid.json"
    path.write_text(
        json.dumps(
            {
                "name": "paid",
                "version": 1,
                "weights": weights | {"episode_end": 0.5},
                "terminal": ["rejected"],
                "primary": "task_outcome",
            }
        )
    )
    with pytest.raises(RewardSpecError, match=r"(?s)paid.json.*\['episode_end'\] carry no reward"):
        get_spec(str(path))
    with pytest.raises(ValueError, match="carry no reward"):
        RewardSpec.model_validate(TAB_V1.model_dump() | {"weights": TAB_V1.weights | {K.episode_end: -1.0}})


def test_outcome_is_the_feedback_part_of_the_reward() -> None:
    assert outcome_of({"rejected": -0.25, "judge": 0.15, "parl_parallel": 0.2, "unfinished": -0.5}) == -0.25
    assert outcome_of({"accepted": 0.75, "edit_reverted": -0.5}) == 0.25
    assert outcome_of({NO_FEEDBACK: 0.0, "judge": 0.1}) is None
    assert outcome_of({"edited": 0.0}) == 0.0


def test_judge_disagrees_truth_table() -> None:
    assert judge_disagrees({"rejected": -0.25}, 0.8) is True
    assert judge_disagrees({"task_outcome": 1.0}, 0.8) is False
    assert judge_disagrees({"accepted": 0.75}, 0.2) is True
    assert judge_disagrees({"rejected": -0.25, "judge": -0.15}, 0.2) is False
    assert judge_disagrees({"rejected": -0.25}, 0.5) is True  # 0.5 counts as good
    assert judge_disagrees({"task_outcome": 0.0}, 0.8) is True  # a failed task (0) is not good
    assert judge_disagrees({"task_outcome": 0.0}, 0.3) is False
    assert judge_disagrees({NO_FEEDBACK: 0.0, "judge": 0.15}, 0.8) is None  # no feedback
    assert judge_disagrees({"rejected": -0.25}, None) is None  # no grade


def test_the_parl_and_judged_specs_are_built_in() -> None:
    assert get_spec("parl-v1") is PARL_V1 and PARL_V1.spec_id == "parl-v1@2"
    assert get_spec("judged-v1") is JUDGED_V1 and JUDGED_V1.spec_id == "judged-v1@1"
    for spec in (PARL_V1, JUDGED_V1):  # tab-v1's feedback weights, plus one term each
        assert (spec.weights, spec.terminal, spec.unfinished) == (
            TAB_V1.weights,
            TAB_V1.terminal,
            TAB_V1.unfinished,
        )
        assert RewardSpec.model_validate(spec.model_dump()) == spec  # valid as a JSON spec would be
    assert PARL_V1.parl == ParlShaping(
        lambda_parallel=0.2, lambda_finish=0.2, anneal_cycles=10, parallel_target=4
    )
    assert PARL_V1.judge is None and JUDGED_V1.parl is None and TAB_V1.parl is None and TAB_V1.judge is None


def test_a_judge_rubric_must_show_the_judge_the_episode() -> None:
    with pytest.raises(ValueError, match=r"\{completion\}"):
        JudgeTerm(weight=0.25, rubric="Grade {prompt} from 1 to {scale}")
    assert "{completion}" in JudgeTerm(weight=0.25).rubric


def test_a_spec_that_weights_thumbs_or_acceptance_must_name_a_weighted_primary() -> None:
    """No single signal rules (docs/methods.md, The primary signal): thumbs and acceptances are one term,
    anchored by a primary signal that itself carries weight."""
    base = TAB_V1.model_dump() | {"name": "mine"}
    with pytest.raises(
        ValueError,
        match=r"weights \['accepted', 'rejected', 'thumbs_down', 'thumbs_up'\] but names no primary",
    ):
        RewardSpec.model_validate(base | {"primary": None})
    with pytest.raises(ValueError, match="primary task_outcome gives it weight 0"):
        RewardSpec.model_validate(base | {"weights": TAB_V1.weights | {K.task_outcome: 0.0}})
    with pytest.raises(ValueError, match=r"primary task_outcome gives it weight -1 \(it must be above 0\)"):
        RewardSpec.model_validate(base | {"weights": TAB_V1.weights | {K.task_outcome: -1.0}})
    with pytest.raises(ValueError, match="primary judge has no judge term"):
        RewardSpec.model_validate(base | {"primary": "judge"})
    with pytest.raises(ValueError, match="primary"):
        RewardSpec.model_validate(base | {"primary": "thumbs_up"})  # not a primary signal
    only_thumbs = {k: 0.0 for k in TAB_V1.weights} | {K.thumbs_up: 0.5, K.edit_persisted: 1.0}
    spec = RewardSpec.model_validate(base | {"weights": only_thumbs, "primary": "edit_persisted"})
    assert spec.primary_range() == (0.0, 1.0)
    quiet = {k: 0.0 for k in TAB_V1.weights} | {K.task_outcome: 1.0}
    assert RewardSpec.model_validate(base | {"weights": quiet, "primary": None}).primary is None  # no thumbs


def test_the_built_in_specs_name_a_weighted_primary_without_a_version_bump() -> None:
    assert (TAB_V1.primary, PARL_V1.primary, JUDGED_V1.primary) == ("task_outcome", "task_outcome", "judge")
    assert (TAB_V1.spec_id, PARL_V1.spec_id, JUDGED_V1.spec_id) == ("tab-v1@2", "parl-v1@2", "judged-v1@1")
    for spec in (TAB_V1, PARL_V1, JUDGED_V1):
        assert spec.primary_weight() > 0
        assert RewardSpec.model_validate(spec.model_dump()) == spec
    assert TAB_V1.primary_range() == (-1.0, 1.0) and JUDGED_V1.primary_range() == (-0.25, 0.25)


def test_the_primary_value_of_an_episode() -> None:
    assert TAB_V1.primary_value({"thumbs_up": 0.5, "task_outcome": 0.0}) == 0.0
    assert TAB_V1.primary_value({"thumbs_up": 0.5}) is None  # the episode does not carry it
    assert JUDGED_V1.primary_value({"judge": 0.15}) == 0.15
    assert JUDGED_V1.primary_value({"judge_unavailable": 0.0}) is None
    edits = RewardSpec.model_validate(TAB_V1.model_dump() | {"primary": "edit_persisted"})
    assert edits.primary_value({"accepted": 0.75, "edit_persisted": 1.0}) == 1.0
    assert edits.primary_value({"accepted": 0.75, "edit_reverted": -0.5}) == 0.0  # did not persist
    assert edits.primary_value({"accepted": 0.75}) is None


def test_a_correction_is_text_not_reward_in_every_built_in_spec() -> None:
    for spec in (TAB_V1, PARL_V1, JUDGED_V1):
        assert spec.weights[K.correction] == 0.0
        assert K.correction not in spec.terminal  # the client sends `rejected` beside it if it means one
    # Same version as before the kind existed: weight 0 changes no reward.
    assert (TAB_V1.spec_id, PARL_V1.spec_id, JUDGED_V1.spec_id) == ("tab-v1@2", "parl-v1@2", "judged-v1@1")
    result = score(TAB_V1, [sig(K.correction), sig(K.rejected)])
    assert result.reward == -0.25
    assert result.components == {"rejected": -0.25}  # text, not a term of the reward
    alone = score(TAB_V1, [sig(K.correction)])  # a correction alone is no verdict: the episode stays unrated
    assert alone.components == {"no_feedback": 0.0} and outcome_of(alone.components) is None


def test_a_json_spec_without_correction_reads_it_as_zero_and_no_other_kind(tmp_path) -> None:
    weights = {kind.value: 0.0 for kind in K if kind is not K.correction} | {"task_outcome": 1.0}
    path = tmp_path / "older.json"
    path.write_text(json.dumps({"name": "older", "version": 1, "weights": weights, "terminal": []}))
    spec = get_spec(str(path))
    assert spec.weights[K.correction] == 0.0
    weights.pop("accepted")
    path.write_text(json.dumps({"name": "older", "version": 2, "weights": weights, "terminal": []}))
    with pytest.raises(RewardSpecError, match="no weight for.*accepted"):
        get_spec(str(path))
    # A spec may weight it: a correction is then an event like any other (counted once).
    mine = TAB_V1.model_validate({**TAB_V1.model_dump(), "weights": {**TAB_V1.weights, K.correction: -0.1}})
    assert score(mine, [sig(K.correction), sig(K.correction)]).reward == -0.1
