"""The ripple chain as the operator follows it: `ripplemesh trace ID --ripple` leads from a
request's routing decision to the work it placed, to the later request its cached prefix
served, and to the utilisation sample that measured its batch; real service processes."""

from __future__ import annotations

import httpx
import pytest
from click.testing import CliRunner

from ripplemesh.cli import main
from ripplemesh.launcher import Mesh
from ripplemesh.traces import load_request_trace
from tests.conftest import TEST_KEY, async_wait_until

pytestmark = pytest.mark.timeout(120)

SHARED = "You are a careful assistant. Answer in one paragraph about the sea and its tides. " * 12


async def ask(mesh: Mesh, client_id: str, question: str) -> str:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"http://127.0.0.1:{mesh.http_port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {TEST_KEY}", "x-request-id": client_id},
            json={
                "model": "llama-3-8b",
                "messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": question}],
                "max_tokens": 8,
            },
        )
    assert response.status_code == 200, response.text
    return str(response.json()["id"]).removeprefix("chatcmpl-")


async def test_trace_ripple_follows_a_placement_to_the_requests_its_cache_served(mesh: Mesh) -> None:
    first = await ask(mesh, "ripple-first", "What is a tide?")
    second = await ask(mesh, "ripple-second", "What is a wave?")

    def prefill_of(request_id: str):  # type: ignore[no-untyped-def]
        spans = load_request_trace(mesh.data_dir, request_id)
        return next((s for s in spans if s["name"].startswith("prefill ")), None)

    # The second request's prefill found the shared prompt cached, and names the first's
    # prefill, which computed it, as the cause.
    reused = await async_wait_until(lambda: prefill_of(second), timeout_s=15)
    origin = await async_wait_until(lambda: prefill_of(first), timeout_s=15)
    assert reused["attributes"]["ripple.cached_tokens"] > 0
    kinds = {(link["span_id"], link["attributes"].get("ripple.link")) for link in reused["links"]}
    assert (origin["span_id"], "reused_kv") in kinds
    # The prefill links to the decision that placed it.
    placed_by = [link for link in origin["links"] if link["attributes"].get("ripple.link") == "placed_by"]
    decide = next(s for s in load_request_trace(mesh.data_dir, first) if s["name"] == "router.decide")
    assert [link["span_id"] for link in placed_by] == [decide["span_id"]]
    # The span records the batch it joined.
    assert reused["attributes"]["ripple.batch.sequences"] >= 1

    runner = CliRunner()

    def ripple() -> str | None:
        result = runner.invoke(
            main, ["trace", "ripple-first", "--ripple", "--data-dir", str(mesh.data_dir)], terminal_width=250
        )
        if result.exit_code != 0:  # the HTTP span (with the client's id) ends last
            assert "no spans found" in result.output, result.output
            return None
        wanted = ("placed the work", "its cached prefix served", second, "utilisation sample")
        return result.output if all(w in result.output for w in wanted) else None

    # Heartbeats sample the batch once a second; spans reach the files every 200 ms.
    output = await async_wait_until(ripple, timeout_s=15)
    assert "router.decide" in output and f"request_id={second}" in output
