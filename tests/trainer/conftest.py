"""Fixtures of the trainer's integration tests: the session's Redis and MLflow, with a store, run
dir, registry model and experiment of each test's own, and the tiny model as v1 @champion."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from registry import CHAMPION, Registry
from schemas.settings import Settings
from store import Store


@pytest.fixture
def settings(redis_service: Settings, mlflow_service: Settings, tmp_path: Path) -> Settings:
    """The session's Redis and MLflow, with a store, run dir, model name and experiment of this test's own."""
    services = mlflow_service
    tag = uuid.uuid4().hex[:8]
    return services.model_copy(
        update={
            "store": services.store.model_copy(update={"url": f"sqlite:///{tmp_path}/rtrl.db"}),
            "services": services.services.model_copy(update={"run_dir": tmp_path / "run"}),
            "mlflow": services.mlflow.model_copy(
                update={"model_name": f"trainer-test-{tag}", "experiment": f"trainer-test-{tag}"}
            ),
            "trainer": services.trainer.model_copy(
                update={
                    "min_samples": 16,
                    "max_episodes": 64,
                    "steps": 2,
                    "micro_batch": 16,
                    "lr": 1e-3,
                    "checkpoint_dir": tmp_path / "checkpoints",
                }
            ),
            # Episodes fed here are trainable at once (the window rule: tests/store/test_store.py).
            "labeler": services.labeler.model_copy(update={"settle_window_s": 0.0}),
            # Every episode fed here trains: the held-out slice is the gate's (tests/deployer, tests/e2e).
            "gate": services.gate.model_copy(
                update={"ope": services.gate.ope.model_copy(update={"holdout_percent": 0})}
            ),
        }
    )


@pytest.fixture
def store(settings: Settings) -> Iterator[Store]:
    s = Store(settings.store.url)
    s.migrate()
    yield s
    s.close()


@pytest.fixture
def registry(settings: Settings) -> Registry:
    return Registry.from_settings(settings)


@pytest.fixture
def champion(registry: Registry, tiny_model_dir: Path) -> int:
    """The tiny model registered as v1 @champion (no fleet alignment: no vLLM needed here)."""
    version = registry.register_checkpoint(tiny_model_dir, tags={"rtrl.base": "true"})
    registry.set_alias(CHAMPION, version)
    return version
