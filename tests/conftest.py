"""Shared fixtures: a real nats-server on a random port, and a real mesh of service processes.

The server has the mesh's NATS users (the services' and one per tenant of TEST_CONFIG, with
their permissions), so every connection authenticates: `mesh.connect_options()` for the
services' user, `mesh.credentials(tenant)` for a tenant's. With RIPPLEMESH_TEST_NATS_NODES=3 the
whole suite runs on a 3-node JetStream cluster with R3 streams.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from openai import OpenAI

from ripplemesh.launcher import Mesh
from services.mesh.bus import Bus
from services.mesh.config import MeshConfig
from services.mesh.embedded_nats import EmbeddedNats
from services.mesh.nats_auth import NatsAuth, auth_for_config

TEST_KEY = "rm-test-key"
TINY_KEY = "rm-tiny-key"
LOWLY_KEY = "rm-lowly-key"  # a sheddable-only tenant that may not ask above its class
PLAIN_KEY = "rm-plain-key"  # a standard tenant with the defaults: asking above is downgraded


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TEST_CONFIG = f"""
block_size = 16
max_prompt_tokens = 2000
max_body_bytes = 65536
first_token_timeout_s = 20.0
body_read_timeout_s = 3.0
stream_idle_timeout_s = 20.0

[[models]]
name = "llama-3-8b"
shape = "llama-3-8b"
max_context_tokens = 4096

[tenants.acme]
api_keys_sha256 = ["{_digest(TEST_KEY)}"]
max_priority = "critical"
requests_per_s = 1000.0
request_burst = 1000.0
tokens_per_s = 10000000.0
token_burst = 10000000.0

[tenants.tiny]
api_keys_sha256 = ["{_digest(TINY_KEY)}"]
requests_per_s = 0.05
request_burst = 1.0
tokens_per_s = 100000.0
token_burst = 100000.0

[tenants.plain]
api_keys_sha256 = ["{_digest(PLAIN_KEY)}"]
subscribers_read_tokens = true

[tenants.lowly]
api_keys_sha256 = ["{_digest(LOWLY_KEY)}"]
priority = "sheddable"
above_max_priority = "reject"

[gpu_prices_per_hour]
H100 = 3.6
H200 = 3.8
A100-80GB = 1.8
L40S = 1.0
B200 = 5.5
"""


TEST_NATS_NODES = int(os.environ.get("RIPPLEMESH_TEST_NATS_NODES", "1"))


def replicas_for(server: EmbeddedNats) -> int:
    """Stream replicas on this deployment: one per node, at most 3."""
    return min(3, len(server.nodes))


@pytest.fixture(scope="session")
def nats_auth() -> NatsAuth:
    """The test mesh's NATS users: the services' and one per tenant of TEST_CONFIG."""
    return auth_for_config(msgspec.toml.decode(TEST_CONFIG, type=MeshConfig))


@pytest.fixture(scope="session")
def nats_credentials(nats_auth: NatsAuth, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The users' credential files, by name ("services" or the tenant's), for other processes."""
    return nats_auth.write(tmp_path_factory.mktemp("credentials"))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory, nats_auth: NatsAuth) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"), nodes=TEST_NATS_NODES, auth=nats_auth).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
async def no_task_outlives_its_test() -> AsyncIterator[None]:
    """The suite shares one event loop: a task a test leaves running (a client reconnecting to
    a stopped server, a consumer loop, a timer) would run on beside the tests after it. Every
    background task is cancelled on shutdown, so a leftover one fails the test that left it."""
    before = asyncio.all_tasks()
    yield
    deadline = time.monotonic() + 5.0  # closing clients finish their own tasks shortly after
    while True:
        left = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
        if not left or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert not left, "tasks left running after the test: " + ", ".join(
        sorted(f"{t.get_name()} ({t.get_coro()!r:.80})" for t in left)
    )


@pytest.fixture
async def nats_cluster(tmp_path: Path, nats_auth: NatsAuth) -> AsyncIterator[EmbeddedNats]:
    """A fresh 3-node JetStream cluster on loopback for one test: random client, route and
    monitoring ports, a data directory per node, the test users; stopped afterwards."""
    async with EmbeddedNats(tmp_path / "nats-cluster", nodes=3, auth=nats_auth) as cluster:
        yield cluster


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    assert nats_server.auth is not None
    connected = await Bus.connect(
        nats_server.url, "tests", credentials=nats_server.auth.service, replicas=replicas_for(nats_server)
    )
    await connected.provision()
    yield connected
    await connected.close()


@pytest.fixture(scope="session")
def test_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "ripplemesh.toml"
    path.write_text(TEST_CONFIG)
    return path


@pytest.fixture(scope="session")
def mesh(
    nats_server: EmbeddedNats, test_config: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    """Every service as its own process, on the test NATS server, sim engine at 1/20 real time."""
    from services.mesh.embedded_nats import free_port

    running = Mesh(
        data_dir=tmp_path_factory.mktemp("mesh"),
        config_path=test_config,
        nats_url=nats_server.url,
        auth=nats_server.auth,
        nats_replicas=replicas_for(nats_server),
        http_port=free_port(),
        prefill=1,
        decode=1,
        time_scale=0.05,
    ).start()
    yield running
    running.stop()


def _poll(predicate, timeout_s: float, deadline: float):  # type: ignore[no-untyped-def]
    """The predicate's value when it holds, None while it may yet; past the deadline, a failure."""
    value = predicate()
    if value:
        return value
    if time.monotonic() > deadline:
        raise AssertionError(f"condition not met within {timeout_s}s")
    return None


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.1):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while (value := _poll(predicate, timeout_s, deadline)) is None:
        time.sleep(interval_s)
    return value


async def async_wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05):  # type: ignore[no-untyped-def]
    """wait_until for a test on the event loop: the loop runs while it waits."""
    deadline = time.monotonic() + timeout_s
    while (value := _poll(predicate, timeout_s, deadline)) is None:
        await asyncio.sleep(interval_s)
    return value


def openai_client(mesh: Mesh) -> OpenAI:
    """The official client on the mesh's HTTP API, as a user points it there."""
    return OpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key=TEST_KEY, max_retries=0)


def wait_for_workers(mesh: Mesh) -> None:
    """Ingress knows the workers (and so what they honour) once their heartbeats reached it."""

    def ready() -> bool:
        return httpx.get(f"http://127.0.0.1:{mesh.http_port}/health", timeout=5).status_code == 200

    wait_until(ready, timeout_s=30)
