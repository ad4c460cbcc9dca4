"""`ripplemesh bench migration`: what a worker's death (or drain) costs the streams it serves.

A mesh of one prefill and `decode` decode workers (sim engine at real time) serves rounds of
`streams` concurrent streaming requests over NATS (`MeshClient`). In each round, once every
stream has delivered some tokens, the decode worker running the most sequences is killed with
SIGKILL (or, with ``--mode drain``, drained with a zero grace period), then restarted once the
round is over. For every stream the client's view is recorded: chunk arrival times, sequence
numbers and tokens.

Figures:
- completed: streams that ended with every token exactly once, in order, at their full length;
- added latency at the failure, for the streams that were migrated (the `RequestMigrated`
  events say which): the longest gap between two chunks minus the stream's median gap;
- detection: from the killed worker's last heartbeat to the router declaring it lost.

Wall-clock figures on a shared machine include other processes' load.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import nats
import uvloop
from nats.aio.client import Client as NatsClient
from rich.console import Console
from rich.table import Table

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from schemas.events import StreamFinished, TokenChunk, WorkerControl, encode_event, new_event_id
from schemas.subjects import LIFECYCLE, control_subject, event_subject
from services.mesh.config import DEFAULT_CONFIG, load_config
from services.mesh.embedded_nats import free_port

Mode = Literal["kill", "drain"]


@dataclass
class StreamRecord:
    request_id: str
    max_tokens: int
    arrivals: list[float] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    tokens: int = 0
    finished: bool = False
    error: str | None = None

    @property
    def complete(self) -> bool:
        return (
            self.finished
            and self.error is None
            and self.tokens == self.max_tokens
            and self.seqs == list(range(len(self.seqs)))
        )

    def added_latency_s(self) -> float:
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        return max(gaps) - statistics.median(gaps) if len(gaps) > 1 else 0.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _health(mesh: Mesh, name: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{mesh.child(name).url}/healthz", timeout=2) as response:
        body: dict[str, Any] = json.loads(response.read())
        return body


def _busiest_decode_worker(mesh: Mesh) -> str:
    running = {
        c.name: _health(mesh, c.name).get("running", 0)
        for c in mesh.children
        if c.name.startswith("decode-") and c.process is not None and c.process.poll() is None
    }
    return max(running, key=lambda name: running[name])


def _wait_for_workers(mesh: Mesh, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _health(mesh, "router")["workers"] < count:
        if time.monotonic() > deadline:
            raise TimeoutError("workers did not come back")
        time.sleep(0.1)


def _detection_sum_count(mesh: Mesh) -> tuple[float, float]:
    with urllib.request.urlopen(f"{mesh.child('router').url}/metrics", timeout=2) as response:
        text = response.read().decode()
    found = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for suffix in found:
            if line.startswith(f"ripplemesh_router_worker_loss_detection_seconds_{suffix} "):
                found[suffix] = float(line.split()[1])
    return found["sum"], found["count"]


async def _stream(client: MeshClient, record: StreamRecord, prompt: str) -> None:
    try:
        async for event in client.events(
            prompt=prompt, max_tokens=record.max_tokens, request_id=record.request_id
        ):
            record.arrivals.append(time.monotonic())
            record.seqs.append(event.seq)
            if isinstance(event, TokenChunk):
                record.tokens += len(event.token_ids)
            elif isinstance(event, StreamFinished):
                record.finished = True
            else:
                record.error = f"{event.code}: {event.message}"
    except Exception as exc:
        record.error = repr(exc)


async def _migrated_ids(mesh: Mesh) -> set[str]:
    nc = await nats.connect(mesh.url, **mesh.connect_options())  # type: ignore[arg-type]
    try:
        sub = await nc.jetstream().subscribe(
            event_subject("migrated"), stream=LIFECYCLE.name, ordered_consumer=True
        )
        found: set[str] = set()
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except TimeoutError:
                return found
            found.add(msgspec.json.decode(msg.data)["request_id"])
    finally:
        await nc.drain()


async def _round(
    mesh: Mesh, client: MeshClient, control: NatsClient, round_no: int, streams: int, tokens: int, mode: Mode
) -> tuple[list[StreamRecord], str]:
    records = [StreamRecord(f"bench-{round_no}-{i}-{new_event_id()[:8]}", tokens) for i in range(streams)]
    tasks = [
        asyncio.ensure_future(_stream(client, r, f"round {round_no} stream {i} tell me a long story"))
        for i, r in enumerate(records)
    ]
    deadline = time.monotonic() + 60
    while any(r.tokens < 30 and not r.finished and r.error is None for r in records):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    victim = await asyncio.to_thread(_busiest_decode_worker, mesh)
    if mode == "kill":
        process = mesh.child(victim).process
        assert process is not None
        process.send_signal(signal.SIGKILL)
    else:
        order = WorkerControl(
            event_id=new_event_id(), occurred_at=time.time(), worker_id=victim, action="drain", grace_s=0.0
        )
        await control.request(control_subject(victim), encode_event(order), timeout=5)
    await asyncio.gather(*tasks)
    await asyncio.to_thread(mesh.restart_child, victim)
    await asyncio.to_thread(_wait_for_workers, mesh, len([c for c in mesh.children if "-" in c.name]))
    return records, victim


async def _bench(mesh: Mesh, rounds: int, streams: int, tokens: int, mode: Mode, console: Console) -> None:
    # Orders to workers need the services' user; a tenant may not send them.
    control = await nats.connect(mesh.url, **mesh.connect_options())  # type: ignore[arg-type]
    async with MeshClient(
        mesh.url, "demo", credentials=mesh.credentials("demo"), idle_timeout_s=60
    ) as client:
        # Warm up: every worker has served once.
        await asyncio.gather(*(client.complete(prompt=f"warm up {i}", max_tokens=4) for i in range(4)))
        everything: list[StreamRecord] = []
        for round_no in range(rounds):
            records, victim = await _round(mesh, client, control, round_no, streams, tokens, mode)
            everything.extend(records)
            done = sum(r.complete for r in records)
            console.print(
                f"round {round_no + 1}/{rounds}: {mode} {victim}; {done}/{len(records)} streams whole"
            )
    await control.drain()
    migrated = await _migrated_ids(mesh)
    moved = [r for r in everything if r.request_id in migrated]
    added = [r.added_latency_s() for r in moved if len(r.arrivals) > 2]
    unaffected = [
        r.added_latency_s() for r in everything if r.request_id not in migrated and len(r.arrivals) > 2
    ]
    detection_sum, detection_count = await asyncio.to_thread(_detection_sum_count, mesh)
    table = Table(
        title=f"Mid-stream migration ({mode}, {rounds} rounds x {streams} streams x {tokens} tokens)"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    completed = sum(r.complete for r in everything)
    table.add_row(
        "streams completed whole", f"{completed}/{len(everything)} ({100 * completed / len(everything):.1f}%)"
    )
    table.add_row("streams migrated", str(len(moved)))
    table.add_row("added latency at the failure, p50 (s)", f"{_percentile(added, 0.5):.3f}")
    table.add_row("added latency at the failure, p99 (s)", f"{_percentile(added, 0.99):.3f}")
    table.add_row("added latency at the failure, max (s)", f"{max(added, default=float('nan')):.3f}")
    table.add_row("same figure, streams not migrated, p50 (s)", f"{_percentile(unaffected, 0.5):.3f}")
    if detection_count:
        table.add_row(
            "loss detection after last heartbeat, mean (s)", f"{detection_sum / detection_count:.3f}"
        )
    console.print(table)
    failures = [r for r in everything if not r.complete]
    for r in failures[:10]:
        console.print(f"[red]incomplete[/] {r.request_id}: tokens {r.tokens}/{r.max_tokens}, error {r.error}")


def run_migration_bench(
    *, rounds: int, streams: int, tokens: int, decode: int, mode: Mode, console: Console
) -> None:
    with tempfile.TemporaryDirectory(prefix="ripplemesh-bench-migration-") as tmp:
        config = Path(tmp) / "ripplemesh.toml"
        default = load_config(DEFAULT_CONFIG)
        text = DEFAULT_CONFIG.read_text()
        # Generous quotas and as many migrations as rounds: the bench measures migration, not limits.
        text = text.replace("requests_per_s = 50.0", "requests_per_s = 10000.0").replace(
            "request_burst = 100.0", "request_burst = 10000.0"
        )
        config.write_text(f"max_migrations = {max(rounds, default.max_migrations)}\n" + text)
        mesh = Mesh(
            data_dir=Path(tmp) / "data",
            config_path=config,
            http_port=free_port(),
            prefill=1,
            decode=decode,
            time_scale=1.0,
        )
        console.print(f"starting a mesh: 1 prefill, {decode} decode workers (sim, real time)")
        with mesh:
            uvloop.run(_bench(mesh, rounds, streams, tokens, mode, console))
