"""The mesh's own traffic, recorded and replayed: agent workflows sent through the HTTP API of
real service processes are written by the lifecycle exporter as a workflow trace, and the
simulator replays that trace closed loop with the same requests, tokens and workflows."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from examples.lifecycle_export import LifecycleExporter, to_workflow_jsonl
from ripplemesh.launcher import Mesh
from services.mesh.bus import Bus
from services.simulator import FleetSpec, PoolSpec, run_simulation
from services.simulator.records import RequestRecord
from services.simulator.workload import load_workload
from tests.conftest import TEST_KEY

pytestmark = pytest.mark.timeout(120)

SYSTEM = "You are a coding agent. Work through the task one tool call at a time. " * 20
STEPS = 3
PRIORITY = {"agent-a": "critical", "agent-b": "standard"}  # a workflow's class, each step's


async def chat(
    http: httpx.AsyncClient, mesh: Mesh, content: str, max_tokens: int, headers: dict[str, str]
) -> str:
    response = await http.post(
        f"http://127.0.0.1:{mesh.http_port}/v1/chat/completions",
        headers={"Authorization": f"Bearer {TEST_KEY}", **headers},
        json={
            "model": "llama-3-8b",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
        },
    )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def written_rows(directory: Path) -> int:
    parts = list(directory.glob("part-*.parquet"))
    return pq.read_table(parts).num_rows if parts else 0


async def test_a_recorded_mesh_run_replays_in_the_simulator_request_for_request(
    mesh: Mesh, bus: Bus, tmp_path: Path
) -> None:
    out = tmp_path / "lifecycle"
    exporter = LifecycleExporter(
        f"test-record-{uuid.uuid4().hex[:8]}", durable=False, out_dir=out, flush_every_s=0.2, settle_s=0.3
    )
    run = uuid.uuid4().hex[:6]
    workflows = [f"agent-{name}-{run}" for name in ("a", "b")]
    await exporter.start(bus)
    try:
        async with httpx.AsyncClient(timeout=30) as http:

            async def agent(workflow_id: str) -> None:
                history = SYSTEM + f"Task {workflow_id}: fix the failing test."
                for step in range(1, STEPS + 1):
                    headers = {
                        "x-ripple-workflow-id": workflow_id,
                        "x-ripple-workflow-step": str(step),
                        "x-ripple-workflow-steps": str(STEPS),
                        "x-ripple-priority": PRIORITY[workflow_id[:7]],
                        "x-ripple-deadline-ms": "30000",
                    }
                    answer = await chat(http, mesh, history, 8 * step, headers)
                    history += answer + f" Tool result {step}: 3 tests passed."  # the next step's prompt
                    await asyncio.sleep(0.3)  # the agent thinks

            await asyncio.gather(*(agent(w) for w in workflows))
            await chat(http, mesh, "A question on its own.", 5, {})
        deadline = time.monotonic() + 20
        while written_rows(out) < 2 * STEPS + 1:
            assert time.monotonic() < deadline, written_rows(out)
            await asyncio.sleep(0.1)
    finally:
        await exporter.stop()

    trace = tmp_path / "recorded.jsonl"
    to_workflow_jsonl(out, trace)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    mine = [line for line in lines if line.get("workflow_id") in workflows]
    # The recording: each workflow's steps in order, their classes and deadlines, each step's
    # measured completion before the next step's arrival.
    for workflow_id in workflows:
        steps = sorted(
            (line for line in mine if line["workflow_id"] == workflow_id), key=lambda line: line["step"]
        )
        assert [(line["step"], line["steps"]) for line in steps] == [(s, STEPS) for s in range(1, STEPS + 1)]
        assert [line["priority"] for line in steps] == [PRIORITY[workflow_id[:7]]] * STEPS
        assert all(line["tenant"] == "acme" and line["e2e_deadline_ms"] == 30_000 for line in steps)
        for earlier, later in itertools.pairwise(steps):
            assert earlier["completed_ms"] <= later["timestamp"]
            assert later["input_length"] > earlier["input_length"]  # the history grows
            assert later["hash_ids"][: len(earlier["hash_ids"]) - 1] == earlier["hash_ids"][:-1]
    assert any("workflow_id" not in line for line in lines)  # the single request

    # Replayed closed loop: the same requests with the same tokens, in the same workflows.
    workload = load_workload(str(trace), block_size=16)
    records: list[RequestRecord] = []
    spec = FleetSpec(pools=[PoolSpec(replicas=1)], gpu_prices_per_hour={"H100": 3.0})
    result = run_simulation(workload, spec, request_log=records.append, admission="none")
    assert result.requests == result.requests_completed == len(lines)
    by_id = {record.request_id: record for record in records}
    for line in mine:
        record = by_id[f"{line['workflow_id']}-{line['step']}"]
        assert (record.prompt_tokens, record.output_tokens) == (line["input_length"], line["output_length"])
    for workflow_id in workflows:
        arrivals = [by_id[f"{workflow_id}-{step}"] for step in range(1, STEPS + 1)]
        # Each step issued once its previous one completed in the simulation.
        assert all(b.arrival >= a.finished_at for a, b in itertools.pairwise(arrivals))
