"""The local MLflow server is real: a run's artifacts become a registered model version with an alias."""

from __future__ import annotations

import uuid
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from schemas.settings import Settings

pytestmark = pytest.mark.integration


def test_registered_version_read_back_by_alias(mlflow_service: Settings, tmp_path: Path) -> None:
    mlflow.set_tracking_uri(mlflow_service.mlflow.tracking_uri)
    client = MlflowClient(mlflow_service.mlflow.tracking_uri)
    experiment_id = client.create_experiment(f"services-test-{uuid.uuid4().hex[:8]}")
    name = f"services-test-model-{uuid.uuid4().hex[:8]}"

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"cycle": 1}')
    with mlflow.start_run(experiment_id=experiment_id) as run:
        mlflow.log_metric("reward_mean", 0.25, step=1)
        mlflow.log_artifacts(str(ckpt), artifact_path="checkpoint")

    client.create_registered_model(name)
    version = client.create_model_version(name, f"runs:/{run.info.run_id}/checkpoint", run_id=run.info.run_id)
    client.set_registered_model_alias(name, "challenger", version.version)

    by_alias = client.get_model_version_by_alias(name, "challenger")
    assert by_alias.version == version.version == "1"
    assert by_alias.run_id == run.info.run_id
    assert "challenger" in by_alias.aliases
    # The checkpoint went to the server (proxied artifacts) and comes back through the alias.
    downloaded = Path(mlflow.artifacts.download_artifacts(
        artifact_uri=f"models:/{name}@challenger", dst_path=str(tmp_path / "dl")))
    assert (downloaded / "config.json").read_text() == '{"cycle": 1}'
    assert client.get_run(run.info.run_id).data.metrics["reward_mean"] == 0.25
