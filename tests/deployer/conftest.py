"""Fixtures of the deployer's tests on real services."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployer import rollout
from registry import Registry
from schemas.settings import GateSettings, MlflowSettings, ServicesSettings, Settings
from serving import VllmClient


@pytest.fixture()
def deploy_settings(services: Settings, tmp_path: Path) -> Iterator[Settings]:
    """The session's services under a private model name and deploy dir; restores the fleet to v1 after."""
    settings = services.model_copy(
        update={
            "mlflow": MlflowSettings(
                **{**services.mlflow.model_dump(), "model_name": f"deployer-{uuid.uuid4().hex[:8]}"}
            ),
            "services": ServicesSettings(**{**services.services.model_dump(), "run_dir": tmp_path / "run"}),
            "gate": GateSettings(eval_prompts=16, samples_per_prompt=2, tolerance=0.05),
        }
    )
    registry = Registry.from_settings(settings)
    yield settings
    # Leave the shared servers as other tests expect them: base weights, version v1, resumed.
    if registry.versions() and registry.champion() != 1:
        rollout.promote(settings, registry, 1)
    for url in (*settings.vllm.servers, settings.vllm.staging_server):
        assert url is not None
        with VllmClient(url, model=settings.vllm.served_model_name) as server:
            if server.is_paused():
                server.resume()
            assert server.weight_version() == 1
