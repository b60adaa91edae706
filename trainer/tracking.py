"""MLflow logging of a training cycle: one run per cycle in ``settings.mlflow.experiment``.

The run carries the trainer settings as params, per-step metrics, the ids of the episodes it
learnt from (artifact ``episodes.json`` + tag ``rtrl.episodes``) and, through
`deployer.registry.register_checkpoint`, the checkpoint artifact its registered version points
at. Registration itself lives in deployer/registry.py so that the trainer and ``bootstrap`` write
versions the same way.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.settings import Settings

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient


def _client(settings: Settings) -> MlflowClient:
    from deployer.registry import client

    return client(settings)


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = str(value)


def start_run(settings: Settings, cycle_id: int, champion: int) -> str:
    """Create the cycle's run with the trainer settings as params; returns its id."""
    from mlflow.exceptions import MlflowException

    client = _client(settings)
    experiment = client.get_experiment_by_name(settings.mlflow.experiment)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        try:
            experiment_id = client.create_experiment(settings.mlflow.experiment)
        except MlflowException:  # another process created it first
            experiment_id = client.get_experiment_by_name(settings.mlflow.experiment).experiment_id  # type: ignore[union-attr]
    run = client.create_run(
        experiment_id,
        run_name=f"cycle-{cycle_id}",
        tags={"rtrl.kind": "training_cycle", "rtrl.cycle_id": str(cycle_id), "rtrl.parent_version": str(champion)},
    )
    params: dict[str, str] = {}
    _flatten("trainer", settings.trainer.model_dump(mode="json"), params)
    params["model_name"] = settings.mlflow.model_name
    from mlflow.entities import Param

    client.log_batch(run.info.run_id, params=[Param(k, v[:6000]) for k, v in sorted(params.items())])
    return str(run.info.run_id)


def log_metrics(settings: Settings, run_id: str, step: int, metrics: dict[str, float]) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client = _client(settings)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in sorted(metrics.items())])


def log_episodes(settings: Settings, run_id: str, episode_ids: list[str], summary: dict[str, Any]) -> None:
    """The lineage of the run: which episodes it learnt from, and the cycle summary."""
    client = _client(settings)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "episodes.json").write_text(json.dumps(sorted(episode_ids)) + "\n")
        (Path(tmp) / "cycle.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
        client.log_artifacts(run_id, tmp)
    client.set_tag(run_id, "rtrl.episodes", str(len(episode_ids)))


def end_run(settings: Settings, run_id: str, status: str) -> None:
    """status: FINISHED or FAILED."""
    _client(settings).set_terminated(run_id, status)


def delete_version(settings: Settings, version: int) -> None:
    """Undo a registration whose cycle could not be finished (deliberate compensation)."""
    _client(settings).delete_model_version(settings.mlflow.model_name, str(version))
