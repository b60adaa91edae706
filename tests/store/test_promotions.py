"""rtrl's record of its promotions (store/promotions.py): the champion, rollback targets, grounds."""

from __future__ import annotations

import pytest
from factories import at

from store import Store

pytestmark = pytest.mark.unit

MODEL = "policy"


def test_the_first_look_adopts_the_alias_once_and_the_record_decides_after(store: Store) -> None:
    reads: list[int] = []

    def alias() -> int:
        reads.append(1)
        return 4

    assert store.champion_record(MODEL) is None
    assert store.recorded_champion(MODEL, alias, "tester") == 4
    assert store.recorded_champion(MODEL, lambda: 9, "tester") == 4  # an alias moved later is not followed
    assert len(reads) == 1
    (adopted,) = store.promotions(MODEL)
    assert (adopted.version, adopted.grounds, adopted.actor) == (4, "adopted", "tester")
    assert store.recorded_champion("another-model", lambda: 2, "tester") == 2  # each model its own record


def test_the_previous_champion_is_the_last_other_version_rtrl_promoted(store: Store) -> None:
    assert store.previous_champion(MODEL) is None
    store.record_promotion(MODEL, 1, "bootstrap", "a", "base")
    assert store.previous_champion(MODEL) is None
    store.record_promotion(MODEL, 2, "force", "a", "why")
    store.record_promotion(MODEL, 2, "served", "a", "again")
    assert store.champion_record(MODEL).version == 2  # type: ignore[union-attr]
    assert store.previous_champion(MODEL) == 1
    store.record_promotion(MODEL, 3, "gate", "a", "passed", gate_decision_id=7)
    assert store.previous_champion(MODEL) == 2
    assert [p.version for p in store.promotions(MODEL)] == [3, 2, 2, 1]


def test_grounds_are_the_newest_gate_decision_of_that_models_version_or_having_served(store: Store) -> None:
    assert store.promotion_grounds(MODEL, 2) is None
    store.record_gate_decision(2, 1, True, "fine", {}, at(0), model="another-model")
    assert store.promotion_grounds(MODEL, 2) is None  # v2 of another model is another checkpoint
    store.record_gate_decision(2, 1, True, "fine", {}, at(1), model=MODEL)
    found = store.promotion_grounds(MODEL, 2)
    assert found is not None and found[0] == "gate" and isinstance(found[1], int)
    store.record_gate_decision(2, 1, False, "worse", {}, at(2), model=MODEL)
    assert store.promotion_grounds(MODEL, 2) is None  # the newest decision failed
    store.record_promotion(MODEL, 2, "force", "op", "incident 12")
    assert store.promotion_grounds(MODEL, 2) == ("served", None)  # a rollback to it needs no force


def test_a_decision_recorded_before_decisions_named_their_model_still_counts(store: Store) -> None:
    store.record_gate_decision(5, 4, True, "fine", {}, at(0))
    assert store.promotion_grounds(MODEL, 5) is not None


def test_unknown_grounds_are_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="unknown promotion grounds"):
        store.record_promotion(MODEL, 1, "because", "a", "b")
