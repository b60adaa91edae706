"""Fixtures of the store's tests: one store per backend, an SQLite file in tmp_path (unit) and a
database of its own on the session's PostgreSQL (integration), for tests that must hold on both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from factories import FakeClock

from store import Store


@pytest.fixture(
    params=[
        pytest.param("sqlite", marks=pytest.mark.unit),
        pytest.param("postgresql", marks=pytest.mark.integration),
    ]
)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store URL: an SQLite file in tmp_path, or a database of its own on the session's PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'rtrl.db'}"
    database: str = request.getfixturevalue("postgres_database")
    return database


@pytest.fixture
def any_store(url: str, clock: FakeClock) -> Iterator[Store]:
    """A migrated store at `url` whose time follows `clock`."""
    opened = Store(url, clock=clock)
    opened.migrate()
    yield opened
    opened.close()
