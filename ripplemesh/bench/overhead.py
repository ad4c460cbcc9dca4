"""`ripplemesh bench overhead`: what the mesh adds to time to first token.

One run, side by side, on the same embedded NATS server:
- mesh: requests over `MeshClient` through every service, sim engine with zero compute time;
  time from submit to the first token chunk;
- floor: the same number of hops as bare NATS request/reply round trips to an echo responder,
  made in sequence, at the same rate. The responder is a subscription on the requester's own
  connection: one hot process, no process wake-up per message, so the floor is a strict one.
The ratio of the two, and the difference at p50, is the mesh's overhead.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import nats
import uvloop
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from schemas.events import StreamFailed, TokenChunk
from schemas.subjects import LEDGER_CONSUMER
from services.mesh.embedded_nats import EmbeddedNats, free_port

# Messages on the path to the first token: client -> ingress -> admission -> router -> prefill
# -> client.
HOPS = 5


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_by_service(mesh: Mesh) -> dict[str, float]:
    return {c.name: _cpu_seconds(c.process.pid) for c in mesh.children if c.process is not None}


async def _ledger_caught_up(url: str, timeout_s: float = 60.0) -> None:
    """Until the ledger has acked every lifecycle event so far."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = await js.consumer_info(LEDGER_CONSUMER.stream, LEDGER_CONSUMER.durable)
            if not info.num_pending and not info.num_ack_pending:
                return
            await asyncio.sleep(0.05)
    finally:
        await nc.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _paced(count: int, rate: float, one: object, progress: Progress, label: str) -> list[float]:
    task = progress.add_task(label, total=count)
    results: list[float] = []

    async def run(i: int) -> None:
        results.append(await one(i))  # type: ignore[operator]
        progress.advance(task)

    start = time.perf_counter()
    pending = []
    for i in range(count):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        pending.append(asyncio.create_task(run(i)))
    await asyncio.wait_for(asyncio.gather(*pending), timeout=120)
    return results


async def _measure(
    url: str, rate: float, count: int, progress: Progress, cpu: Callable[[], dict[str, float]]
) -> tuple[list[float], list[float], dict[str, float], dict[str, tuple[int, int]]]:
    # request id -> (submitted, first token) wall-clock ns: the ends of each request's trace.
    timeline: dict[str, tuple[int, int]] = {}
    async with MeshClient(url, "demo", first_token_timeout_s=30) as client:

        async def mesh_ttft(i: int) -> float:
            # Timed to the first token, then read to its end as a client does: leaving after the
            # first token would cancel every request, a cancellation's work the mesh does not do
            # for a request that completes.
            started = time.perf_counter()
            submitted_ns = time.time_ns()
            request_id = uuid.uuid4().hex
            first: float | None = None
            async for event in client.events(
                prompt=f"overhead probe {i}", max_tokens=1, request_id=request_id
            ):
                if isinstance(event, TokenChunk) and first is None:
                    first = time.perf_counter() - started
                    timeline[request_id] = (submitted_ns, time.time_ns())
                elif isinstance(event, StreamFailed):
                    raise RuntimeError(f"request failed: {event.code}: {event.message}")
            if first is None:
                raise RuntimeError("no token")
            return first

        # Warm up connections, consumers and code paths before measuring.
        for i in range(10):
            await mesh_ttft(-i)
        await _ledger_caught_up(url)
        cpu_before = cpu()
        mesh = await _paced(count, rate, mesh_ttft, progress, "mesh")
        # The ledger runs at a lower priority and may still be recording: its CPU counts once
        # it has caught up.
        await _ledger_caught_up(url)
        cpu_after = cpu()
        # CPU per request by service: unlike latency, hardly affected by other load on the machine.
        cpu_per_request = {name: (cpu_after[name] - cpu_before[name]) / count for name in cpu_before}

    nc = await nats.connect(url)
    try:

        async def echo(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(msg.data)

        await nc.subscribe("bench.echo", cb=echo)
        await nc.flush()
        payload = b"x" * 600  # about the size of a prepared request event

        async def floor_ttft(i: int) -> float:
            started = time.perf_counter()
            for _ in range(HOPS):
                await nc.request("bench.echo", payload, timeout=5)
            return time.perf_counter() - started

        floor = await _paced(count, rate, floor_ttft, progress, "bare NATS")
    finally:
        await nc.drain()
    return mesh, floor, cpu_per_request, timeline


def run_overhead_bench(*, rate: float, count: int, prefill: int, console: Console) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ripplemesh-bench-") as tmp:
        data = Path(tmp)
        with EmbeddedNats(data / "nats") as server:
            mesh = Mesh(
                data_dir=data / "mesh",
                nats_url=server.url,
                http_port=free_port(),
                prefill=prefill,
                decode=1,
                time_scale=0.0,
            )
            with mesh, Progress(console=console, transient=True) as progress:
                mesh_s, floor_s, cpu_per_request, timeline = uvloop.run(
                    _measure(server.url, rate, count, progress, lambda: _cpu_by_service(mesh))
                )
            keep = os.environ.get("RIPPLEMESH_BENCH_TRACES")
            if keep:  # the run's spans and each request's ends, for where the time goes (§20)
                shutil.copytree(data / "mesh" / "traces", keep, dirs_exist_ok=True)
                (Path(keep) / "client.json").write_text(json.dumps(timeline))
    rows = {
        "mesh_p50_ms": _percentile(mesh_s, 0.5) * 1e3,
        "mesh_p99_ms": _percentile(mesh_s, 0.99) * 1e3,
        "floor_p50_ms": _percentile(floor_s, 0.5) * 1e3,
        "floor_p99_ms": _percentile(floor_s, 0.99) * 1e3,
        "mesh_mean_ms": statistics.fmean(mesh_s) * 1e3,
    }
    rows["overhead_p50_ms"] = rows["mesh_p50_ms"] - rows["floor_p50_ms"]
    table = Table(
        title=f"Time to first token, zero compute: {count} requests at {rate:g}/s, "
        f"{'disaggregated' if prefill else 'aggregated'}"
    )
    for column in ("", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right")
    table.add_row("mesh (5 services, JetStream)", f"{rows['mesh_p50_ms']:.2f}", f"{rows['mesh_p99_ms']:.2f}")
    table.add_row(
        f"floor ({HOPS} bare NATS round trips)",
        f"{rows['floor_p50_ms']:.2f}",
        f"{rows['floor_p99_ms']:.2f}",
    )
    table.add_row(
        "ratio mesh / floor",
        f"{rows['mesh_p50_ms'] / rows['floor_p50_ms']:.1f}x",
        f"{rows['mesh_p99_ms'] / rows['floor_p99_ms']:.1f}x",
    )
    table.add_row(
        "mesh overhead (mesh - floor)",
        f"{rows['overhead_p50_ms']:.2f}",
        f"{rows['mesh_p99_ms'] - rows['floor_p99_ms']:.2f}",
    )
    console.print(table)
    cpu_table = Table(title="CPU per request by service (user + system)")
    cpu_table.add_column("service")
    cpu_table.add_column("ms", justify="right")
    for name, seconds in sorted(cpu_per_request.items(), key=lambda kv: -kv[1]):
        cpu_table.add_row(name, f"{seconds * 1e3:.2f}")
        rows[f"cpu_ms_{name}"] = seconds * 1e3
    rows["cpu_ms_total"] = sum(cpu_per_request.values()) * 1e3
    cpu_table.add_row("total", f"{rows['cpu_ms_total']:.2f}")
    console.print(cpu_table)
    verdict = "meets" if rows["overhead_p50_ms"] < 5.0 else "misses"
    console.print(f"p50 overhead {rows['overhead_p50_ms']:.2f} ms: {verdict} the 5 ms target")
    return rows
