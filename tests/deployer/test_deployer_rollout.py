"""The deployer against the session's real vLLM CPU servers (serving + staging) and real MLflow.

Each test registers under its own MLflow model name, so the registry other tests use is
untouched, and every test that swaps the shared servers puts them back on the base weights with
weight version "v1" before it ends (the base model is v1 under every model name).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from episodes import tuned_copy
from gating import gate_settings, hack_setup, perturbed_copy

from deployer import gate, rollout, swap
from deployer.probe import PROBE_TOLERANCES
from registry import Registry
from schemas.clock import utcnow
from schemas.settings import (
    OfflineSuiteSettings,
    Settings,
    TrafficSettings,
    VllmSettings,
)
from schemas.settings.gate import SAMPLED_K
from services.testing import free_ports
from serving import VllmClient, meaningful_digests
from simulation.planted import ASKING, RAMBLING
from store import Store
from store.models import RecordedDigests

pytestmark = pytest.mark.integration

PROMPT = "Q: What is 2 plus 3?\nA:"


def greedy(server: VllmClient) -> str:
    return server.complete([PROMPT], max_tokens=12, temperature=0.0, stop=["\n"])[0][0]


def serving(settings: Settings) -> VllmClient:
    return VllmClient(settings.vllm.servers[0], model=settings.vllm.served_model_name)


def test_bootstrap_promote_and_rollback(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = deploy_settings
    registry = Registry.from_settings(settings)
    assert rollout.bootstrap(settings, registry, tiny_model_dir) == 1
    assert rollout.bootstrap(settings, registry, tiny_model_dir) == 1  # idempotent
    assert registry.versions() == [1]
    with serving(settings) as server:
        assert server.weight_version() == 1
        base_text = greedy(server)

    v2 = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "v2", std=0.05, seed=2))
    assert v2 == 2
    result = rollout.promote(settings, registry, v2, force_reason="by hand in a test")
    print("promote v2:", result.model_dump_json())
    assert result.ok, result.error
    assert result.previous_version == 1 and not result.rolled_back
    step = result.servers[0]
    assert step.verified and step.max_abs_logprob_diff is not None
    assert step.max_abs_logprob_diff <= PROBE_TOLERANCES[settings.vllm.dtype]  # float32 servers: 1e-3
    assert registry.champion() == 2
    assert registry.previous_champion() == 1
    with serving(settings) as server:
        assert server.weight_version() == 2
        assert not server.is_paused()
        assert greedy(server) != base_text

    back = rollout.rollback(settings, registry)
    print("rollback:", back.model_dump_json())
    assert back.ok and back.version == 1
    assert registry.champion() == 1
    with serving(settings) as server:
        assert server.weight_version() == 1
        assert greedy(server) == base_text


def test_an_alias_moved_outside_rtrl_is_refused_and_only_a_version_with_grounds_is_promoted(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Anyone who can write MLflow can move @champion. The reconciler puts it back on the version
    rtrl promoted, without swapping a server; promoting a version without a passing gate decision
    is refused before any server is touched; a passing decision in rtrl's store is enough."""
    from helpers import run_rtrl

    from deployer.errors import NotAuthorized
    from deployer.reconcile import reconcile_once
    from registry import CHAMPION

    settings = deploy_settings
    registry = Registry.from_settings(settings)
    rollout.bootstrap(settings, registry, tiny_model_dir)
    v2 = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "v2", std=0.05, seed=3))
    registry.set_alias(CHAMPION, v2)  # what a `POST .../registered-models/alias` does

    report = reconcile_once(settings, registry)
    assert report is not None and report.champion == 1 and report.alias_refused == v2, report
    assert registry.champion() == 1 and not report.swaps
    with serving(settings) as server:
        assert server.weight_version() == 1

    registry.set_alias(CHAMPION, v2)
    status = run_rtrl(settings, "deploy", "status")
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert (shown["champion"], shown["alias_refused"]) == (1, v2)
    assert "which rtrl did not promote" in status.stderr
    assert [p["grounds"] for p in shown["promotions"]] == ["bootstrap"]

    with pytest.raises(NotAuthorized, match=f"v{v2} has no passing gate decision"):
        rollout.promote(settings, registry, v2)
    refused = run_rtrl(settings, "deploy", "promote", str(v2))
    assert refused.returncode == 1 and "--force --reason" in refused.stderr
    assert "Traceback" not in refused.stderr
    with serving(settings) as server:
        assert server.weight_version() == 1

    with Store(settings.store.url) as store:
        store.record_gate_decision(v2, 1, True, "passed", {}, utcnow(), model=registry.model_name)
    promoted = rollout.promote(settings, registry, v2)
    assert promoted.ok, promoted.error
    with Store(settings.store.url) as store:
        latest = store.champion_record(registry.model_name)
    assert latest is not None and (latest.version, latest.grounds) == (v2, "gate")
    assert registry.champion() == v2


def test_failed_verification_restores_previous_weights(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = deploy_settings
    registry = Registry.from_settings(settings)
    rollout.bootstrap(settings, registry, tiny_model_dir)
    with serving(settings) as server:
        base_text = greedy(server)
        digests = server.weight_digests()
    v2 = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "v2", std=0.05, seed=3))
    # Digests recorded for v2 that the checkpoint on disk does not match: what the deployer sees
    # when a checkpoint changed between the gate and the deploy.
    store = Store(settings.store.url)  # the session's store, where the gate would have recorded them
    swap.save_digests(settings, store, v2, {name: "0" * 64 for name in meaningful_digests(digests)})

    result = rollout.promote(settings, registry, v2, force_reason="by hand in a test")
    print("tampered promote:", result.model_dump_json())
    assert not result.ok and result.rolled_back
    step = result.servers[0]
    assert step.digest_match is False and step.restored and not step.verified
    assert step.max_abs_logprob_diff is None  # caught in the pause window, before any generation
    assert registry.champion() == 1
    with serving(settings) as server:
        assert server.weight_version() == 1
        assert not server.is_paused()
        assert greedy(server) == base_text

    # A fleet whose second server is down: the canary is swapped, then swapped back.
    with store.transaction() as session:  # forget them: the canary records v2's own
        session.execute(
            sa.delete(RecordedDigests).where(
                RecordedDigests.model == settings.mlflow.model_name, RecordedDigests.version == v2
            )
        )
    store.close()
    (dead_port,) = free_ports(1)
    fleet = settings.model_copy(
        update={
            "vllm": VllmSettings(
                **{
                    **settings.vllm.model_dump(),
                    "servers": (*settings.vllm.servers, f"http://127.0.0.1:{dead_port}"),
                }
            )
        }
    )
    result = rollout.promote(fleet, registry, v2, force_reason="by hand in a test")
    print("dead second server:", result.model_dump_json())
    assert not result.ok and result.rolled_back
    assert [s.verified for s in result.servers] == [True, False, True]  # canary, dead server, canary back
    assert registry.champion() == 1
    with serving(settings) as server:
        assert server.weight_version() == 1
        assert not server.is_paused()
        assert greedy(server) == base_text


def test_gate_passes_the_same_weights_and_rejects_noised_ones_in_seeded_runs(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The same weights as challenger pass in every seeded gate run; weights with noise added fail in
        every one. Each run asks the retention suite's census (every held-out question, greedy) on the
    staging server and
        reweights held-out logged traffic (sampled from the base model) for the ope suite. Three seeds
        show the behaviour in `make test`; RTRL_TEST_GATE_RUNS=20 measures the error rates over 20 (at
        most 1 in 20 wrong; 40 runs in about 106 s on the 2-core machine, docs/gate.md)."""
    from episodes import feed, sample_episodes

    from store import Store

    store = Store(f"sqlite:///{tmp_path / 'gate.db'}")
    store.migrate()
    feed(store, sample_episodes(tiny_model_dir, 96, seed=11))
    settings = gate_settings(deploy_settings, store.url)
    registry = Registry.from_settings(settings)
    rollout.bootstrap(settings, registry, tiny_model_dir)
    same = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "same", std=0.0, seed=0))
    noised = registry.register_checkpoint(
        perturbed_copy(tiny_model_dir, tmp_path / "noised", std=0.3, seed=4)
    )
    runs = int(os.environ.get("RTRL_TEST_GATE_RUNS", "3"))
    outcomes: dict[int, list[bool]] = {same: [], noised: []}
    started = time.monotonic()
    for seed in range(runs):
        # retention_sampled at its default k (the session pins it off: tests/conftest.py).
        retention = settings.gate.retention.model_copy(update={"sampled_k": SAMPLED_K})
        seeded_gate = settings.gate.model_copy(update={"seed": seed, "retention": retention})
        seeded = settings.model_copy(update={"gate": seeded_gate})
        for version in (same, noised):
            decision = gate.evaluate(seeded, registry, version, store)
            outcomes[version].append(decision.passed)
            if seed == 0:
                print(f"gate v{version}:", decision.model_dump_json())
                assert swap.load_digests(
                    settings, store, version
                )  # recorded on staging for the swap verification
                ope = next(s for s in decision.suites if s.name == "ope")
                assert ope.n > 20, ope
                # Fresh draws: this challenger's own seed, recorded; the retention suite is a census of
                # every held-out question, so no question was drawn (docs/gate.md, Fresh draws).
                assert decision.fresh_draw and decision.seed == gate.draw_seed(
                    0, registry.model_name, version
                )
                assert decision.draw == gate.run_draw(seeded, registry.model_name, version)[1] == []
                k = seeded.gate.retention.sampled_k  # retention_sampled beside the census: k per question
                assert decision.census == ["retention"] and decision.n_samples == 75 + 75 * k
                retention = next(s for s in decision.suites if s.name == "retention")
                assert retention.census and retention.n == 75 and "census of 75" in retention.note
                sampled = next(s for s in decision.suites if s.name == "retention_sampled")
                assert not sampled.census and sampled.n == 75 and sampled.difference is not None
                assert store.gate_decisions(version)[0]["seed"] == decision.seed
                tags = registry.version_tags(version)
                assert tags["gate_seed"] == str(decision.seed)
                assert tags["gate_draw"] == "fresh retention: census"
                if version == same:
                    # Both models sampled with the run's seed: the same weights score exactly alike.
                    assert decision.passed and decision.challenger_score == decision.champion_score
                    # The same weights sampled with the same seed: the same k answers per question.
                    assert sampled.passed and abs(sampled.difference.estimate) < 0.01, sampled
                    assert ope.conclusive and ope.difference is not None and ope.difference.estimate == 0.0
                    assert not any(a.fired for a in decision.alarms)
                else:
                    assert not decision.passed
                    # Far from what users were served: its weights on the logged traffic collapse (the
                    # estimate is inconclusive, whatever its value), and the KL alarm names why.
                    assert not ope.conclusive and ope.ess is not None and ope.ess < 8
                    kl = next(a for a in decision.alarms if a.name == "kl")
                    assert kl.fired and "trainer.max_kl" in kl.detail  # the budget follows the trust region
    print(
        f"{runs} seeded runs x 2 in {time.monotonic() - started:.0f} s:",
        {f"v{v}": f"{sum(o)}/{len(o)} passed" for v, o in outcomes.items()},
    )
    assert sum(outcomes[same]) >= runs - runs // 20
    assert sum(not passed for passed in outcomes[noised]) >= runs - runs // 20
    records = store.gate_decisions(noised)
    assert len(records) == runs and records[0]["passed"] is False
    assert len({r["seed"] for r in records}) == runs  # gate.seed is still the base of each run's draw
    assert store.gate_decisions(same)[0]["seed"] != records[0]["seed"]  # another challenger, another seed
    assert registry.version_tags(noised)["gate"] == "fail"
    assert registry.version_tags(same)["gate_suite_ope"].startswith("pass +0.0000")
    assert registry.champion() == 1
    assert settings.vllm.staging_server is not None
    with VllmClient(settings.vllm.staging_server, model=settings.vllm.served_model_name) as staging:
        assert staging.weight_version() == 1  # the gate leaves staging on the champion
    store.close()


def test_the_traffic_suite_passes_the_same_weights_on_held_out_prompts(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The tenant's own traffic as the gate's only suite, no task (docs/gate.md, Suites: traffic):
    held-out logged prompts (sampled from the base model, half of the buckets held out) drawn with
    the run's seed, replayed through both models on the staging server and scored without a judge.
    The same weights pass, scoring exactly alike; a challenger that answers with clarifying
    questions fails the suite itself, not only the no_action alarm."""
    from episodes import feed, sample_episodes

    from deployer.traffic import traffic_suite

    store = Store(f"sqlite:///{tmp_path / 'gate.db'}")
    store.migrate()
    feed(store, sample_episodes(tiny_model_dir, 96, seed=11))
    base = gate_settings(deploy_settings, store.url)
    replay = TrafficSettings(max_prompts=24, min_prompts=8, max_tokens=16, stop=("\n",))
    settings = base.model_copy(
        update={"gate": base.gate.model_copy(update={"suites": ("traffic",), "traffic": replay})}
    )
    registry = Registry.from_settings(settings)
    rollout.bootstrap(settings, registry, tiny_model_dir)
    same = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "same", std=0.0, seed=0))
    held_out = {p.episode_id for p in store.heldout_prompts(512, holdout_percent=50)}
    assert len(held_out) >= replay.max_prompts

    decision = gate.evaluate(settings, registry, same, store)
    print(f"gate v{same} on traffic:", decision.model_dump_json())
    (suite,) = decision.suites
    assert suite.name == "traffic" and suite.conclusive and suite.n == replay.max_prompts
    assert decision.passed and suite.difference is not None and suite.difference.estimate == 0.0
    assert suite.challenger == suite.champion and suite.champion is not None and suite.champion > 0.5
    assert "no judge" in suite.note and not any(a.fired for a in decision.alarms)
    # The run's own draw of held-out episodes, recorded; the task's questions are not drawn at all.
    assert decision.seed == gate.draw_seed(settings.gate.seed, registry.model_name, same)
    assert decision.draw == [] and len(decision.traffic_draw) == replay.max_prompts
    assert set(decision.traffic_draw) <= held_out
    assert decision.traffic_draw == traffic_suite(settings, store, decision.seed).episodes
    assert store.gate_decisions(same)[0]["traffic_draw"] == decision.traffic_draw
    assert registry.version_tags(same)["gate_suite_traffic"].startswith("pass +0.0000")

    asking = registry.register_checkpoint(tuned_copy(tiny_model_dir, tmp_path / "asking", ASKING))
    refused = gate.evaluate(settings, registry, asking, store)
    print(f"gate v{asking} on traffic:", refused.model_dump_json())
    (suite,) = refused.suites
    assert not refused.passed and suite.conclusive and suite.passed is False
    assert suite.challenger is not None and suite.champion is not None and suite.challenger < suite.champion
    assert refused.traffic_draw != decision.traffic_draw  # another challenger, another draw
    assert registry.champion() == 1
    store.close()


def test_the_ope_suite_with_dr_samples_the_held_out_prompts_on_staging(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """ope as the gate's only suite under ``gate.ope.estimator`` "dr" (docs/gate.md, Suites: ope): the
    held-out episodes' completions decoded for the cross-fitted reward model, both models sampling
    ``gate.ope.dr_samples`` completions of each held-out prompt on the staging server after the
    verified swap. The same weights draw the same completions with the run's seed and carry the same
    importance weights: a difference of exactly 0, the estimator named in the note, the suite's
    fields, the version's tags and its run's metrics; staging ends on the champion."""
    from episodes import feed, sample_episodes

    store = Store(f"sqlite:///{tmp_path / 'gate.db'}")
    store.migrate()
    feed(store, sample_episodes(tiny_model_dir, 96, seed=11))
    base = gate_settings(deploy_settings, store.url)
    dr = base.gate.ope.model_copy(update={"estimator": "dr", "dr_samples": 2})
    settings = base.model_copy(update={"gate": base.gate.model_copy(update={"suites": ("ope",), "ope": dr})})
    registry = Registry.from_settings(settings)
    rollout.bootstrap(settings, registry, tiny_model_dir)
    same = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "same", std=0.0, seed=0))

    decision = gate.evaluate(settings, registry, same, store)
    print(f"gate v{same} ope dr:", decision.model_dump_json())
    suites = {s.name: s for s in decision.suites}
    suite = suites["ope"]  # beside it the ope_primary guard, which always reads SNIPS
    assert suite.estimator == "dr" and suite.r2 is not None and suites["ope_primary"].estimator is None
    assert suite.difference is not None and suite.difference.estimate == pytest.approx(0.0, abs=1e-12)
    assert "estimator dr (doubly robust, 2 staging samples per prompt)" in suite.note
    assert "out-of-fold R²" in suite.note and "SNIPS: " in suite.note
    tags = registry.version_tags(same)
    assert tags["gate_suite_ope_estimator"] == "dr"
    assert registry.champion() == 1
    assert settings.vllm.staging_server is not None
    with VllmClient(settings.vllm.staging_server, model=settings.vllm.served_model_name) as staging:
        assert staging.weight_version() == 1  # swapped back to the champion after the ope samples
    store.close()


def test_gate_rejects_a_challenger_that_stops_finishing_its_answers(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Planted reward hack: a challenger whose answers run past max_tokens (never scorable) is
    rejected with the truncation alarm named in the decision record."""
    store, settings, registry = hack_setup(deploy_settings, tiny_model_dir, tmp_path)
    rambling = registry.register_checkpoint(tuned_copy(tiny_model_dir, tmp_path / "rambling", RAMBLING))
    decision = gate.evaluate(settings, registry, rambling, store)
    print("gate rambling:", decision.model_dump_json())
    assert not decision.passed
    assert (
        "truncation" in {a.name for a in decision.alarms if a.fired} and "alarm truncation" in decision.reason
    )
    behaviour, allowed = decision.behaviour, settings.gate.alarms.truncation_rate
    assert behaviour["challenger"].truncated > behaviour["champion"].truncated + allowed
    assert store.gate_decisions(rambling)[0]["reason"] == decision.reason
    store.close()


def test_gate_rejects_a_challenger_that_stopped_answering_and_explains_why(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Planted reward hack: a challenger that answers with clarifying questions (which users leave
    without feedback) is rejected with the no_action alarm named in the decision record, and
    `rtrl gate explain` says so."""
    import subprocess
    import sys

    store, settings, registry = hack_setup(deploy_settings, tiny_model_dir, tmp_path)
    asking = registry.register_checkpoint(tuned_copy(tiny_model_dir, tmp_path / "asking", ASKING))
    decision = gate.evaluate(settings, registry, asking, store)
    print("gate asking:", decision.model_dump_json())
    assert not decision.passed
    assert "no_action" in {a.name for a in decision.alarms if a.fired}
    assert "alarm no_action" in decision.reason
    behaviour, allowed = decision.behaviour, settings.gate.alarms.no_action_rate
    assert behaviour["challenger"].no_action > behaviour["champion"].no_action + allowed
    ope = next(s for s in decision.suites if s.name == "ope")
    assert not ope.conclusive  # no held-out traffic in this store: the suite says so and does not decide
    assert "no_action" in registry.version_tags(asking)["gate_alarms"].split(",")
    env = {**os.environ, "RTRL_STORE__URL": store.url}
    out = subprocess.run(
        [sys.executable, "-m", "rtrl.cli", "gate", "explain", str(asking)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stderr
    assert f"v{asking} against champion v1: FAIL" in out.stdout
    assert "alarm no_action" in out.stdout and "FIRED" in out.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "rtrl.cli", "gate", "explain", "999"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and "no gate decision is recorded for v999" in missing.stderr
    assert "Traceback" not in missing.stderr
    store.close()


def test_gate_holds_the_line_at_the_anchor_when_the_champion_has_slipped(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Non-inferiority against the champion alone ratchets: each promotion may lose a little. Here the
    champion has already lost what the base could do (v2, noised weights, promoted without the gate:
    its answers are no longer in the task's shape); a challenger with v2's very weights is
    non-inferior to it, and is still rejected, because it falls below the anchor (the base, v1) on
    the anchored suite (an offline suite: answers in the task's shape). ope is anchored too (the
    users' reward on held-out traffic, reweighted to the anchor)."""
    from episodes import feed, sample_episodes

    from evals import get_task

    store, settings, registry = hack_setup(deploy_settings, tiny_model_dir, tmp_path)
    feed(store, sample_episodes(tiny_model_dir, 64, seed=11))  # held-out traffic the base served
    shape = tmp_path / "shape.jsonl"
    shape.write_text(
        "".join(
            json.dumps({"prompt": p, "pattern": r"^\s*(It is |The answer is )?\w+[.!]\s*$"}) + "\n"
            for p in get_task("exclaim").heldout_prompts(16)
        )
    )
    settings = settings.model_copy(
        update={
            "gate": settings.gate.model_copy(
                update={
                    "offline": (
                        OfflineSuiteSettings(name="shape", path=shape, scorer="regex", max_tokens=16),
                    ),
                    "anchor_suites": ("shape", "ope"),
                }
            )
        }
    )
    slipped = registry.register_checkpoint(
        perturbed_copy(tiny_model_dir, tmp_path / "slipped", std=0.3, seed=4)
    )
    rollout.promote(settings, registry, slipped, force_reason="by hand in a test")
    same = registry.register_checkpoint(
        perturbed_copy(tmp_path / "slipped", tmp_path / "same", std=0.0, seed=0)
    )
    decision = gate.evaluate(settings, registry, same, store)
    print("gate at the anchor:", decision.model_dump_json())
    suites = {s.name: s for s in decision.suites}
    assert decision.champion_version == slipped and decision.anchor_version == 1
    assert suites["shape"].passed and suites["shape"].difference.estimate == 0.0  # type: ignore[union-attr]
    anchor = suites["shape_anchor"]
    assert anchor.conclusive and not anchor.passed and anchor.champion is not None and anchor.champion > 0.5
    assert not decision.passed and "suite shape_anchor" in decision.reason
    assert registry.version_tags(same)["gate_suite_shape_anchor"].startswith("fail")
    # The users' reward against the anchor too: reweighted to the base (v1) on its own traffic. The
    # slipped weights are far from what was served, so neither estimate decides; both say why.
    users = suites["ope_anchor"]
    assert users.n == suites["ope"].n > 10 and "anchor v1" in users.note and "anchor" in users.note
    assert not users.conclusive and users.passed is None
    assert store.gate_decisions(same)[0]["anchor_version"] == 1
    # Anchored at the champion itself (its own number, or "none"), the same challenger passes.
    unanchored = settings.model_copy(
        update={"gate": settings.gate.model_copy(update={"anchor": str(slipped)})}
    )
    again = gate.evaluate(unanchored, registry, same, store)
    assert (
        again.passed and again.anchor_version is None and "shape_anchor" not in {s.name for s in again.suites}
    )
    # The gate left staging on the champion (v2); the fixture expects every server back on v1.
    assert rollout.promote(settings, registry, 1).ok
    assert settings.vllm.staging_server is not None
    with swap.server_client(settings, settings.vllm.staging_server) as staging:
        gate._load(staging, swap.target(settings, registry, store, 1), settings, store)
    store.close()


def gateway_counts(gateway: str, admin: str) -> dict[str, dict[str, float]]:
    """The gateway's requests sent to, and now on, each server: {"sent": {url: n}, "on": {url: n}}."""
    text = httpx.get(f"{gateway}/metrics", headers={"authorization": f"Bearer {admin}"}, timeout=30).text
    counts: dict[str, dict[str, float]] = {"sent": {}, "on": {}}
    for line in text.splitlines():
        for key, name in (
            ("sent", "rtrl_gateway_upstream_requests_total{"),
            ("on", "rtrl_gateway_upstream_in_flight{"),
        ):
            if line.startswith(name):
                counts[key][line.split('server="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return counts


def test_a_swap_under_load_through_the_gateway_fails_nothing_and_no_request_waits(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two serving servers (the session's serving and staging servers) behind one gateway, under
    concurrent streaming and non-streaming load: each server leaves the rotation, is drained,
    swapped, verified and put back while the other serves."""
    import threading

    from openai import OpenAI

    from services.launch import gateway_process
    from store import Store

    base = deploy_settings
    assert base.vllm.staging_server is not None
    settings = base.model_copy(
        update={
            "vllm": base.vllm.model_copy(
                update={"servers": (*base.vllm.servers, base.vllm.staging_server), "staging_server": None}
            ),
            "store": base.store.model_copy(update={"url": f"sqlite:///{tmp_path / 'rtrl.db'}"}),
            "gateway": base.gateway.model_copy(
                update={"port": free_ports(1)[0], "spool_dir": tmp_path / "spool"}
            ),
        }
    )
    store = Store(settings.store.url)
    store.migrate()
    _, key = store.create_api_key(role="tenant", tenant="swap-load", name="swap under load", rate_per_s=0)
    registry = Registry.from_settings(settings)
    assert rollout.bootstrap(settings, registry, tiny_model_dir) == 1
    v2 = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "v2", std=0.05, seed=5))

    _, admin = store.create_api_key(role="admin", tenant=None, name="swap under load")
    stop = threading.Event()
    served: list[str] = []
    failures: list[str] = []
    # What the gateway had sent to, and had on, the server being swapped: read inside its swap window
    # (out of rotation, drained), just before the pause and just after the verification. The probe
    # wraps the real swap_server and changes nothing it does.
    probes: dict[str, tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]] = {}
    real_swap_server = swap.swap_server
    gateway_url = ""

    def probed_swap_server(server: VllmClient, *args: object, **kwargs: object) -> object:
        before = gateway_counts(gateway_url, admin)
        try:
            return real_swap_server(server, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            probes[server.url] = (before, gateway_counts(gateway_url, admin))

    def load(streaming: bool, client: OpenAI) -> None:
        while not stop.is_set():
            try:
                if streaming:
                    chunks = list(
                        client.completions.create(
                            model=settings.vllm.served_model_name, prompt=PROMPT, max_tokens=16, stream=True
                        )
                    )
                    served.append("".join(c.choices[0].text for c in chunks if c.choices))
                else:
                    served.append(
                        client.completions.create(
                            model=settings.vllm.served_model_name, prompt=PROMPT, max_tokens=8
                        )
                        .choices[0]
                        .text
                    )
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                failures.append(repr(exc))

    try:
        with gateway_process(settings, tmp_path / "gateway.log") as gateway:
            gateway_url = gateway
            client = OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=60)
            threads = [threading.Thread(target=load, args=(i % 2 == 0, client)) for i in range(6)]
            for thread in threads:
                thread.start()
            time.sleep(2)  # load running on both servers
            before = len(served)
            with monkeypatch.context() as patch:
                patch.setattr(rollout, "swap_server", probed_swap_server)
                result = rollout.promote(settings, registry, v2, force_reason="by hand in a test")
            during = len(served) - before
            time.sleep(1)
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
            rotation = store.rotation()
    finally:
        stop.set()
        # Both shared servers back on v1 (the fixture checks it), whatever happened above.
        rollout.promote(settings, registry, 1)
        store.close()
    print("promote v2 under load:", result.model_dump_json())
    print("gateway inside each swap window (before the pause, after the verification):", probes)
    assert result.ok, result.error
    assert failures == [], failures[:5]
    assert during > 0 and len(served) > 20
    assert [s.url for s in result.servers] == [u.rstrip("/") for u in settings.vllm.servers]
    for step in result.servers:
        assert step.verified and step.drained
        assert step.in_flight_at_pause == 0, step  # vLLM had none left: drained before the pause
        # No request waited for the paused server: from just before its pause until its verification
        # ended, the gateway sent it nothing, and had nothing on it when the verification ended. (Just
        # before the pause it may still be relaying the tail of a stream vLLM has finished.)
        at_pause, after = probes[step.url]
        assert after["sent"][step.url] == at_pause["sent"][step.url], (step.url, at_pause, after)
        assert after["on"][step.url] == 0, (step.url, after)
    assert all(row.in_rotation for row in rotation.values())  # every server back in rotation


def test_the_reconciler_brings_back_a_restarted_server_and_undoes_a_dead_deployers_leftovers(
    deploy_settings: Settings, services: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Champion v2; the vLLM servers are restarted by hand (they come back on their base weights,
    labelled "default"), and a deployer that died mid-swap left the staging server paused and the
    serving server out of rotation. One `rtrl deploy reconcile` swaps both back to v2 (verified),
    resumes staging and puts the serving server back in rotation; a second one finds nothing to do."""
    from helpers import run_rtrl

    from services import down, up
    from store import Store

    settings = deploy_settings
    registry = Registry.from_settings(settings)
    rollout.bootstrap(settings, registry, tiny_model_dir)
    v2 = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "v2", std=0.05, seed=8))
    assert rollout.promote(settings, registry, v2, force_reason="by hand in a test").ok
    url = settings.vllm.servers[0].rstrip("/")
    staging = settings.vllm.staging_server
    assert staging is not None
    with serving(settings) as server:
        v2_text = greedy(server)

    stopped = down(services, only=("vllm",))  # both servers: the "vllm" unit includes staging
    up(services, only=("vllm",))  # a restart by hand: base weights, no version
    assert sorted(stopped) == ["vllm", "vllm-staging"]
    with serving(settings) as server:
        assert server.state().weight_version is None and greedy(server) != v2_text
    store = Store(settings.store.url)
    try:
        store.set_rotation(url, False, f"{swap.DEPLOYER_MARK}swap to v2")  # left by a dead deployer
        with VllmClient(staging, model=settings.vllm.served_model_name) as server:
            server.pause()

        proc = run_rtrl(settings, "deploy", "reconcile", timeout_s=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads(proc.stdout)
        print("reconcile:", report)
        assert report["champion"] == 2 and report["errors"] == {}
        assert {s["url"] for s in report["swaps"]} == {url, staging.rstrip("/")}
        assert all(s["verified"] for s in report["swaps"])
        assert report["resumed"] == [staging.rstrip("/")] and report["returned_to_rotation"] == [url]
        assert store.rotation()[url].in_rotation and store.rotation()[url].version == 2
        with serving(settings) as server:
            assert server.weight_version() == 2 and greedy(server) == v2_text
        with VllmClient(staging, model=settings.vllm.served_model_name) as server:
            assert server.weight_version() == 2 and not server.is_paused()

        again = run_rtrl(settings, "deploy", "reconcile", timeout_s=300)
        assert again.returncode == 0, again.stderr
        quiet = json.loads(again.stdout)
        assert (
            quiet["swaps"] == quiet["relabelled"] == quiet["resumed"] == quiet["returned_to_rotation"] == []
        )
    finally:
        store.close()
        # The shared servers back on v1, staging included (a promotion leaves staging alone).
        rollout.promote(settings, registry, 1)
        rollout.align_fleet(settings, registry)


def test_a_server_killed_while_paused_mid_swap_leaves_the_fleet_on_the_champion(
    deploy_settings: Settings,
    services: Settings,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two serving servers (the session's serving and staging servers); promoting v2, the second
    vLLM process is SIGKILLed right after the deployer paused it. The promotion fails and rolls the
    canary back: the live server serves v1, @champion stays v1. Without an operator, `rtrl deploy
    reconcile` (what `rtrl run`'s reconciler runs) restarts the dead one (out of rotation while it
    comes back on its base weights), gives it the champion's version and puts it back in rotation."""
    import os
    import signal

    from helpers import run_rtrl

    from services import services as units
    from services import up
    from store import Store

    base = deploy_settings
    assert base.vllm.staging_server is not None
    settings = base.model_copy(
        update={
            "vllm": base.vllm.model_copy(
                update={"servers": (*base.vllm.servers, base.vllm.staging_server), "staging_server": None}
            ),
        }
    )
    registry = Registry.from_settings(settings)
    rollout.bootstrap(settings, registry, tiny_model_dir)
    live, victim = (u.rstrip("/") for u in settings.vllm.servers)
    with serving(settings) as server:
        base_text = greedy(server)
    v2 = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "v2", std=0.05, seed=9))
    (unit,) = [u for u in units(services, ("vllm",)) if u.name == "vllm-staging"]
    victim_pid = unit.pid()
    assert victim_pid is not None
    real_pause = VllmClient.pause

    def pause_then_die(self: VllmClient, mode: str = "wait") -> None:
        real_pause(self, mode)  # type: ignore[arg-type]
        if self.url.rstrip("/") == victim:
            os.killpg(victim_pid, signal.SIGKILL)  # the whole vLLM process group, engine included

    store = Store(settings.store.url)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(VllmClient, "pause", pause_then_die)
            result = rollout.promote(settings, registry, v2, force_reason="by hand in a test")
        print("promote with a server killed mid-swap:", result.model_dump_json())
        assert not result.ok and result.rolled_back and registry.champion() == 1
        assert [s.url for s in result.servers][:2] == [live, victim] and not result.servers[1].verified
        with serving(settings) as server:
            assert server.weight_version() == 1 and not server.is_paused() and greedy(server) == base_text
        assert unit.pid() is None  # dead, and nobody has started it

        # The reconciler of the run dir that started the servers (where their pid files are).
        healer = settings.model_copy(update={"services": services.services})
        proc = run_rtrl(healer, "deploy", "reconcile", timeout_s=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads(proc.stdout)
        print("reconcile after the kill:", report)
        assert report["restarted"] == [victim] and report["errors"] == {}
        # Back on its base weights, which are the champion's (v1): relabelled after the probe, and
        # back in the rotation the restart took it out of.
        assert (
            report["champion"] == 1
            and victim in report["relabelled"]
            and victim in report["returned_to_rotation"]
        )
        assert unit.pid() not in (None, victim_pid)
        assert store.rotation()[victim].in_rotation and store.rotation()[victim].version == 1
        with VllmClient(victim, model=settings.vllm.served_model_name) as server:
            assert server.weight_version() == 1 and greedy(server) == base_text
    finally:
        store.close()
        up(services, only=("vllm",))  # whatever happened above, the session's servers run again
