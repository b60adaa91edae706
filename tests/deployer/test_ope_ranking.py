"""The gate's off-policy suite ranks challengers as serving them would: on held-out traffic logged
from the base model, a challenger tuned toward what users accept is estimated better than the
champion, one tuned away from it worse, and the truth (each model sampled on-policy, scored by
the same users) agrees. No vLLM: the suite rescored the logged tokens with transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
from episodes import feed, sample_episodes, tuned_copy

from deployer import gate_suites, ope
from evals import get_task
from schemas.rewards import get_spec
from schemas.settings import Settings
from store import Store

LOGGED = 192  # held-out episodes logged from the base model (every one held out below)
TRUTH = 192  # on-policy samples per model for the ground truth

pytestmark = pytest.mark.unit  # no service: transformers rescoring and a SQLite store (about 20 s)


def on_policy_reward(model_dir: Path, seed: int, spec_id: str, tmp_path: Path) -> float:
    """The truth: the mean reward the labeler gives `model_dir`'s own episodes when it serves the
    same users (`sample_episodes`: thumbs up when the completion contains "!")."""
    store = Store(f"sqlite:///{tmp_path / f'truth-{model_dir.name}.db'}")
    store.migrate()
    feed(store, sample_episodes(model_dir, TRUTH, seed=seed))
    episodes = store.select_heldout(TRUTH, spec_id=spec_id, holdout_percent=100)
    store.close()
    assert len(episodes) == TRUTH
    return sum(e.reward for e in episodes) / len(episodes)


def test_ope_on_held_out_traffic_ranks_a_better_and_a_worse_challenger_correctly(
    services_config: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    store = Store(f"sqlite:///{tmp_path / 'ope.db'}")
    store.migrate()
    feed(store, sample_episodes(tiny_model_dir, LOGGED, seed=21))
    task = get_task("exclaim")
    better = tuned_copy(tiny_model_dir, tmp_path / "better", task.preferred_shapes, steps=12)
    worse = tuned_copy(tiny_model_dir, tmp_path / "worse", task.plain_shapes, steps=12)
    settings = services_config.model_copy(
        update={
            "store": services_config.store.model_copy(update={"url": store.url}),
            "gate": services_config.gate.model_copy(
                update={
                    "bootstrap_resamples": 1000,
                    "ope": services_config.gate.ope.model_copy(
                        update={"holdout_percent": 100, "min_ess": 16}
                    ),
                }
            ),
        }
    )
    champion = ope.Weights(tiny_model_dir)
    spec_id = get_spec(settings.labeler.reward_spec).spec_id
    estimates = {}
    for name, path in (("champion", tiny_model_dir), ("better", better), ("worse", worse)):
        verdicts = gate_suites.ope_suite(settings, store, ope.Weights(path), champion)
        suite, fired = verdicts.suite, verdicts.alarms
        print(name, suite.model_dump_json(), [a.name for a in fired if a.fired])
        assert suite.n == LOGGED and suite.conclusive, suite.note
        estimates[name] = suite
    truth = {
        name: on_policy_reward(path, 33, spec_id, tmp_path)
        for name, path in (("champion", tiny_model_dir), ("better", better), ("worse", worse))
    }
    print("on-policy truth:", truth)

    # The truth: the tuned challengers really are clearly better and clearly worse for these users.
    assert truth["better"] > truth["champion"] + 0.3 and truth["worse"] < truth["champion"] - 0.1

    # The champion against itself: exactly no difference.
    same = estimates["champion"].difference
    assert same is not None and same.estimate == same.low == same.high == 0.0
    # The ranking, each with its one-sided interval clear of zero.
    up, down = estimates["better"].difference, estimates["worse"].difference
    assert up is not None and down is not None
    assert up.low > 0 and down.high < 0, (up, down)
    values = {name: suite.challenger for name, suite in estimates.items()}
    assert values["better"] is not None and values["champion"] is not None and values["worse"] is not None
    assert values["better"] > values["champion"] > values["worse"], values
    # The users' reward held against an anchor (gate.anchor_suites has "ope"): the champion as the
    # anchor gives the very estimate against the champion; the worse model as the anchor puts the
    # better challenger further ahead (the anchor's weights are the champion's plus its own change).
    suite, _, anchored, _ = gate_suites.ope_suite(
        settings, store, ope.Weights(better), champion, anchor=ope.Weights(tiny_model_dir)
    )
    assert anchored is not None and anchored.difference == suite.difference
    _, _, below, _ = gate_suites.ope_suite(
        settings, store, ope.Weights(better), champion, anchor=ope.Weights(worse)
    )
    assert below is not None and below.conclusive and below.difference is not None and up is not None
    assert (
        below.difference.low > up.low and below.champion is not None and below.champion < values["champion"]
    )
    verdict = gate_suites.against_anchor(below, 1, settings)
    assert verdict.name == "ope_anchor" and verdict.passed and verdict.margin == settings.gate.anchor_margin
    # Each estimate lands near its truth (measured: within 0.011 on recipe v1, 0.034 on v2; reward in [-1, 1]).
    for name in ("champion", "better", "worse"):
        assert abs(values[name] - truth[name]) < 0.1, (name, values, truth)
    store.close()
