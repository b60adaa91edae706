"""Local MLflow tracking server and model registry.

Started by `rtrl services up` as ``python -m mlflow server`` from the rtrl virtualenv, one worker,
on ``services.host:services.mlflow_port``. Runs and registered models go to
``mlflow.backend_store_uri``: by default the ``postgres.mlflow_database`` database of the local
PostgreSQL, so `up` starts MLflow once PostgreSQL is healthy and has created it (:meth:`requires`;
the URL is passed as it is: MLflow takes ``postgresql+psycopg://``, psycopg 3, like the store);
``rtrl demo`` uses a SQLite file under the run dir instead. Artifacts are proxied by the server
(``mlflow-artifacts:/``) into ``mlflow.artifact_root``, so clients never need the server's file
system. Relative paths (the artifact root, a SQLite file) are relative to the working directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .base import Service


def _absolute_sqlite(uri: str) -> str:
    """`sqlite:///rel/path.db` → `sqlite:////abs/rel/path.db` (the server runs in its own cwd)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return uri
    path = Path(uri[len(prefix) :])
    if not path.is_absolute():
        path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


class Mlflow(Service):
    name = "mlflow"

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.settings.services.mlflow_port,)

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.settings.services.mlflow_port}"

    def requires(self) -> tuple[str, ...]:
        # On a PostgreSQL that rtrl runs, the server needs it up with its database made (Postgres.after_start);
        # one that rtrl does not run (postgres not in services.enabled) is someone else's to start.
        on_postgres = self.settings.mlflow.backend_store_uri.startswith("postgresql")
        return ("postgres",) if on_postgres and "postgres" in self.settings.services.enabled else ()

    def command(self) -> list[str]:
        m = self.settings.mlflow
        port = self.settings.services.mlflow_port
        artifacts = m.artifact_root.expanduser().resolve()
        artifacts.mkdir(parents=True, exist_ok=True)
        # The security middleware rejects Host headers it does not know; clients use host:port.
        allowed = ",".join(f"{h}:{port}" for h in dict.fromkeys((self.host, "127.0.0.1", "localhost")))
        return [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            _absolute_sqlite(m.backend_store_uri),
            "--serve-artifacts",
            "--artifacts-destination",
            str(artifacts),
            "--host",
            self.host,
            "--port",
            str(port),
            "--workers",
            "1",
            "--allowed-hosts",
            allowed,
        ]

    def env(self) -> dict[str, str]:
        return {
            "PYTHONUNBUFFERED": "1",
            # The server's job runner (GenAI scorers, trace archival) starts eight huey consumers of
            # ~170 MB each; the registry and tracking rtrl uses do not need it.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }

    def check(self) -> str:
        import httpx

        response = httpx.get(f"{self.address}/health", timeout=3)
        response.raise_for_status()
        version = httpx.get(f"{self.address}/version", timeout=3)
        return f"MLflow {version.text.strip() if version.is_success else '?'}"
