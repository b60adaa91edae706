"""bench_gate's offline stage: planted checkpoints through the real offline gate (not a bench itself).

For the planted challengers whose live effect a tiny-model checkpoint can carry
(simulation/planted.py), a checkpoint is made and judged by `deployer.gate.evaluate` on a real
staging vLLM server and MLflow registry, with the gate's default suites (ope on held-out traffic,
retention) and alarms, against the base as champion: exactly what `rtrl run` does before a canary.
The held-out traffic is the base's own, `logged` episodes rated by exclaim users
(`simulation.planted.sample_episodes`, all of them held out). Each checkpoint's true effect on those
users is measured on-policy too (`truth_acceptance`: the share of its own sampled answers the users
accept, against the base's; ``truth_promote``: at least the base's), which bench_gate checks
against the planted direction (``offline_truth_agreement``) instead of assuming it. The gate runs
with ``gate.fresh_draws`` off, so a run repeats the same questions and bootstrap.

The other planted effects (worse for a segment of users only, thumbs against outcomes) need users
that differ from one another or a second signal, which the exclaim users and the tiny model do not
have: those challengers go to the canary stage without an offline stage.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deployer import gate, rollout
from evals import get_task
from feedback.records import holdout_key
from registry import Registry
from schemas.settings import Settings, StoreSettings
from services import up
from services.testing import private_services
from simulation.planted import ASKING, RAMBLING, feed, perturbed_copy, sample_episodes, tuned_copy
from store import Store

_EXCLAIM = get_task("exclaim")

# Planted name (bench_gate.PLANTED) -> how its checkpoint is made from the base.
CHECKPOINTS: dict[str, Callable[[Path, Path], Path]] = {
    "better": lambda base, out: tuned_copy(base, out, _EXCLAIM.preferred_shapes, steps=12),
    "equal": lambda base, out: perturbed_copy(base, out, std=0.0, seed=0),
    "worse_for_all": lambda base, out: tuned_copy(base, out, _EXCLAIM.plain_shapes, steps=12),
    "longer_same_content": lambda base, out: tuned_copy(base, out, RAMBLING),
    "non_answer_hack": lambda base, out: tuned_copy(base, out, ASKING),
}


def acceptance(model_dir: Path, n: int, seed: int) -> float:
    """The share of `n` of the model's own sampled answers that exclaim users accept (thumbs up)."""
    rated = sample_episodes(model_dir, n, seed=seed)
    return sum(f.kind == "thumbs_up" for _, f in rated) / len(rated)


def _settings(settings: Settings, run_dir: Path) -> Settings:
    gate_cfg = settings.gate
    return settings.model_copy(
        update={
            "store": StoreSettings(url=f"sqlite:///{run_dir / 'gate.db'}"),
            "mlflow": settings.mlflow.model_copy(update={"model_name": f"bench-gate-{uuid.uuid4().hex[:8]}"}),
            # Every logged episode is held out: the bench trains nothing on them. Fixed draws: the model
            # name is random, and fresh draws would follow it from run to run.
            "gate": gate_cfg.model_copy(
                update={"fresh_draws": False, "ope": gate_cfg.ope.model_copy(update={"holdout_percent": 100})}
            ),
        }
    )


def offline_stage(logged: int, truth_samples: int) -> dict[str, dict[str, Any]]:
    """Each checkpoint-able planted challenger's offline gate decision and its measured truth."""
    results: dict[str, dict[str, Any]] = {}
    with private_services("rtrl-bench-gate-", enabled=("mlflow", "vllm")) as services:
        run_dir = services.services.run_dir
        settings = _settings(services, run_dir)
        from services.vllm import ensure_model

        base = ensure_model(settings)
        up(settings)
        store = Store(settings.store.url)
        store.migrate()
        feed(store, sample_episodes(base, logged, seed=21), holdout_key(settings))
        registry = Registry.from_settings(settings)
        rollout.bootstrap(settings, registry, base)
        champion_truth = acceptance(base, truth_samples, seed=33)
        for name, make in CHECKPOINTS.items():
            path = make(base, run_dir / f"planted-{name}")
            version = registry.register_checkpoint(path)
            decision = gate.evaluate(settings, registry, version, store)
            truth = acceptance(path, truth_samples, seed=33)
            results[name] = {
                "offline_passed": decision.passed,
                "reason": decision.reason,
                "suites": {
                    s.name: None if s.difference is None else round(s.difference.estimate, 4)
                    for s in decision.suites
                },
                "alarms": [a.name for a in decision.alarms if a.fired],
                "truth_acceptance": round(truth, 4),
                "champion_truth_acceptance": round(champion_truth, 4),
                "truth_promote": truth >= champion_truth,
            }
            print(f"offline {name:22s} {results[name]}", flush=True)
        store.close()
    return results
