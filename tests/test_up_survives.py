"""`ripplemesh up` survives its own processes dying: kill -9 of each kind of service under a
streaming load from the official openai client, through `up` itself; the supervisor restarts it,
and the clients get every token once (the sim engine's greedy output is the reference)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ripplemesh.client import MeshClient
from services.mesh.nats_auth import load_credentials
from tests.conftest import wait_until
from tests.test_up import RunningUp, _user_env, running_up

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 300


def _children(up: RunningUp) -> dict[str, Any]:
    return dict(json.loads((up.data_dir / "supervisor.json").read_text())["children"])


def kill(up: RunningUp, name: str) -> int:
    """kill -9 a service of the running mesh; its pid."""
    pid = int(_children(up)[name]["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_back(up: RunningUp, name: str, old_pid: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """The supervisor restarted it and it is healthy again."""

    def back() -> dict[str, Any] | None:
        child = _children(up)[name]
        return child if child["state"] == "running" and child["pid"] != old_pid else None

    child: dict[str, Any] = wait_until(back, timeout_s=timeout_s, interval_s=0.2)
    return child


@dataclass
class Streams:
    """Streaming chat completions (greedy) as the official client reads them."""

    api: openai.AsyncOpenAI
    texts: dict[int, str] = field(default_factory=dict)
    chunks: dict[int, int] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)

    async def one(self, i: int, prompt: str) -> None:
        try:
            stream = await self.api.chat.completions.create(
                model="llama-3-8b",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
            )
            async for chunk in stream:
                if chunk.choices:
                    self.texts[i] = self.texts.get(i, "") + (chunk.choices[0].delta.content or "")
                    self.chunks[i] = self.chunks.get(i, 0) + 1
                    self.finish[i] = chunk.choices[0].finish_reason or self.finish.get(i)
        except openai.APIError as exc:
            self.errors[i] = repr(exc)

    async def run(
        self, prompts: list[str], when: Callable[[Streams], bool], action: Callable[[], int]
    ) -> int:
        """Every prompt streamed at once; `action` (in a thread) once `when` holds; its result."""
        tasks = [asyncio.create_task(self.one(i, p)) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 60
        while not when(self) and time.monotonic() < deadline and not all(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        assert when(self), "the streams ended before the moment to act"
        result = await asyncio.to_thread(action)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        return result

    def each_past(self, count: int, chunks: int) -> bool:
        return len(self.chunks) == count and min(self.chunks.values()) >= chunks


async def reference(api: openai.AsyncOpenAI, prompts: list[str]) -> list[str]:
    """What an undisturbed mesh answers (the sim's greedy output depends on the prompt alone)."""
    replies = await asyncio.gather(
        *(
            api.chat.completions.create(
                model="llama-3-8b",
                messages=[{"role": "user", "content": p}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            for p in prompts
        )
    )
    return [r.choices[0].message.content or "" for r in replies]


def async_client(up: RunningUp) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="rm-demo-key", max_retries=0)


def prompts(tag: str, n: int) -> list[str]:
    return [f"{tag} request {i}: tell me about the mesh and its caches " * 4 for i in range(n)]


def takeovers(up: RunningUp) -> int:
    router = _children(up)["router"]["url"]
    health = httpx.get(f"{router}/healthz", timeout=5).json()
    return sum(int(v) for v in health.get("migration", {}).get("takeovers", {}).values())


def test_killed_workers_are_restarted_and_their_streams_migrate_without_a_lost_token(tmp_path: Path) -> None:
    with running_up(tmp_path, "--prefill", "1", "--decode", "2") as up:

        async def drill() -> None:
            api = async_client(up)
            try:
                streams = Streams(api)
                asked = prompts("decode", 6)
                killed = await streams.run(
                    asked,
                    when=lambda s: max(s.chunks.values(), default=0) >= 60,
                    action=functools.partial(kill, up, "decode-0"),
                )
                assert streams.errors == {}
                assert all(streams.finish[i] == "length" for i in range(len(asked)))
                assert [streams.texts[i] for i in range(len(asked))] == await reference(api, asked)
                assert takeovers(up) >= 1  # the kill cut streams, which moved
                back = wait_back(up, "decode-0", killed)
                assert back["restarts"] == 1 and back["recoveries_s"]

                # A prefill worker killed between requests: the next ones are served all the same.
                old = kill(up, "prefill-0")
                later = prompts("prefill", 3)
                replies = await reference(api, later)
                assert all(replies)
                wait_back(up, "prefill-0", old)
                assert await reference(api, later) == replies

                # A decode worker and the router killed together: the restarted router never saw
                # the worker's earlier start, and still takes over its predecessor's streams.
                streams = Streams(api)
                asked = prompts("together", 4)
                pids: dict[str, int] = {}

                def kill_both() -> int:
                    pids["router"] = kill(up, "router")
                    pids["decode-1"] = kill(up, "decode-1")
                    return pids["decode-1"]

                await streams.run(
                    asked, when=lambda s: max(s.chunks.values(), default=0) >= 60, action=kill_both
                )
                assert streams.errors == {}
                assert [streams.texts[i] for i in range(len(asked))] == await reference(api, asked)
                for name, pid in pids.items():
                    wait_back(up, name, pid)
            finally:
                await api.close()

        asyncio.run(drill())
        status = subprocess.run(
            [sys.executable, "-m", "ripplemesh", "status", "--data-dir", str(up.data_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            env=_user_env(),
        )
        assert status.returncode == 0 and "decode-0" in status.stdout and "running" in status.stdout


def test_killed_control_plane_services_come_back_and_nothing_is_lost_or_counted_twice(tmp_path: Path) -> None:
    with running_up(tmp_path, "--prefill", "0", "--decode", "2") as up:
        nats_url = up.ready_line.split()[2]
        credentials = load_credentials(up.data_dir / "credentials" / "tenant-demo.json")

        async def drill() -> int:
            api = async_client(up)
            completed = 0
            try:
                for name in ("router", "admission", "ledger"):
                    streams = Streams(api)
                    asked = prompts(name, 4)
                    pid = await streams.run(
                        asked,
                        when=functools.partial(Streams.each_past, count=len(asked), chunks=20),
                        action=functools.partial(kill, up, name),
                    )
                    # Placed before the kill: on the workers already, the stream goes on.
                    assert streams.errors == {}, (name, streams.errors)
                    assert [streams.texts[i] for i in range(len(asked))] == await reference(api, asked)
                    wait_back(up, name, pid)
                    completed += 2 * len(asked)

                # An ingress killed: only its HTTP connections are cut; a NATS client's request
                # in flight does not notice, and HTTP serves again once it is back.
                async with MeshClient(nats_url, "demo", credentials=credentials) as client:
                    over_nats = asyncio.create_task(
                        client.complete(prompt="over nats " * 20, max_tokens=MAX_TOKENS)
                    )
                    await asyncio.sleep(0.5)
                    old = kill(up, "ingress")
                    result = await asyncio.wait_for(over_nats, timeout=60)
                assert result.finish_reason == "length" and result.usage.completion_tokens == MAX_TOKENS
                completed += 1
                wait_back(up, "ingress", old)
                assert await reference(api, ["after the ingress came back"])
                completed += 1
            finally:
                await api.close()
            return completed

        completed = asyncio.run(drill())
        # The ledger, killed mid-load and restarted, counts every completed request once.
        ledger = _children(up)["ledger"]["url"]

        def counted() -> dict[str, Any] | None:
            totals: dict[str, Any] = httpx.get(f"{ledger}/v1/ledger/totals", timeout=5).json()
            return totals if totals["requests"]["completed"] >= completed else None

        totals = wait_until(counted, timeout_s=30, interval_s=0.5)
        assert totals["requests"]["completed"] == completed, totals


def test_ingress_replicas_share_the_port_and_a_dead_one_leaves_the_others_serving(tmp_path: Path) -> None:
    with running_up(tmp_path, "--ingress", "2", "--time-scale", "0.05") as up:
        client = up.client()

        def served_by(name: str) -> float:
            metrics = httpx.get(f"{_children(up)[name]['url']}/metrics", timeout=5).text
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("ripplemesh_ingress_http_requests_total{")
            )

        def ask() -> str:
            # A connection of its own each time (as a retry after a cut connection has).
            reply = client.completions.create(
                model="llama-3-8b", prompt="hello mesh", max_tokens=4, extra_headers={"Connection": "close"}
            )
            return reply.choices[0].text

        for _ in range(30):
            assert ask()
        # The kernel spread the connections (a new one per request) over both processes.
        assert served_by("ingress-0") > 0 and served_by("ingress-1") > 0
        old = kill(up, "ingress-0")
        # While it is down (and restarting), every request finds the other: at once, or on its
        # retry when its connection was still queued on the dying process.
        client = client.with_options(max_retries=1)
        answered = [ask() for _ in range(20)]
        assert all(answered)
        wait_back(up, "ingress-0", old)
        assert ask()


def test_a_killed_nats_node_of_the_cluster_is_restarted_and_the_mesh_serves_throughout(
    tmp_path: Path,
) -> None:
    with running_up(tmp_path, "--nats-cluster", "3", "--time-scale", "0.05") as up:
        client = up.client()
        nodes = sorted(name for name in _children(up) if name.startswith("nats-"))
        assert len(nodes) == 3
        old = kill(up, nodes[0])
        # Two of three nodes keep the replicated streams' quorum: requests are served meanwhile.
        for _ in range(5):
            reply = client.completions.create(model="llama-3-8b", prompt="still there?", max_tokens=4)
            assert reply.choices[0].finish_reason == "length"
        back = wait_back(up, nodes[0], old)
        assert back["restarts"] == 1
        reply = client.completions.create(model="llama-3-8b", prompt="and now?", max_tokens=4)
        assert reply.choices[0].text
