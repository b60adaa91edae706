"""Local PostgreSQL server (Debian's binaries) for the scale-out SQL store.

Started by `rtrl services up`. ``initdb`` runs once into ``<run_dir>/postgres/data``; the server
listens on ``services.host:services.postgres_port`` with its unix socket in ``<run_dir>/postgres``,
trusts loopback connections (a local development service, never exposed), and gets the role
``postgres.user`` owning two databases: ``postgres.database``, the store of ``rtrl run`` and the
operator commands, and ``postgres.mlflow_database``, the local MLflow server's backend (both by
default: ``schemas.settings.local_postgres_url``). PostgreSQL refuses to run as root, so as root
it runs as the ``postgres`` system user.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
from pathlib import Path

from .base import Service, ServiceError

SUPERUSER = "postgres"  # bootstrap superuser created by initdb; rtrl itself connects as postgres.user


def bin_dir() -> Path:
    """The newest /usr/lib/postgresql/<ver>/bin (Debian keeps the server binaries off PATH)."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"),
        key=lambda p: int(re.sub(r"\D", "", p.parent.parent.name) or 0),
    )
    if not found:
        raise ServiceError(
            "postgres: no /usr/lib/postgresql/<ver>/bin/postgres; run `bash infra/system-deps.sh`"
        )
    return found[-1].parent


class Postgres(Service):
    name = "postgres"
    stop_signal = signal.SIGINT  # "fast" shutdown; SIGTERM ("smart") waits for every client to leave

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.settings.services.postgres_port,)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.settings.services.postgres_port}"

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "data"

    def run_as(self) -> str | None:
        return SUPERUSER if os.geteuid() == 0 else None

    def _as_user(self, cmd: list[str]) -> subprocess.CompletedProcess[str]:
        user = self.run_as()
        return subprocess.run(cmd, capture_output=True, text=True, user=user, group=user, cwd=self.data_dir)

    def prepare(self) -> None:
        user = self.run_as()
        if user is not None:
            try:
                entry = pwd.getpwnam(user)
            except KeyError:
                raise ServiceError(
                    f"postgres: running as root needs the '{user}' system user (the postgresql package creates it)"
                ) from None
            shutil.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
            if self._as_user(["test", "-w", str(self.data_dir)]).returncode != 0:
                raise ServiceError(
                    f"postgres: user '{user}' cannot write {self.data_dir}; every parent directory needs o+x"
                )
        if (self.pgdata / "PG_VERSION").exists():
            return
        result = self._as_user(
            [
                str(bin_dir() / "initdb"),
                "-D",
                str(self.pgdata),
                "-U",
                SUPERUSER,
                "--auth-local=trust",
                "--auth-host=trust",
                "-E",
                "UTF8",
                "--no-locale",
            ]
        )
        if result.returncode != 0:
            shutil.rmtree(self.pgdata, ignore_errors=True)
            raise ServiceError(f"postgres: initdb failed:\n{(result.stdout + result.stderr)[-4000:]}")

    def command(self) -> list[str]:
        return [
            str(bin_dir() / "postgres"),
            "-D",
            str(self.pgdata),
            "-c",
            f"listen_addresses={self.host}",
            "-c",
            f"port={self.settings.services.postgres_port}",
            "-c",
            f"unix_socket_directories={self.data_dir}",
            "-c",
            "logging_collector=off",  # log to stderr, i.e. <run_dir>/logs/postgres.log
        ]

    def _connect(self, user: str, dbname: str):  # type: ignore[no-untyped-def]
        import psycopg

        return psycopg.connect(
            host=self.host,
            port=self.settings.services.postgres_port,
            user=user,
            dbname=dbname,
            connect_timeout=3,
            autocommit=True,
        )

    def check(self) -> str:
        with self._connect(SUPERUSER, "postgres") as conn:
            row = conn.execute("SELECT current_setting('server_version')").fetchone()
        assert row is not None
        return f"PostgreSQL {row[0].split()[0]}"

    def after_start(self) -> None:
        """Create the rtrl role, the store's database and MLflow's when missing (idempotent)."""
        from psycopg import sql

        pg = self.settings.postgres
        with self._connect(SUPERUSER, "postgres") as conn:
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (pg.user,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEDB").format(sql.Identifier(pg.user)))
        for database in dict.fromkeys((pg.database, pg.mlflow_database)):
            self.create_database(database)

    def create_database(self, database: str) -> None:
        """Create `database`, owned by postgres.user, unless it exists (the server is running)."""
        from psycopg import sql

        with self._connect(SUPERUSER, "postgres") as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone() is None:
                conn.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        sql.Identifier(database), sql.Identifier(self.settings.postgres.user)
                    )
                )

    def drop_database(self, database: str) -> None:
        """Drop `database` if it exists, closing its clients' connections (the server is running)."""
        from psycopg import sql

        with self._connect(SUPERUSER, "postgres") as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
