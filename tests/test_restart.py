"""A service killed mid-run and restarted resumes its durable consumer: nothing lost, nothing twice."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
import uuid

import pytest

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from schemas.events import WorkflowRef
from schemas.subjects import LEDGER_CONSUMER, WORKFLOW_SPEND
from services.ledger.workflow_spend import decode_workflow_spend
from services.mesh.bus import Bus
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(150)


def _ledger(mesh: Mesh, path: str) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(f"{mesh.child('ledger').url}{path}", timeout=5) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


async def _ledger_caught_up(bus: Bus, timeout_s: float = 30.0) -> None:
    """Wait until the ledger has recorded every lifecycle event so far (it runs at a lower
    priority and may still be recording the requests of the tests before)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        info = await bus.js.consumer_info(LEDGER_CONSUMER.stream, LEDGER_CONSUMER.durable)
        if (info.num_pending or 0) == 0 and (info.num_ack_pending or 0) == 0:
            return
        if loop.time() > deadline:
            raise AssertionError(f"ledger behind: {info.num_pending} pending, {info.num_ack_pending} unacked")
        await asyncio.sleep(0.1)


async def test_ledger_killed_mid_stream_counts_every_request_exactly_once(mesh: Mesh, bus: Bus) -> None:
    await _ledger_caught_up(bus)
    before = _ledger(mesh, "/v1/ledger/totals")
    before_report = _ledger(mesh, "/v1/ledger/report")["fleet"]
    requests, max_tokens = 40, 20
    workflows, steps = 4, 3
    workflow_ids = [f"wf-restart-{uuid.uuid4().hex[:8]}" for _ in range(workflows)]

    async def workflow(client: MeshClient, workflow_id: str) -> list[str]:
        done = []
        for step in range(1, steps + 1):
            result = await client.complete(
                prompt=f"{workflow_id} step {step}",
                max_tokens=max_tokens,
                workflow=WorkflowRef(workflow_id=workflow_id, step=step, steps=steps),
            )
            done.append(result.request_id)
        return done

    async with MeshClient(mesh.url, "acme", credentials=mesh.credentials("acme")) as client:
        tasks = [
            asyncio.create_task(client.complete(prompt=f"restart {i} of the ledger", max_tokens=max_tokens))
            for i in range(requests)
        ]
        flows = [asyncio.create_task(workflow(client, w)) for w in workflow_ids]
        # Kill the ledger without warning while requests are completing.
        while sum(t.done() for t in tasks) < 5:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(mesh.stop_child, "ledger", sig=signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        flow_requests = await asyncio.gather(*flows)
    assert all(r.usage.completion_tokens == max_tokens for r in results)
    await asyncio.to_thread(mesh.restart_child, "ledger")
    completed = requests + workflows * steps

    def caught_up():  # type: ignore[no-untyped-def]
        totals = _ledger(mesh, "/v1/ledger/totals")
        done = totals["requests"]["completed"] - before["requests"]["completed"]
        return totals if done >= completed else None

    after = await asyncio.to_thread(wait_until, caught_up, 30)
    await asyncio.sleep(6)  # past the ledger's ack wait: any redelivery would have landed
    after = _ledger(mesh, "/v1/ledger/totals")
    assert after["requests"]["completed"] - before["requests"]["completed"] == completed
    costs: dict[str, float] = {}
    for result in results:
        row = _ledger(mesh, f"/v1/ledger/requests/{result.request_id}")
        assert row["status"] == "completed"
        assert row["completion_tokens"] == max_tokens
        assert row["prefill_gpu_seconds"] > 0 and row["decode_gpu_seconds"] > 0
        costs[result.request_id] = row["cost_usd"]

    # The figures of merit agree with the request rows: every task once, nothing wasted.
    report = _ledger(mesh, "/v1/ledger/report")["fleet"]
    assert report["tasks"]["succeeded"] - before_report["tasks"]["succeeded"] == requests + workflows
    assert report["tasks"]["failed"] == before_report["tasks"]["failed"]
    assert report["wasted_spend_usd"] == pytest.approx(before_report["wasted_spend_usd"])
    assert report["busy_spend_usd"] == pytest.approx(after["spend_usd"], rel=1e-9)
    assert report["gpu_spend_usd"] - before_report["gpu_spend_usd"] == pytest.approx(
        after["prefill_spend_usd"]
        + after["decode_spend_usd"]
        - before["prefill_spend_usd"]
        - before["decode_spend_usd"]
    )
    assert report["cost_per_successful_task_usd"] == pytest.approx(
        report["spend_usd"] / report["tasks"]["succeeded"]
    )
    assert report["idle_spend_usd"] >= 0.0  # the workers' heartbeats: provisioned, partly idle

    # Each workflow: one successful task whose spend is its requests', in the ledger and in the
    # WORKFLOW_SPEND bucket that admission and the router read.
    kv = await bus.key_value(WORKFLOW_SPEND)
    for workflow_id, request_ids in zip(workflow_ids, flow_requests, strict=True):
        spend = sum(_ledger(mesh, f"/v1/ledger/requests/{r}")["cost_usd"] for r in request_ids)
        task = _ledger(mesh, f"/v1/ledger/workflows/{workflow_id}")
        assert (task["status"], task["max_completed_step"], task["steps"]) == ("succeeded", steps, steps)
        assert task["spend_usd"] == pytest.approx(spend, rel=1e-9) and spend > 0

        entry = await kv.get(workflow_id)
        assert entry.value is not None
        value = decode_workflow_spend(entry.value)
        assert (value.status, value.steps_completed) == ("succeeded", steps)
        assert value.spend_usd == pytest.approx(spend, rel=1e-9)
    by_workflow = {
        g["workflow"]: g for g in _ledger(mesh, "/v1/ledger/report?by=workflow&since=10m")["groups"]
    }
    assert set(workflow_ids) <= set(by_workflow)
    assert all(by_workflow[w]["status"] == "succeeded" for w in workflow_ids)
    tenants = {g["tenant"]: g for g in _ledger(mesh, "/v1/ledger/report?by=tenant")["groups"]}
    assert tenants["acme"]["tasks"]["succeeded"] >= requests + workflows
