"""Statements compiled once for a database and executed with rows of plain tuples: how the
ledger's batches reach the driver with as little per-row work in Python as can be.

`Compiled` takes a statement (an upsert of upserts.py, a lookup of store.py), the dialect and the
order of the fields in its rows; see its docstring for the paths it takes per driver.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection


def driver_parameter_order(compiled: Any) -> Sequence[str] | None:
    """The names of the parameters in the order the driver takes them; None for named ones."""
    return compiled.positiontup  # type: ignore[no-any-return]


class Compiled:
    """A statement compiled once for the store's dialect, executed with rows of plain tuples.

    A row holds the values of `fields`, in that order, of types the drivers take as they are
    (str, int, float, bool, None). With a positional paramstyle (aiosqlite, asyncpg) rows go
    straight to the driver: SQLAlchemy's parameter processing, row by row, would cost more CPU
    than the database spends on them. Drivers with named parameters get SQLAlchemy's own.

    On PostgreSQL an INSERT (or upsert) whose parameters are all its columns' values runs as
    one statement over the whole batch, its rows sent as one JSON array of arrays
    (``INSERT ... SELECT (r->>0)::type, ... FROM jsonb_array_elements($1::jsonb) AS r``): one
    execution instead of one per row, and no per-value encoding in the driver. Its rows must
    have distinct keys, as the batch's folded rows do. JSON has no NaN or infinity: those
    (accepted only in a nullable `deadline_at`, or from a producer that skipped validation)
    arrive as NULL.

    `parameter_order` reads the driver's order of parameters off the compiled statement
    (default: `driver_parameter_order`; None from it means named parameters).
    """

    def __init__(
        self,
        statement: Any,
        dialect: sa.Dialect,
        fields: Sequence[str],
        *,
        parameter_order: Callable[[Any], Sequence[str] | None] | None = None,
    ) -> None:
        column_keys = None
        if isinstance(statement, sa.Insert):
            # The fields' columns only, and no RETURNING of generated keys: nothing reads them.
            column_keys = [name for name in fields if name in statement.table.c]
            statement = statement.inline()
        self.statement = statement
        self.fields = tuple(fields)
        compiled = statement.compile(dialect=dialect, column_keys=column_keys)
        names = (parameter_order or driver_parameter_order)(compiled)
        self._sql: str | None = None
        self._bulk_sql: str | None = None
        if names is None:
            return
        unknown = set(names) - set(self.fields)
        if unknown:
            raise RuntimeError(f"statement parameters not among the row's fields: {sorted(unknown)}")
        indexes = [self.fields.index(name) for name in names]
        self._sql = compiled.string
        self._pick: Callable[[tuple[Any, ...]], tuple[Any, ...]] = (
            operator.itemgetter(*indexes) if len(indexes) > 1 else lambda row: (row[indexes[0]],)
        )
        self._bulk_sql = _bulk_sql(statement, dialect, compiled.string, names)

    async def execute(self, conn: AsyncConnection, row: tuple[Any, ...]) -> sa.CursorResult[Any]:
        if self._sql is None:
            result: sa.CursorResult[Any] = await conn.execute(
                self.statement, dict(zip(self.fields, row, strict=True))
            )
            return result
        return await conn.exec_driver_sql(self._sql, self._pick(row))

    async def executemany(self, conn: AsyncConnection, rows: Sequence[tuple[Any, ...]]) -> None:
        if self._sql is None:
            await conn.execute(self.statement, [dict(zip(self.fields, row, strict=True)) for row in rows])
            return
        pick = self._pick
        if self._bulk_sql is not None and len(rows) > 1:
            payload = _json_encode([pick(row) for row in rows]).decode()
            await conn.exec_driver_sql(self._bulk_sql, (payload,))
            return
        await conn.exec_driver_sql(self._sql, [pick(row) for row in rows])


_json_encode = msgspec.json.Encoder().encode


def _bulk_sql(statement: Any, dialect: sa.Dialect, sql: str, names: Sequence[str]) -> str | None:
    """`sql` (a PostgreSQL INSERT of `names`, in the driver's order) over a JSON array of rows,
    or None where it cannot be: another dialect or statement, or parameters beyond the values."""
    if dialect.name != "postgresql" or not isinstance(statement, sa.Insert):
        return None
    table = statement.table
    head, on_conflict, conflict = sql.partition(" ON CONFLICT ")
    if not names or len(set(names)) != len(names) or any(name not in table.c for name in names):
        return None
    if "$" in conflict or not head.startswith(f"INSERT INTO {table.name} ("):
        return None
    values = ", ".join(
        f"(r->>{i})::{table.c[name].type.compile(dialect=dialect)}" for i, name in enumerate(names)
    )
    rows = "jsonb_array_elements($1::jsonb) AS r"
    select = f"INSERT INTO {table.name} ({', '.join(names)}) SELECT {values} FROM {rows}"
    return select + (on_conflict + conflict if on_conflict else "")
