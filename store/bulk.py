"""Set-based statements of one labeler batch: many rows, one statement, a few parameters.

The labeler writes and looks up a few hundred rows per table per batch (bench/bench_labeler.py).
How PostgreSQL gets them decides its rate:

* Rows as one parameter set each (an executemany) cost a parse and a plan per row on the server.
  SQLAlchemy sends an INSERT with an ON CONFLICT clause that way whatever the dialect options (its
  multi-row "insertmanyvalues" form skips such statements), and an UPDATE always.
* Rows as an array parameter per column (``unnest``) are one statement, but psycopg adapts every
  element of a list in Python: a third of the labeler's time went there.
* Rows as one JSON document (``json_to_recordset``), what :func:`insert_rows` and
  :func:`update_rows` send, are one statement and one parameter, encoded by orjson (the floats
  checked first, which it would write as null when NaN; what it refuses left to the json module)
  and decoded by the server; the record's column definitions are the table's own
  types, so a value the table would refuse (a string too long, an integer out of range) fails the
  statement as it would an INSERT of it.
* An ``IN`` list is rendered as one placeholder per value, which psycopg parses out of the query
  text again on every call (its cache skips long queries); :func:`among` sends one array instead.

On SQLite (in-process, where a statement per row costs microseconds) each is the plain
executemany or ``IN``.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from datetime import datetime
from enum import Enum
from typing import Any

import orjson
from sqlalchemy import ColumnElement, Table, any_, bindparam, text, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session
from sqlalchemy.types import ARRAY, JSON, DateTime, LargeBinary, TypeDecorator

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
            raise ValueError(
                f"insert_rows into {table.name}: give {', '.join(missing)} (Python-side defaults)"
            )
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
            text(
                f"INSERT INTO {_quote(table.name)} ({names}) SELECT {names} FROM {_recordset(table, columns)} "
                f"ON CONFLICT {target}DO NOTHING"
                + ("" if returning is None else f" RETURNING {_quote(returning)}")
            ),
            {"rows": _document(table, columns, group)},
        )
        if returning is not None:
            inserted.update(result.scalars())
    return inserted


def update_rows(session: Session, table: Table, key: str, rows: Sequence[dict[str, Any]]) -> None:
    """``UPDATE table SET <the other columns of each row> WHERE key = row[key]`` for every row.

    Rows may set different columns; each set of columns is one statement."""
    postgres = session.get_bind().dialect.name == "postgresql"
    for columns, group in _by_columns(
        rows, lambda row: tuple(sorted(name for name in row if name != key))
    ).items():
        if not columns:
            continue
        if not postgres:
            statement = (
                update(table)
                .where(table.c[key] == bindparam("_key"))
                .values({name: bindparam(f"_v_{name}") for name in columns})
            )
            session.execute(
                statement, [{"_key": r[key], **{f"_v_{n}": r[n] for n in columns}} for r in group]
            )
            continue
        sets = ", ".join(f"{_quote(name)} = v.{_quote(name)}" for name in columns)
        session.execute(
            text(
                f"UPDATE {_quote(table.name)} AS t SET {sets} FROM {_recordset(table, (key, *columns))} "
                f"WHERE t.{_quote(key)} = v.{_quote(key)}"
            ),
            {"rows": _document(table, (key, *columns), group)},
        )


def among(session: Session, column: Any, values: Collection[Any]) -> ColumnElement[bool]:
    """``column IN values``; on PostgreSQL ``column = ANY(:array)``, one parameter however many
    values (planned the same: an index scan per value once the table is analyzed and large enough;
    docs/scaling.md, Labeler)."""
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


# What orjson is left to encode itself: str, int, float, bool, None, list, tuple, dict with str keys,
# enums (as their value) and UUIDs. Datetimes, dates and times, subclasses of the builtin types and
# dataclasses go to `_aware_iso`, which writes an aware datetime as the json module's path does and
# refuses the rest.
_ORJSON_OPTIONS = (
    orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS
)


def _document(table: Table, columns: Sequence[str], rows: list[dict[str, Any]]) -> str:
    """The rows (each giving exactly `columns`) as one JSON array of objects, each value as the
    column's type would send it (docs/platform.md, JSON documents for PostgreSQL).

    Encoded by orjson, once every float of the rows (nested in JSON columns too) is checked
    finite: orjson writes NaN and infinities as null, where the statement must fail, so they raise
    ValueError as the json module does. Rows orjson refuses (an integer beyond 64 bits, a dict key
    that is not a string, a subclass of a builtin type, a naive datetime, ...) are encoded by the
    json module instead, which writes or refuses each such value as it always did: a naive
    datetime given to a UtcDateTime column raises ValueError."""
    converters = [(name, convert) for name in columns if (convert := _converter(table, name)) is not None]
    instants = [name for name in columns if isinstance(table.c[name].type, UtcDateTime)]
    for row in rows:
        for name in columns:
            value = row[name]
            if type(value) not in _NO_FLOATS:  # most values are; a call per value was most of the cost
                _finite(name, value)
        for name in instants:  # orjson would pass a string on, read in the server's time zone
            if row[name] is not None and not isinstance(row[name], datetime):
                raise TypeError(f"{table.name}.{name}: a datetime, not {type(row[name]).__name__}")
    binary = [(name, convert) for name, convert in converters if isinstance(table.c[name].type, LargeBinary)]
    try:
        return orjson.dumps(_converted(rows, binary), default=_aware_iso, option=_ORJSON_OPTIONS).decode()
    except orjson.JSONEncodeError:
        return json.dumps(_converted(rows, converters), allow_nan=False, separators=(",", ":"))


def _converted(
    rows: list[dict[str, Any]], converters: list[tuple[str, Callable[[Any], Any]]]
) -> list[dict[str, Any]]:
    """`rows` with each converter applied to its column's non-null values (copies; `rows` itself
    when there is nothing to convert)."""
    if not converters:
        return rows
    converted = []
    for row in rows:
        row = dict(row)
        for name, convert in converters:
            if row[name] is not None:
                row[name] = convert(row[name])
        converted.append(row)
    return converted


def _aware_iso(value: Any) -> str:
    """orjson's fallback: an aware datetime in ISO 8601 with its offset, as `isoformat` writes it;
    anything else (a naive datetime, a subclass, a dataclass) is refused, so the json module
    encodes the rows."""
    if type(value) is datetime and value.utcoffset() is not None:
        return value.isoformat()
    raise TypeError(f"left to the json module: {type(value).__name__}")


def _converter(table: Table, name: str) -> Callable[[Any], Any] | None:
    """How a value of column `name` becomes JSON the server reads as the column's type (None: as
    the encoder writes it)."""
    column_type = table.c[name].type
    if isinstance(column_type, JSON):
        return None  # nested in the document; the record's JSON column takes it whole
    if isinstance(column_type, UtcDateTime):
        return _utc_iso
    if isinstance(column_type, TypeDecorator):  # UtcDateTime is the store's only one
        raise TypeError(f"{table.name}.{name}: no JSON form for {type(column_type).__name__}")
    if isinstance(column_type, LargeBinary):
        return lambda value: "\\x" + bytes(value).hex()  # bytea's hex input format
    if isinstance(column_type, DateTime):
        return lambda value: value.isoformat()
    return None


def _utc_iso(value: datetime) -> str:
    """A UtcDateTime value as ISO 8601 with its offset (the server keeps the instant); naive
    datetimes are refused as UtcDateTime refuses them."""
    if value.utcoffset() is None:
        raise ValueError("naive datetime given to the store; use UTC-aware datetimes")
    return value.isoformat()


# Values of exactly these types hold no float, so `_document` skips `_finite` for them (subclasses of
# them, enums among them, are still checked).
_NO_FLOATS = frozenset({str, int, bool, type(None), datetime})


def _finite(name: str, value: Any) -> None:
    """Raise ValueError if `value` is or holds (in lists, tuples and dicts, at any depth, and as an
    enum's value, which orjson writes) a NaN or an infinite float. Other subclasses of the builtin
    types are not looked into: orjson leaves them to the json module, whose ``allow_nan=False``
    refuses them."""
    kind = type(value)
    if kind is float:
        if not math.isfinite(value):
            raise ValueError(f"Out of range float value {value!r} in {name}: JSON has no NaN or infinity")
    elif kind is list or kind is tuple:
        try:
            if math.isfinite(sum(value)):
                return  # numbers only, none of them NaN or infinite (token ids, logprobs): no walk
        except Exception:  # noqa: BLE001 - not numbers only, an integer too large for a float, a Decimal's own errors
            pass
        for item in value:
            _finite(name, item)
    elif kind is dict:
        for item in value.values():
            _finite(name, item)
    elif isinstance(value, Enum):
        _finite(name, value.value)
