"""The registry client against the session's real MLflow server: versions, aliases, checkpoints, runs."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest

from registry import CHALLENGER, CHAMPION, NoChampion, Registry, RegistryError
from schemas.errors import OperatorError
from schemas.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
def registry(mlflow_service: Settings, tmp_path: Path) -> Registry:
    """A registry under a model name and experiment of this test's own."""
    tag = uuid.uuid4().hex[:8]
    mlflow = mlflow_service.mlflow.model_copy(
        update={"model_name": f"registry-test-{tag}", "experiment": f"registry-test-{tag}"}
    )
    return Registry(mlflow, tmp_path / "checkpoints", mlflow_service.services.run_dir)


def checkpoint(directory: Path, marker: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"marker": marker}))
    (directory / "model.safetensors").write_bytes(b"\0" * 64)
    return directory


def test_versions_aliases_and_checkpoint_download(registry: Registry, tmp_path: Path) -> None:
    assert registry.versions() == []
    with pytest.raises(NoChampion, match="rtrl deploy bootstrap") as caught:
        registry.champion()
    assert isinstance(caught.value, OperatorError)

    first = registry.register_checkpoint(checkpoint(tmp_path / "a", "a"), tags={"rtrl.base": "true"})
    second = registry.register_checkpoint(checkpoint(tmp_path / "b", "b"))
    assert (first, second) == (1, 2) and registry.versions() == [1, 2]
    registry.set_alias(CHAMPION, first)
    registry.set_alias(CHALLENGER, second)
    assert (registry.champion(), registry.challenger(), registry.alias("nope")) == (1, 2, None)
    registry.set_previous_champion(1)
    assert registry.previous_champion() == 1
    assert registry.version_tags(1)["rtrl.base"] == "true"

    # The checkpoint travels through the server (proxied artifacts) into the local cache, once.
    local = registry.download_checkpoint(2)
    assert local == registry.checkpoints_dir / "v2"
    assert json.loads((local / "config.json").read_text()) == {"marker": "b"}
    (local / "config.json").write_text("{}")  # a complete copy is not downloaded again
    assert registry.download_checkpoint(2) == local and (local / "config.json").read_text() == "{}"

    with pytest.raises(RegistryError, match="neither an HF checkpoint .* nor a LoRA adapter"):
        registry.register_checkpoint(tmp_path)
    with pytest.raises(RegistryError, match="version 9"):
        registry.download_checkpoint(9)
    registry.delete_version(2)
    assert registry.versions() == [1]


def test_a_cycle_run_carries_params_metrics_and_lineage(registry: Registry, tmp_path: Path) -> None:
    run_id = registry.start_run(
        "cycle-1", tags={"rtrl.kind": "training_cycle"}, params={"trainer.lr": "0.001"}
    )
    registry.log_metrics(run_id, {"loss": 0.5, "kl_k1": 0.0}, step=1)
    registry.log_json(run_id, {"episodes.json": ["e2", "e1"], "gate/decision-v2.json": {"passed": True}})
    version = registry.register_checkpoint(checkpoint(tmp_path / "ckpt", "c"), run_id=run_id)
    registry.end_run(run_id, "FINISHED")

    run = registry.run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["trainer.lr"] == "0.001"
    assert run.data.metrics["loss"] == 0.5 and run.data.tags["rtrl.kind"] == "training_cycle"
    assert registry.version_run_id(version) == run_id
    episodes = registry.download_run_artifact(run_id, "episodes.json", tmp_path / "dl")
    assert json.loads(episodes.read_text()) == ["e2", "e1"]
    decision = registry.download_run_artifact(run_id, "gate/decision-v2.json", tmp_path / "dl")
    assert json.loads(decision.read_text()) == {"passed": True}


def test_racing_processes_get_one_experiment(registry: Registry) -> None:
    clients = [Registry(registry.settings, registry.checkpoints_dir) for _ in range(4)]
    ids: list[str] = []
    threads = [threading.Thread(target=lambda c=c: ids.append(c.experiment_id())) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ids) == 4 and len(set(ids)) == 1


def test_mlflow_refuses_whoever_does_not_sign_in_as_rtrl(
    registry: Registry, mlflow_service: Settings, tmp_path: Path
) -> None:
    """The local MLflow runs its basic-auth app (services/mlflow.py): moving an alias or reading a
    model needs rtrl's credentials; /health alone is open."""
    import httpx

    from registry.credentials import credentials

    version = registry.register_checkpoint(checkpoint(tmp_path / "a", "a"))
    uri = registry.settings.tracking_uri.rstrip("/")
    move = {"name": registry.model_name, "alias": CHAMPION, "version": str(version)}
    found = credentials(registry.settings, mlflow_service.services.run_dir)
    assert found is not None
    user, password = found
    for auth in (None, (user, "not-" + password), ("someone", password)):
        moved = httpx.post(f"{uri}/api/2.0/mlflow/registered-models/alias", json=move, auth=auth, timeout=10)
        assert moved.status_code == 401, (auth and auth[0], moved.status_code, moved.text[:200])
        read = httpx.get(
            f"{uri}/api/2.0/mlflow/registered-models/get",
            params={"name": registry.model_name},
            auth=auth,
            timeout=10,
        )
        assert read.status_code == 401
    assert registry.alias(CHAMPION) is None  # nothing moved
    assert httpx.get(f"{uri}/health", timeout=10).status_code == 200
    signed = httpx.post(
        f"{uri}/api/2.0/mlflow/registered-models/alias", json=move, auth=(user, password), timeout=10
    )
    assert signed.status_code == 200 and registry.alias(CHAMPION) == version


def test_a_registry_made_before_the_local_credentials_exist_signs_in_once_they_do(
    mlflow_service: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rtrl demo` makes its registry client before `rtrl services up` has written the local MLflow
    admin's credentials (a fresh run dir): the client asks for them again before its next call,
    instead of failing every call with 401; without any, the 401 is one line that says what to set."""
    import shutil

    from registry import RegistryRefused
    from registry.credentials import AUTH_FILE

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    run_dir = tmp_path / "run"  # nothing in it yet, as on a fresh machine
    tag = uuid.uuid4().hex[:8]
    mlflow = mlflow_service.mlflow.model_copy(
        update={"model_name": f"late-{tag}", "experiment": f"late-{tag}", "username": None, "password": None}
    )
    registry = Registry(mlflow, tmp_path / "checkpoints", run_dir)
    with pytest.raises(RegistryRefused, match="RTRL_MLFLOW__USERNAME") as refused:
        registry.versions()
    assert "(401)" in str(refused.value) and "\n" not in str(refused.value)

    (run_dir / AUTH_FILE).parent.mkdir(parents=True)
    shutil.copy(mlflow_service.services.run_dir / AUTH_FILE, run_dir / AUTH_FILE)  # `services up` wrote them
    assert registry.versions() == []
    assert registry.register_checkpoint(checkpoint(tmp_path / "a", "a")) == 1
