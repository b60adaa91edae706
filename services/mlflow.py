"""Local MLflow tracking server and model registry.

Started by `rtrl services up` as ``python -m mlflow server`` from the rtrl virtualenv, one worker,
on ``services.host:services.mlflow_port``. Runs and registered models go to
``mlflow.backend_store_uri``: by default the ``postgres.mlflow_database`` database of the local
PostgreSQL, so `up` starts MLflow once PostgreSQL is healthy and has created it (:meth:`requires`;
the URL is passed as it is: MLflow takes ``postgresql+psycopg://``, psycopg 3, like the store);
``rtrl demo`` uses a SQLite file under the run dir instead. Artifacts are proxied by the server
(``mlflow-artifacts:/``) into ``mlflow.artifact_root``, so clients never need the server's file
system. Relative paths (the artifact root, a SQLite file) are relative to the working directory.

The server runs MLflow's basic-auth app: every call but ``/health`` needs a user and password
(docs/security.md, The registry). rtrl signs in as the admin user, ``settings.mlflow.username`` /
``password`` when set, else ``rtrl-admin`` with a password made once into
``<run_dir>/mlflow/auth.json`` (mode 0600, with the Flask secret the app's CSRF checks need), which
`registry.credentials` reads. Nobody else has any permission (``default_permission =
NO_PERMISSIONS``); the users and permissions live in ``<run_dir>/mlflow/basic_auth.db``, made again
when the admin password changes.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

import registry.credentials

from .base import Service

ADMIN = "rtrl-admin"


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

    @property
    def auth_path(self) -> Path:
        return self.run_dir / registry.credentials.AUTH_FILE

    def _auth(self) -> dict[str, str]:
        """The admin credentials and Flask secret (module docstring), made once."""
        m = self.settings.mlflow
        try:
            found: dict[str, str] = json.loads(self.auth_path.read_text())
        except (OSError, ValueError):
            found = {}
        wanted = {
            "username": m.username or found.get("username") or ADMIN,
            "password": m.password.get_secret_value() if m.password else found.get("password") or "",
            "flask_secret": found.get("flask_secret") or secrets.token_hex(32),
        }
        wanted["password"] = wanted["password"] or secrets.token_urlsafe(24)
        if wanted != found:
            if (found.get("username"), found.get("password")) != (wanted["username"], wanted["password"]):
                # MLflow sets the admin password only when it makes the users database.
                (self.data_dir / "basic_auth.db").unlink(missing_ok=True)
            self.auth_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.auth_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(wanted, out)
        return wanted

    def prepare(self) -> None:
        auth = self._auth()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "basic_auth.ini").write_text(
            "[mlflow]\n"
            "default_permission = NO_PERMISSIONS\n"
            f"database_uri = sqlite:///{self.data_dir / 'basic_auth.db'}\n"
            f"admin_username = {auth['username']}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            "grant_default_workspace_access = false\n"
        )

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
            "--app-name",
            "basic-auth",
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
        auth = self._auth()
        return {
            "PYTHONUNBUFFERED": "1",
            "MLFLOW_AUTH_CONFIG_PATH": str(self.data_dir / "basic_auth.ini"),
            # The admin password goes through the environment, never into the ini file.
            "MLFLOW_AUTH_ADMIN_PASSWORD": auth["password"],
            "MLFLOW_FLASK_SERVER_SECRET_KEY": auth["flask_secret"],
            # The server's job runner (GenAI scorers, trace archival) starts eight huey consumers of
            # ~170 MB each; the registry and tracking rtrl uses do not need it.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }

    def check(self) -> str:
        import httpx

        response = httpx.get(f"{self.address}/health", timeout=3)
        response.raise_for_status()
        auth = self._auth()
        version = httpx.get(f"{self.address}/version", timeout=3, auth=(auth["username"], auth["password"]))
        return f"MLflow {version.text.strip() if version.is_success else '?'}"
