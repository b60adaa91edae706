"""Advantages: group baseline (Dr. GRPO) and the running per-prompt baseline, hand-worked values."""

import pytest

from trainer import advantages as A
from trainer.advantages import BaselineState, compute_advantages, prompt_key

pytestmark = pytest.mark.unit


def test_prompt_key_depends_only_on_token_ids() -> None:
    assert prompt_key([1, 2, 3]) == prompt_key((1, 2, 3))
    assert prompt_key([1, 2, 3]) != prompt_key([1, 23])
    assert prompt_key([12, 3]) != prompt_key([1, 23])


def test_groups_subtract_their_mean_without_std_division() -> None:
    adv, _ = compute_advantages(["a", "a", "b", "b", "b"], [1.0, 0.0, 3.0, 0.0, 0.0], BaselineState())
    # group a: mean 0.5; group b: mean 1.0. No division by std (Dr. GRPO).
    assert adv.values == pytest.approx([0.5, -0.5, 2.0, -1.0, -1.0])
    assert adv.kinds == ["group"] * 5


def test_lone_samples_on_the_first_cycle_use_the_batch_mean() -> None:
    adv, state = compute_advantages(["a", "b", "c"], [1.0, 0.0, 0.5], BaselineState())
    assert adv.values == pytest.approx([0.5, -0.5, 0.0])
    assert adv.kinds == ["global"] * 3
    # First sight of a prompt: its baseline starts at its mean; the global mean at the batch mean.
    assert state.prompts == pytest.approx({"a": 1.0, "b": 0.0, "c": 0.5})
    assert state.global_mean == pytest.approx(0.5)
    assert state.updates == 1


def test_known_prompts_use_their_running_baseline_and_unknown_the_global_one() -> None:
    before = BaselineState(global_mean=0.4, prompts={"a": 0.2}, touched={"a": 1}, updates=1)
    adv, after = compute_advantages(["a", "d"], [1.0, 0.0], before, alpha=0.3)
    assert adv.values == pytest.approx([0.8, -0.4])  # 1 − 0.2 ; 0 − 0.4
    assert adv.baselines == pytest.approx([0.2, 0.4])
    assert adv.kinds == ["prompt", "global"]
    assert after.prompts["a"] == pytest.approx(0.7 * 0.2 + 0.3 * 1.0)  # 0.44
    assert after.prompts["d"] == pytest.approx(0.0)
    assert after.global_mean == pytest.approx(0.7 * 0.4 + 0.3 * 0.5)  # 0.43
    assert before.prompts == {"a": 0.2}, "the input state is not modified"


def test_groups_and_lone_samples_mix_and_groups_update_the_running_baseline() -> None:
    before = BaselineState(global_mean=0.0, prompts={"g": 1.0}, touched={"g": 1}, updates=1)
    adv, after = compute_advantages(["g", "g", "s"], [0.0, 1.0, 1.0], before, alpha=0.5)
    assert adv.values == pytest.approx([-0.5, 0.5, 1.0])
    assert adv.kinds == ["group", "group", "global"]
    assert after.prompts["g"] == pytest.approx(0.5 * 1.0 + 0.5 * 0.5)  # 0.75


def test_empty_batch_and_mismatched_lengths() -> None:
    adv, state = compute_advantages([], [], BaselineState())
    assert adv.values == [] and state == BaselineState()
    with pytest.raises(ValueError, match="2 keys for 1 rewards"):
        compute_advantages(["a", "b"], [1.0], BaselineState())


def test_state_round_trips_through_json_and_forgets_the_oldest_prompts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(A, "MAX_PROMPT_KEYS", 2)
    _, s1 = compute_advantages(["a"], [1.0], BaselineState())
    _, s2 = compute_advantages(["b", "c"], [0.0, 0.0], s1)
    assert set(s2.prompts) == {"b", "c"}  # "a" was touched least recently
    assert BaselineState.from_json(s2.to_json()) == s2
