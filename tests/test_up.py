"""`ripplemesh up` as a user runs it: one command, the official OpenAI client, a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai import OpenAI

from services.mesh.embedded_nats import free_port

pytestmark = pytest.mark.timeout(150)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("nats_nodes", [1, 3], ids=["one-nats-server", "nats-cluster-3"])
def test_up_serves_the_openai_client_and_stops_cleanly(tmp_path: Path, nats_nodes: int) -> None:
    port = free_port()
    data_dir = tmp_path / "mesh-data"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OTEL_") and k not in ("NATS_URL", "RIPPLEMESH_NATS_CREDENTIALS")
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ripplemesh",
            "up",
            "--http-port",
            str(port),
            "--data-dir",
            str(data_dir),
            "--time-scale",
            "0.05",
            "--nats-cluster",
            str(nats_nodes),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 90
        lines = []
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("READY"):
                break
        assert lines and lines[-1].startswith("READY"), "".join(lines)

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="rm-demo-key", max_retries=0)
        assert [m.id for m in client.models.list()] == ["llama-3-8b"]
        stream = client.chat.completions.create(
            model="llama-3-8b",
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage, finish = [], None, None
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens == 24
        assert usage.prompt_tokens > 0
        assert finish == "length"
        assert len([p for p in pieces if p]) == 24 and "".join(pieces).strip()

        completion = client.completions.create(model="llama-3-8b", prompt="Once upon", max_tokens=5)
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        assert completion.choices[0].text.strip()

        # NATS: every node listed; the tenant's credentials written for its owner only, and
        # `ripplemesh submit` finds them (and the servers) in the data directory.
        assert len(lines[-1].split()[2].split(",")) == nats_nodes
        credentials = data_dir / "credentials" / "tenant-demo.json"
        assert credentials.stat().st_mode & 0o777 == 0o600
        submitted = subprocess.run(
            [
                sys.executable,
                "-m",
                "ripplemesh",
                "submit",
                "Hello",
                "--max-tokens",
                "4",
                "--data-dir",
                str(data_dir),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert submitted.returncode == 0, submitted.stderr
        assert submitted.stdout.strip()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            returncode = process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert returncode == 0
    # Every service and the embedded nats-server are gone.
    time.sleep(0.5)
    assert _processes_mentioning(str(data_dir)) == []


def test_up_refuses_a_deferral_queue_the_admission_consumer_cannot_hold(tmp_path: Path) -> None:
    # Deferred requests hold their messages: a queue past the consumer's max_ack_pending would
    # stall every admission replica, so the config is refused before anything starts.
    from tests.conftest import TEST_CONFIG

    config = tmp_path / "ripplemesh.toml"
    config.write_text(TEST_CONFIG + "\n[admission]\nmax_deferred = 20000\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ripplemesh",
            "up",
            "--config",
            str(config),
            "--data-dir",
            str(tmp_path / "d"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "admission.max_deferred = 20000 does not fit the admission consumer" in done.stderr
    assert "16384" in done.stderr
    assert not (tmp_path / "d").exists()  # nothing started, nothing written
