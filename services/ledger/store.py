"""The ledger's database: every lifecycle event recorded once, and each request's cost.

`LedgerStore` works on SQLite (``sqlite+aiosqlite:////abs/path/ledger.db``) and PostgreSQL
(``postgresql+asyncpg://...``) through SQLAlchemy's async Core.

- Ingestion is idempotent: `record_many` inserts the events' ids into ``events`` and applies the
  events in the same transaction; an id already there is a redelivery and changes nothing.
- Ingestion is batched: a batch costs a constant number of statements, not some per event. Its
  new events are folded into one change per request (fold.py, pure) and each change is one row
  of a single upsert (upserts.py), the same as applying the events one at a time.
- Events may arrive in any order (a decode's completion before its prefill's), so every change to
  a request's row is an upsert that adds costs and keeps a completed request completed.
- GPU time that cannot be priced is never priced at zero silently: the reason goes to
  ``ledger_errors`` (with the unpriced GPU-seconds) and the event is still marked as seen.
- The schema evolves by numbered migrations (`MIGRATIONS`, schema.py), each applied once, in a
  transaction.

Since migration 2 the same batch also keeps, with one statement each: every event's cost on its
``events`` row (for figures by time window, tenant and pool); one row of facts per task
(``tasks``: a standalone request or a workflow, tasks.py); and each worker's running sum of busy
GPU-seconds (``workers``), from which the idle sampler (`record_idle`, idle.py) derives idle
spend per pool and time window (``idle_spend``). `report` computes the figures of merit from
these tables: cost per successful task, wasted spend, idle spend, in total and per tenant, pool
or workflow, over all time or since a given time.

The work is split by what it does: schema.py holds the migrations and tables, upserts.py the
write statements, queries.py the reports' SELECTs and summaries.py (pure) what their rows become.
This module is the store itself: connecting, migrating, the transactions of ingestion and idle
sampling, lookups by key, and the statements compiled once for its database (compiled.py). Its former
names (the tables, `MIGRATIONS`, `DIMENSIONS`, ...) are re-exported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from schemas.events import LifecycleEvent
from services.ledger import queries, upserts
from services.ledger.compiled import Compiled, driver_parameter_order
from services.ledger.figures import Figures
from services.ledger.fold import TaskDelta, WorkerBusy, fold
from services.ledger.idle import IdleAccount, IdleAccounting, WorkerSample, account_idle
from services.ledger.queries import DIMENSIONS, UNKNOWN_POOL, Dimension
from services.ledger.schema import (
    MIGRATIONS,
    PG_MIGRATION_LOCK_KEY,
    SCHEMA_MIGRATIONS_DDL,
    STATUSES,
    Migration,
    Statement,
    check_migrations,
    events,
    idle_spend,
    ledger_errors,
    metadata,
    request_costs,
    schema_migrations,
    tasks,
    workers,
)
from services.ledger.summaries import facts_of, request_summary
from services.ledger.tasks import TaskFacts

__all__ = [
    "DIMENSIONS",
    "KNOWN_IDS_CHUNK",
    "MIGRATIONS",
    "SQLITE_BUSY_TIMEOUT_MS",
    "SQLITE_CACHE_KIB",
    "SQLITE_WAL_CHECKPOINT_PAGES",
    "STATUSES",
    "SUPPORTED_DIALECTS",
    "UNKNOWN_POOL",
    "BatchResult",
    "Dimension",
    "LedgerStore",
    "Migration",
    "Statement",
    "default_database_url",
    "events",
    "idle_spend",
    "ledger_errors",
    "metadata",
    "request_costs",
    "schema_migrations",
    "tasks",
    "workers",
]

SQLITE_BUSY_TIMEOUT_MS = 10_000
SQLITE_CACHE_KIB = 65_536
SQLITE_WAL_CHECKPOINT_PAGES = 4096
SUPPORTED_DIALECTS = ("sqlite", "postgresql")
KNOWN_IDS_CHUNK = 512  # event ids per SELECT of those already recorded

_rc = request_costs.c
_wc = workers.c


def default_database_url(data_dir: Path) -> str:
    """The ledger's database when none is given: SQLite in the data directory."""
    return f"sqlite+aiosqlite:///{Path(data_dir).resolve() / 'ledger.db'}"


class LedgerStore:
    """Costs per request over SQLAlchemy async Core; create it with `await LedgerStore.open(url)`."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.dialect: str = engine.dialect.name
        # Writes begin with BEGIN IMMEDIATE on SQLite (see `_install_sqlite_hooks`).
        self._writer = engine.execution_options(ledger_write=True)
        # SQLite has one writer at a time: queue this process's writes here rather than have
        # them spin on the database lock.
        self._write_lock: asyncio.Lock | None = asyncio.Lock() if self.dialect == "sqlite" else None
        # The batch's statements, compiled once for this database.
        dialect = engine.dialect
        name = self.dialect
        self._insert_events = _compiled(events.insert(), dialect, upserts.EVENT_FIELDS)
        self._upsert_requests = _compiled(upserts.upsert_requests(name), dialect, upserts.REQUEST_FIELDS)
        self._upsert_tasks = _compiled(upserts.upsert_tasks(name), dialect, upserts.TASK_FIELDS)
        self._upsert_busy = _compiled(upserts.upsert_busy(name), dialect, upserts.BUSY_FIELDS)
        self._insert_errors = _compiled(ledger_errors.insert(), dialect, upserts.ERROR_FIELDS)
        self._upsert_accounts = _compiled(upserts.upsert_accounts(name), dialect, upserts.ACCOUNT_FIELDS)
        self._upsert_idle = _compiled(upserts.upsert_idle(name), dialect, upserts.IDLE_FIELDS)
        self._known_ids: dict[int, Compiled] = {}  # by number of ids
        self._task_queries: dict[int, Compiled] = {}  # by number of task keys

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        schema: str | None = None,
        migrations: Sequence[Migration] = MIGRATIONS,
    ) -> LedgerStore:
        """Connect and bring the schema up to date.

        `schema` (PostgreSQL only) puts the ledger's tables in that existing schema instead of
        the connection's default search path.
        """
        sa_url = sa.make_url(url)
        dialect = sa_url.get_backend_name()
        if dialect not in SUPPORTED_DIALECTS:
            raise ValueError(f"unsupported ledger database {dialect!r}: use sqlite or postgresql")
        connect_args: dict[str, Any] = {}
        server_settings: dict[str, str] = {}
        if schema is not None:
            if dialect != "postgresql":
                raise ValueError("a ledger schema can only be chosen on PostgreSQL")
            server_settings["search_path"] = schema
        if sa_url.get_driver_name() == "asyncpg":
            # Plan each execution for the tables as they are now: a plan cached while the ledger
            # was empty (a sequential scan) would otherwise serve its lookups by key for ever.
            server_settings["plan_cache_mode"] = "force_custom_plan"
        if server_settings:
            connect_args["server_settings"] = server_settings
        if dialect == "sqlite" and sa_url.database and sa_url.database != ":memory:":
            Path(sa_url.database).parent.mkdir(parents=True, exist_ok=True)
        # A server connection can go stale; a local SQLite file cannot, so only ping servers.
        engine = create_async_engine(sa_url, connect_args=connect_args, pool_pre_ping=dialect != "sqlite")
        if dialect == "sqlite":
            _install_sqlite_hooks(engine)
        store = cls(engine)
        try:
            await store.migrate(migrations)
        except BaseException:
            await engine.dispose()
            raise
        return store

    async def close(self) -> None:
        await self.engine.dispose()

    # ------------------------------------------------------------ migrations

    async def migrate(self, migrations: Sequence[Migration] = MIGRATIONS) -> list[int]:
        """Apply the migrations not yet applied, each in its own transaction.

        Returns the versions applied now (empty when the schema was already up to date).
        """
        check_migrations(migrations)
        async with self._write() as conn:
            await self._lock_migrations(conn)
            await conn.exec_driver_sql(SCHEMA_MIGRATIONS_DDL)
        applied: list[int] = []
        for version, statements in migrations:
            async with self._write() as conn:
                await self._lock_migrations(conn)
                done = await conn.scalar(
                    sa.select(schema_migrations.c.version).where(schema_migrations.c.version == version)
                )
                if done is not None:
                    continue
                for statement in statements:
                    await conn.exec_driver_sql(self._ddl(statement, version))
                await conn.execute(schema_migrations.insert().values(version=version, applied_at=time.time()))
            applied.append(version)
        return applied

    async def schema_version(self) -> int:
        async with self.engine.connect() as conn:
            version = await conn.scalar(sa.select(sa.func.max(schema_migrations.c.version)))
        return int(version or 0)

    def _ddl(self, statement: Statement, version: int) -> str:
        if isinstance(statement, str):
            return statement
        try:
            return statement[self.dialect]
        except KeyError:
            raise RuntimeError(f"migration {version} has no statement for dialect {self.dialect!r}") from None

    async def _lock_migrations(self, conn: AsyncConnection) -> None:
        if self.dialect == "postgresql":
            await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.literal(PG_MIGRATION_LOCK_KEY))))

    # ------------------------------------------------------------ ingestion

    async def record(
        self, event: LifecycleEvent, prices: Mapping[str, float], *, kv_usd_per_gb: float = 0.0
    ) -> bool:
        """Record one lifecycle event; False if it was recorded before (a redelivery).

        The event's id and its effect are committed together, so a redelivered event never
        counts twice and a failed write leaves nothing half-applied (the event is retried).
        """
        return (await self.record_many([event], prices, kv_usd_per_gb=kv_usd_per_gb))[0]

    async def record_many(
        self, batch: Sequence[LifecycleEvent], prices: Mapping[str, float], *, kv_usd_per_gb: float = 0.0
    ) -> list[bool]:
        """Record several events in one transaction (group commit); one flag per event, False for
        an event recorded before (in an earlier batch or earlier in this one). See `record_batch`."""
        return (await self.record_batch(batch, prices, kv_usd_per_gb=kv_usd_per_gb)).flags

    async def record_batch(
        self, batch: Sequence[LifecycleEvent], prices: Mapping[str, float], *, kv_usd_per_gb: float = 0.0
    ) -> BatchResult:
        """Record several events in one transaction (group commit).

        A constant number of statements per batch, whatever its size: the ids already recorded
        (one SELECT per `KNOWN_IDS_CHUNK` ids), then one executemany each for the new events
        (with their costs), the changed requests, tasks and workers (the batch folded into one
        delta each, fold.py) and the pricing errors. The result is the same as recording the
        events one at a time, in order. KV transfers are priced at `kv_usd_per_gb`.
        """
        if not batch:
            return BatchResult([], [])
        now = time.time()
        async with self._write() as conn:
            known = await self._known_event_ids(conn, {event.event_id for event in batch})
            flags: list[bool] = []
            new: list[LifecycleEvent] = []
            for event in batch:
                is_new = event.event_id not in known
                flags.append(is_new)
                if is_new:
                    known.add(event.event_id)
                    new.append(event)
            if not new:
                return BatchResult(flags, [])
            folded = fold(new, prices, kv_usd_per_gb)
            # A plain INSERT: should a concurrent writer commit one of these ids meanwhile
            # (PostgreSQL), the batch fails and is retried rather than counted twice.
            await self._insert_events.executemany(conn, [(*row, now) for row in folded.events])
            if folded.requests:
                await self._upsert_requests.executemany(
                    conn, [(*upserts.delta_values(delta), now) for delta in folded.requests]
                )
            if folded.tasks:
                await self._upsert_tasks.executemany(
                    conn, [(*upserts.task_values(task), now) for task in folded.tasks]
                )
            if folded.workers:
                await self._upsert_busy.executemany(
                    conn, [(*upserts.busy_values(busy), now) for busy in folded.workers]
                )
            if folded.errors:
                await self._insert_errors.executemany(
                    conn, [(e.event_id, e.request_id, e.reason, now) for e in folded.errors]
                )
            # The workflows' totals as this batch leaves them (for WORKFLOW_SPEND): read in the
            # same transaction, so no later batch's change is mixed in.
            keys = [task.task_key for task in folded.tasks if task.workflow_id is not None]
            workflows = await self._read_tasks(conn, keys) if keys else []
        return BatchResult(flags, folded.tasks, folded.workers, workflows)

    async def _known_event_ids(self, conn: AsyncConnection, event_ids: set[str]) -> set[str]:
        """Which of `event_ids` are recorded already."""
        ids = sorted(event_ids)
        known: set[str] = set()
        for start in range(0, len(ids), KNOWN_IDS_CHUNK):
            chunk = ids[start : start + KNOWN_IDS_CHUNK]
            # Padded to a power of two (repeating an id): few distinct queries to compile, and for
            # the database to prepare.
            size = 1 << (len(chunk) - 1).bit_length()
            chunk += chunk[-1:] * (size - len(chunk))
            query = self._known_ids.get(size)
            if query is None:
                query = self._known_ids[size] = _compiled(
                    _known_event_ids_query(size), self.engine.dialect, [f"id{i}" for i in range(size)]
                )
            known.update((await query.execute(conn, tuple(chunk))).scalars())
        return known

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        if self._write_lock is None:
            async with self._writer.begin() as conn:
                yield conn
            return
        async with self._write_lock, self._writer.begin() as conn:
            yield conn

    # ------------------------------------------------------------ queries

    async def request(self, request_id: str) -> dict[str, Any] | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(request_costs).where(_rc.request_id == request_id))).first()
        return None if row is None else request_summary(row._mapping)

    async def totals(self) -> dict[str, Any]:
        """Requests by status, spend and GPU-seconds by phase, tokens, events and errors."""
        async with self.engine.connect() as conn:
            return await queries.totals(conn)

    async def by_tenant(self) -> list[dict[str, Any]]:
        """Per tenant: requests by status, spend, GPU-seconds and tokens; biggest spender first."""
        async with self.engine.connect() as conn:
            return await queries.by_tenant(conn)

    async def by_class(self) -> list[dict[str, Any]]:
        """Per service class (interactive, batch): requests, spend and cost per completed request."""
        async with self.engine.connect() as conn:
            return await queries.by_class(conn)

    async def by_model(self) -> list[dict[str, Any]]:
        """Per model: requests, spend and cost per completed request."""
        async with self.engine.connect() as conn:
            return await queries.by_model(conn)

    async def errors(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The most recent ledger errors, oldest first."""
        latest = sa.select(ledger_errors).order_by(ledger_errors.c.id.desc()).limit(limit).subquery()
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(latest).order_by(latest.c.id))).all()
        return [dict(row._mapping) for row in rows]

    # ------------------------------------------------------------ tasks

    async def tasks(self, task_keys: Iterable[str]) -> list[TaskFacts]:
        """The facts of these tasks (those recorded), in no particular order."""
        async with self.engine.connect() as conn:
            return await self._read_tasks(conn, task_keys)

    async def _read_tasks(self, conn: AsyncConnection, task_keys: Iterable[str]) -> list[TaskFacts]:
        """Compiled once per (power of two) number of keys, like `_known_event_ids`: this runs
        after every batch that touches a workflow."""
        keys = sorted(set(task_keys))
        out: list[TaskFacts] = []
        for start in range(0, len(keys), KNOWN_IDS_CHUNK):
            chunk = keys[start : start + KNOWN_IDS_CHUNK]
            size = 1 << (len(chunk) - 1).bit_length()
            chunk += chunk[-1:] * (size - len(chunk))
            query = self._task_queries.get(size)
            if query is None:
                query = self._task_queries[size] = _compiled(
                    queries.tasks_query(size), self.engine.dialect, [f"key{i}" for i in range(size)]
                )
            out.extend(facts_of(row) for row in await query.execute(conn, tuple(chunk)))
        return out

    async def quiet_workflows(self, after: float, until: float) -> list[TaskFacts]:
        """Workflows whose last event is in (`after`, `until`]: those a sweep at `until` + the
        task timeout finds newly abandoned, unless they ended already."""
        async with self.engine.connect() as conn:
            return await queries.quiet_workflows(conn, after, until)

    # ------------------------------------------------------------ idle time

    async def record_idle(
        self,
        samples: Sequence[WorkerSample],
        now: float,
        prices: Mapping[str, float],
        *,
        window_s: float = 60.0,
        backfill_s: float = 10.0,
    ) -> IdleAccounting:
        """Account the idle time of the sampled (live) workers up to `now`, in one transaction:
        read what each was accounted before, add its idle time to ``idle_spend`` per pool and
        window, and move its account forward (idle.py)."""
        if not samples:
            return IdleAccounting()
        ids = sorted({sample.worker_id for sample in samples})
        async with self._write() as conn:
            query = sa.select(
                _wc.worker_id,
                _wc.busy_gpu_seconds,
                _wc.idle_covered_until,
                _wc.idle_busy_counted_s,
                _wc.idle_debt_s,
            ).where(_wc.worker_id.in_(ids))
            if self.dialect == "postgresql":
                query = query.with_for_update()  # another ledger process samples the same workers
            accounts = {
                row.worker_id: IdleAccount(
                    worker_id=row.worker_id,
                    busy_total_s=float(row.busy_gpu_seconds),
                    covered_until=None if row.idle_covered_until is None else float(row.idle_covered_until),
                    busy_counted_s=float(row.idle_busy_counted_s),
                    debt_s=float(row.idle_debt_s),
                )
                for row in await conn.execute(query)
            }
            result = account_idle(samples, accounts, now, prices, window_s=window_s, backfill_s=backfill_s)
            await self._upsert_accounts.executemany(
                conn,
                [
                    (
                        a.worker_id,
                        a.pool,
                        a.gpu_type,
                        a.started_at,
                        a.covered_until,
                        a.busy_counted_s,
                        a.debt_s,
                        now,
                        now,
                    )
                    for a in result.accounts
                ],
            )
            if result.shares:
                await self._upsert_idle.executemany(
                    conn,
                    [
                        (
                            share.window_start,
                            share.pool,
                            share.gpu_type,
                            share.window_s,
                            share.provisioned_gpu_seconds,
                            share.busy_gpu_seconds,
                            share.idle_gpu_seconds,
                            share.idle_cost_usd,
                            share.workers,
                            now,
                        )
                        for share in result.shares
                    ],
                )
            if result.errors:
                await self._insert_errors.executemany(
                    conn, [(f"idle:{e.worker_id}:{now:.3f}", None, e.reason, now) for e in result.errors]
                )
        return result

    # ------------------------------------------------------------ figures

    async def report(
        self,
        *,
        now: float,
        task_timeout_s: float,
        since: float | None = None,
        by: Dimension | None = None,
        limit: int = 100,
    ) -> dict[str, Any]:
        """The figures of merit (figures.py) for the fleet, and per tenant, pool or workflow
        (`by`), over everything recorded or since `since` (Unix seconds); task statuses as of
        `now` with a task timeout of `task_timeout_s` (queries.py)."""
        if by not in (None, *DIMENSIONS):
            raise ValueError(f"unknown report dimension {by!r}: one of {', '.join(DIMENSIONS)}")
        async with self.engine.connect() as conn:
            return await queries.report(
                conn, now=now, task_timeout_s=task_timeout_s, since=since, by=by, limit=limit
            )

    async def figures(
        self,
        *,
        now: float,
        task_timeout_s: float,
        since: float | None = None,
        by: Literal["tenant", "pool"] | None = None,
    ) -> dict[Any, Figures]:
        """`report`'s figures as `Figures`, by tenant or pool (or the fleet's, under None)."""
        async with self.engine.connect() as conn:
            return await queries.figures(conn, now=now, task_timeout_s=task_timeout_s, since=since, by=by)


# ---------------------------------------------------------------- helpers


def _known_event_ids_query(size: int) -> sa.Select[Any]:
    return sa.select(events.c.event_id).where(
        events.c.event_id.in_([sa.bindparam(f"id{i}", type_=sa.Text) for i in range(size)])
    )


@dataclasses.dataclass(frozen=True, slots=True)
class BatchResult:
    """What `record_batch` did: one flag per event (False: recorded before), the changes its
    new events made to tasks and workers, and the workflows it touched as it left them."""

    flags: list[bool]
    tasks: list[TaskDelta]
    workers: list[WorkerBusy] = dataclasses.field(default_factory=list)
    workflows: list[TaskFacts] = dataclasses.field(default_factory=list)

    @property
    def workflow_ids(self) -> list[str]:
        return [task.workflow_id for task in self.tasks if task.workflow_id is not None]


# How a compiled statement's driver takes its parameters, looked up at each compilation: a test
# replaces it here to run the path of drivers with named parameters.
_driver_parameter_order = driver_parameter_order


def _compiled(statement: Any, dialect: sa.Dialect, fields: Sequence[str]) -> Compiled:
    return Compiled(statement, dialect, fields, parameter_order=_driver_parameter_order)


def _install_sqlite_hooks(engine: AsyncEngine) -> None:
    """WAL and a busy timeout on every connection, and real transactions.

    Python's sqlite3 (before 3.16) begins transactions only before DML, so DDL (migrations) would
    autocommit statement by statement; SQLAlchemy emits BEGIN itself instead. Writes use
    BEGIN IMMEDIATE so that they take the write lock up front (waiting up to the busy timeout)
    rather than failing when a read transaction tries to upgrade.
    """

    @sa.event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            # Room for the hot pages of every table and index a batch touches (default: 2 MB),
            # and a WAL of up to 16 MiB between checkpoints (default: 4 MiB), so that the pages
            # every batch rewrites (index roots, the latest rows) are copied back once, not each
            # time: the ledger's write rate roughly doubles.
            cursor.execute(f"PRAGMA cache_size = -{SQLITE_CACHE_KIB}")
            cursor.execute(f"PRAGMA wal_autocheckpoint = {SQLITE_WAL_CHECKPOINT_PAGES}")
        finally:
            cursor.close()

    @sa.event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        immediate = conn.get_execution_options().get("ledger_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
