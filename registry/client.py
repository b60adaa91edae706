"""The one MLflow client of an rtrl process: runs of training cycles, model versions, aliases, checkpoints.

Registered version N of ``settings.mlflow.model_name`` serves as weight version ``"vN"``
(schemas/versions.py); in this API a version is the ``int`` N. A version's checkpoint is an
HF-format directory (config, safetensors, tokenizer) logged as the artifact folder ``checkpoint``
of an MLflow run; the version's source points there. Alias ``champion`` is what the fleet serves,
``challenger`` the newest trained candidate; the registered-model tag ``previous_champion``
remembers what a rollback returns to.

Open one `Registry` per process (it holds one `MlflowClient`) and pass it down. MLflow is
imported when the first `Registry` is created, not when this module is. A tracking server that
does not answer raises `RegistryUnavailable` from any method (MLflow's own retries happen first).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.credentials import sign_in
from registry.errors import NoChampion, RegistryError, RegistryRefused, RegistryUnavailable
from schemas.lines import Line
from schemas.settings import MlflowSettings, Settings
from schemas.versions import format_version

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION_TAG = "previous_champion"
CHECKPOINT_ARTIFACT = "checkpoint"
# How long a new model version may stay PENDING_REGISTRATION before registration fails.
REGISTRATION_TIMEOUT_S = 60
# Written last into a downloaded checkpoint directory: its presence means the download completed.
DOWNLOAD_COMPLETE = ".rtrl-complete"


@dataclass(frozen=True)
class VersionRecord:
    """A registered version as retention sees it (`Registry.version_records`)."""

    version: int
    source: str  # the artifact URI of its checkpoint folder
    run_id: str | None
    created_at: datetime


def _unanswered(exc: Exception) -> bool:
    """Whether an MlflowException means the server never answered (MLflow's REST client words
    transport failures as "API request to <url> failed with [timeout] exception ...")."""
    message = str(exc)
    return message.startswith("API request to") and (
        "failed with exception" in message or "failed with timeout exception" in message
    )


def _answered(uri: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, raising RegistryUnavailable when the server at `uri` does not answer."""
    from mlflow.exceptions import MlflowException

    try:
        return call(*args, **kwargs)
    except MlflowException as exc:
        if (status := exc.get_http_status_code()) in (401, 403):  # type: ignore[no-untyped-call]
            raise RegistryRefused(
                f"MLflow at {uri} refused rtrl's credentials ({status}): set RTRL_MLFLOW__USERNAME and "
                "RTRL_MLFLOW__PASSWORD to a user of its basic-auth app with rights on the model (the local services' admin is in "
                "<services.run_dir>/mlflow/auth.json, made by `rtrl services up`; docs/security.md, The registry)"
            ) from exc
        if _unanswered(exc):
            raise RegistryUnavailable(
                f"MLflow at {uri} does not answer ({' '.join(str(exc).split())[:300]}); is it up? "
                "(`rtrl services status`, RTRL_MLFLOW__TRACKING_URI)"
            ) from exc
        raise


class _Answering:
    """An MlflowClient whose calls raise RegistryUnavailable when the server does not answer and
    RegistryRefused when it refuses rtrl's credentials; until `sign_in` has found credentials, it
    is asked again before each call."""

    def __init__(self, client: Any, uri: str, sign_in: Callable[[], bool]) -> None:
        self._client = client
        self._uri = uri
        self._sign_in = sign_in
        self._signed_in = sign_in()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            if not self._signed_in:
                self._signed_in = self._sign_in()
            return _answered(self._uri, method, *args, **kwargs)

        return call


def flatten(prefix: str, value: Any, out: dict[str, str]) -> dict[str, str]:
    """Nested settings as MLflow params: ``{"loss": {"type": "cispo"}}`` -> ``{"loss.type": "cispo"}``."""
    if isinstance(value, dict):
        for key, inner in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = str(value)
    return out


class Registry:
    """MLflow tracking and model registry for one experiment and one registered model.

    `checkpoints_dir` is where `download_checkpoint` keeps local copies of versions (one folder
    per version, ``v<N>``); it is made absolute, because vLLM resolves ``reload_weights`` paths in
    its own working directory.
    """

    def __init__(
        self,
        mlflow: MlflowSettings,
        checkpoints_dir: Path,
        run_dir: Path | None = None,
        tenant: str | None = None,
    ) -> None:
        from mlflow.tracking import MlflowClient

        self.settings = mlflow
        self.model_name = mlflow.model_name
        # Whose adapter line this registry holds (schemas/lines.py); None: the global line. The
        # deployer reads it to leave the servers' weight-version label (the global line's) alone.
        self.tenant = tenant
        self.checkpoints_dir = checkpoints_dir.expanduser().resolve()
        self._client = _Answering(
            MlflowClient(tracking_uri=mlflow.tracking_uri, registry_uri=mlflow.tracking_uri),
            mlflow.tracking_uri,
            # Configured credentials, else the local services' (registry/credentials.py), which may
            # not exist yet when the client is made: `rtrl demo` makes it before `services.up`.
            lambda: sign_in(mlflow, run_dir),
        )
        self._experiment_id: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> Registry:
        """The registry of ``settings.mlflow``, keeping checkpoints under ``<services.run_dir>/deploy``."""
        return cls(settings.mlflow, settings.services.run_dir / "deploy", settings.services.run_dir)

    @classmethod
    def for_line(cls, line: Line) -> Registry:
        """The registry of one line (schemas/lines.py): its own registered model, its local copies in
        a folder of their own (`Line.checkpoints_dir`)."""
        return cls(line.settings.mlflow, line.checkpoints_dir(), line.settings.services.run_dir, line.tenant)

    # ---- experiment and runs --------------------------------------------------------------------

    def experiment_id(self) -> str:
        """The id of ``settings.mlflow.experiment``, created on first use (safe when processes race)."""
        from mlflow.exceptions import MlflowException

        if self._experiment_id is not None:
            return self._experiment_id
        name = self.settings.experiment
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            self._experiment_id = str(experiment.experiment_id)
            return self._experiment_id
        try:
            self._experiment_id = str(self._client.create_experiment(name))
        except MlflowException:
            experiment = self._client.get_experiment_by_name(name)  # another process created it first
            if experiment is None:
                raise
            self._experiment_id = str(experiment.experiment_id)
        return self._experiment_id

    def start_run(self, name: str, tags: dict[str, str], params: dict[str, str]) -> str:
        """A new run in the experiment with these tags and params; returns its id."""
        from mlflow.entities import Param

        run = self._client.create_run(self.experiment_id(), run_name=name, tags=tags)
        run_id = str(run.info.run_id)
        if params:
            # MLflow caps a param value at 6000 characters.
            self._client.log_batch(run_id, params=[Param(k, v[:6000]) for k, v in sorted(params.items())])
        return run_id

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(
            run_id, metrics=[Metric(k, float(v), now, step) for k, v in sorted(metrics.items())]
        )

    def log_json(self, run_id: str, files: dict[str, Any]) -> None:
        """Each value as a JSON artifact of the run, under its file name (``gate/decision.json``)."""
        with tempfile.TemporaryDirectory() as tmp:
            for name, value in files.items():
                path = Path(tmp) / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")
            self._client.log_artifacts(run_id, tmp)

    def set_run_tag(self, run_id: str, key: str, value: str) -> None:
        self._client.set_tag(run_id, key, value)

    def end_run(self, run_id: str, status: str) -> None:
        """status: FINISHED or FAILED."""
        self._client.set_terminated(run_id, status)

    def run(self, run_id: str) -> Any:
        """The `mlflow.entities.Run` (params, metrics, tags, status), for scripts and tests."""
        return self._client.get_run(run_id)

    def runs(self, filter_string: str = "") -> list[Any]:
        """The experiment's runs matching an MLflow search filter, newest first."""
        return list(
            self._client.search_runs([self.experiment_id()], filter_string, order_by=["start_time DESC"])
        )

    # ---- versions ---------------------------------------------------------------------------------

    def _ensure_registered_model(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self._client.get_registered_model(self.model_name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            try:
                self._client.create_registered_model(
                    self.model_name, description="rtrl policy; version N serves as weight version vN"
                )
            except MlflowException as again:  # another process created it meanwhile
                if again.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise

    def versions(self) -> list[int]:
        """Every registered version number of the policy, ascending (empty when none)."""
        found = self._client.search_model_versions(f"name = '{self.model_name}'")
        return sorted(int(v.version) for v in found)

    def register_checkpoint(
        self, checkpoint: Path, *, run_id: str | None = None, tags: dict[str, str] | None = None
    ) -> int:
        """Log an HF-format checkpoint (or LoRA adapter) directory as the ``checkpoint`` artifact of `run_id` (a new
        run in the experiment when None) and register it; returns the new version number once READY.

        A version that does not become READY is deleted before RegistryError is raised, so a failed
        registration never leaves a version behind.
        """
        from mlflow.exceptions import MlflowException

        if not (checkpoint / "config.json").is_file() and not (checkpoint / "adapter_config.json").is_file():
            raise RegistryError(
                f"{checkpoint} is neither an HF checkpoint (no config.json) nor a LoRA adapter "
                "(no adapter_config.json)"
            )
        self._ensure_registered_model()
        own_run = run_id is None
        if run_id is None:
            run_id = self.start_run("checkpoint", {"rtrl.kind": "checkpoint"}, {})
        self._client.log_artifacts(run_id, str(checkpoint), CHECKPOINT_ARTIFACT)
        artifact_uri = self._client.get_run(run_id).info.artifact_uri
        if own_run:
            self._client.set_terminated(run_id)
        try:
            created = self._client.create_model_version(
                self.model_name,
                source=f"{artifact_uri}/{CHECKPOINT_ARTIFACT}",
                run_id=run_id,
                tags=tags or {},
                await_creation_for=REGISTRATION_TIMEOUT_S,
            )
        except MlflowException as exc:
            for version in self._client.search_model_versions(
                f"name = '{self.model_name}' and run_id = '{run_id}'"
            ):
                if version.status != "READY":
                    self._client.delete_model_version(self.model_name, version.version)
            raise RegistryError(
                f"registering {checkpoint} as a version of {self.model_name} failed: {exc}"
            ) from exc
        return int(created.version)

    def delete_version(self, version: int) -> None:
        """Undo a registration whose cycle could not be finished (deliberate compensation), or
        delete a version retention let go (deployer/artefacts.py). A version already gone is no
        error; any other refusal raises RegistryError."""
        from mlflow.exceptions import MlflowException

        try:
            self._client.delete_model_version(self.model_name, str(version))
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise RegistryError(f"deleting {self.model_name} version {version} failed: {exc}") from exc

    def version_records(self) -> list[VersionRecord]:
        """Every registered version with where its checkpoint is and when it was registered, ascending."""
        found = self._client.search_model_versions(f"name = '{self.model_name}'")
        return sorted(
            (
                VersionRecord(
                    version=int(v.version),
                    source=str(v.source or ""),
                    run_id=v.run_id or None,
                    created_at=datetime.fromtimestamp((v.creation_timestamp or 0) / 1000, tz=UTC),
                )
                for v in found
            ),
            key=lambda record: record.version,
        )

    def delete_checkpoint_artifacts(self, source: str) -> None:
        """Delete the artifact folder a version was registered from (its `VersionRecord.source`),
        through the tracking server's artifact proxy or the artifact store itself; the run and its
        other artifacts stay. Deleting what is already gone is no error (the stores ignore it)."""
        from mlflow.exceptions import MlflowException
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        uri = self.settings.tracking_uri
        # The folder by name, from its parent (the run's artifact root): the proxy's DELETE is then
        # on ".../artifacts/checkpoint", never on a bare root.
        parent, _, name = source.rstrip("/").rpartition("/")
        if not parent or not name:
            raise RegistryError(f"{source!r} names no artifact folder to delete")
        try:
            repository = get_artifact_repository(parent, tracking_uri=uri)
            _answered(uri, repository.delete_artifacts, name)
        except (MlflowException, NotImplementedError) as exc:  # a store that cannot delete, or refused
            raise RegistryError(f"deleting the artifacts at {source} failed: {exc}") from exc

    def _by_alias(self, alias: str) -> ModelVersion | None:
        from mlflow.exceptions import MlflowException

        try:
            found: ModelVersion = self._client.get_model_version_by_alias(self.model_name, alias)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise
        return found

    def alias(self, alias: str) -> int | None:
        """The version an alias points at, or None."""
        found = self._by_alias(alias)
        return None if found is None else int(found.version)

    def champion(self) -> int:
        """The version the fleet should serve. Raises NoChampion before the base model is registered."""
        found = self.alias(CHAMPION)
        if found is None:
            raise NoChampion(
                f"{self.model_name} has no @{CHAMPION} in {self.settings.tracking_uri}; "
                "run `rtrl deploy bootstrap` (or `rtrl run`, which does it) first"
            )
        return found

    def challenger(self) -> int | None:
        return self.alias(CHALLENGER)

    def set_alias(self, alias: str, version: int) -> None:
        self._client.set_registered_model_alias(self.model_name, alias, str(version))

    def previous_champion(self) -> int | None:
        """What the last promotion replaced (the registered-model tag), if any."""
        value = self._client.get_registered_model(self.model_name).tags.get(PREVIOUS_CHAMPION_TAG)
        return None if value is None else int(value)

    def set_previous_champion(self, version: int) -> None:
        self._client.set_registered_model_tag(self.model_name, PREVIOUS_CHAMPION_TAG, str(version))

    def version_run_id(self, version: int) -> str | None:
        """The MLflow run a version was logged from (the training cycle's run), if known."""
        found = self._client.get_model_version(self.model_name, str(version)).run_id
        return found or None

    def version_tags(self, version: int) -> dict[str, str]:
        """A version's tags: lineage (``rtrl.cycle_id``, ``rtrl.parent_version``), the gate's verdict, deploys."""
        return dict(self._client.get_model_version(self.model_name, str(version)).tags)

    def tag_version(self, version: int, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self._client.set_model_version_tag(self.model_name, str(version), key, value)

    # ---- checkpoints ------------------------------------------------------------------------------

    def download_checkpoint(self, version: int) -> Path:
        """A local copy of version `version`'s checkpoint, downloaded from MLflow on first use.

        The copy lands in ``<checkpoints_dir>/v<N>``; a download goes to a temporary folder first
        and is renamed into place, so a crash never leaves a half-copied checkpoint that looks
        complete. Every host that loads a version needs its own copy (or a shared filesystem).
        """
        from mlflow.artifacts import download_artifacts
        from mlflow.exceptions import MlflowException

        target = self.checkpoints_dir / format_version(version)
        if (target / DOWNLOAD_COMPLETE).is_file():
            # The marker's time is the copy's last use: retention keeps a copy used recently
            # (deployer/artefacts.py). A read-only copy is still a good copy.
            with suppress(OSError):
                os.utime(target / DOWNLOAD_COMPLETE)
            return target
        try:
            source = self._client.get_model_version_download_uri(self.model_name, str(version))
        except MlflowException as exc:
            raise RegistryError(f"{self.model_name} version {version}: {exc.message}") from exc
        staging = target.with_name(f".{target.name}.download-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            uri = self.settings.tracking_uri
            downloaded = Path(
                _answered(
                    uri, download_artifacts, artifact_uri=source, dst_path=str(staging), tracking_uri=uri
                )
            )
            if (
                not (downloaded / "config.json").is_file()
                and not (downloaded / "adapter_config.json").is_file()
            ):
                raise RegistryError(
                    f"version {version}'s artifacts at {source} are neither an HF checkpoint "
                    "(no config.json) nor a LoRA adapter (no adapter_config.json)"
                )
            (downloaded / DOWNLOAD_COMPLETE).write_text(source + "\n")
            if target.exists():  # an older, incomplete copy, or another process won the race
                if (target / DOWNLOAD_COMPLETE).is_file():
                    return target
                shutil.rmtree(target)
            downloaded.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def download_run_artifact(self, run_id: str, path: str, destination: Path) -> Path:
        """One artifact of a run, downloaded into `destination` (lineage checks, tests)."""
        destination.mkdir(parents=True, exist_ok=True)
        return Path(self._client.download_artifacts(run_id, path, str(destination)))
