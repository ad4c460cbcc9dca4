"""`ripplemesh up --autoscale` as a user runs it: a burst scales the pools up, the calm drains
them down and to zero, and the next request brings a worker back; the official openai client
counts every token, and the ledger every request."""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
import time
from pathlib import Path

import nats
import nats.js.errors
import openai
import pytest
from rich.console import Console

from ripplemesh.traces import load_spans, render_ripple, request_trace
from schemas.events import ScalingDecision, decode_event
from schemas.subjects import WORKERS, event_subject
from services.mesh.bus import kv_keys
from services.mesh.config import DEFAULT_CONFIG
from services.mesh.nats_auth import load_credentials
from tests.test_up import running_up

pytestmark = pytest.mark.timeout(240)

AUTOSCALER = """
[autoscaler]
interval_s = 1.0
scale_down_delay_s = 4.0
idle_to_zero_s = 12.0
"""


async def stream(api: openai.AsyncOpenAI, i: int, max_tokens: int) -> tuple[int, int | None, str]:
    """Content chunks received, the usage's completion tokens (one token per chunk), the id."""
    chunks, usage, response_id = 0, None, ""
    response = await api.chat.completions.create(
        model="llama-3-8b",
        messages=[{"role": "user", "content": f"request {i}: " + "tell me about the sea " * 40}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in response:
        response_id = chunk.id
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        chunks += sum(1 for c in chunk.choices if c.delta.content)
    return chunks, usage, response_id


async def started_by_plans(js, kv) -> set[str]:  # type: ignore[no-untyped-def]
    """The scaling decisions the registered workers say started them."""
    started_by: set[str] = set()
    for key in await kv_keys(js, WORKERS.bucket):
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue  # drained meanwhile
        if entry.value:
            state = json.loads(entry.value)
            if state.get("scaling_decision"):
                started_by.add(state["scaling_decision"])
    return started_by


async def test_a_burst_scales_up_the_calm_drains_to_zero_and_a_request_brings_a_worker_back(
    tmp_path: Path,
) -> None:
    config = tmp_path / "ripplemesh.toml"
    config.write_text(DEFAULT_CONFIG.read_text() + AUTOSCALER)
    args = ("--autoscale", "--config", str(config), "--time-scale", "3", "--max-workers", "3")
    with running_up(tmp_path, *args) as up:
        nats_url = up.ready_line.split()[2]
        creds = load_credentials(up.data_dir / "credentials" / "services.json")
        nc = await nats.connect(servers=nats_url.split(","), **creds.connect_options())
        decisions: list[ScalingDecision] = []

        async def on_decision(msg) -> None:  # type: ignore[no-untyped-def]
            event = decode_event(msg.data)
            assert isinstance(event, ScalingDecision)
            decisions.append(event)

        await nc.subscribe(event_subject("scaling"), cb=on_decision)
        await nc.flush()
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{up.port}/v1", api_key="rm-demo-key", max_retries=0, timeout=120
        )
        # The workers' registrations, read all along: a worker a plan starts during the burst may
        # be drained again soon after it.
        js = nc.jetstream()
        kv = await js.key_value(WORKERS.bucket)
        started_by: set[str] = set()

        async def watch_workers() -> None:
            while True:
                started_by.update(await started_by_plans(js, kv))
                await asyncio.sleep(0.3)

        watcher = asyncio.create_task(watch_workers())
        try:
            # A burst: 60 streams at once on one prefill and one decode worker.
            burst = await asyncio.gather(*(stream(api, i, 100) for i in range(60)))
            assert all(chunks == usage for chunks, usage, _ in burst)  # no token lost or doubled
            assert all(usage == 100 for _, usage, _ in burst)
            grew = [d for d in decisions if any(p.add for p in d.pools)]
            assert grew, [p.reason for d in decisions for p in d.pools]
            added = {p.pool for d in grew for p in d.pools if p.add}
            # A prompt's KV hand-off (the config's $0.01/GB) costs more than prefilling it on the
            # decode GPU: the plan serves aggregated, and grows the decode pool.
            assert "decode-H100" in added
            prefill_reasons = [p.reason for d in grew for p in d.pools if p.pool == "prefill-H100"]
            assert all("aggregated: prefill + KV hand-off" in r for r in prefill_reasons)
            # A worker started by a plan names it (a plan late in the burst may still have its
            # worker warming when the burst ends).
            planned = {d.event_id for d in grew}
            deadline = time.monotonic() + 30
            while not started_by & planned:
                assert time.monotonic() < deadline, (started_by, planned)
                await asyncio.sleep(0.5)

            # The calm: drained down, then to zero once idle.
            deadline = time.monotonic() + 90
            while not (decisions and all(p.serving + p.warming == 0 for p in decisions[-1].pools)):
                assert time.monotonic() < deadline, [p.reason for p in decisions[-1].pools]
                await asyncio.sleep(0.5)
            drained = [r for d in decisions for p in d.pools for r in p.remove]
            assert len(drained) >= 2 and any("to zero" in p.reason for d in decisions for p in d.pools)

            # From zero: the next requests are held, a worker starts, they are served.
            started = time.monotonic()
            again = await asyncio.gather(*(stream(api, 100 + i, 20) for i in range(2)))
            assert all(chunks == usage == 20 for chunks, usage, _ in again)
            assert time.monotonic() - started < 30
            assert any(d.trigger == "held" and any(p.add for p in d.pools) for d in decisions)
        finally:
            watcher.cancel()
            await api.close()
            await nc.close()
        # The chain, followed from a request of the burst: its batch's utilisation sample, the
        # plan made on it, and the requests served by the worker that plan started.
        spans = load_spans(up.data_dir)
        chains = []
        for _, _, response_id in burst:
            console = Console(file=io.StringIO(), width=250)
            console.print(render_ripple(request_trace(spans, response_id), spans))
            chains.append(console.file.getvalue())  # type: ignore[attr-defined]
        # The plan that grew the pool links the requests that arrived in its window; a plan
        # made on the SLO, the slow ones; every plan, the workers' latest samples.
        assert any(
            "counted in the traffic an autoscaler plan forecast from" in chain
            and "served by a worker this plan started" in chain
            for chain in chains
        ), chains[0]
        assert any("planned on by the autoscaler" in chain for chain in chains)
        # The ledger counts every request, once.
        await asyncio.sleep(2)
        with sqlite3.connect(up.data_dir / "ledger.db") as db:
            rows = db.execute("select status, count(*) from request_costs group by status").fetchall()
        assert dict(rows) == {"completed": 62}
        status = json.loads((up.data_dir / "supervisor.json").read_text())["children"]
        assert not any(c["state"] == "gave_up" for c in status.values())
