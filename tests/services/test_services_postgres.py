"""The local PostgreSQL server is real: a SQLAlchemy round trip through psycopg 3, the databases
it makes for the store and for MLflow, and throw-away ones created and dropped."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from schemas.settings import Settings, local_postgres_url
from services.postgres import Postgres

pytestmark = pytest.mark.integration


def test_sqlalchemy_round_trip(postgres_url: str) -> None:
    assert postgres_url.startswith("postgresql+psycopg://")
    engine = sa.create_engine(postgres_url)
    table = f"roundtrip_{uuid.uuid4().hex[:8]}"
    meta = sa.MetaData()
    rows = sa.Table(table, meta, sa.Column("id", sa.Integer, primary_key=True), sa.Column("body", sa.JSON))
    try:
        meta.create_all(engine)
        with engine.begin() as conn:
            conn.execute(rows.insert(), [{"id": 1, "body": {"a": [1, 2]}}, {"id": 2, "body": {"b": None}}])
        with engine.connect() as conn:
            got = conn.execute(sa.select(rows.c.id, rows.c.body).order_by(rows.c.id)).all()
            version = conn.execute(sa.text("SELECT current_setting('server_version_num')::int")).scalar_one()
            user = conn.execute(sa.text("SELECT current_user")).scalar_one()
        assert [tuple(r) for r in got] == [(1, {"a": [1, 2]}), (2, {"b": None})]
        assert version >= 150000
        assert user == "rtrl"
    finally:
        meta.drop_all(engine)
        engine.dispose()


def test_the_store_and_mlflow_get_their_databases_owned_by_rtrl(postgres_service: Settings) -> None:
    pg = postgres_service.postgres
    Postgres(postgres_service).after_start()  # again: idempotent
    engine = sa.create_engine(local_postgres_url(postgres_service, "postgres"))
    try:
        with engine.connect() as conn:
            owners = dict(
                conn.execute(
                    sa.text(
                        "SELECT datname, pg_get_userbyid(datdba) FROM pg_database WHERE datname IN (:store, :mlflow)"
                    ),
                    {"store": pg.database, "mlflow": pg.mlflow_database},
                ).all()
            )
    finally:
        engine.dispose()
    assert owners == {pg.database: pg.user, pg.mlflow_database: pg.user}


def test_a_database_is_created_once_and_dropped_with_its_connections_closed(
    postgres_service: Settings,
) -> None:
    server, name = Postgres(postgres_service), f"rtrl_test_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(local_postgres_url(postgres_service, name))
    listing = sa.create_engine(local_postgres_url(postgres_service, "postgres"))
    found = sa.text("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = :name")
    try:
        server.create_database(name)
        with engine.connect() as conn:
            conn.execute(sa.text("CREATE TABLE kept (x int)"))
            conn.commit()
        server.create_database(name)  # exists: left as it is
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT to_regclass('kept') IS NOT NULL")).scalar() is True
        with listing.connect() as conn:
            assert conn.execute(found, {"name": name}).scalar() == postgres_service.postgres.user
        held = engine.connect()  # a client still connected when the database is dropped
        held.execute(sa.text("SELECT 1"))
        server.drop_database(name)
        held.invalidate()  # the server closed it: not handed back to the pool
        server.drop_database(name)  # gone: nothing to do
        with listing.connect() as conn:
            assert conn.execute(found, {"name": name}).first() is None
    finally:
        engine.dispose()
        listing.dispose()
        server.drop_database(name)
