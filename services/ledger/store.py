"""The ledger's database: every lifecycle event recorded once, and each request's cost.

`LedgerStore` works on SQLite (``sqlite+aiosqlite:////abs/path/ledger.db``) and PostgreSQL
(``postgresql+asyncpg://...``) through SQLAlchemy's async Core.

- Ingestion is idempotent: `record_many` inserts the events' ids into ``events`` and applies the
  events in the same transaction; an id already there is a redelivery and changes nothing.
- Ingestion is batched: a batch costs a constant number of statements, not some per event. Its
  new events are folded into one change per request (fold.py, pure) and each change is one row
  of a single upsert, the same as applying the events one at a time.
- Events may arrive in any order (a decode's completion before its prefill's), so every change to
  a request's row is an upsert that adds costs and keeps a completed request completed.
- GPU time that cannot be priced is never priced at zero silently: the reason goes to
  ``ledger_errors`` (with the unpriced GPU-seconds) and the event is still marked as seen.
- The schema evolves by numbered migrations (`MIGRATIONS`), each applied once, in a transaction.

Since migration 2 the same batch also keeps, with one statement each: every event's cost on its
``events`` row (for figures by time window, tenant and pool); one row of facts per task
(``tasks``: a standalone request or a workflow, tasks.py); and each worker's running sum of busy
GPU-seconds (``workers``), from which the idle sampler (`record_idle`, idle.py) derives idle
spend per pool and time window (``idle_spend``). `report` computes the figures of merit from
these tables: cost per successful task, wasted spend, idle spend, in total and per tenant, pool
or workflow, over all time or since a given time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import operator
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from schemas.events import LifecycleEvent
from services.ledger.figures import Figures
from services.ledger.fold import EVENT_ROW_FIELDS, RequestDelta, TaskDelta, WorkerBusy, fold
from services.ledger.idle import IdleAccount, IdleAccounting, WorkerSample, account_idle
from services.ledger.tasks import WORKFLOW_KEY_PREFIX, TaskFacts, status_of

SQLITE_BUSY_TIMEOUT_MS = 10_000
SQLITE_CACHE_KIB = 65_536
SQLITE_WAL_CHECKPOINT_PAGES = 4096
SUPPORTED_DIALECTS = ("sqlite", "postgresql")
STATUSES = ("running", "completed", "failed", "rejected")

# A DDL statement: one for every dialect, or one per dialect name.
Statement = str | Mapping[str, str]
Migration = tuple[int, Sequence[Statement]]

_TASKS_DDL = """
            CREATE TABLE tasks (
                task_key TEXT PRIMARY KEY,
                kind TEXT NOT NULL CHECK (kind IN ('request', 'workflow')),
                workflow_id TEXT,
                tenant TEXT NOT NULL,
                steps INTEGER,
                max_completed_step INTEGER NOT NULL DEFAULT 0,
                max_failed_step INTEGER NOT NULL DEFAULT 0,
                final_completed_at DOUBLE PRECISION,
                deadline_misses INTEGER NOT NULL DEFAULT 0,
                completions INTEGER NOT NULL DEFAULT 0,
                failures INTEGER NOT NULL DEFAULT 0,
                gpu_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
                gpu_cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
                kv_cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
                kv_transfer_bytes BIGINT NOT NULL DEFAULT 0,
                first_event_at DOUBLE PRECISION NOT NULL,
                last_event_at DOUBLE PRECISION NOT NULL,
                updated_at DOUBLE PRECISION NOT NULL
            )
            """

# Append only: a released migration is never edited, a change is a new version.
MIGRATIONS: list[Migration] = [
    (
        1,
        [
            """
            CREATE TABLE events (
                event_id TEXT PRIMARY KEY,
                type TEXT NOT NULL,
                request_id TEXT,
                tenant TEXT,
                occurred_at DOUBLE PRECISION NOT NULL,
                recorded_at DOUBLE PRECISION NOT NULL
            )
            """,
            "CREATE INDEX ix_events_request_id ON events (request_id)",
            """
            CREATE TABLE request_costs (
                request_id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                workflow_id TEXT,
                prefill_worker TEXT,
                decode_worker TEXT,
                gpu_type_prefill TEXT,
                gpu_type_decode TEXT,
                prefill_gpu_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
                decode_gpu_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
                prefill_cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
                decode_cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
                prompt_tokens INTEGER NOT NULL DEFAULT 0,
                cached_tokens INTEGER NOT NULL DEFAULT 0,
                completion_tokens INTEGER NOT NULL DEFAULT 0,
                kv_transfer_bytes BIGINT NOT NULL DEFAULT 0,
                status TEXT NOT NULL
                    CHECK (status IN ('running', 'completed', 'failed', 'rejected')),
                finish_reason TEXT,
                latency_s DOUBLE PRECISION,
                updated_at DOUBLE PRECISION NOT NULL
            )
            """,
            "CREATE INDEX ix_request_costs_tenant ON request_costs (tenant)",
            "CREATE INDEX ix_request_costs_workflow_id ON request_costs (workflow_id)",
            {
                "sqlite": """
                    CREATE TABLE ledger_errors (
                        id INTEGER PRIMARY KEY AUTOINCREMENT,
                        event_id TEXT NOT NULL,
                        request_id TEXT,
                        reason TEXT NOT NULL,
                        occurred_at DOUBLE PRECISION NOT NULL
                    )
                """,
                "postgresql": """
                    CREATE TABLE ledger_errors (
                        id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
                        event_id TEXT NOT NULL,
                        request_id TEXT,
                        reason TEXT NOT NULL,
                        occurred_at DOUBLE PRECISION NOT NULL
                    )
                """,
            },
        ],
    ),
    (
        2,
        [
            # Each event's task and cost, for figures by time window, tenant and pool.
            *(
                f"ALTER TABLE events ADD COLUMN {column}"
                for column in (
                    "task_key TEXT",
                    "worker_id TEXT",
                    "gpu_type TEXT",
                    "gpu_seconds DOUBLE PRECISION",
                    "cost_usd DOUBLE PRECISION",
                    "kv_transfer_bytes BIGINT",
                    "kv_cost_usd DOUBLE PRECISION",
                )
            ),
            "CREATE INDEX ix_events_occurred_at ON events (occurred_at)",
            *(
                f"ALTER TABLE request_costs ADD COLUMN {column}"
                for column in (
                    "kv_cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0",
                    "completed_at DOUBLE PRECISION",
                    "deadline_at DOUBLE PRECISION",
                    "workflow_step INTEGER",
                    "workflow_steps INTEGER",
                )
            ),
            # SQLite: the row lives in its key's B-tree (one write per upsert, not two).
            {
                "sqlite": _TASKS_DDL + " WITHOUT ROWID",
                "postgresql": _TASKS_DDL,
            },
            """
            CREATE TABLE workers (
                worker_id TEXT PRIMARY KEY,
                pool TEXT,
                gpu_type TEXT,
                started_at DOUBLE PRECISION,
                busy_gpu_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
                busy_cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
                idle_covered_until DOUBLE PRECISION,
                idle_busy_counted_s DOUBLE PRECISION NOT NULL DEFAULT 0,
                idle_debt_s DOUBLE PRECISION NOT NULL DEFAULT 0,
                last_seen_at DOUBLE PRECISION,
                updated_at DOUBLE PRECISION NOT NULL
            )
            """,
            """
            CREATE TABLE idle_spend (
                window_start DOUBLE PRECISION NOT NULL,
                pool TEXT NOT NULL,
                gpu_type TEXT NOT NULL,
                window_s DOUBLE PRECISION NOT NULL,
                provisioned_gpu_seconds DOUBLE PRECISION NOT NULL,
                busy_gpu_seconds DOUBLE PRECISION NOT NULL,
                idle_gpu_seconds DOUBLE PRECISION NOT NULL,
                idle_cost_usd DOUBLE PRECISION NOT NULL,
                samples INTEGER NOT NULL,
                updated_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (window_start, pool, gpu_type)
            )
            """,
        ],
    ),
]

_SCHEMA_MIGRATIONS_DDL = (
    "CREATE TABLE IF NOT EXISTS schema_migrations ("
    "version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
)
# Serialises migrations between processes opening the same PostgreSQL database at once.
_PG_MIGRATION_LOCK_KEY = 0x5249_5050_4C45  # "RIPPLE"

# ---------------------------------------------------------------- tables (after all migrations)

metadata = sa.MetaData()

schema_migrations = sa.Table(
    "schema_migrations",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("applied_at", sa.Double, nullable=False),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("event_id", sa.Text, primary_key=True),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("request_id", sa.Text),
    sa.Column("tenant", sa.Text),
    sa.Column("occurred_at", sa.Double, nullable=False),
    sa.Column("recorded_at", sa.Double, nullable=False),
    # Migration 2.
    sa.Column("task_key", sa.Text),
    sa.Column("worker_id", sa.Text),
    sa.Column("gpu_type", sa.Text),
    sa.Column("gpu_seconds", sa.Double),
    sa.Column("cost_usd", sa.Double),
    sa.Column("kv_transfer_bytes", sa.BigInteger),
    sa.Column("kv_cost_usd", sa.Double),
)

request_costs = sa.Table(
    "request_costs",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    sa.Column("tenant", sa.Text, nullable=False),
    sa.Column("workflow_id", sa.Text),
    sa.Column("prefill_worker", sa.Text),
    sa.Column("decode_worker", sa.Text),
    sa.Column("gpu_type_prefill", sa.Text),
    sa.Column("gpu_type_decode", sa.Text),
    sa.Column("prefill_gpu_seconds", sa.Double, nullable=False),
    sa.Column("decode_gpu_seconds", sa.Double, nullable=False),
    sa.Column("prefill_cost_usd", sa.Double, nullable=False),
    sa.Column("decode_cost_usd", sa.Double, nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("cached_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("kv_transfer_bytes", sa.BigInteger, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("finish_reason", sa.Text),
    sa.Column("latency_s", sa.Double),
    sa.Column("updated_at", sa.Double, nullable=False),
    # Migration 2.
    sa.Column("kv_cost_usd", sa.Double, nullable=False),
    sa.Column("completed_at", sa.Double),
    sa.Column("deadline_at", sa.Double),
    sa.Column("workflow_step", sa.Integer),
    sa.Column("workflow_steps", sa.Integer),
)

ledger_errors = sa.Table(
    "ledger_errors",
    metadata,
    sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
    sa.Column("event_id", sa.Text, nullable=False),
    sa.Column("request_id", sa.Text),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("occurred_at", sa.Double, nullable=False),
)

tasks = sa.Table(
    "tasks",
    metadata,
    sa.Column("task_key", sa.Text, primary_key=True),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("workflow_id", sa.Text),
    sa.Column("tenant", sa.Text, nullable=False),
    sa.Column("steps", sa.Integer),
    sa.Column("max_completed_step", sa.Integer, nullable=False),
    sa.Column("max_failed_step", sa.Integer, nullable=False),
    sa.Column("final_completed_at", sa.Double),
    sa.Column("deadline_misses", sa.Integer, nullable=False),
    sa.Column("completions", sa.Integer, nullable=False),
    sa.Column("failures", sa.Integer, nullable=False),
    sa.Column("gpu_seconds", sa.Double, nullable=False),
    sa.Column("gpu_cost_usd", sa.Double, nullable=False),
    sa.Column("kv_cost_usd", sa.Double, nullable=False),
    sa.Column("kv_transfer_bytes", sa.BigInteger, nullable=False),
    sa.Column("first_event_at", sa.Double, nullable=False),
    sa.Column("last_event_at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
)

workers = sa.Table(
    "workers",
    metadata,
    sa.Column("worker_id", sa.Text, primary_key=True),
    sa.Column("pool", sa.Text),
    sa.Column("gpu_type", sa.Text),
    sa.Column("started_at", sa.Double),
    sa.Column("busy_gpu_seconds", sa.Double, nullable=False),
    sa.Column("busy_cost_usd", sa.Double, nullable=False),
    sa.Column("idle_covered_until", sa.Double),
    sa.Column("idle_busy_counted_s", sa.Double, nullable=False),
    sa.Column("idle_debt_s", sa.Double, nullable=False),
    sa.Column("last_seen_at", sa.Double),
    sa.Column("updated_at", sa.Double, nullable=False),
)

idle_spend = sa.Table(
    "idle_spend",
    metadata,
    sa.Column("window_start", sa.Double, primary_key=True),
    sa.Column("pool", sa.Text, primary_key=True),
    sa.Column("gpu_type", sa.Text, primary_key=True),
    sa.Column("window_s", sa.Double, nullable=False),
    sa.Column("provisioned_gpu_seconds", sa.Double, nullable=False),
    sa.Column("busy_gpu_seconds", sa.Double, nullable=False),
    sa.Column("idle_gpu_seconds", sa.Double, nullable=False),
    sa.Column("idle_cost_usd", sa.Double, nullable=False),
    sa.Column("samples", sa.Integer, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
)

_rc = request_costs.c
_tc = tasks.c
_wc = workers.c
_ec = events.c
_ic = idle_spend.c


def default_database_url(data_dir: Path) -> str:
    """The ledger's database when none is given: SQLite in the data directory."""
    return f"sqlite+aiosqlite:///{Path(data_dir).resolve() / 'ledger.db'}"


def _check_migrations(migrations: Sequence[Migration]) -> None:
    versions = [version for version, _ in migrations]
    if versions != sorted(set(versions)) or any(v < 1 for v in versions):
        raise RuntimeError(f"migrations must have unique, increasing versions >= 1: {versions}")


_check_migrations(MIGRATIONS)


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
        self._insert_events = _Compiled(events.insert(), dialect, _EVENT_FIELDS)
        self._upsert_requests = _Compiled(self._upsert_requests_statement(), dialect, _REQUEST_FIELDS)
        self._upsert_tasks = _Compiled(self._upsert_tasks_statement(), dialect, _TASK_FIELDS)
        self._upsert_busy = _Compiled(self._upsert_busy_statement(), dialect, _BUSY_FIELDS)
        self._insert_errors = _Compiled(ledger_errors.insert(), dialect, _ERROR_FIELDS)
        self._upsert_accounts = _Compiled(self._upsert_accounts_statement(), dialect, _ACCOUNT_FIELDS)
        self._upsert_idle = _Compiled(self._upsert_idle_statement(), dialect, _IDLE_FIELDS)
        self._known_ids: dict[int, _Compiled] = {}  # by number of ids
        self._task_queries: dict[int, _Compiled] = {}  # by number of task keys

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
        _check_migrations(migrations)
        async with self._write() as conn:
            await self._lock_migrations(conn)
            await conn.exec_driver_sql(_SCHEMA_MIGRATIONS_DDL)
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
            await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.literal(_PG_MIGRATION_LOCK_KEY))))

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
                    conn, [(*_delta_values(delta), now) for delta in folded.requests]
                )
            if folded.tasks:
                await self._upsert_tasks.executemany(
                    conn, [(*_task_values(task), now) for task in folded.tasks]
                )
            if folded.workers:
                await self._upsert_busy.executemany(
                    conn, [(*_busy_values(busy), now) for busy in folded.workers]
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
                query = self._known_ids[size] = _Compiled(
                    _known_event_ids_query(size), self.engine.dialect, [f"id{i}" for i in range(size)]
                )
            known.update((await query.execute(conn, tuple(chunk))).scalars())
        return known

    def _upsert_requests_statement(self) -> Any:
        """One upsert for every `RequestDelta`: a new row is the delta itself; an existing one
        combines with it as fold.py describes."""
        stmt = self._insert(request_costs)
        excluded = stmt.excluded
        # Whether the delta holds a prefill (decode) report: only such a report sets its GPU
        # type. Told by the row itself, so that the statement's only parameters are its values.
        has_prefill = excluded.gpu_type_prefill.is_not(None)
        has_decode = excluded.gpu_type_decode.is_not(None)

        def replaced_if(reported: sa.ColumnElement[Any], name: str) -> sa.ColumnElement[Any]:
            return sa.case((reported, excluded[name]), else_=_rc[name])

        updates: dict[str, Any] = {
            "updated_at": excluded.updated_at,
            "workflow_id": sa.func.coalesce(_rc.workflow_id, excluded.workflow_id),
            # A completion's worker replaces; routing's (the delta's otherwise) only fills a gap.
            "prefill_worker": sa.case(
                (has_prefill, excluded.prefill_worker),
                else_=sa.func.coalesce(_rc.prefill_worker, excluded.prefill_worker),
            ),
            "decode_worker": sa.case(
                (has_decode, excluded.decode_worker),
                else_=sa.func.coalesce(_rc.decode_worker, excluded.decode_worker),
            ),
            "gpu_type_prefill": replaced_if(has_prefill, "gpu_type_prefill"),
            "gpu_type_decode": replaced_if(has_decode, "gpu_type_decode"),
            "prompt_tokens": replaced_if(sa.or_(has_prefill, has_decode), "prompt_tokens"),
            "cached_tokens": replaced_if(sa.or_(has_prefill, has_decode), "cached_tokens"),
            "completion_tokens": replaced_if(has_decode, "completion_tokens"),
            "finish_reason": replaced_if(has_decode, "finish_reason"),
            "latency_s": replaced_if(has_decode, "latency_s"),
            # The delta's status is the one its events give a running request: 'running' keeps
            # the row's, and a completed request stays completed.
            "status": sa.case(
                (
                    sa.or_(excluded.status == _RUNNING, _rc.status == _COMPLETED),
                    _rc.status,
                ),
                else_=excluded.status,
            ),
            "completed_at": replaced_if(has_decode, "completed_at"),
            "deadline_at": sa.func.coalesce(_rc.deadline_at, excluded.deadline_at),
            "workflow_step": sa.func.coalesce(_rc.workflow_step, excluded.workflow_step),
            "workflow_steps": sa.func.coalesce(_rc.workflow_steps, excluded.workflow_steps),
        }
        updates.update({name: _rc[name] + excluded[name] for name in _ADDED})
        return stmt.on_conflict_do_update(index_elements=[_rc.request_id], set_=updates)

    def _upsert_tasks_statement(self) -> Any:
        """One upsert for every `TaskDelta`: sums add, maxima and minima combine, the row's tenant
        and workflow id stay (fold.py)."""
        stmt = self._insert(tasks)
        excluded = stmt.excluded
        greatest, least = self._greatest, self._least
        updates: dict[str, Any] = {
            "workflow_id": sa.func.coalesce(_tc.workflow_id, excluded.workflow_id),
            "steps": greatest(_tc.steps, excluded.steps, nullable=True),
            "max_completed_step": greatest(_tc.max_completed_step, excluded.max_completed_step),
            "max_failed_step": greatest(_tc.max_failed_step, excluded.max_failed_step),
            "final_completed_at": least(_tc.final_completed_at, excluded.final_completed_at, nullable=True),
            "first_event_at": least(_tc.first_event_at, excluded.first_event_at),
            "last_event_at": greatest(_tc.last_event_at, excluded.last_event_at),
            "updated_at": excluded.updated_at,
        }
        updates.update({name: _tc[name] + excluded[name] for name in _TASK_ADDED})
        return stmt.on_conflict_do_update(index_elements=[_tc.task_key], set_=updates)

    def _upsert_busy_statement(self) -> Any:
        """Each worker's running sums of reported GPU time (the idle sampler's input)."""
        stmt = self._insert(workers)
        excluded = stmt.excluded
        updates = {
            "gpu_type": excluded.gpu_type,
            "busy_gpu_seconds": _wc.busy_gpu_seconds + excluded.busy_gpu_seconds,
            "busy_cost_usd": _wc.busy_cost_usd + excluded.busy_cost_usd,
            "updated_at": excluded.updated_at,
        }
        return stmt.on_conflict_do_update(index_elements=[_wc.worker_id], set_=updates)

    def _greatest(self, a: Any, b: Any, *, nullable: bool = False) -> Any:
        """The larger of two values; with `nullable`, a NULL is no value (the other wins)."""
        if self.dialect == "postgresql":
            return sa.func.greatest(a, b)  # ignores NULLs
        if nullable:  # SQLite's max(a, b) is NULL when either is
            return sa.func.max(sa.func.coalesce(a, b), sa.func.coalesce(b, a))
        return sa.func.max(a, b)

    def _least(self, a: Any, b: Any, *, nullable: bool = False) -> Any:
        if self.dialect == "postgresql":
            return sa.func.least(a, b)
        if nullable:
            return sa.func.min(sa.func.coalesce(a, b), sa.func.coalesce(b, a))
        return sa.func.min(a, b)

    def _insert(self, table: sa.Table) -> Any:
        """A dialect-specific INSERT, for its ON CONFLICT clauses."""
        if self.dialect == "postgresql":
            return postgresql.insert(table)
        return sqlite.insert(table)

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
        if row is None:
            return None
        result = dict(row._mapping)
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens", "kv_transfer_bytes"):
            result[name] = int(result[name])
        for name in (
            "prefill_gpu_seconds",
            "decode_gpu_seconds",
            "prefill_cost_usd",
            "decode_cost_usd",
        ):
            result[name] = float(result[name])
        result["kv_cost_usd"] = float(result["kv_cost_usd"])
        result["cost_usd"] = result["prefill_cost_usd"] + result["decode_cost_usd"] + result["kv_cost_usd"]
        result["gpu_seconds"] = result["prefill_gpu_seconds"] + result["decode_gpu_seconds"]
        return result

    async def totals(self) -> dict[str, Any]:
        """Requests by status, spend and GPU-seconds by phase, tokens, events and errors."""
        query = sa.select(_rc.status, sa.func.count().label("requests"), *_sums()).group_by(_rc.status)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
            event_count = await conn.scalar(sa.select(sa.func.count()).select_from(events))
            error_count = await conn.scalar(sa.select(sa.func.count()).select_from(ledger_errors))
        by_status = {status: 0 for status in STATUSES}
        sums = _zero_sums()
        for row in rows:
            by_status[row.status] = int(row.requests)
            for name, value in _sums_of(row).items():
                sums[name] += value
        return {
            "requests": by_status,
            "requests_total": sum(by_status.values()),
            **_with_derived(sums),
            "events": int(event_count or 0),
            "errors": int(error_count or 0),
        }

    async def by_tenant(self) -> list[dict[str, Any]]:
        """Per tenant: requests by status, spend, GPU-seconds and tokens; biggest spender first."""
        query = sa.select(
            _rc.tenant,
            sa.func.count().label("requests"),
            *(sa.func.count().filter(_rc.status == s).label(s) for s in STATUSES),
            *_sums(),
        ).group_by(_rc.tenant)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        tenants = [
            {
                "tenant": row.tenant,
                "requests": int(row.requests),
                **{status: int(row._mapping[status]) for status in STATUSES},
                **_with_derived(_sums_of(row)),
            }
            for row in rows
        ]
        tenants.sort(key=lambda t: (-t["spend_usd"], t["tenant"]))
        return tenants

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
                query = self._task_queries[size] = _Compiled(
                    _tasks_query(size), self.engine.dialect, [f"key{i}" for i in range(size)]
                )
            out.extend(_facts(row) for row in await query.execute(conn, tuple(chunk)))
        return out

    async def quiet_workflows(self, after: float, until: float) -> list[TaskFacts]:
        """Workflows whose last event is in (`after`, `until`]: those a sweep at `until` + the
        task timeout finds newly abandoned, unless they ended already."""
        query = sa.select(*_TASK_FACT_COLUMNS).where(
            _tc.task_key.in_(_tasks_with_events(after, until, workflows_only=True)),
            _tc.kind == _WORKFLOW,
            _tc.last_event_at > after,
            _tc.last_event_at <= until,
        )
        async with self.engine.connect() as conn:
            return [_facts(row) for row in await conn.execute(query)]

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

    def _upsert_accounts_statement(self) -> Any:
        """A sampled worker's pool, start and idle account; its busy sums are the batches'."""
        stmt = self._insert(workers)
        excluded = stmt.excluded
        updates = {
            name: excluded[name]
            for name in (
                "pool",
                "gpu_type",
                "started_at",
                "idle_covered_until",
                "idle_busy_counted_s",
                "idle_debt_s",
                "last_seen_at",
                "updated_at",
            )
        }
        return stmt.on_conflict_do_update(index_elements=[_wc.worker_id], set_=updates)

    def _upsert_idle_statement(self) -> Any:
        stmt = self._insert(idle_spend)
        excluded = stmt.excluded
        updates: dict[str, Any] = {
            name: _ic[name] + excluded[name]
            for name in (
                "provisioned_gpu_seconds",
                "busy_gpu_seconds",
                "idle_gpu_seconds",
                "idle_cost_usd",
                "samples",
            )
        }
        updates["updated_at"] = excluded.updated_at
        keys = [_ic.window_start, _ic.pool, _ic.gpu_type]
        return stmt.on_conflict_do_update(index_elements=keys, set_=updates)

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
        `now` with a task timeout of `task_timeout_s`."""
        if by not in (None, *DIMENSIONS):
            raise ValueError(f"unknown report dimension {by!r}: one of {', '.join(DIMENSIONS)}")
        statuses = self._task_statuses(now, task_timeout_s)
        async with self.engine.connect() as conn:
            fleet = await self._figures(conn, statuses, since, None)
            groups: list[dict[str, Any]] = []
            if by == "workflow":
                groups = await self._workflows(conn, now, task_timeout_s, since, limit)
            elif by is not None:
                by_key = await self._figures(conn, statuses, since, by)
                groups = [{by: key, **figures.as_dict()} for key, figures in by_key.items()]
                groups.sort(key=lambda g: (-g["spend_usd"], str(g[by])))
            error_query = sa.select(sa.func.count()).select_from(ledger_errors)
            if since is not None:
                error_query = error_query.where(ledger_errors.c.occurred_at >= since)
            errors = int(await conn.scalar(error_query) or 0)
        return {
            "since": since,
            "until": now,
            "task_timeout_s": task_timeout_s,
            "fleet": {**fleet[None].as_dict(), "errors": errors},
            "by": by,
            "groups": groups,
        }

    async def figures(
        self,
        *,
        now: float,
        task_timeout_s: float,
        since: float | None = None,
        by: Literal["tenant", "pool"] | None = None,
    ) -> dict[Any, Figures]:
        """`report`'s figures as `Figures`, by tenant or pool (or the fleet's, under None)."""
        statuses = self._task_statuses(now, task_timeout_s)
        async with self.engine.connect() as conn:
            return await self._figures(conn, statuses, since, by)

    def _task_statuses(self, now: float, timeout_s: float) -> Any:
        """Every task's status and failure reason as of `now`: tasks.py's rules, in SQL."""
        now_ = sa.literal(now, sa.Double)
        timeout_ = sa.literal(timeout_s, sa.Double)
        quiet = (now_ - _tc.last_event_at) > timeout_
        quiet_success = sa.and_(quiet, _tc.steps.is_(None), _tc.max_completed_step > 0)
        missed = _tc.deadline_misses > 0
        final = _tc.final_completed_at.is_not(None)
        failed_step = _tc.max_failed_step > _tc.max_completed_step
        status = sa.case(
            (missed, _literal("failed")),
            (final, _literal("succeeded")),
            (failed_step, _literal("failed")),
            (quiet_success, _literal("succeeded")),
            (quiet, _literal("failed")),
            else_=_literal("running"),
        )
        reason = sa.case(
            (missed, _literal("deadline_missed")),
            (final, sa.null()),
            (failed_step, _literal("step_failed")),
            (quiet_success, sa.null()),
            (quiet, _literal("abandoned")),
            else_=sa.null(),
        )
        return sa.select(
            _tc.task_key,
            _tc.tenant,
            _tc.last_event_at,
            status.label("status"),
            reason.label("reason"),
        ).subquery("task_status")

    async def _figures(
        self, conn: AsyncConnection, statuses: Any, since: float | None, by: Dimension | None
    ) -> dict[Any, Figures]:
        """Figures by `by`'s key (None: the fleet, under the key None)."""
        out: dict[Any, Figures] = {}

        def figures_of(key: Any) -> Figures:
            found = out.get(key)
            if found is None:
                found = out[key] = Figures(
                    idle_spend_usd=None if by == "tenant" else 0.0,
                    idle_gpu_seconds=None if by == "tenant" else 0.0,
                    provisioned_gpu_seconds=None if by == "tenant" else 0.0,
                )
            return found

        if by is None:
            figures_of(None)
        pool = sa.func.coalesce(_wc.pool, _UNKNOWN_POOL)
        key = {None: sa.null(), "tenant": _ec.tenant, "pool": pool}[by]
        # Spend, by when it was incurred; waste: that of tasks failed as of now.
        cost = sa.func.coalesce(_ec.cost_usd, 0.0) + sa.func.coalesce(_ec.kv_cost_usd, 0.0)
        failed = statuses.c.status == _literal("failed")
        sources = events.join(statuses, statuses.c.task_key == _ec.task_key)
        if by == "pool":
            sources = sources.outerjoin(workers, _wc.worker_id == _ec.worker_id)
        spend = (
            sa.select(
                key.label("key"),
                sa.func.sum(_ec.cost_usd).label("gpu"),
                sa.func.sum(_ec.kv_cost_usd).label("kv"),
                sa.func.sum(_ec.gpu_seconds).label("gpu_seconds"),
                sa.func.sum(sa.case((failed, cost), else_=0.0)).label("wasted"),
            )
            .select_from(sources)
            .where(_ec.gpu_seconds.is_not(None))
        )
        if since is not None:
            spend = spend.where(_ec.occurred_at >= since)
        if by is not None:
            spend = spend.group_by(key)
        for row in await conn.execute(spend):
            if by is None and row.gpu is None and row.gpu_seconds is None:
                continue
            figures = figures_of(row.key)
            figures.gpu_spend_usd += float(row.gpu or 0.0)
            figures.kv_transfer_spend_usd += float(row.kv or 0.0)
            figures.gpu_seconds += float(row.gpu_seconds or 0.0)
            figures.wasted_spend_usd += float(row.wasted or 0.0)
        # Tasks, by when they saw their last event.
        if by == "pool":
            touched = (
                sa.select(_ec.task_key, pool.label("key"))
                .distinct()
                .select_from(events.outerjoin(workers, _wc.worker_id == _ec.worker_id))
                .where(_ec.gpu_seconds.is_not(None))
            )
            if since is not None:
                touched = touched.where(_ec.occurred_at >= since)
            touched_sq = touched.subquery("touched")
            counts = sa.select(
                touched_sq.c.key, statuses.c.status, statuses.c.reason, sa.func.count().label("n")
            ).select_from(touched_sq.join(statuses, statuses.c.task_key == touched_sq.c.task_key))
            group = [touched_sq.c.key]
        else:
            task_key = statuses.c.tenant if by == "tenant" else sa.null()
            counts = sa.select(
                task_key.label("key"), statuses.c.status, statuses.c.reason, sa.func.count().label("n")
            )
            group = [statuses.c.tenant] if by == "tenant" else []
        if since is not None:
            counts = counts.where(
                statuses.c.task_key.in_(_tasks_with_events(since)), statuses.c.last_event_at >= since
            )
        counts = counts.group_by(*group, statuses.c.status, statuses.c.reason)
        for count in await conn.execute(counts):
            figures_of(count.key).add_tasks(count.status, count.reason, int(count.n))
        # Idle time, by pool (the fleet's is every pool's).
        if by != "tenant":
            idle = sa.select(
                (_ic.pool if by == "pool" else sa.null()).label("key"),
                sa.func.sum(_ic.idle_cost_usd).label("cost"),
                sa.func.sum(_ic.idle_gpu_seconds).label("seconds"),
                sa.func.sum(_ic.provisioned_gpu_seconds).label("provisioned"),
            )
            if since is not None:
                idle = idle.where(_ic.window_start + _ic.window_s > since)
            if by == "pool":
                idle = idle.group_by(_ic.pool)
            for window in await conn.execute(idle):
                if window.cost is None:
                    continue
                figures = figures_of(window.key)
                figures.idle_spend_usd = (figures.idle_spend_usd or 0.0) + float(window.cost)
                figures.idle_gpu_seconds = (figures.idle_gpu_seconds or 0.0) + float(window.seconds)
                provisioned = (figures.provisioned_gpu_seconds or 0.0) + float(window.provisioned)
                figures.provisioned_gpu_seconds = provisioned
        return out

    async def _workflows(
        self, conn: AsyncConnection, now: float, timeout_s: float, since: float | None, limit: int
    ) -> list[dict[str, Any]]:
        """The latest workflows (by last event), with their whole spend and status."""
        query = sa.select(*_TASK_FACT_COLUMNS).where(_tc.kind == _WORKFLOW)
        if since is not None:
            query = query.where(_tc.task_key.in_(_tasks_with_events(since)), _tc.last_event_at >= since)
        query = query.order_by(_tc.last_event_at.desc(), _tc.task_key).limit(limit)
        out = []
        for row in await conn.execute(query):
            facts = _facts(row)
            status, reason = status_of(facts, now, timeout_s)
            out.append(
                {
                    "workflow": facts.workflow_id,
                    "tenant": facts.tenant,
                    "status": status,
                    "reason": reason,
                    "steps": facts.steps,
                    "steps_completed": facts.max_completed_step,
                    "completions": facts.completions,
                    "failures": facts.failures,
                    "deadline_misses": facts.deadline_misses,
                    "spend_usd": facts.spend_usd,
                    "gpu_spend_usd": facts.gpu_cost_usd,
                    "kv_transfer_spend_usd": facts.kv_cost_usd,
                    "wasted_spend_usd": facts.spend_usd if status == "failed" else 0.0,
                    "gpu_seconds": facts.gpu_seconds,
                    "first_event_at": facts.first_event_at,
                    "last_event_at": facts.last_event_at,
                }
            )
        return out


# ---------------------------------------------------------------- helpers

KNOWN_IDS_CHUNK = 512  # event ids per SELECT of those already recorded


def _tasks_with_events(after: float, until: float | None = None, *, workflows_only: bool = False) -> Any:
    """The tasks with an event in [`after`, ∞), or in (`after`, `until`]: those whose last event
    is there are among them. ``tasks`` has no index on its last event (every batch would rewrite
    it): a window of tasks is found through the events' time index instead."""
    query = sa.select(_ec.task_key).where(_ec.task_key.is_not(None))
    if until is None:
        query = query.where(_ec.occurred_at >= after)
    else:
        query = query.where(_ec.occurred_at > after, _ec.occurred_at <= until)
    if workflows_only:
        query = query.where(_ec.task_key.startswith(WORKFLOW_KEY_PREFIX, autoescape=True))
    return query


def _tasks_query(size: int) -> sa.Select[Any]:
    return sa.select(*_TASK_FACT_COLUMNS).where(
        _tc.task_key.in_([sa.bindparam(f"key{i}", type_=sa.Text) for i in range(size)])
    )


def _known_event_ids_query(size: int) -> sa.Select[Any]:
    return sa.select(events.c.event_id).where(
        events.c.event_id.in_([sa.bindparam(f"id{i}", type_=sa.Text) for i in range(size)])
    )


# Columns a delta adds to an existing row; the others it replaces or fills (see fold.py).
_ADDED = (
    "prefill_gpu_seconds",
    "decode_gpu_seconds",
    "prefill_cost_usd",
    "decode_cost_usd",
    "kv_transfer_bytes",
    "kv_cost_usd",
)
_TASK_ADDED = (
    "deadline_misses",
    "completions",
    "failures",
    "gpu_seconds",
    "gpu_cost_usd",
    "kv_cost_usd",
    "kv_transfer_bytes",
)


# Rows go to `_Compiled` as tuples of these fields' values, in this order.
_EVENT_FIELDS = (*EVENT_ROW_FIELDS, "recorded_at")
# A delta's fields (the request_costs columns: has_* are told by them, see the upsert), then
# updated_at.
_DELTA_FIELDS = tuple(
    f.name for f in dataclasses.fields(RequestDelta) if f.name not in ("has_prefill", "has_decode")
)
_REQUEST_FIELDS = (*_DELTA_FIELDS, "updated_at")
_TASK_DELTA_FIELDS = tuple(f.name for f in dataclasses.fields(TaskDelta))
_TASK_FIELDS = (*_TASK_DELTA_FIELDS, "updated_at")
_BUSY_DELTA_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerBusy))
_BUSY_FIELDS = (*_BUSY_DELTA_FIELDS, "updated_at")
_ERROR_FIELDS = ("event_id", "request_id", "reason", "occurred_at")
_ACCOUNT_FIELDS = (
    "worker_id",
    "pool",
    "gpu_type",
    "started_at",
    "idle_covered_until",
    "idle_busy_counted_s",
    "idle_debt_s",
    "last_seen_at",
    "updated_at",
)
_IDLE_FIELDS = (
    "window_start",
    "pool",
    "gpu_type",
    "window_s",
    "provisioned_gpu_seconds",
    "busy_gpu_seconds",
    "idle_gpu_seconds",
    "idle_cost_usd",
    "samples",
    "updated_at",
)

Dimension = Literal["tenant", "pool", "workflow"]
DIMENSIONS: tuple[Dimension, ...] = ("tenant", "pool", "workflow")

_TASK_FACT_COLUMNS = tuple(_tc[f.name] for f in dataclasses.fields(TaskFacts))
_WORKFLOW: sa.ColumnElement[str] = sa.literal_column("'workflow'", sa.Text)
# The pool of a worker whose heartbeat the ledger never saw.
UNKNOWN_POOL = "unknown"
_UNKNOWN_POOL: sa.ColumnElement[str] = sa.literal_column(f"'{UNKNOWN_POOL}'", sa.Text)


def _literal(value: str) -> sa.ColumnElement[str]:
    """An inlined string constant: the same SQL wherever it appears (GROUP BY matches)."""
    return sa.literal_column(f"'{value}'", sa.Text)


def _facts(row: Sequence[Any]) -> TaskFacts:
    """A ``tasks`` row (its `_TASK_FACT_COLUMNS`, in order) as facts. Both drivers return these
    columns as str, int and float already (SQLite may give an int for a whole REAL)."""
    final = row[6]
    return TaskFacts(
        row[0],
        row[1],
        row[2],
        row[3],
        row[4],
        row[5],
        None if final is None else float(final),
        row[7],
        row[8],
        row[9],
        float(row[10]),
        float(row[11]),
        float(row[12]),
        float(row[13]),
        float(row[14]),
    )


_delta_values: Callable[[RequestDelta], tuple[Any, ...]] = operator.attrgetter(*_DELTA_FIELDS)
_task_values: Callable[[TaskDelta], tuple[Any, ...]] = operator.attrgetter(*_TASK_DELTA_FIELDS)
_busy_values: Callable[[WorkerBusy], tuple[Any, ...]] = operator.attrgetter(*_BUSY_DELTA_FIELDS)


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


# Inlined rather than bound, so that the upsert's only parameters are the rows' fields.
_RUNNING: sa.ColumnElement[str] = sa.literal_column("'running'", sa.Text)
_COMPLETED: sa.ColumnElement[str] = sa.literal_column("'completed'", sa.Text)


def _driver_parameter_order(compiled: Any) -> Sequence[str] | None:
    """The names of the parameters in the order the driver takes them; None for named ones."""
    return compiled.positiontup  # type: ignore[no-any-return]


class _Compiled:
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
    """

    def __init__(self, statement: Any, dialect: sa.Dialect, fields: Sequence[str]) -> None:
        column_keys = None
        if isinstance(statement, sa.Insert):
            # The fields' columns only, and no RETURNING of generated keys: nothing reads them.
            column_keys = [name for name in fields if name in statement.table.c]
            statement = statement.inline()
        self.statement = statement
        self.fields = tuple(fields)
        compiled = statement.compile(dialect=dialect, column_keys=column_keys)
        names = _driver_parameter_order(compiled)
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


_FLOAT_SUMS = (
    "prefill_cost_usd",
    "decode_cost_usd",
    "kv_cost_usd",
    "prefill_gpu_seconds",
    "decode_gpu_seconds",
)
_INT_SUMS = ("prompt_tokens", "cached_tokens", "completion_tokens", "kv_transfer_bytes")


def _sums() -> list[sa.ColumnElement[Any]]:
    return [sa.func.coalesce(sa.func.sum(_rc[name]), 0).label(name) for name in (*_FLOAT_SUMS, *_INT_SUMS)]


def _zero_sums() -> dict[str, float]:
    return {name: 0 for name in (*_FLOAT_SUMS, *_INT_SUMS)}


def _sums_of(row: sa.Row[Any]) -> dict[str, float]:
    # PostgreSQL's SUM of integers is NUMERIC (Decimal): normalise to int and float.
    values: dict[str, float] = {name: float(row._mapping[name]) for name in _FLOAT_SUMS}
    values.update({name: int(row._mapping[name]) for name in _INT_SUMS})
    return values


def _with_derived(sums: dict[str, float]) -> dict[str, float]:
    return {
        "spend_usd": sums["prefill_cost_usd"] + sums["decode_cost_usd"] + sums["kv_cost_usd"],
        "prefill_spend_usd": sums["prefill_cost_usd"],
        "decode_spend_usd": sums["decode_cost_usd"],
        "kv_transfer_spend_usd": sums["kv_cost_usd"],
        "gpu_seconds": sums["prefill_gpu_seconds"] + sums["decode_gpu_seconds"],
        "prefill_gpu_seconds": sums["prefill_gpu_seconds"],
        "decode_gpu_seconds": sums["decode_gpu_seconds"],
        **{name: sums[name] for name in _INT_SUMS},
    }


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
