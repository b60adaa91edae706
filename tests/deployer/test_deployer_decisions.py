"""Unit tests of the deployer's decisions: the gate's rule, swap verification, probe comparison, result shapes."""

from __future__ import annotations

import hashlib
import math
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from deployer.alarms import Alarm
from deployer.errors import RolloutBusy
from deployer.gate import GateDecision, cause, decide
from deployer.gate_suites import SuiteResult, against_anchor
from deployer.probe import max_abs_diff
from deployer.rollout import SwapResult
from deployer.swap import ServerSwap, digests_agree, rollout_lock, verdict
from evals.stats import Interval
from rtrl.commands.gate import explain_text
from schemas.settings import Settings
from serving import EMPTY_DIGEST, meaningful_digests
from store import Store

pytestmark = pytest.mark.unit


# ---- gate -------------------------------------------------------------------------------------


def suite(name: str, low: float | None, *, conclusive: bool = True, estimate: float = 0.0) -> SuiteResult:
    difference = None if low is None else Interval(estimate=estimate, low=low, high=estimate + 0.1, n=48)
    passed = None if not conclusive or low is None else low > -0.05
    return SuiteResult(
        name=name,
        kind="prompts",
        challenger=0.5,
        champion=0.5,
        difference=difference,
        conclusive=conclusive,
        passed=passed,
        n=48,
        margin=0.05,
        note="few episodes" if not conclusive else "",
    )


def test_gate_passes_when_every_conclusive_suite_is_non_inferior() -> None:
    passed, reason = decide([suite("retention", -0.04), suite("ope", None, conclusive=False)], [])
    assert passed and reason.startswith("non-inferior on retention")


def test_gate_fails_a_suite_whose_lower_bound_is_below_the_margin() -> None:
    passed, reason = decide([suite("retention", 0.0), suite("oracle", -0.06, estimate=-0.02)], [])
    assert not passed
    assert "suite oracle: challenger - champion -0.0200, lower bound -0.0600 <= -0.05" in reason


def test_gate_fails_when_no_suite_is_conclusive() -> None:
    passed, reason = decide([suite("ope", None, conclusive=False)], [])
    assert not passed and "no suite was conclusive: ope: few episodes" in reason


def test_an_anchored_verdict_alone_never_passes_the_gate() -> None:
    """Right after a promotion the anchor may have served most held-out traffic: its ope estimate can
    be conclusive while the champion's is not. It bounds losses; it is not a comparison with the
    champion, so it cannot be the one conclusive suite."""
    anchored = against_anchor(suite("ope", -0.01), 1, Settings())
    assert anchored.against_anchor and anchored.name == "ope_anchor"
    passed, reason = decide([suite("ope", None, conclusive=False), anchored], [])
    assert not passed and "no suite was conclusive" in reason
    passed, _ = decide([suite("ope", -0.01), anchored], [])
    assert passed


def test_gate_fails_on_any_alarm() -> None:
    alarm = Alarm(
        name="no_action", fired=True, value=0.3, threshold=0.1, detail="non-answers 30.0% vs champion 0.0%"
    )
    passed, reason = decide([suite("retention", 0.0)], [alarm])
    assert not passed and reason.startswith("alarm no_action: non-answers 30.0%")


def test_gate_decision_shape_and_cause() -> None:
    decision = GateDecision(
        passed=False,
        challenger_version=3,
        champion_version=2,
        challenger_score=-0.5,
        champion_score=0.25,
        tolerance=0.05,
        confidence=0.95,
        n_prompts=48,
        n_samples=96,
        suites=[suite("oracle", -0.5)],
        reason="worse",
        decided_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    data = decision.model_dump(mode="json")
    assert data["decided_at"] == "2026-01-01T00:00:00Z"
    assert GateDecision.model_validate_json(decision.model_dump_json()) == decision
    assert cause(decision) == "inferior"
    assert cause(decision.model_copy(update={"suites": []})) == "challenger_not_loaded"
    assert cause(decision.model_copy(update={"passed": True})) == "non_inferior"
    text = explain_text(data)
    assert "v3 against champion v2: FAIL" in text and "suite oracle" in text and "FAIL" in text
    anchored = explain_text(decision.model_copy(update={"anchor_version": 1}).model_dump(mode="json"))
    assert "v3 against champion v2 and anchor v1: FAIL" in anchored


# ---- swap verification ------------------------------------------------------------------------


def test_verdict() -> None:
    assert verdict(0.01, 0.05, None) is None
    assert verdict(0.05, 0.05, True) is None  # the tolerance is inclusive
    assert "0.06 > tolerance 0.05" in (verdict(0.06, 0.05, True) or "")
    assert verdict(math.inf, 0.05, None) is not None  # unreadable probe
    assert verdict(math.nan, 0.05, None) is not None  # nan never passes
    assert verdict(0.0, 0.05, False) == "weight digests differ from the version's recorded digests"


def test_only_meaningful_digests_are_compared() -> None:
    # On CPU linear layers digest to sha256(b"") whatever the weights; those must not count.
    assert EMPTY_DIGEST == hashlib.sha256(b"").hexdigest()
    baseline = {"embed": "aa", "qkv_proj": EMPTY_DIGEST, "lm_head": "bb"}
    assert meaningful_digests(baseline) == {"embed": "aa", "lm_head": "bb"}
    assert digests_agree(baseline, {"embed": "aa", "qkv_proj": "zz", "lm_head": "bb"}) is True
    assert digests_agree(baseline, {"embed": "aa", "qkv_proj": EMPTY_DIGEST, "lm_head": "cc"}) is False
    assert digests_agree(baseline, {"embed": "aa"}) is False  # a tensor the server does not have
    assert digests_agree(None, {"embed": "aa"}) is None
    assert digests_agree({"qkv_proj": EMPTY_DIGEST}, {"qkv_proj": EMPTY_DIGEST}) is None


# ---- probe comparison -------------------------------------------------------------------------


def test_probe_max_abs_diff_hand_worked() -> None:
    expected = [[-1.0, -2.0], [-0.5]]
    observed = [[-1.0, -2.25], [-0.375]]
    assert max_abs_diff(expected, observed) == 0.25  # |-2 - -2.25| beats |-0.5 - -0.375| = 0.125
    assert max_abs_diff(expected, expected) == 0.0


def test_probe_shape_mismatch_or_non_finite_is_infinite() -> None:
    assert max_abs_diff([[-1.0, -2.0]], [[-1.0]]) == math.inf
    assert max_abs_diff([[-1.0]], [[-1.0], [-2.0]]) == math.inf
    assert max_abs_diff([[-1.0]], [[-math.inf]]) == math.inf
    assert max_abs_diff([[-1.0]], [[math.nan]]) == math.inf


# ---- swap result shape ------------------------------------------------------------------------


def test_swap_result_shape() -> None:
    step = ServerSwap(
        url="http://127.0.0.1:18000",
        version=2,
        pause_ms=80.5,
        reload_ms=24.0,
        total_ms=80.5,
        verified=True,
        max_abs_logprob_diff=2e-6,
        digest_match=True,
    )
    result = SwapResult(
        ok=True, version=2, previous_version=1, servers=[step], swap_ms=80.5, rolled_back=False
    )
    data = result.model_dump(mode="json")
    assert data["servers"][0]["restored"] is False
    assert data["servers"][0]["error"] is None
    assert data["error"] is None
    assert SwapResult.model_validate_json(result.model_dump_json()) == result


# ---- one rollout at a time ---------------------------------------------------------------------


def test_a_held_rollout_lock_is_rollout_busy_naming_its_holder(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'rtrl.db'}")
    store.migrate()
    with rollout_lock(store, "rollout", "promote v3"):
        with pytest.raises(
            RolloutBusy,
            match=r"^another rollout is under way: the rollout lock is held by "
            r"[^ ]+:\d+ \(promote v3\) since ",
        ):
            with rollout_lock(store, "rollout", "align the fleet to @champion"):
                pass
        with rollout_lock(store, "staging", "gate v4"):  # a gate run on staging meanwhile
            pass
    with rollout_lock(store):  # released
        pass
    store.close()


def test_the_workers_chain_waits_for_a_lock_a_reconciler_tick_holds(tmp_path: Path) -> None:
    """A registered challenger must not fail because a reconciler tick held the fleet for a moment:
    with `wait_s` the lock is tried again until it is free; without, or past `wait_s`, RolloutBusy."""
    store = Store(f"sqlite:///{tmp_path / 'rtrl.db'}")
    store.migrate()
    taken, release = threading.Event(), threading.Event()

    def tick() -> None:
        with rollout_lock(store, "rollout", "align the fleet to @champion"):
            taken.set()
            release.wait(10)

    reconciler = threading.Thread(target=tick)
    reconciler.start()
    assert taken.wait(10)
    with pytest.raises(RolloutBusy, match=r"^another rollout is under way: "):
        with rollout_lock(store, "rollout", "promote v3"):  # an operator: at once
            pass
    started = time.monotonic()
    with pytest.raises(
        RolloutBusy, match=r"^another rollout is under way \(waited 0.3 s\): .*align the fleet"
    ):
        with rollout_lock(store, "rollout", "promote v3", wait_s=0.3):
            pass
    assert 0.3 <= time.monotonic() - started < 2
    threading.Timer(0.5, release.set).start()  # the tick ends half a second from now
    started = time.monotonic()
    with rollout_lock(store, "rollout", "promote v3", wait_s=10):
        assert store.lock_holders()[0].purpose == "promote v3"
    assert 0.4 <= time.monotonic() - started < 5
    reconciler.join(10)
    store.close()
