"""The router's KV-aware placement end to end, through real service processes: a request that
shares a long prefix with an earlier one lands on the worker that holds it, and its trace shows
the router's prediction next to what the prefill found (`ripplemesh trace`)."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from ripplemesh.traces import load_request_trace, render_tree
from services.mesh.embedded_nats import free_port
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(180)

WORDS = "the model token cache request worker batch prefill decode latency cost router queue fleet".split()


@pytest.fixture(scope="module")
def two_worker_mesh(test_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Two workers serving aggregated (prefill and decode on one), on a NATS of its own."""
    running = Mesh(
        data_dir=tmp_path_factory.mktemp("mesh-router"),
        config_path=test_config,
        http_port=free_port(),
        prefill=0,
        decode=2,
        time_scale=0.05,
    ).start()
    yield running
    running.stop()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def spans_of(mesh: Mesh, request_id: str, name_prefix: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        for span in load_request_trace(mesh.data_dir, request_id):
            if span["name"].startswith(name_prefix):
                return span
        return None

    return wait_until(find, timeout_s=15)  # type: ignore[no-any-return]


def indexed_blocks(mesh: Mesh, worker_id: str) -> int:
    with urllib.request.urlopen(f"{mesh.child('router').url}/healthz", timeout=5) as response:
        entry = json.loads(response.read())["kv_index"]["by_worker"].get(worker_id)
    return int(entry["blocks"]) if entry and entry["synced"] else 0


async def test_a_request_sharing_a_long_prefix_lands_on_the_worker_holding_it(two_worker_mesh: Mesh) -> None:
    mesh = two_worker_mesh
    rng = random.Random(uuid.uuid4().int)
    holders = set()
    # Three prefixes: with two workers, landing on the holder by chance three times is 1 in 8.
    async with MeshClient(mesh.url, "acme", credentials=mesh.credentials("acme")) as client:
        for _ in range(3):
            prefix = words(rng, 600)
            first = await client.complete(prompt=f"{prefix} {words(rng, 20)}", max_tokens=4)
            decided = spans_of(mesh, first.request_id, "router.decide")["attributes"]
            holder = decided["ripple.router.prefill_worker"]
            holders.add(holder)
            # The holder's stored blocks reach the router's index within tens of milliseconds.
            blocks = first.usage.prompt_tokens // 16
            await asyncio.to_thread(wait_until, lambda h=holder, b=blocks: indexed_blocks(mesh, h) >= b, 10)

            second = await client.complete(prompt=f"{prefix} {words(rng, 20)}", max_tokens=4)
            decision = spans_of(mesh, second.request_id, "router.decide")["attributes"]
            assert decision["ripple.router.prefill_worker"] == holder
            predicted = decision["ripple.router.predicted_cached_tokens"]
            # The shared prefix's whole blocks (the tails differ, so the block they start in does too).
            assert predicted >= 560
            assert predicted == second.usage.cached_tokens
            assert decision["ripple.router.policy"] == "ripplemesh"
            assert decision["ripple.router.predicted_ttft_s"] > 0
            assert decision["ripple.router.runners_up"]  # the other worker, passed over

            # The prefill span: the actual next to the predicted, for cached tokens and TTFT.
            prefill = spans_of(mesh, second.request_id, "prefill ")["attributes"]
            assert prefill["ripple.worker_id"] == holder
            assert prefill["ripple.cached_tokens"] == second.usage.cached_tokens
            assert prefill["ripple.predicted.cached_tokens"] == predicted
            assert prefill["ripple.ttft_s"] > 0 and prefill["ripple.predicted.ttft_s"] == pytest.approx(
                decision["ripple.router.predicted_ttft_s"]
            )

            # `ripplemesh trace` prints them side by side.
            console = Console(record=True, width=400)
            console.print(render_tree(load_request_trace(mesh.data_dir, second.request_id)))
            text = console.export_text()
            assert f"cached_tokens={second.usage.cached_tokens} (predicted {predicted})" in text
            assert "ttft_s=" in text and "(predicted " in text and "runners_up[0]" in text


def router_calibration(mesh: Mesh) -> dict[str, Any]:
    with urllib.request.urlopen(f"{mesh.child('router').url}/healthz", timeout=5) as response:
        return json.loads(response.read())["calibration"]  # type: ignore[no-any-return]


async def test_the_router_learns_how_its_predictions_turn_out(two_worker_mesh: Mesh) -> None:
    # Each completion the workers report is set against the router's prediction for it: its
    # calibration (on /healthz, per GPU type) counts them, with the ratio it found.
    mesh = two_worker_mesh
    before = router_calibration(mesh).get("H100", {}).get("completion_samples", 0)
    rng = random.Random(uuid.uuid4().int)
    prefix = words(rng, 300)
    async with MeshClient(mesh.url, "acme", credentials=mesh.credentials("acme")) as client:
        for _ in range(6):
            await client.complete(prompt=f"{prefix} {words(rng, 20)}", max_tokens=8)

    def learned() -> dict[str, Any] | None:
        h100 = router_calibration(mesh).get("H100", {})
        return h100 if h100.get("completion_samples", 0) >= before + 6 else None

    h100 = await asyncio.to_thread(wait_until, learned, 15)
    assert 0.0 < h100["completion_ratio"] < 100.0 and h100["completion_spread"] > 0.0
    # The later requests' prefills found the shared prefix the index said was there.
    assert h100["cached_samples"] >= 1 and h100["cached_share"] > 0.5
