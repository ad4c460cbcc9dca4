"""`ripplemesh top`: a live view of a running mesh, for a terminal without Grafana at hand.

Functional core, imperative shell:

- the pure part: `RecentEvents` (a sliding window of the rejections and prefills seen on the
  bus), `build_snapshot` (heartbeats, the autoscaler's latest plan, that window and the ledger's
  figures in, a `TopSnapshot` out) and `render` (a snapshot and the clock in, rich tables out);
- `MeshWatch`, the I/O: one NATS connection that reads the WORKERS bucket (each worker's
  `WorkerState` heartbeat), the latest `ScalingDecision` kept on the LIFECYCLE stream, the
  `RequestRejected` and `PrefillCompleted` events of the last `window_s` (ordered consumers on
  LIFECYCLE, started that far back), and, when it knows the ledger's HTTP address, its report.

The ledger publishes no totals on NATS (only each workflow's spend, in WORKFLOW_SPEND): the
cost per successful task comes from its ``GET /v1/ledger/report``, the same figures as its
Prometheus gauges (over the last hour).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from rich.console import Group, JustifyMethod, RenderableType
from rich.table import Table
from rich.text import Text

from schemas.events import PrefillCompleted, RequestRejected, ScalingDecision, WorkerState
from schemas.subjects import LIFECYCLE, WORKERS, event_subject
from services.mesh.bus import kv_keys
from services.router.policy import LIVENESS_S

# A heartbeat older than this is stale: the router passes the worker over (its liveness bound).
STALE_AFTER_S = LIVENESS_S
# What the ledger's figures cover (its Prometheus gauges' window) and how often top asks.
LEDGER_WINDOW = "1h"
LEDGER_EVERY_S = 5.0
DEFAULT_WINDOW_S = 300.0

# ---------------------------------------------------------------- the pure part


@dataclass(slots=True)
class RecentEvents:
    """The rejections and prefills of the last `window_s` seconds, fed one decoded event at a
    time (duplicates, by event id, count once). Pure: the clock is passed in."""

    window_s: float = DEFAULT_WINDOW_S
    _rejections: deque[tuple[float, str, str]] = field(default_factory=deque)  # (at, id, reason)
    _prefills: deque[tuple[float, str, str, int, int]] = field(default_factory=deque)
    _seen: set[str] = field(default_factory=set)

    def add(self, event: RequestRejected | PrefillCompleted) -> None:
        if event.event_id in self._seen:
            return
        self._seen.add(event.event_id)
        if isinstance(event, RequestRejected):
            self._rejections.append((event.occurred_at, event.event_id, event.reason))
        else:
            self._prefills.append(
                (event.occurred_at, event.event_id, event.worker_id, event.prompt_tokens, event.cached_tokens)
            )

    def prune(self, now: float) -> None:
        """Forget what happened before the window (events arrive roughly in time order)."""
        since = now - self.window_s
        for queue in (self._rejections, self._prefills):
            while queue and queue[0][0] < since:
                self._seen.discard(queue.popleft()[1])

    def rejections(self, now: float) -> dict[str, int]:
        since = now - self.window_s
        return dict(Counter(reason for at, _, reason in self._rejections if at >= since))

    def hit_rates(self, now: float) -> dict[str, tuple[float, int]]:
        """By worker: the share of its prefills' prompt tokens found cached, and how many prefills."""
        since = now - self.window_s
        prompt: Counter[str] = Counter()
        cached: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for at, _, worker, prompt_tokens, cached_tokens in self._prefills:
            if at >= since:
                prompt[worker] += prompt_tokens
                cached[worker] += cached_tokens
                count[worker] += 1
        return {w: (cached[w] / prompt[w] if prompt[w] else 0.0, count[w]) for w in count}


@dataclass(frozen=True, slots=True)
class WorkerRow:
    state: WorkerState
    hit_rate: float | None  # of its prefills in the window; None: it prefilled nothing there
    prefills: int = 0


@dataclass(frozen=True, slots=True)
class PoolRow:
    pool: str
    model: str
    role: str
    live: int  # heart-beating within STALE_AFTER_S and not draining
    draining: int
    stale: int
    desired: int | None  # the autoscaler's latest plan; None: no plan names the pool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class LedgerFigures:
    """The fleet's figures of merit from the ledger's report."""

    window: str
    cost_per_successful_task_usd: float | None
    spend_usd: float
    idle_spend_usd: float
    wasted_spend_usd: float
    succeeded: int
    failed: int
    running: int

    @classmethod
    def from_report(cls, report: Mapping[str, Any], window: str = LEDGER_WINDOW) -> LedgerFigures:
        """From ``GET /v1/ledger/report``'s JSON (its ``fleet``); KeyError/TypeError/ValueError
        on anything else."""
        fleet = report["fleet"]
        tasks = fleet["tasks"]
        cost = fleet.get("cost_per_successful_task_usd")
        return cls(
            window=window,
            cost_per_successful_task_usd=None if cost is None else float(cost),
            spend_usd=float(fleet["spend_usd"]),
            idle_spend_usd=float(fleet.get("idle_spend_usd") or 0.0),
            wasted_spend_usd=float(fleet.get("wasted_spend_usd") or 0.0),
            succeeded=int(tasks["succeeded"]),
            failed=int(tasks["failed"]),
            running=int(tasks["running"]),
        )


@dataclass(frozen=True, slots=True)
class TopSnapshot:
    """What one frame shows: each worker's heartbeat, each pool's desired and actual replicas,
    the rejections of the window by reason and the ledger's cost per successful task."""

    taken_at: float
    source: str  # where it was read (the NATS URL)
    workers: tuple[WorkerRow, ...]
    pools: tuple[PoolRow, ...]
    scaling: ScalingDecision | None
    rejections: Mapping[str, int]
    window_s: float
    cost: LedgerFigures | None = None
    cost_note: str | None = None  # why there are no figures
    notes: tuple[str, ...] = ()  # what could not be read


def is_stale(state: WorkerState, now: float) -> bool:
    return now - state.occurred_at > STALE_AFTER_S


def build_snapshot(
    states: Iterable[WorkerState],
    *,
    now: float,
    recent: RecentEvents | None = None,
    scaling: ScalingDecision | None = None,
    cost: LedgerFigures | None = None,
    cost_note: str | None = None,
    source: str = "",
    notes: Sequence[str] = (),
) -> TopSnapshot:
    """The frame's contents: workers by pool and id; a pool for each pool heart-beating or
    named by the latest plan."""
    hit_rates = recent.hit_rates(now) if recent is not None else {}
    workers = tuple(
        WorkerRow(s, *hit_rates.get(s.worker_id, (None, 0)))
        for s in sorted(states, key=lambda s: (s.pool, s.worker_id))
    )
    plans = {p.pool: p for p in scaling.pools} if scaling is not None else {}
    names = sorted({w.state.pool for w in workers} | set(plans))
    pools = []
    for name in names:
        members = [w.state for w in workers if w.state.pool == name]
        plan = plans.get(name)
        first = members[0] if members else None
        stale = sum(1 for s in members if is_stale(s, now))
        draining = sum(1 for s in members if s.draining and not is_stale(s, now))
        pools.append(
            PoolRow(
                pool=name,
                model=plan.model if plan else first.model if first else "",
                role=plan.role if plan else first.role if first else "",
                live=len(members) - stale - draining,
                draining=draining,
                stale=stale,
                desired=plan.desired if plan else None,
                reason=plan.reason if plan else "",
            )
        )
    return TopSnapshot(
        taken_at=now,
        source=source,
        workers=workers,
        pools=tuple(pools),
        scaling=scaling,
        rejections=dict(recent.rejections(now)) if recent is not None else {},
        window_s=recent.window_s if recent is not None else DEFAULT_WINDOW_S,
        cost=cost,
        cost_note=cost_note,
        notes=tuple(notes),
    )


def usd(value: float) -> str:
    return f"${value:,.2f}" if abs(value) >= 1 else f"${value:.3g}"


def _window(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:g} s"


def _worker_state(state: WorkerState, now: float) -> Text:
    stale = is_stale(state, now)
    if state.draining and stale:
        return Text("draining, stale", style="red")
    if stale:
        return Text("stale", style="red")
    if state.draining:
        return Text("draining", style="yellow")
    return Text("serving", style="green")


def _heartbeat(state: WorkerState, now: float) -> Text:
    age = max(0.0, now - state.occurred_at)
    if is_stale(state, now):
        return Text(f"{age:.1f} s ago (stale)", style="bold red")
    return Text(f"{age:.1f} s ago")


def _workers_table(snapshot: TopSnapshot, now: float) -> Table:
    table = Table(title=f"Workers ({len(snapshot.workers)})", title_justify="left", expand=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("worker", "left"),
        ("pool", "left"),
        ("model", "left"),
        ("state", "left"),
        ("running", "right"),
        ("queue", "right"),
        ("KV used", "right"),
        ("cached", "right"),
        ("hit rate", "right"),
        ("tok/s", "right"),
        ("heartbeat", "right"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    for row in snapshot.workers:
        s = row.state
        share = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        hit = "-" if row.hit_rate is None else f"{row.hit_rate:.0%} of {row.prefills}"
        table.add_row(
            s.worker_id,
            s.pool,
            s.model,
            _worker_state(s, now),
            str(s.running),
            str(s.queue_depth),
            f"{s.kv_blocks_used}/{s.kv_blocks_total} {share:.0%}",
            str(s.kv_blocks_cached),
            hit,
            f"{s.tokens_per_s:.0f}",
            _heartbeat(s, now),
        )
    if not snapshot.workers:
        table.caption = Text("no worker heart-beats in the WORKERS bucket", style="yellow")
        table.caption_justify = "left"
    return table


def _pools_table(snapshot: TopSnapshot, now: float) -> Table:
    plan = snapshot.scaling
    if plan is None:
        title = "Pools (no autoscaler plan on the bus yet)"
    else:
        title = (
            f"Pools (autoscaler plan {max(0.0, now - plan.occurred_at):.0f} s ago, {plan.mode} mode, "
            f"{usd(plan.cost_per_hour)}/h planned)"
        )
    table = Table(title=title, title_justify="left", expand=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("pool", "left"),
        ("model", "left"),
        ("role", "left"),
        ("desired", "right"),
        ("actual", "right"),
        ("draining", "right"),
        ("stale", "right"),
        ("plan", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "plan")
    for pool in snapshot.pools:
        desired = "-" if pool.desired is None else str(pool.desired)
        off = pool.desired is not None and pool.desired != pool.live
        table.add_row(
            pool.pool,
            pool.model,
            pool.role,
            desired,
            Text(str(pool.live), style="yellow" if off else ""),
            str(pool.draining),
            Text(str(pool.stale), style="red" if pool.stale else ""),
            Text(pool.reason, style="dim"),
        )
    return table


def _rejections_line(snapshot: TopSnapshot) -> Text:
    total = sum(snapshot.rejections.values())
    head = f"Rejected in the last {_window(snapshot.window_s)}: {total}"
    if not total:
        return Text(head + " (none)")
    parts = ", ".join(
        f"{reason} {n}" for reason, n in sorted(snapshot.rejections.items(), key=lambda x: -x[1])
    )
    return Text(f"{head} ({parts})", style="yellow")


def _cost_line(snapshot: TopSnapshot) -> Text:
    cost = snapshot.cost
    if cost is None:
        return Text(f"Cost per successful task: unknown ({snapshot.cost_note or 'no ledger'})", style="dim")
    per_task = (
        usd(cost.cost_per_successful_task_usd)
        if cost.cost_per_successful_task_usd is not None
        else "- (no task has succeeded yet)"
    )
    return Text(
        f"Cost per successful task (ledger, last {cost.window}): {per_task}; tasks {cost.succeeded} "
        f"succeeded, {cost.failed} failed, {cost.running} running; spend {usd(cost.spend_usd)} "
        f"(idle {usd(cost.idle_spend_usd)}, wasted {usd(cost.wasted_spend_usd)})"
    )


def render(snapshot: TopSnapshot, now: float) -> RenderableType:
    """One frame: a header, the workers, the pools, the rejections and the cost."""
    moment = datetime.datetime.fromtimestamp(snapshot.taken_at).strftime("%H:%M:%S")
    header = Text.assemble(("ripplemesh top", "bold"), f"  {snapshot.source}  at {moment}")
    parts: list[RenderableType] = [
        header,
        _workers_table(snapshot, now),
        _pools_table(snapshot, now),
        _rejections_line(snapshot),
        _cost_line(snapshot),
    ]
    parts += [Text(note, style="yellow") for note in snapshot.notes]
    return Group(*parts)


# ---------------------------------------------------------------- the I/O


class TopError(Exception):
    """The mesh could not be read at all (NATS unreachable, refused credentials): one line."""


_state_decoder = msgspec.json.Decoder(WorkerState)
_scaling_decoder = msgspec.json.Decoder(ScalingDecision)
_window_decoder: msgspec.json.Decoder[RequestRejected | PrefillCompleted] = msgspec.json.Decoder(
    RequestRejected | PrefillCompleted
)
_WINDOW_SUBJECTS = (event_subject("rejected"), event_subject("prefill_completed"))


class MeshWatch:
    """Top's connection to the mesh; `open` it, `catch_up`, then `snapshot` once per frame.

    Every NATS and HTTP call is bounded by `timeout_s`; what fails to be read becomes a note on
    the frame rather than an error (except the connection itself, `TopError`).
    """

    def __init__(
        self,
        nc: Any,
        source: str,
        *,
        window_s: float,
        ledger_url: str | None,
        ledger_note: str | None,
        timeout_s: float,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=timeout_s)
        self.source = source
        self.timeout_s = timeout_s
        self.recent = RecentEvents(window_s)
        self.ledger_url = ledger_url.rstrip("/") if ledger_url else None
        self.cost: LedgerFigures | None = None
        self.cost_note = ledger_note
        self._cost_at = -float("inf")
        self._seen_seq: dict[str, int] = {}
        self._subscriptions: list[Any] = []
        self._notes: dict[str, str] = {}

    @classmethod
    async def open(
        cls,
        url: str,
        connect_options: Mapping[str, Any],
        *,
        window_s: float = DEFAULT_WINDOW_S,
        ledger_url: str | None = None,
        ledger_note: str | None = None,
        timeout_s: float = 3.0,
    ) -> MeshWatch:
        """Connect (TopError within about `timeout_s` when no server answers) and subscribe to
        the window's events."""
        import nats
        from nats.aio.client import Client

        from services.mesh.bus import nats_servers

        errors: list[BaseException] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        options: dict[str, Any] = {
            "name": "ripplemesh-top",
            "connect_timeout": min(2.0, timeout_s),
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,  # once connected, a lost node is a note on the frame
            "reconnect_time_wait": 0.25,
            "error_cb": on_error,
            **connect_options,
        }
        nc = Client()
        try:
            await asyncio.wait_for(nc.connect(nats_servers(url), **options), timeout=timeout_s)
        except (TimeoutError, OSError, ValueError, nats.errors.Error) as exc:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), timeout_s)
            cause = errors[-1] if errors else exc
            if "authorization" in str(cause).lower():
                hint = "the NATS user was refused: --nats-credentials, or --data-dir of a `ripplemesh up`"
            else:
                hint = "is the mesh running? --nats-url, or --data-dir of a `ripplemesh up`"
            raise TopError(f"cannot reach NATS at {url}: {_describe(cause)} ({hint})") from None
        watch = cls(
            nc, url, window_s=window_s, ledger_url=ledger_url, ledger_note=ledger_note, timeout_s=timeout_s
        )
        await watch._subscribe()
        return watch

    async def close(self) -> None:
        for sub in self._subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.close(), self.timeout_s)

    async def _subscribe(self) -> None:
        """Ordered consumers on LIFECYCLE from `window_s` back, for rejections and prefills."""
        from nats.js.api import ConsumerConfig, DeliverPolicy
        from nats.js.errors import NotFoundError

        start = datetime.datetime.fromtimestamp(time.time() - self.recent.window_s, tz=datetime.UTC)
        for subject in _WINDOW_SUBJECTS:

            async def on_message(msg: Any, subject: str = subject) -> None:
                self._seen_seq[subject] = max(self._seen_seq.get(subject, 0), msg.metadata.sequence.stream)
                try:
                    self.recent.add(_window_decoder.decode(msg.data))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass  # not ours to judge: the ledger dead-letters it

            try:
                sub = await self.js.subscribe(
                    subject,
                    stream=LIFECYCLE.name,
                    ordered_consumer=True,
                    deliver_policy=DeliverPolicy.BY_START_TIME,
                    config=ConsumerConfig(opt_start_time=start),
                    cb=on_message,
                )
            except NotFoundError:
                self._notes["lifecycle"] = f"no {LIFECYCLE.name} stream: no rejections or hit rates to show"
            except Exception as exc:
                self._notes[subject] = f"cannot read {subject} on {LIFECYCLE.name}: {_describe(exc)}"
            else:
                self._subscriptions.append(sub)

    async def catch_up(self, timeout_s: float | None = None) -> None:
        """Wait (at most `timeout_s`) until the window's events already stored are all read."""
        targets: dict[str, int] = {}
        since = time.time() - self.recent.window_s
        for subject in _WINDOW_SUBJECTS:
            try:
                last = await self.js.get_last_msg(LIFECYCLE.name, subject)
            except Exception:
                continue  # none yet (or unreadable: a note already)
            if last.seq and last.time is not None and last.time.timestamp() >= since:
                targets[subject] = last.seq
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        while time.monotonic() < deadline:
            if all(self._seen_seq.get(s, 0) >= seq for s, seq in targets.items()):
                return
            await asyncio.sleep(0.02)
        self._notes["catch-up"] = "the window's events were not all read in time: counts may be short"

    async def _workers(self) -> list[WorkerState]:
        from nats.js.errors import BucketNotFoundError, KeyNotFoundError

        for stale_note in [n for n in self._notes if n.startswith("worker ")]:
            del self._notes[stale_note]
        try:
            kv = await self.js.key_value(WORKERS.bucket)
            keys = await asyncio.wait_for(kv_keys(self.js, WORKERS.bucket), self.timeout_s)
        except BucketNotFoundError:
            self._notes["bucket"] = f"no {WORKERS.bucket} bucket: has any service of the mesh started?"
            return []
        self._notes.pop("bucket", None)

        async def get(key: str) -> Any:
            try:
                return await kv.get(key)
            except KeyNotFoundError:
                return None  # gone meanwhile

        states = []
        for key, entry in zip(keys, await asyncio.gather(*(get(k) for k in keys)), strict=True):
            if entry is None or not entry.value:
                continue
            try:
                states.append(_state_decoder.decode(entry.value))
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._notes[f"worker {key}"] = f"worker {key}: its heartbeat does not decode"
        return states

    async def _scaling(self) -> ScalingDecision | None:
        from nats.js.errors import NotFoundError

        try:
            msg = await self.js.get_last_msg(LIFECYCLE.name, event_subject("scaling"))
        except NotFoundError:
            return None
        if not msg.data:
            return None
        try:
            return _scaling_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._notes["scaling"] = "the latest ScalingDecision does not decode"
            return None

    async def _ledger(self) -> None:
        """The ledger's report, every LEDGER_EVERY_S at most."""
        import httpx

        if self.ledger_url is None or time.monotonic() - self._cost_at < LEDGER_EVERY_S:
            return
        self._cost_at = time.monotonic()
        url = f"{self.ledger_url}/v1/ledger/report"
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                response = await client.get(url, params={"since": LEDGER_WINDOW})
                response.raise_for_status()
                self.cost = LedgerFigures.from_report(response.json())
                self.cost_note = None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.cost_note = f"the ledger at {self.ledger_url} did not answer: {_describe(exc)}"
            # a figure a few seconds old is still worth showing next to the note

    async def snapshot(self) -> TopSnapshot:
        """Read what a frame needs (each part bounded by `timeout_s`) and build it."""

        async def bounded(what: str, coro: Any, default: Any) -> Any:
            try:
                result = await asyncio.wait_for(coro, self.timeout_s)
            except Exception as exc:
                self._notes[what] = f"{what}: not read ({_describe(exc)})"
                return default
            self._notes.pop(what, None)
            return result

        states, scaling, _ = await asyncio.gather(
            bounded("workers", self._workers(), []),
            bounded("autoscaler plan", self._scaling(), None),
            bounded("ledger", self._ledger(), None),
        )
        now = time.time()
        self.recent.prune(now)
        if not self.nc.is_connected:
            self._notes["connection"] = f"NATS connection lost; reconnecting to {self.source}"
        else:
            self._notes.pop("connection", None)
        return build_snapshot(
            states,
            now=now,
            recent=self.recent,
            scaling=scaling,
            cost=self.cost,
            cost_note=self.cost_note,
            source=self.source,
            notes=list(self._notes.values()),
        )


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError) or type(exc).__name__ == "TimeoutError":
        return "timed out"
    if text.startswith("nats: "):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
