"""The running spend of each workflow in the WORKFLOW_SPEND KV bucket, on a real NATS server.

The ledger's own path: events go through the group-commit writer into a real SQLite ledger, each
committed batch hands its workflows to the publisher, which puts them in the bucket.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from nats.js.errors import KeyNotFoundError

from schemas.events import DecodeCompleted, PrefillCompleted, RequestFailed, Usage, WorkflowSpend
from schemas.subjects import WORKFLOW_SPEND
from services.ledger.service import GroupCommit
from services.ledger.store import LedgerStore
from services.ledger.workflow_spend import WorkflowSpendPublisher, decode_workflow_spend
from services.mesh.bus import Bus

PRICES = {"h100": 4.0}


def prefill(workflow: str, request: str, at: float) -> PrefillCompleted:
    return PrefillCompleted(
        event_id=uuid.uuid4().hex,
        occurred_at=at,
        request_id=request,
        tenant="acme",
        workflow_id=workflow,
        worker_id="p0",
        gpu_type="h100",
        gpu_seconds=225.0,
        prompt_tokens=10,
        cached_tokens=0,
        ttft_s=0.1,
    )


def decode(workflow: str, request: str, at: float, step: int, steps: int) -> DecodeCompleted:
    return DecodeCompleted(
        event_id=uuid.uuid4().hex,
        occurred_at=at,
        request_id=request,
        tenant="acme",
        workflow_id=workflow,
        worker_id="d0",
        gpu_type="h100",
        gpu_seconds=450.0,
        kv_transfer_bytes=10**9,
        usage=Usage(prompt_tokens=10, completion_tokens=5),
        finish_reason="stop",
        latency_s=1.0,
        workflow_step=step,
        workflow_steps=steps,
    )


async def read(bus: Bus, workflow: str, *, timeout_s: float = 5.0) -> WorkflowSpend | None:
    kv = await bus.key_value(WORKFLOW_SPEND)
    try:
        entry = await kv.get(workflow)
    except KeyNotFoundError:
        return None
    return None if entry.value is None else decode_workflow_spend(entry.value)


async def wait_for(bus: Bus, workflow: str, predicate, timeout_s: float = 5.0) -> WorkflowSpend:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        value = await read(bus, workflow)
        if value is not None and predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"WORKFLOW_SPEND[{workflow}] is {value}")
        await asyncio.sleep(0.02)


async def test_each_batch_puts_its_workflows_running_spend(bus: Bus, tmp_path: Path) -> None:
    store = await LedgerStore.open(f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}")
    now = time.time()
    publisher = WorkflowSpendPublisher(store, lambda: bus.key_value(WORKFLOW_SPEND), task_timeout_s=600.0)
    writer = GroupCommit(
        store, PRICES, gather_s=0.01, kv_usd_per_gb=0.25, on_batch=lambda b: publisher.notify(b.workflows)
    )
    tasks = [asyncio.create_task(writer.run()), asyncio.create_task(publisher.run())]
    ok, bad = f"wf-{uuid.uuid4().hex[:8]}", f"wf-{uuid.uuid4().hex[:8]}"
    try:
        step1 = [prefill(ok, f"{ok}-1", now - 5), decode(ok, f"{ok}-1", now - 4, 1, 2)]
        assert await asyncio.gather(*(writer.record(e) for e in step1)) == [True, True]
        # $0.25 + $0.5 of GPU time, $0.25 of KV transfer.
        value = await wait_for(bus, ok, lambda v: v.steps_completed == 1)
        assert (value.spend_usd, value.gpu_seconds, value.status, value.steps) == (1.0, 675.0, "running", 2)
        assert value.tenant == "acme" and value.last_event_at == now - 4

        # A redelivery changes nothing; the final step completes the task.
        step2 = [step1[1], prefill(ok, f"{ok}-2", now - 3), decode(ok, f"{ok}-2", now - 2, 2, 2)]
        assert await asyncio.gather(*(writer.record(e) for e in step2)) == [False, True, True]
        value = await wait_for(bus, ok, lambda v: v.status != "running")
        assert (value.spend_usd, value.steps_completed, value.status, value.reason) == (
            2.0,
            2,
            "succeeded",
            None,
        )

        failure = RequestFailed(
            event_id=uuid.uuid4().hex,
            occurred_at=now - 1,
            request_id=f"{bad}-1",
            tenant="acme",
            workflow_id=bad,
            stage="decode",
            message="lost",
            workflow_step=1,
            workflow_steps=3,
        )
        assert await asyncio.gather(writer.record(prefill(bad, f"{bad}-1", now - 2)), writer.record(failure))
        value = await wait_for(bus, bad, lambda v: v.status == "failed")
        assert (value.spend_usd, value.reason, value.steps_completed) == (0.25, "step_failed", 0)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.close()


async def test_the_sweep_puts_abandoned_workflows(bus: Bus, tmp_path: Path) -> None:
    store = await LedgerStore.open(f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}")
    clock = [1_000_000.0]
    publisher = WorkflowSpendPublisher(
        store, lambda: bus.key_value(WORKFLOW_SPEND), task_timeout_s=600.0, clock=lambda: clock[0]
    )
    quiet = f"wf-{uuid.uuid4().hex[:8]}"
    try:
        await store.record_many([prefill(quiet, f"{quiet}-1", clock[0] - 10)], PRICES)
        [value] = await publisher.publish([quiet])
        assert value.status == "running" and (await read(bus, quiet)) == value
        assert await publisher.sweep() == []  # not quiet for long enough yet
        clock[0] += 600.0
        [value] = await publisher.sweep()
        assert (value.workflow_id, value.status, value.reason, value.spend_usd) == (
            quiet,
            "failed",
            "abandoned",
            0.25,
        )
        assert (await read(bus, quiet)) == value
        clock[0] += 30.0
        assert await publisher.sweep() == []  # each abandonment is put once
    finally:
        await store.close()
