"""The MLflow model registry as rtrl uses it: versions, aliases, and a local cache of checkpoints.

Registered version N of ``settings.mlflow.model_name`` serves as weight version ``"vN"``
(schemas/versions.py). A version's checkpoint is an HF-format directory (config, safetensors,
tokenizer) logged as the artifact folder ``checkpoint`` of an MLflow run; the version's source
points there. Alias ``champion`` is what the fleet serves, ``challenger`` is the newest trained
candidate; the registered-model tag ``previous_champion`` remembers what `rollback` returns to.

`bootstrap` registers the base model as version 1 (once) and brings the fleet's weight versions
in line with the registry; ``rtrl deploy bootstrap`` calls it. The trainer registers its
checkpoints with `register_checkpoint`.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from deployer.errors import RegistryError
from schemas.settings import Settings

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion
    from mlflow.tracking import MlflowClient

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION_TAG = "previous_champion"
CHECKPOINT_ARTIFACT = "checkpoint"
# Written last into a cached checkpoint directory: its presence means the download completed.
_COMPLETE = ".rtrl-complete"


def client(settings: Settings) -> MlflowClient:
    from mlflow.tracking import MlflowClient

    uri = settings.mlflow.tracking_uri
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _experiment_id(mlflow_client: MlflowClient, name: str) -> str:
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    return str(mlflow_client.create_experiment(name))


def _ensure_registered_model(mlflow_client: MlflowClient, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client.get_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        mlflow_client.create_registered_model(
            name, description="rtrl policy; version N serves as weight version vN"
        )


def versions(settings: Settings) -> list[int]:
    """Every registered version number of the policy, ascending (empty when none)."""
    mlflow_client = client(settings)
    found = mlflow_client.search_model_versions(f"name = '{settings.mlflow.model_name}'")
    return sorted(int(v.version) for v in found)


def register_checkpoint(
    settings: Settings,
    checkpoint: Path,
    *,
    run_id: str | None = None,
    tags: dict[str, str] | None = None,
) -> int:
    """Log an HF-format checkpoint directory as the ``checkpoint`` artifact of `run_id` (a new run
    in the rtrl experiment when None) and register it; returns the new version number."""
    if not (checkpoint / "config.json").is_file():
        raise RegistryError(f"{checkpoint} is not an HF checkpoint directory (no config.json)")
    name = settings.mlflow.model_name
    mlflow_client = client(settings)
    _ensure_registered_model(mlflow_client, name)
    own_run = run_id is None
    if run_id is None:
        experiment_id = _experiment_id(mlflow_client, settings.mlflow.experiment)
        run_id = mlflow_client.create_run(experiment_id, tags={"rtrl.kind": "checkpoint"}).info.run_id
    mlflow_client.log_artifacts(run_id, str(checkpoint), CHECKPOINT_ARTIFACT)
    artifact_uri = mlflow_client.get_run(run_id).info.artifact_uri
    if own_run:
        mlflow_client.set_terminated(run_id)
    created = mlflow_client.create_model_version(
        name, source=f"{artifact_uri}/{CHECKPOINT_ARTIFACT}", run_id=run_id, tags=tags or {}
    )
    _wait_ready(mlflow_client, name, str(created.version))
    return int(created.version)


def _wait_ready(mlflow_client: MlflowClient, name: str, version: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = mlflow_client.get_model_version(name, version).status
        if status == "READY":
            return
        if status == "FAILED_REGISTRATION" or time.monotonic() > deadline:
            raise RegistryError(f"{name} version {version} did not become READY (status {status})")
        time.sleep(0.2)


def bootstrap(settings: Settings, model_dir: Path) -> int:
    """Register `model_dir` as version 1 @champion when the registry has no version, then make every
    server (fleet and staging) report the champion's weight version; returns the champion.

    Idempotent: a second call finds the champion and only re-checks the servers. A server that
    reports another version (or none while the champion is past v1, e.g. after a restart on the
    base weights) is swapped to the champion with the verified swap.
    """
    name = settings.mlflow.model_name
    mlflow_client = client(settings)
    _ensure_registered_model(mlflow_client, name)
    if not versions(settings):
        version = register_checkpoint(settings, model_dir, tags={"rtrl.base": "true"})
        if version != 1:
            raise RegistryError(
                f"registered the base model as version {version}; expected 1 (concurrent bootstrap?)"
            )
        set_alias(settings, CHAMPION, version)
    current = champion(settings)

    from deployer.rollout import align_fleet

    align_fleet(settings)
    return current


def _by_alias(settings: Settings, alias: str) -> ModelVersion | None:
    from mlflow.exceptions import MlflowException

    try:
        return client(settings).get_model_version_by_alias(settings.mlflow.model_name, alias)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def champion(settings: Settings) -> int:
    """The version the fleet should serve. Raises RegistryError before `bootstrap`."""
    found = _by_alias(settings, CHAMPION)
    if found is None:
        raise RegistryError(
            f"{settings.mlflow.model_name} has no @{CHAMPION}; run `rtrl deploy bootstrap` first"
        )
    return int(found.version)


def challenger(settings: Settings) -> int | None:
    found = _by_alias(settings, CHALLENGER)
    return None if found is None else int(found.version)


def set_alias(settings: Settings, alias: str, version: int) -> None:
    client(settings).set_registered_model_alias(settings.mlflow.model_name, alias, str(version))


def previous_champion(settings: Settings) -> int | None:
    """What the last promotion replaced (the registered-model tag), if any."""
    tags = client(settings).get_registered_model(settings.mlflow.model_name).tags
    value = tags.get(PREVIOUS_CHAMPION_TAG)
    return None if value is None else int(value)


def set_previous_champion(settings: Settings, version: int) -> None:
    client(settings).set_registered_model_tag(settings.mlflow.model_name, PREVIOUS_CHAMPION_TAG, str(version))


def run_id(settings: Settings, version: int) -> str | None:
    """The MLflow run a version was logged from (the training cycle's run), if known."""
    found = client(settings).get_model_version(settings.mlflow.model_name, str(version)).run_id
    return found or None


def tag_version(settings: Settings, version: int, tags: dict[str, str]) -> None:
    mlflow_client = client(settings)
    for key, value in tags.items():
        mlflow_client.set_model_version_tag(settings.mlflow.model_name, str(version), key, value)


def deploy_dir(settings: Settings) -> Path:
    """Local working directory of the deployer (checkpoint cache, digests, lock files), absolute:
    vLLM resolves `reload_weights` paths in its own working directory."""
    path = (settings.services.run_dir / "deploy").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def checkpoint_dir(settings: Settings, version: int) -> Path:
    """A local copy of version `version`'s checkpoint, downloaded from MLflow on first use.

    The copy lands under ``<run_dir>/deploy/v<N>``; a download goes to a temporary folder first
    and is renamed into place, so a crash never leaves a half-copied checkpoint that looks cached.
    A real multi-host fleet needs this per host (or a shared filesystem).
    """
    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException

    target = deploy_dir(settings) / f"v{version}"
    if (target / _COMPLETE).is_file():
        return target
    mlflow_client = client(settings)
    try:
        source = mlflow_client.get_model_version_download_uri(settings.mlflow.model_name, str(version))
    except MlflowException as exc:
        raise RegistryError(f"{settings.mlflow.model_name} version {version}: {exc.message}") from exc
    staging = target.with_name(f".{target.name}.download-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        downloaded = Path(
            download_artifacts(
                artifact_uri=source, dst_path=str(staging), tracking_uri=settings.mlflow.tracking_uri
            )
        )
        if not (downloaded / "config.json").is_file():
            raise RegistryError(
                f"version {version}'s artifacts at {source} are not an HF checkpoint (no config.json)"
            )
        (downloaded / _COMPLETE).write_text(source + "\n")
        if target.exists():  # an older, incomplete copy, or another process won the race
            if (target / _COMPLETE).is_file():
                return target
            shutil.rmtree(target)
        downloaded.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
