"""Set-based writes of one labeler batch: many rows, one statement.

The labeler writes a few hundred rows per table per batch (bench/bench_labeler.py). Sent one
statement per row, PostgreSQL spends its time parsing and planning the same UPDATE hundreds of
times; the ORM's unit of work adds its own bookkeeping per object. Here an UPDATE of many rows is
one statement on PostgreSQL (``UPDATE .. FROM unnest(array, ...)``: one array parameter per
column, whatever the number of rows) and an executemany on SQLite (in-process, where a statement
per row costs microseconds). Inserts are `insert_ignoring` (store/events.py), which the engine
sends as multi-row INSERTs (store/db.py).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, bindparam, text, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session
from sqlalchemy.types import JSON, TypeDecorator

_PG = postgresql.dialect()  # type: ignore[no-untyped-call]


def update_rows(session: Session, table: Table, key: str, rows: Sequence[dict[str, Any]]) -> None:
    """``UPDATE table SET <the other columns of each row> WHERE key = row[key]`` for every row.

    Rows may set different columns; each set of columns is one statement."""
    dialect = session.get_bind().dialect.name
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[tuple(sorted(name for name in row if name != key))].append(row)
    for columns, group in groups.items():
        if not columns:
            continue
        if dialect == "postgresql":
            _update_unnest(session, table, key, columns, group)
        else:
            statement = (
                update(table)
                .where(table.c[key] == bindparam("_key"))
                .values({name: bindparam(f"_v_{name}") for name in columns})
            )
            session.execute(statement, [{"_key": r[key], **{f"_v_{n}": r[n] for n in columns}} for r in group])


def _update_unnest(session: Session, table: Table, key: str, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    names = (key, *columns)
    arrays = {f"a{i}": [_bind(table, name, row[name]) for row in rows] for i, name in enumerate(names)}
    unnest = ", ".join(f"CAST(:a{i} AS {_array_type(table, name)})" for i, name in enumerate(names))
    sets = ", ".join(f"{name} = {_value(table, name)}" for name in columns)
    session.execute(
        text(f"UPDATE {table.name} AS t SET {sets} FROM unnest({unnest}) AS v({', '.join(names)}) "
             f"WHERE t.{key} = v.{key}"),
        arrays,
    )  # fmt: skip


def _array_type(table: Table, name: str) -> str:
    column_type = table.c[name].type
    if isinstance(column_type, JSON):
        return "TEXT[]"  # sent as JSON text, cast in the SET clause (`_value`)
    return f"{column_type.compile(dialect=_PG)}[]"


def _value(table: Table, name: str) -> str:
    """The unnested column as the table's type (JSON arrives as text: no implicit cast from it)."""
    column_type = table.c[name].type
    return f"CAST(v.{name} AS {column_type.compile(dialect=_PG)})" if isinstance(column_type, JSON) else f"v.{name}"


def _bind(table: Table, name: str, value: Any) -> Any:
    """`value` as the column's type would send it (JSON as text, UTC datetimes)."""
    if value is None:
        return None
    column_type = table.c[name].type
    if isinstance(column_type, JSON):
        return json.dumps(value)
    if isinstance(column_type, TypeDecorator):
        return column_type.process_bind_param(value, _PG)
    return value
