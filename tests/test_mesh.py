"""The whole request path through real service processes on a real NATS server."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid

import httpx
import msgspec
import pytest

from ripplemesh.client import MeshClient, MeshError
from ripplemesh.launcher import Mesh
from ripplemesh.traces import load_request_trace
from schemas.events import DeadLetter, StreamFinished, TokenChunk
from schemas.subjects import DLQ, REQUESTS, dlq_subject, request_subject
from tests.conftest import TEST_KEY, TINY_KEY, wait_until

pytestmark = pytest.mark.timeout(120)


def api(mesh: Mesh) -> str:
    return f"http://127.0.0.1:{mesh.http_port}/v1"


async def test_mesh_client_receives_every_chunk_in_order(mesh: Mesh) -> None:
    async with MeshClient(mesh.url, "acme", credentials=mesh.credentials("acme")) as client:
        seqs, tokens = [], 0
        final = None
        async for event in client.events(prompt="the router picks a worker", max_tokens=40):
            seqs.append(event.seq)
            if isinstance(event, TokenChunk):
                tokens += len(event.token_ids)
            else:
                final = event
        assert seqs == list(range(len(seqs)))
        assert isinstance(final, StreamFinished)
        assert tokens == 40 == final.usage.completion_tokens
        assert final.finish_reason == "length"


async def test_concurrent_requests_all_complete(mesh: Mesh) -> None:
    async with MeshClient(mesh.url, "acme", credentials=mesh.credentials("acme")) as client:
        results = await asyncio.gather(
            *(client.complete(prompt=f"request number {i} for the fleet", max_tokens=12) for i in range(30))
        )
    assert [r.usage.completion_tokens for r in results] == [12] * 30
    assert len({r.request_id for r in results}) == 30


async def test_one_request_is_one_trace_across_every_service(mesh: Mesh) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"{api(mesh)}/chat/completions",
            headers={"Authorization": f"Bearer {TEST_KEY}"},
            json={
                "model": "llama-3-8b",
                "messages": [{"role": "user", "content": "trace me"}],
                "max_tokens": 5,
            },
        )
    assert response.status_code == 200, response.text
    request_id = response.json()["id"].removeprefix("chatcmpl-")

    def spans():  # type: ignore[no-untyped-def]
        found = load_request_trace(mesh.data_dir, request_id)
        services = {s["service"].removeprefix("ripplemesh-") for s in found}
        # The prefill service is on the trace when the router disaggregated; aggregated, the
        # decode worker ran the prefill too.
        modes = {s["attributes"].get("ripple.router.mode") for s in found if s["name"] == "router.decide"}
        wanted = {"ingress", "admission", "router", "decode", "ledger"}
        if modes and not modes <= {"aggregated", "disaggregated"}:
            raise AssertionError(f"the router.decide span names no serving mode: {modes}")
        if "disaggregated" in modes:
            wanted.add("prefill")
        # The HTTP span ends last, after the response body is sent.
        has_root = any(s["name"] == "POST /v1/chat/completions" for s in found)
        # Each process writes its spans out every 200 ms: wait for every parent to be written
        # (a consumer taking a message directly ends before its producer span does).
        ids = {s["span_id"] for s in found}
        whole = sum(s["parent_id"] not in ids for s in found) == 1
        return found if modes and wanted <= services and has_root and whole else None

    found = wait_until(spans, timeout_s=15)
    assert len({s["trace_id"] for s in found}) == 1
    ids = {s["span_id"] for s in found}
    roots = [s for s in found if s["parent_id"] not in ids]
    assert len(roots) == 1 and roots[0]["name"] == "POST /v1/chat/completions"
    # Every consumer span is a child of the producer span that sent its message.
    by_id = {s["span_id"]: s for s in found}
    for span in found:
        if span["kind"] == "CONSUMER":
            assert by_id[span["parent_id"]]["kind"] == "PRODUCER"
            # The OTel messaging conventions: which system, subject, message and delivery.
            attributes = span["attributes"]
            assert attributes["messaging.system"] == "nats" and attributes["messaging.message.id"]
            assert attributes["messaging.destination.name"].startswith("rmesh.")
            assert attributes["messaging.message.delivery_count"] >= 1


async def test_bad_http_input_gets_a_clear_error_and_the_mesh_keeps_serving(mesh: Mesh) -> None:
    url = f"{api(mesh)}/chat/completions"
    auth = {"Authorization": f"Bearer {TEST_KEY}"}
    good = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(url, json=good, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await http.post(url, content=b"{nope", headers={**auth, "content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = await http.post(url, json={**good, "max_tokens": "many"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = await http.post(
            url, json={**good, "messages": [{"role": "wizard", "content": "x"}]}, headers=auth
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
        long_prompt = " the" * 2500
        r = await http.post(
            url, json={**good, "messages": [{"role": "user", "content": long_prompt}]}, headers=auth
        )
        assert r.status_code == 400 and "the limit is 2000" in r.json()["error"]["message"]
        r = await http.post(url, json={**good, "model": "gpt-9"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = await http.post(url, content=b"x" * 70000, headers=auth)
        assert r.status_code == 413
        r = await http.post(url, json=good, headers={**auth, "x-ripple-priority": "urgent"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-ripple-priority"
        r = await http.post(url, json=good, headers=auth)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


async def test_quota_rejection_is_429_with_retry_after(mesh: Mesh) -> None:
    url = f"{api(mesh)}/completions"
    body = {"model": "llama-3-8b", "prompt": "quota", "max_tokens": 2}
    async with httpx.AsyncClient(timeout=30) as http:
        first = await http.post(url, json=body, headers={"Authorization": f"Bearer {TINY_KEY}"})
        second = await http.post(url, json=body, headers={"Authorization": f"Bearer {TINY_KEY}"})
    assert first.status_code == 200
    assert second.status_code == 429
    assert int(second.headers["retry-after"]) >= 1
    assert second.json()["error"]["code"] == "quota"


async def test_malformed_nats_submission_is_dead_lettered_and_serving_goes_on(mesh: Mesh) -> None:
    import nats

    nc = await nats.connect(mesh.servers, **mesh.connect_options())
    try:
        js = nc.jetstream()
        marker = uuid.uuid4().hex
        await js.publish(
            request_subject("acme"), f'{{"type": "request.submit.v1", "junk": "{marker}"}}'.encode()
        )
        found = None
        deadline = time.monotonic() + 10
        while found is None and time.monotonic() < deadline:
            sub = await js.subscribe(dlq_subject(REQUESTS.name), stream=DLQ.name, ordered_consumer=True)
            try:
                while True:
                    letter = msgspec.json.decode((await sub.next_msg(timeout=0.5)).data, type=DeadLetter)
                    if marker.encode() in letter.data:
                        found = letter
            except TimeoutError:
                pass
            finally:
                await sub.unsubscribe()
        assert found is not None, "the malformed submission was not dead-lettered"
        assert found.consumer == "ingress" and found.reason.startswith("undecodable")
        async with MeshClient(mesh.url, "acme", nc=nc) as client:
            done = await client.complete(prompt="still serving", max_tokens=4)
            assert done.usage.completion_tokens == 4
            with pytest.raises(MeshError) as rejected:
                await client.complete(prompt="x", max_tokens=4, model="no-such-model")
            assert rejected.value.http_status == 404
            # A submission outside the schema is dead-lettered, and its client told why at once
            # (not left to wait for a first token that never comes).
            started = time.monotonic()
            with pytest.raises(MeshError) as invalid:
                await client.complete(prompt="x", max_tokens=4, priority="urgent")  # type: ignore[arg-type]
            assert time.monotonic() - started < 5
            assert invalid.value.http_status == 400 and invalid.value.code == "invalid"
            assert "priority" in invalid.value.message
    finally:
        await nc.drain()


async def test_service_health_and_metrics(mesh: Mesh) -> None:
    for child in mesh.children:
        with urllib.request.urlopen(f"{child.url}/healthz", timeout=5) as response:
            assert json.loads(response.read())["ready"] is True
    with urllib.request.urlopen(f"{mesh.child('router').url}/metrics", timeout=5) as response:
        assert b"ripplemesh_router_placements_total" in response.read()


async def test_ripplemesh_trace_takes_the_ids_the_client_saw(mesh: Mesh) -> None:
    """Tried as a new user would: the response's id and the client's own x-request-id both find
    the request's trace; an id nobody sent says where it looked."""
    from click.testing import CliRunner

    from ripplemesh.cli import main

    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"{api(mesh)}/chat/completions",
            headers={"Authorization": f"Bearer {TEST_KEY}", "x-request-id": "my-client-id-42"},
            json={
                "model": "llama-3-8b",
                "messages": [{"role": "user", "content": "find me"}],
                "max_tokens": 4,
            },
        )
    assert response.status_code == 200 and response.headers["x-request-id"] == "my-client-id-42"
    response_id = response.json()["id"]
    assert response_id.startswith("chatcmpl-")
    wait_until(lambda: load_request_trace(mesh.data_dir, response_id.removeprefix("chatcmpl-")), timeout_s=15)
    runner = CliRunner()
    for seen_id in (response_id, "my-client-id-42"):

        def printed(seen_id: str = seen_id) -> str | None:
            # Each process writes its spans every 200 ms: wait until the router's is there too.
            result = runner.invoke(main, ["trace", seen_id, "--data-dir", str(mesh.data_dir)])
            wanted = ("POST /v1/chat/completions", "router.decide")
            found = result.exit_code == 0 and all(name in result.output for name in wanted)
            return result.output if found else None

        output = wait_until(printed, timeout_s=15)
        assert "POST /v1/chat/completions" in output and "router.decide" in output
    missing = runner.invoke(main, ["trace", "chatcmpl-nobody", "--data-dir", str(mesh.data_dir)])
    assert missing.exit_code != 0 and "no spans found for request chatcmpl-nobody" in missing.output
    assert "x-request-id" in missing.output
