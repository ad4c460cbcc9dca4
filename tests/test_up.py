"""`ripplemesh up` as a user runs it: one command, the official OpenAI client, a clean stop."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from services.mesh.embedded_nats import free_port
from tests.conftest import wait_until

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


def _user_env() -> dict[str, str]:
    """The environment as a user's shell has it: no collector, no NATS of the machine's."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OTEL_") and k not in ("NATS_URL", "RIPPLEMESH_NATS_CREDENTIALS")
    }


@dataclass
class RunningUp:
    port: int
    data_dir: Path
    ready_line: str

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="rm-demo-key", max_retries=0)


@contextlib.contextmanager
def running_up(tmp_path: Path, *args: str) -> Iterator[RunningUp]:
    """`ripplemesh up ARGS` as a user runs it, until READY; on leaving, SIGTERM, a clean exit
    and nothing left running."""
    port = free_port()
    data_dir = tmp_path / "mesh-data"
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
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_user_env(),
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
        yield RunningUp(port, data_dir, lines[-1])
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


@pytest.mark.parametrize("nats_nodes", [1, 3], ids=["one-nats-server", "nats-cluster-3"])
def test_up_serves_the_openai_client_and_stops_cleanly(tmp_path: Path, nats_nodes: int) -> None:
    with running_up(tmp_path, "--time-scale", "0.05", "--nats-cluster", str(nats_nodes)) as up:
        client = up.client()
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
        assert len(up.ready_line.split()[2].split(",")) == nats_nodes
        credentials = up.data_dir / "credentials" / "tenant-demo.json"
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
                str(up.data_dir),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=_user_env(),
        )
        assert submitted.returncode == 0, submitted.stderr
        assert submitted.stdout.strip()


SEARCH_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the documentation for a query",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
                "required": ["query"],
            },
        },
    }
]
AGENT_SYSTEM = (
    "You are a research agent. Use the search_docs tool to look things up, one query at a time, "
    "and answer once you have read enough. Keep each answer short and cite what you read. "
) * 6


def test_a_five_step_tool_using_agent_runs_through_up_and_reuses_its_prefix(tmp_path: Path) -> None:
    """An agent as a user writes one with the official client: the model calls a tool, the tool's
    result goes back in the history (assistant tool_calls with null content, then a tool
    message), and the next call extends the conversation; the workflow headers say which step."""
    with running_up(tmp_path, "--time-scale", "0.05") as up:
        client = up.client()
        messages: list[dict[str, object]] = [
            {"role": "system", "content": AGENT_SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "How does the router pick a worker?"}]},
        ]
        usages = []
        for step in range(1, 6):
            last = step == 5
            reply = client.chat.completions.create(
                model="llama-3-8b",
                messages=messages,  # type: ignore[arg-type]
                tools=SEARCH_TOOLS,  # type: ignore[arg-type]
                tool_choice="none" if last else "required",
                max_tokens=120,
                extra_headers={
                    "x-ripple-workflow-id": "agent-run-1",
                    "x-ripple-workflow-step": str(step),
                    "x-ripple-workflow-steps": "5",
                },
            )
            choice = reply.choices[0]
            assert reply.usage is not None
            usages.append(reply.usage)
            if last:
                assert choice.finish_reason == "length" and choice.message.content
                assert not choice.message.tool_calls
                break
            assert choice.finish_reason == "tool_calls"
            (call,) = choice.message.tool_calls or []
            assert call.function.name == "search_docs"
            arguments = json.loads(call.function.arguments)
            assert isinstance(arguments["query"], str)
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.function.name, "arguments": call.function.arguments},
                        }
                    ],
                }
            )
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": f"result {step}: " + "text " * 40}
            )
        # Each step's prompt extends the previous one, and the mesh finds that prefix cached.
        for before, after in itertools.pairwise(usages):
            assert after.prompt_tokens > before.prompt_tokens
            cached = after.prompt_tokens_details.cached_tokens if after.prompt_tokens_details else 0
            assert (cached or 0) >= 0.9 * before.prompt_tokens, (cached, before.prompt_tokens)


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


def test_two_models_on_one_mesh_each_served_by_its_own_workers_and_priced_apart(tmp_path: Path) -> None:
    from services.mesh.config import DEFAULT_CONFIG

    config = tmp_path / "ripplemesh.toml"
    config.write_text(
        DEFAULT_CONFIG.read_text()
        + '\n[[models]]\nname = "qwen-2.5-7b"\nshape = "llama-3-8b"\nmax_context_tokens = 4096\n'
    )
    args = ("--config", str(config), "--model", "llama-3-8b", "--model", "qwen-2.5-7b", "--prefill", "0")
    with running_up(tmp_path, *args, "--decode", "1") as up:
        client = up.client()
        listed = {m.id for m in client.models.list().data}
        assert {"llama-3-8b", "qwen-2.5-7b"} <= listed
        served: dict[str, set[str]] = {"llama-3-8b": set(), "qwen-2.5-7b": set()}
        ids: dict[str, list[str]] = {"llama-3-8b": [], "qwen-2.5-7b": []}
        for i in range(6):
            model = ("llama-3-8b", "qwen-2.5-7b")[i % 2]
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"which model are you? {i}"}], max_tokens=4
            )
            assert reply.model == model and reply.choices[0].message.content
            ids[model].append(reply.id.removeprefix("chatcmpl-"))
        children = json.loads((up.data_dir / "supervisor.json").read_text())["children"]
        ledger_url = dict(children)["ledger"]["url"]

        def ledger_models() -> dict[str, Any] | None:
            got = {
                m["model"]: m for m in httpx.get(f"{ledger_url}/v1/ledger/models", timeout=5).json()["models"]
            }
            done = all(got.get(m, {}).get("completed", 0) >= 3 for m in served)
            return got if done else None

        models = wait_until(ledger_models, timeout_s=30, interval_s=0.5)
        for model, request_ids in ids.items():
            for request_id in request_ids:
                row = httpx.get(f"{ledger_url}/v1/ledger/requests/{request_id}", timeout=5).json()
                served[model].add(row["decode_worker"])
                assert row["model"] == model
            assert models[model]["spend_usd"] > 0
        # The router never placed a request on the other model's worker.
        assert served == {"llama-3-8b": {"decode-0"}, "qwen-2.5-7b": {"decode-qwen-2_5-7b-0"}}
        with pytest.raises(openai.NotFoundError, match="mistral"):
            client.chat.completions.create(
                model="mistral", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
