"""Set-based statements of one labeler batch: many rows, one statement, a few parameters.

The labeler writes and looks up a few hundred rows per table per batch (bench/bench_labeler.py).
How PostgreSQL gets them decides its rate:

* Rows as one parameter set each (an executemany) cost a parse and a plan per row on the server.
  SQLAlchemy sends an INSERT with an ON CONFLICT clause that way whatever the dialect options (its
  multi-row "insertmanyvalues" form skips such statements), and an UPDATE always.
* Rows as an array parameter per column (``unnest``) are one statement, but psycopg adapts every
  element of a list in Python: a third of the labeler's time went there.
* Rows as one JSON document (``json_to_recordset``), what :func:`insert_rows` and
  :func:`update_rows` send, are one statement and one parameter, encoded by orjson (checked
  first for what it would write where the statement must fail: NaN, a naive datetime) and decoded
  by the server; the record's column definitions are the table's own
  types, so a value the table would refuse (a string too long, an integer out of range) fails the
  statement as it would an INSERT of it.
* An ``IN`` list is rendered as one placeholder per value, which psycopg parses out of the query
  text again on every call (its cache skips long queries); :func:`among` sends one array instead.

On SQLite (in-process, where a statement per row costs microseconds) each is the plain
executemany or ``IN``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import ColumnElement, Table, any_, bindparam, text, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session
from sqlalchemy.types import ARRAY, DateTime, LargeBinary, String, TypeDecorator

from store.models import UtcDateTime

_PG = postgresql.dialect()  # type: ignore[no-untyped-call]
_quote = _PG.identifier_preparer.quote


def insert_rows(
    session: Session,
    table: Table,
    rows: Sequence[dict[str, Any]],
    *,
    conflict: Sequence[str] | None = None,
    returning: str | None = None,
) -> set[Any]:
    """``INSERT INTO table`` every row, skipping a row that conflicts with a stored one
    (``ON CONFLICT DO NOTHING``): on the unique columns `conflict`, or on any unique index when
    None. Returns the `returning` column of the rows inserted (empty when None).

    Rows may give different columns; each set of columns is one statement. A column a row leaves
    out gets its server default (or NULL): the table's Python-side defaults are not applied, so a
    column that has one must be given."""
    postgres = session.get_bind().dialect.name == "postgresql"
    inserted: set[Any] = set()
    for columns, group in _by_columns(rows, lambda row: tuple(row)).items():
        missing = [c.name for c in table.columns if c.name not in columns and c.default is not None]
        if missing:
            raise ValueError(f"insert_rows into {table.name}: give {', '.join(missing)} (Python-side defaults)")
        if not postgres:
            statement = sqlite_insert(table).on_conflict_do_nothing(index_elements=conflict)
            if returning is None:
                session.execute(statement, group)
            else:
                inserted.update(session.scalars(statement.returning(table.c[returning]), group))
            continue
        names = ", ".join(_quote(name) for name in columns)
        target = "" if conflict is None else f"({', '.join(_quote(name) for name in conflict)}) "
        result = session.execute(
            text(f"INSERT INTO {_quote(table.name)} ({names}) SELECT {names} FROM {_recordset(table, columns)} "
                 f"ON CONFLICT {target}DO NOTHING" + ("" if returning is None else f" RETURNING {_quote(returning)}")),
            {"rows": _document(table, columns, group)},
        )  # fmt: skip
        if returning is not None:
            inserted.update(result.scalars())
    return inserted


def update_rows(session: Session, table: Table, key: str, rows: Sequence[dict[str, Any]]) -> None:
    """``UPDATE table SET <the other columns of each row> WHERE key = row[key]`` for every row.

    Rows may set different columns; each set of columns is one statement."""
    postgres = session.get_bind().dialect.name == "postgresql"
    for columns, group in _by_columns(rows, lambda row: tuple(sorted(name for name in row if name != key))).items():
        if not columns:
            continue
        if not postgres:
            statement = (
                update(table)
                .where(table.c[key] == bindparam("_key"))
                .values({name: bindparam(f"_v_{name}") for name in columns})
            )
            session.execute(statement, [{"_key": r[key], **{f"_v_{n}": r[n] for n in columns}} for r in group])
            continue
        sets = ", ".join(f"{_quote(name)} = v.{_quote(name)}" for name in columns)
        session.execute(
            text(f"UPDATE {_quote(table.name)} AS t SET {sets} FROM {_recordset(table, (key, *columns))} "
                 f"WHERE t.{_quote(key)} = v.{_quote(key)}"),
            {"rows": _document(table, (key, *columns), group)},
        )  # fmt: skip


def among(session: Session, column: Any, values: Collection[Any]) -> ColumnElement[bool]:
    """``column IN values``; on PostgreSQL ``column = ANY(:array)``, one parameter however many
    values (planned the same: an index scan per value)."""
    if session.get_bind().dialect.name != "postgresql":
        return column.in_(values)  # type: ignore[no-any-return]
    return column == any_(bindparam(None, list(values), type_=ARRAY(column.type)))  # type: ignore[no-any-return]


def _by_columns(
    rows: Sequence[dict[str, Any]], columns_of: Callable[[dict[str, Any]], tuple[str, ...]]
) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[columns_of(row)].append(row)
    return groups


def _recordset(table: Table, columns: Sequence[str]) -> str:
    """``json_to_recordset(:rows) AS v(<column> <the table's type>, ...)``."""
    types = ", ".join(f"{_quote(name)} {table.c[name].type.compile(dialect=_PG)}" for name in columns)
    return f"json_to_recordset(CAST(:rows AS JSON)) AS v({types})"


def _document(table: Table, columns: Sequence[str], rows: list[dict[str, Any]]) -> str:
    """The rows (each giving exactly `columns`) as one JSON array of objects, each value as the
    column's type would send it, encoded by orjson (docs/platform.md, JSON documents for
    PostgreSQL: orjson and what it writes differently).

    orjson writes NaN and infinite floats as null and a naive datetime without an offset, where the
    statement must fail instead: a non-finite float anywhere in a row (nested in a JSON column too)
    raises ValueError, as does a naive datetime given to a UtcDateTime column."""
    checks = [(name, check) for name in columns if (check := _check(table, name)) is not None]
    for row in rows:
        for name, check in checks:
            value = row[name]
            if value is not None:
                check(name, value)
    converters = [(name, convert) for name in columns if (convert := _converter(table, name)) is not None]
    if converters:
        converted = []
        for row in rows:
            row = dict(row)
            for name, convert in converters:
                if row[name] is not None:
                    row[name] = convert(row[name])
            converted.append(row)
        rows = converted
    return orjson.dumps(rows, default=_float_subclass, option=orjson.OPT_NON_STR_KEYS).decode()


def _float_subclass(value: Any) -> float:
    """orjson's fallback for what it does not encode itself: a float subclass (numpy's float64) as
    its float (checked finite before); anything else is refused, as the json module refuses it."""
    if isinstance(value, float):
        return float(value)
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def _check(table: Table, name: str) -> Callable[[str, Any], None] | None:
    """What a value of column `name` is checked for before it is encoded (None: nothing)."""
    column_type = table.c[name].type
    if isinstance(column_type, UtcDateTime):
        return _aware
    if isinstance(column_type, LargeBinary | DateTime | String):
        return None  # bytes, datetimes and text carry no float
    return _finite


def _converter(table: Table, name: str) -> Callable[[Any], Any] | None:
    """How a value of column `name` becomes JSON the server reads as the column's type (None: as
    orjson writes it: numbers, strings, lists and objects as they are, an aware datetime in ISO 8601
    with its offset, which the server keeps as the instant)."""
    column_type = table.c[name].type
    if isinstance(column_type, UtcDateTime):
        return None
    if isinstance(column_type, TypeDecorator):  # UtcDateTime is the store's only one
        raise TypeError(f"{table.name}.{name}: no JSON form for {type(column_type).__name__}")
    if isinstance(column_type, LargeBinary):
        return lambda value: "\\x" + bytes(value).hex()  # bytea's hex input format
    return None


def _aware(name: str, value: datetime) -> None:
    """A UtcDateTime value must carry its offset, as UtcDateTime refuses naive datetimes."""
    if value.utcoffset() is None:
        raise ValueError(f"naive datetime given to the store ({name}); use UTC-aware datetimes")


def _finite(name: str, value: Any) -> None:
    """Raise ValueError if `value` is or holds (in lists and dicts, at any depth) a NaN or an
    infinite float: JSON has none, and orjson would write null."""
    kind = type(value)
    if kind is float:
        if not math.isfinite(value):
            raise ValueError(f"Out of range float value {value!r} in {name}: JSON has no NaN or infinity")
    elif kind is list or kind is tuple or kind is dict:
        for item in value.values() if kind is dict else value:
            item_kind = type(item)
            if item_kind is int or item_kind is str or item_kind is bool or item is None:
                continue
            if item_kind is float and math.isfinite(item):
                continue
            _finite(name, item)
    elif isinstance(value, float):  # a float subclass
        _finite(name, float(value))
