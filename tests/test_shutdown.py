"""Graceful shutdown: a service told to stop finishes the work it holds before it exits."""

from __future__ import annotations

import asyncio
import signal

import pytest

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from schemas.events import StreamFinished, TokenChunk

pytestmark = pytest.mark.timeout(120)


async def test_sigterm_to_a_decode_worker_lets_its_streams_finish(mesh: Mesh) -> None:
    max_tokens = 1500
    try:
        async with MeshClient(mesh.url, "acme", credentials=mesh.credentials("acme")) as client:
            events = client.events(prompt="a long answer, please", max_tokens=max_tokens)
            tokens, final = 0, None
            # Tokens past the first come from the decode worker: it is streaming this request.
            while tokens < 10:
                chunk = await anext(events)
                assert isinstance(chunk, TokenChunk)
                tokens += len(chunk.token_ids)
            # Stop the only decode worker while the stream is young.
            stopping = asyncio.create_task(asyncio.to_thread(mesh.stop_child, "decode-0", sig=signal.SIGTERM))
            async for event in events:
                if isinstance(event, TokenChunk):
                    tokens += len(event.token_ids)
                else:
                    final = event
            await stopping
            assert isinstance(final, StreamFinished)
            assert tokens == max_tokens == final.usage.completion_tokens
            assert mesh.child("decode-0").process.poll() == 0  # exited cleanly, after finishing
    finally:
        await asyncio.to_thread(mesh.restart_child, "decode-0")


def test_a_service_whose_http_port_is_taken_exits_and_says_why(
    nats_server,
    nats_credentials,
    test_config,
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """Not a service that works with no /metrics and no /healthz: it stops, naming the port."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "ripplemesh", "run", "router", "--http-port", str(port)]
        command += ["--nats-url", nats_server.url, "--nats-credentials", str(nats_credentials["services"])]
        command += ["--config", str(test_config), "--data-dir", str(tmp_path)]
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode != 0
    assert "address already in use" in result.stderr


def test_an_ingress_that_cannot_start_takes_no_client_and_stops_when_told(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A restarting ingress (NATS not answering, as while a stream elects its leader) says 503 on
    its own port, leaves the shared API port to the ingresses that can serve, and a SIGTERM
    ends it then, not once NATS answers."""
    import subprocess
    import sys
    import time

    import httpx

    from services.mesh.embedded_nats import free_port
    from tests.conftest import wait_until

    own, shared, nothing = free_port(), free_port(), free_port()
    command = [sys.executable, "-m", "ripplemesh", "run", "ingress", "--http-port", str(own)]
    command += ["--shared-port", str(shared), "--nats-url", f"nats://127.0.0.1:{nothing}"]
    command += ["--data-dir", str(tmp_path)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:

        def health() -> httpx.Response | None:
            try:
                return httpx.get(f"http://127.0.0.1:{own}/healthz", timeout=2)
            except httpx.TransportError:
                return None

        wait_until(lambda: health() is not None, timeout_s=30)
        answer = health()
        assert answer is not None and answer.status_code == 503
        assert answer.json()["ready"] is False
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{shared}/v1/models", timeout=2)
        asked = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        assert time.monotonic() - asked < 10
        assert process.stderr is not None and "stopped while starting" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
