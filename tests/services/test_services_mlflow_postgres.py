"""MLflow on the local PostgreSQL, as `rtrl services up` runs it for `rtrl run`: started after
PostgreSQL has made its database, with registered versions landing in that database (psycopg 3,
no psycopg2) and the store beside it in its own.

A private deployment of its own (PostgreSQL and MLflow on free ports, the default databases), not
the session's, whose store and MLflow are SQLite files (`private_services(embedded=True)`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from registry import CHAMPION, Registry
from schemas.settings import Settings, local_postgres_url
from services import up
from services.testing import private_services
from store import Store

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def on_postgres() -> Iterator[Settings]:
    with private_services("rtrl-mlflow-pg-", enabled=("postgres", "mlflow"), embedded=False) as settings:
        up(settings)
        yield settings


def test_registered_versions_land_in_the_mlflow_database(on_postgres: Settings, tmp_path: Path) -> None:
    settings = on_postgres
    assert settings.mlflow.backend_store_uri == local_postgres_url(
        settings, settings.postgres.mlflow_database
    )
    registry = Registry(settings.mlflow, tmp_path / "checkpoints", settings.services.run_dir)
    checkpoint = tmp_path / "v1"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"marker": "on-postgres"}))
    version = registry.register_checkpoint(checkpoint, tags={"rtrl.base": "true"})
    registry.set_alias(CHAMPION, version)

    engine = sa.create_engine(settings.mlflow.backend_store_uri)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT name, version FROM model_versions")).all()
            aliases = conn.execute(sa.text("SELECT alias, version FROM registered_model_aliases")).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [(settings.mlflow.model_name, version)]
    assert [tuple(r) for r in aliases] == [(CHAMPION, version)]
    assert not (
        Path(settings.services.run_dir) / "mlflow" / "mlflow.db"
    ).exists()  # no SQLite file on the side


def test_the_store_is_the_other_database_of_the_same_server(on_postgres: Settings) -> None:
    settings = on_postgres
    assert settings.store.url == local_postgres_url(settings)
    store = Store(settings.store.url)
    try:
        store.migrate()
        store.check_schema()
    finally:
        store.close()
