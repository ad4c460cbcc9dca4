"""A service killed mid-run and restarted resumes its durable consumer: nothing lost, nothing twice."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request

import pytest

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(150)


def _ledger(mesh: Mesh, path: str) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(f"{mesh.child('ledger').url}{path}", timeout=5) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


async def test_ledger_killed_mid_stream_counts_every_request_exactly_once(mesh: Mesh) -> None:
    before = _ledger(mesh, "/v1/ledger/totals")
    requests, max_tokens = 40, 20
    async with MeshClient(mesh.url, "acme") as client:
        tasks = [
            asyncio.create_task(client.complete(prompt=f"restart {i} of the ledger", max_tokens=max_tokens))
            for i in range(requests)
        ]
        # Kill the ledger without warning while requests are completing.
        while sum(t.done() for t in tasks) < 5:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(mesh.stop_child, "ledger", sig=signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    assert all(r.usage.completion_tokens == max_tokens for r in results)
    await asyncio.to_thread(mesh.restart_child, "ledger")

    def caught_up():  # type: ignore[no-untyped-def]
        totals = _ledger(mesh, "/v1/ledger/totals")
        done = totals["requests"]["completed"] - before["requests"]["completed"]
        return totals if done >= requests else None

    after = await asyncio.to_thread(wait_until, caught_up, 30)
    await asyncio.sleep(6)  # past the ledger's ack wait: any redelivery would have landed
    after = _ledger(mesh, "/v1/ledger/totals")
    assert after["requests"]["completed"] - before["requests"]["completed"] == requests
    for result in results:
        row = _ledger(mesh, f"/v1/ledger/requests/{result.request_id}")
        assert row["status"] == "completed"
        assert row["completion_tokens"] == max_tokens
        assert row["prefill_gpu_seconds"] > 0 and row["decode_gpu_seconds"] > 0
