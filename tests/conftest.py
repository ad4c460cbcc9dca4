"""Shared fixtures: a real nats-server on a random port, and a real mesh of service processes."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from ripplemesh.launcher import Mesh
from services.mesh.bus import Bus
from services.mesh.embedded_nats import EmbeddedNats

TEST_KEY = "rm-test-key"
TINY_KEY = "rm-tiny-key"


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

[gpu_prices_per_hour]
H100 = 3.6
H200 = 3.8
A100-80GB = 1.8
L40S = 1.0
B200 = 5.5
"""


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    connected = await Bus.connect(nats_server.url, "tests")
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
        http_port=free_port(),
        prefill=1,
        decode=1,
        time_scale=0.05,
    ).start()
    yield running
    running.stop()


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.1):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)
