"""Alembic environment of the rtrl store.

Run through ``store.Store.migrate()`` (which passes an open connection), so migrations
work from an installed package without an alembic.ini. ``alembic -x url=...`` style invocation is
deliberately not supported: one way in.
"""

from __future__ import annotations

from alembic import context

from store.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through store.Store(url).migrate()")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
