"""Reward specs: hand-worked rewards under tab-v1, combination rules, spec files."""

import json

import pytest

from schemas.errors import OperatorError
from schemas.events import FeedbackEvent, FeedbackKind, FeedbackSignal
from schemas.rewards import NO_FEEDBACK, TAB_V1, RewardSpec, RewardSpecError, get_spec, score

pytestmark = pytest.mark.unit

K = FeedbackKind


def sig(kind: FeedbackKind, value: float = 1.0) -> FeedbackSignal:
    return FeedbackSignal(kind=kind, value=value)


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
    weights = {kind.value: 0.0 for kind in K} | {"accepted": 2.0}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "version": 3, "weights": weights, "terminal": ["accepted"]}))
    spec = get_spec(str(path))
    assert spec.spec_id == "mine@3"
    assert score(spec, [sig(K.accepted), sig(K.rejected)]).reward == 2.0
    assert get_spec("tab-v1") is TAB_V1
    with pytest.raises(RewardSpecError, match="unknown reward spec 'nope'.*RTRL_LABELER__REWARD_SPEC"):
        get_spec("nope")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(OperatorError, match="broken.json"):
        get_spec(str(tmp_path / "broken.json"))


def test_rewards_module_is_import_light() -> None:
    import subprocess
    import sys

    code = "import sys, schemas.rewards; bad = {'kafka', 'sqlalchemy', 'torch'} & set(sys.modules); print(sorted(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_scored_values_outside_the_declared_range_are_refused_not_clamped() -> None:
    assert TAB_V1.value_problem(K.task_outcome, 1.0) is None
    assert TAB_V1.value_problem(K.accepted, 5.0) is None  # event kinds ignore their value
    assert TAB_V1.value_problem(K.judge_score, 1e6) == "judge_score value 1e+06 is outside [-1, 1] of reward spec tab-v1@2"
    with pytest.raises(ValueError, match="value_range"):
        RewardSpec(name="x", version=1, weights=TAB_V1.weights, terminal=frozenset(), value_range={K.task_outcome: (0, 1)})


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
