"""Who rtrl signs in to MLflow as (docs/security.md, The registry).

MLflow runs its basic-auth app (``mlflow server --app-name basic-auth``): without a user and
password every call but ``/health`` is refused with 401. rtrl's credentials come from
``settings.mlflow.username`` / ``password`` (``RTRL_MLFLOW__*``, a secret in the manifests), else,
for the local services, from the admin credentials ``rtrl services up`` made once in
``<services.run_dir>/mlflow/auth.json`` (mode 0600). MLflow's client reads them from
``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``, which `sign_in` sets for this process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from schemas.settings import MlflowSettings

AUTH_FILE = Path("mlflow") / "auth.json"  # under <services.run_dir>


def local_credentials(run_dir: Path) -> tuple[str, str] | None:
    """The local services' MLflow admin credentials, or None when there are none."""
    path = run_dir / AUTH_FILE
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    user, password = found.get("username"), found.get("password")
    return (user, password) if isinstance(user, str) and isinstance(password, str) else None


def credentials(mlflow: MlflowSettings, run_dir: Path | None) -> tuple[str, str] | None:
    """The configured credentials, else the local services' (when `run_dir` is given)."""
    if mlflow.username is not None and mlflow.password is not None:
        return mlflow.username, mlflow.password.get_secret_value()
    return None if run_dir is None else local_credentials(run_dir)


def sign_in(mlflow: MlflowSettings, run_dir: Path | None) -> bool:
    """Set this process's MLflow credentials (one MLflow per process); leave them as they are when
    there are none to set. Returns whether there were: a client made before ``rtrl services up``
    wrote the local ones (``rtrl demo`` on a fresh run dir) asks again before its next call."""
    found = credentials(mlflow, run_dir)
    if found is not None:
        os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = found
    return found is not None
