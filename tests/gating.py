"""Helpers of the gate's tests on real services: challengers made from the base checkpoint, and the
gate's settings and registry for one test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deployer import rollout
from registry import Registry
from schemas.settings import Settings
from simulation.planted import perturbed_copy as perturbed_copy
from store import Store


def gate_settings(settings: Settings, store_url: str) -> Settings:
    """Every suite but the oracle, the held-out slice at its widest, a small bootstrap."""
    return settings.model_copy(
        update={
            "store": settings.store.model_copy(update={"url": store_url}),
            "gate": settings.gate.model_copy(
                update={
                    "suites": ("ope", "retention"),
                    "bootstrap_resamples": 400,
                    "ope": settings.gate.ope.model_copy(update={"holdout_percent": 50, "min_ess": 8}),
                }
            ),
        }
    )


def hack_setup(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> tuple[Store, Settings, Registry]:
    """A store of the test's own (no held-out traffic), the gate's settings, the base as v1 @champion."""
    store = Store(f"sqlite:///{tmp_path / 'gate.db'}")
    store.migrate()
    settings = gate_settings(deploy_settings, store.url)
    # The same prompts and seed in every run: with fresh draws the seed follows the test's random
    # model name, and how far a planted hack shows varies with it (a CI run saw 37.5 % truncation).
    settings = settings.model_copy(update={"gate": settings.gate.model_copy(update={"fresh_draws": False})})
    registry = Registry.from_settings(settings)
    rollout.bootstrap(settings, registry, tiny_model_dir)
    return store, settings, registry


# The canary server of the canary's unit tests: a URL only, nothing listens there.
CANARY = "http://127.0.0.1:18002"


def canary_settings(**canary_update: Any) -> Settings:
    """Default settings with a canary server and the canary enabled, `min_episodes` 30, and `canary_update`."""
    base = Settings(vllm={"canary_server": CANARY})
    update = {"enabled": True, "min_episodes": 30, **canary_update}
    return base.model_copy(
        update={"gate": base.gate.model_copy(update={"canary": base.gate.canary.model_copy(update=update)})}
    )
