"""`ripplemesh bench subscriber`: the subscriber SDK's consume path against the mesh's own
consume loop, side by side on one embedded NATS server.

Two measures, each for a `Subscriber` on ``rmesh.events.>`` and for a bare `Consumer` (what
the ledger runs) with a handler that does nothing, each reader twice (alternating; the mean):
- backlog: `count` lifecycle events already on the stream, read from the start: events per
  second until the last is handled;
- live: events published at `rate` per second while the reader runs: the lag from each publish
  to its handler (p50, p99).
- under a mesh: `ripplemesh up`'s services (sim engine, no compute time) driven by concurrent
  clients as fast as they go, both readers at once on every event the mesh makes: events per
  second the mesh made, and each reader's lag from an event's `occurred_at` to its handler.
The SDK adds its dispatch, handler timeout and metrics to the same loop; the ratio says what
that costs.
"""

from __future__ import annotations

import asyncio
import datetime
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from ripplemesh.subscriber import Context, Subscriber
from schemas.events import LifecycleEvent, PrefillCompleted, new_event_id
from schemas.subjects import LIFECYCLE, PREFIX, ConsumerSpec, event_subject
from services.mesh.bus import Bus
from services.mesh.consumer import Consumer, Delivery
from services.mesh.embedded_nats import EmbeddedNats, free_port


def _event(tag: str, i: int) -> PrefillCompleted:
    return PrefillCompleted(
        event_id=new_event_id(),
        occurred_at=time.time(),
        request_id=f"{tag}-{i}",
        tenant="bench",
        worker_id="prefill-0",
        gpu_type="H100",
        gpu_seconds=0.01,
        prompt_tokens=1000,
        cached_tokens=500,
        ttft_s=0.1,
    )


class _Reader:
    """One way of reading: started on a bus, handing each event of this run to `seen`."""

    def __init__(self, kind: str, tag: str, start_from: str | float) -> None:
        self.kind, self.tag, self.start_from = kind, tag, start_from
        self.lags: list[float] = []
        self.count = 0
        self.done = asyncio.Event()
        self.expected = 0
        self._stop: Callable[[], Awaitable[None]] | None = None

    def seen(self, event: Any) -> None:
        if not self.tag:  # under a mesh: every event
            self.count += 1
            self.lags.append(time.time() - event.occurred_at)
            return
        if isinstance(event, PrefillCompleted) and event.request_id.startswith(self.tag):
            self.count += 1
            self.lags.append(time.time() - event.occurred_at)
            if self.count >= self.expected:
                self.done.set()

    async def start(self, bus: Bus) -> None:
        name = f"bench-{self.kind}-{uuid.uuid4().hex[:6]}"
        if self.kind == "sdk":
            start = (
                datetime.datetime.fromtimestamp(self.start_from, tz=datetime.UTC)
                if isinstance(self.start_from, float)
                else self.start_from
            )
            sub = Subscriber(name, start_from=start, durable=False)  # type: ignore[arg-type]

            @sub.on_subject(f"{PREFIX}.events.>")
            async def handled(event: LifecycleEvent, context: Context) -> None:
                self.seen(event)

            await sub.start(bus)
            self._stop = sub.stop
            return

        async def handler(event: Any, delivery: Delivery) -> None:
            self.seen(event)

        spec = ConsumerSpec(
            durable=name,
            stream=LIFECYCLE.name,
            filter_subject=f"{PREFIX}.events.>",
            deliver="by_start_time" if isinstance(self.start_from, float) else "new",
            start_time=self.start_from if isinstance(self.start_from, float) else None,
            inactive_threshold_s=300.0,
        )
        consumer: Consumer[Any] = Consumer(bus, spec, LifecycleEvent, handler)
        await consumer.start()
        self._stop = consumer.stop

    async def stop(self) -> None:
        if self._stop is not None:
            await self._stop()


async def _backlog(bus: Bus, kind: str, count: int) -> float:
    tag = f"b{uuid.uuid4().hex[:6]}"
    since = time.time()  # each reader reads its own backlog only, not the runs before it
    for i in range(count):
        await bus.publish(event_subject("prefill_completed"), _event(tag, i))
    reader = _Reader(kind, tag, since)
    reader.expected = count
    started = time.perf_counter()
    await reader.start(bus)
    try:
        await asyncio.wait_for(reader.done.wait(), timeout=300)
    finally:
        await reader.stop()
    return count / (time.perf_counter() - started)


async def _live(bus: Bus, kind: str, rate: float, seconds: float) -> tuple[float, float]:
    tag = f"l{uuid.uuid4().hex[:6]}"
    reader = _Reader(kind, tag, "new")
    total = int(rate * seconds)
    reader.expected = total
    await reader.start(bus)
    try:
        await asyncio.sleep(1.0)
        began = time.perf_counter()
        for i in range(total):
            await asyncio.sleep(max(0.0, began + i / rate - time.perf_counter()))
            await bus.publish(event_subject("prefill_completed"), _event(tag, i))
        await asyncio.wait_for(reader.done.wait(), timeout=120)
    finally:
        await reader.stop()
    lags = sorted(reader.lags)
    return statistics.median(lags), lags[min(len(lags) - 1, int(0.99 * len(lags)))]


async def _run(count: int, rate: float, seconds: float) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="ripplemesh-bench-") as tmp:
        async with EmbeddedNats(Path(tmp) / "nats") as server:
            bus = await Bus.connect(server.url, "bench")
            await bus.provision()
            try:
                # Each reader twice, in the order loop, SDK, SDK, loop (neither always first);
                # the mean of its two runs.
                runs: dict[str, list[dict[str, float]]] = {"loop": [], "sdk": []}
                for kind in ("loop", "sdk", "sdk", "loop"):
                    per_s = await _backlog(bus, kind, count)
                    p50, p99 = await _live(bus, kind, rate, seconds)
                    runs[kind].append({"events_per_s": per_s, "lag_p50_s": p50, "lag_p99_s": p99})
                return {
                    kind: {key: statistics.fmean(r[key] for r in measured) for key in measured[0]}
                    for kind, measured in runs.items()
                }
            finally:
                await bus.close()


async def _drive(url: str, seconds: float, concurrency: int) -> tuple[dict[str, _Reader], float]:
    bus = await Bus.connect(url, "bench")
    readers = {kind: _Reader(kind, "", "new") for kind in ("loop", "sdk")}
    try:
        for reader in readers.values():
            await reader.start(bus)
        await asyncio.sleep(1.0)
        async with MeshClient(url, "demo", first_token_timeout_s=30) as client:
            began = time.monotonic()

            async def requests(i: int) -> None:
                n = 0
                while time.monotonic() - began < seconds:
                    n += 1
                    async for _ in client.events(prompt=f"subscriber bench {i} {n}", max_tokens=4):
                        pass

            await asyncio.gather(*(requests(i) for i in range(concurrency)))
            elapsed = time.monotonic() - began
        # Both have read all there is once neither count moves for a second.
        while True:
            counts = [r.count for r in readers.values()]
            await asyncio.sleep(1.0)
            if counts == [r.count for r in readers.values()]:
                break
    finally:
        for reader in readers.values():
            await reader.stop()
        await bus.close()
    return readers, elapsed


def _under_mesh(seconds: float, concurrency: int) -> tuple[dict[str, _Reader], float]:
    with tempfile.TemporaryDirectory(prefix="ripplemesh-bench-") as tmp:
        with EmbeddedNats(Path(tmp) / "nats") as server:
            mesh = Mesh(
                data_dir=Path(tmp) / "mesh",
                nats_url=server.url,
                http_port=free_port(),
                prefill=1,
                decode=1,
                time_scale=0.0,
            )
            with mesh:
                return asyncio.run(_drive(server.url, seconds, concurrency))


def run_subscriber_bench(
    *,
    count: int,
    rate: float,
    seconds: float,
    console: Console,
    mesh_seconds: float = 20.0,
    concurrency: int = 32,
) -> dict[str, dict[str, float]]:
    figures = asyncio.run(_run(count, rate, seconds))
    loop, sdk = figures["loop"], figures["sdk"]
    table = Table(
        title=f"subscriber consume path: {count} events of backlog, then {rate:g}/s for {seconds:g} s"
    )
    for column in ("reader", "backlog events/s", "live lag p50 (ms)", "live lag p99 (ms)"):
        table.add_column(column, justify="right")
    for name, f in (("mesh consume loop", loop), ("Subscriber (SDK)", sdk)):
        table.add_row(
            name, f"{f['events_per_s']:,.0f}", f"{f['lag_p50_s'] * 1000:.1f}", f"{f['lag_p99_s'] * 1000:.1f}"
        )
    table.add_row(
        "SDK / loop",
        f"{sdk['events_per_s'] / loop['events_per_s']:.2f}",
        f"{sdk['lag_p50_s'] / loop['lag_p50_s']:.2f}",
        f"{sdk['lag_p99_s'] / loop['lag_p99_s']:.2f}",
    )
    console.print(table)
    if mesh_seconds > 0:
        readers, elapsed = _under_mesh(mesh_seconds, concurrency)
        loop_r, sdk_r = readers["loop"], readers["sdk"]
        made = max(loop_r.count, sdk_r.count)
        table = Table(
            title=f"under a mesh: {concurrency} clients for {mesh_seconds:g} s, "
            f"{made / elapsed:,.0f} lifecycle events/s made"
        )
        for column in ("reader", "events read", "lag p50 (ms)", "lag p99 (ms)"):
            table.add_column(column, justify="right")
        under: dict[str, float] = {}
        for name, reader in (("mesh consume loop", loop_r), ("Subscriber (SDK)", sdk_r)):
            lags = sorted(reader.lags) or [0.0]
            p50, p99 = statistics.median(lags), lags[min(len(lags) - 1, int(0.99 * len(lags)))]
            under[f"{reader.kind}_lag_p50_s"], under[f"{reader.kind}_lag_p99_s"] = p50, p99
            under[f"{reader.kind}_events"] = reader.count
            table.add_row(name, f"{reader.count:,}", f"{p50 * 1000:.1f}", f"{p99 * 1000:.1f}")
        table.add_row(
            "SDK / loop",
            f"{sdk_r.count / max(1, loop_r.count):.2f}",
            f"{under['sdk_lag_p50_s'] / max(1e-9, under['loop_lag_p50_s']):.2f}",
            f"{under['sdk_lag_p99_s'] / max(1e-9, under['loop_lag_p99_s']):.2f}",
        )
        console.print(table)
        figures["mesh"] = {"events_per_s": made / elapsed, **under}
    return figures
