"""The Batch API through the real mesh (every service its own process, real NATS, the ledger's
SQLite), driven by the official `openai` client: files and batches created, polled, read back
and cancelled; a malformed line reported with its line number while the rest run; a batch
resumed, no line run twice, after its runner is restarted; the ledger's batch class."""

from __future__ import annotations

import asyncio
import io
import signal
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types import Batch

from ripplemesh.launcher import Mesh
from schemas.events import AdmissionDecision, new_event_id
from schemas.subjects import event_subject
from services.batch.records import BatchRecord, FileRecord, LineResult, new_id
from services.batch.store import BatchStore
from services.mesh.bus import Bus
from tests.conftest import PLAIN_KEY, TEST_KEY, openai_client, wait_for_workers, wait_until
from tests.test_up import running_up

MODEL = "llama-3-8b"


@pytest.fixture
def api(mesh: Mesh) -> OpenAI:
    wait_for_workers(mesh)
    return openai_client(mesh)


def _chat_line(custom_id: str, text: str, max_tokens: int = 8, model: str = MODEL) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens},
    }


def _jsonl(lines: list[dict[str, Any] | bytes]) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else msgspec.json.encode(line)) + b"\n" for line in lines
    )


def _submit(api: OpenAI, content: bytes, endpoint: str = "/v1/chat/completions") -> Batch:
    uploaded = api.files.create(file=("requests.jsonl", io.BytesIO(content)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(content)
    batch = api.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
        metadata={"job": "test"},
    )
    assert batch.status == "validating" and batch.input_file_id == uploaded.id
    return batch


def _finished(api: OpenAI, batch_id: str, timeout_s: float = 90.0) -> Batch:
    def done() -> Batch | None:
        batch = api.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None

    return wait_until(done, timeout_s=timeout_s, interval_s=0.3)  # type: ignore[no-any-return]


def _rows(api: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [msgspec.json.decode(line) for line in api.files.content(file_id).text.splitlines() if line]


def test_a_batch_runs_with_its_output_and_error_files(api: OpenAI) -> None:
    lines: list[dict[str, Any] | bytes] = [
        _chat_line(f"req-{i}", f"Say something about {i}.") for i in range(1, 6)
    ]
    lines.insert(2, b'{"custom_id": "broken", "method": "POST", "url": ')  # line 3: not JSON
    lines.insert(4, _chat_line("nowhere", "hi", model="no-such-model"))  # line 5: the mesh's 404
    batch = _submit(api, _jsonl(lines))
    done = _finished(api, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 5, 2)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.metadata == {"job": "test"}
    # The malformed line is in the batch's errors too, with its number.
    assert done.errors is not None and done.errors.data
    assert [(e.line, e.code) for e in done.errors.data] == [(3, "invalid_line")]

    output = _rows(api, done.output_file_id)
    assert sorted(row["custom_id"] for row in output) == [f"req-{i}" for i in range(1, 6)]
    for row in output:
        assert row["error"] is None
        assert row["id"].startswith("batch_req_")
        response = row["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith(batch.id)
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] > 0

    errors = {row["error"]["line"]: row for row in _rows(api, done.error_file_id)}
    assert set(errors) == {3, 5}
    assert errors[3]["custom_id"] is None and errors[3]["response"] is None
    assert errors[3]["error"]["code"] == "invalid_line" and errors[3]["error"]["message"].startswith(
        "line 3:"
    )
    assert errors[5]["custom_id"] == "nowhere"
    assert errors[5]["response"]["status_code"] == 404
    assert "no-such-model" in errors[5]["response"]["body"]["error"]["message"]
    assert errors[5]["error"]["message"].startswith("line 5:")

    # Files and batches as the client reads them back.
    assert api.files.retrieve(done.output_file_id or "").purpose == "batch_output"
    listed = api.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]


def test_unknown_and_other_tenants_ids_are_404s(mesh: Mesh, api: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        api.files.retrieve("file-nope")
    assert caught.value.status_code == 404
    assert caught.value.body["message"] == "No such File object: file-nope"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        api.files.content("file-nope")
    with pytest.raises(openai.NotFoundError):
        api.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        api.batches.cancel("batch_nope")
    with pytest.raises(openai.NotFoundError) as caught:
        api.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert caught.value.body["param"] == "input_file_id"  # type: ignore[index]

    uploaded = api.files.create(
        file=("a.jsonl", io.BytesIO(_jsonl([_chat_line("x", "hi")]))), purpose="batch"
    )
    batch = api.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    other = OpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key=PLAIN_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    assert batch.id not in [b.id for b in other.batches.list().data]
    with pytest.raises(openai.BadRequestError):
        api.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")  # type: ignore[arg-type]
    response = httpx.post(
        f"http://127.0.0.1:{mesh.http_port}/v1/files",
        headers={"Authorization": f"Bearer {TEST_KEY}"},
        files={"file": ("a.jsonl", b"{}\n")},
        data={"purpose": "fine-tune"},
        timeout=10,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "purpose"
    _finished(api, batch.id)


def test_a_cancelled_batch_stops(api: OpenAI) -> None:
    lines: list[dict[str, Any] | bytes] = [
        _chat_line(f"c-{i}", f"Tell a long story {i}.", 64) for i in range(200)
    ]
    batch = _submit(api, _jsonl(lines))
    wait_until(lambda: api.batches.retrieve(batch.id).status == "in_progress", timeout_s=30)
    cancelling = api.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = _finished(api, batch.id, timeout_s=60)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    assert done.request_counts is not None and done.request_counts.completed < 200
    assert len(_rows(api, done.output_file_id)) == done.request_counts.completed
    assert api.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing
    # A finished batch cannot be cancelled: a 409.
    finished = _finished(api, _submit(api, _jsonl([_chat_line("one", "hi")])).id)
    assert finished.status == "completed"
    with pytest.raises(openai.ConflictError):
        api.batches.cancel(finished.id)


def _in_flight(health: dict[str, object]) -> int:
    found = [v for k, v in health.items() if k == "lines_in_flight"]
    found += [_in_flight(v) for v in health.values() if isinstance(v, dict)]
    return max((int(v) for v in found if isinstance(v, int)), default=0)


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_batch_resumes_after_its_runner_restarts_and_no_line_runs_twice(
    mesh: Mesh, api: OpenAI, how: str
) -> None:
    # Stopped: the lines in flight finish first. Killed (-9): they go on in the mesh, and the
    # new runner reads their answers back instead of running them again.
    total = 60
    batch = _submit(api, _jsonl([_chat_line(f"r-{i}", f"Resume me {i}.", 48) for i in range(1, total + 1)]))

    def some_done() -> bool:
        counts = api.batches.retrieve(batch.id).request_counts
        if counts is None or counts.completed < 3:
            return False
        # Killed, it dies with lines in the mesh: what it must not run twice.
        health = httpx.get(f"{mesh.child('batch').url}/healthz", timeout=5).json()
        return how == "stopped" or _in_flight(health) > 0

    wait_until(some_done, timeout_s=60, interval_s=0.02)
    if how == "killed":
        process = mesh.child("batch").process
        assert process is not None
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    mesh.restart_child("batch")
    before = api.batches.retrieve(batch.id)
    assert before.status == "in_progress" and before.request_counts is not None
    assert before.request_counts.completed < total, "the batch finished before the restart: nothing resumed"
    done = _finished(api, batch.id, timeout_s=120)
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == total and done.request_counts.failed == 0
    output = _rows(api, done.output_file_id)
    assert sorted(row["custom_id"] for row in output) == sorted(f"r-{i}" for i in range(1, total + 1))

    # The ledger: every line completed exactly once (one request per line), as the batch class.
    database = mesh.data_dir / "ledger.db"

    def ledger_rows() -> list[tuple[str, str, str | None]] | None:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10) as conn:
            rows = conn.execute(
                "SELECT request_id, status, service_class FROM request_costs WHERE request_id LIKE ?",
                (f"{batch.id}-%",),
            ).fetchall()
        completed = [r for r in rows if r[1] == "completed"]
        return rows if len(completed) >= total else None

    rows = wait_until(ledger_rows, timeout_s=30, interval_s=0.5)
    completed_per_line = Counter(r[0].split("-")[1] for r in rows if r[1] == "completed")
    assert set(completed_per_line) == {str(i) for i in range(1, total + 1)}
    assert set(completed_per_line.values()) == {1}, completed_per_line
    assert {r[2] for r in rows if r[1] == "completed"} == {"batch"}
    used = {row["response"]["request_id"] for row in output}
    assert used == {r[0] for r in rows if r[1] == "completed"}


def test_the_ledger_reports_the_batch_class_apart(mesh: Mesh, api: OpenAI) -> None:
    api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "interactive"}], max_tokens=4
    )
    lines = [_chat_line(f"l-{i}", "priced", 8) for i in range(3)]
    lines.append(_chat_line("nowhere", "refused", model="no-such-model"))  # the mesh's 404
    done = _finished(api, _submit(api, _jsonl(lines)).id)
    assert done.status == "completed"
    ledger = mesh.child("ledger").url

    def classes() -> dict[str, dict[str, Any]] | None:
        found = {
            c["service_class"]: c
            for c in httpx.get(f"{ledger}/v1/ledger/classes", timeout=5).json()["classes"]
        }
        batch = found.get("batch", {})
        ready = (
            batch.get("completed", 0) >= 3
            and batch.get("rejected", 0) >= 1
            and found.get("interactive", {}).get("completed", 0)
        )
        return found if ready else None

    found = wait_until(classes, timeout_s=30, interval_s=0.5)
    batch = found["batch"]
    assert batch["spend_usd"] > 0 and batch["cost_per_completed_request_usd"] > 0
    assert batch["gpu_seconds"] > 0
    assert found["interactive"]["spend_usd"] > 0
    line_request = _rows(api, done.output_file_id)[0]["response"]["request_id"]
    row = httpx.get(f"{ledger}/v1/ledger/requests/{line_request}", timeout=5).json()
    assert row["service_class"] == "batch" and row["status"] == "completed"
    # The refused line is the batch's too (RequestRejected carries the class), not interactive's.
    assert batch["rejected"] >= 1 and found["interactive"].get("rejected", 0) == 0


@pytest.mark.timeout(300)
def test_a_batch_survives_a_restart_of_every_service(tmp_path: Path) -> None:
    """`ripplemesh up` stopped mid-batch (every service and its NATS) and started again on the
    same data directory: the batch goes on from where it was, and every line ran once."""
    total = 40
    content = _jsonl([_chat_line(f"u-{i}", f"Survive {i}.", 64) for i in range(1, total + 1)])
    with running_up(tmp_path, "--time-scale", "0.05") as up:
        api = up.client()
        batch = _submit(api, content)

        def some_done() -> bool:
            counts = api.batches.retrieve(batch.id).request_counts
            return counts is not None and counts.completed >= 3

        wait_until(some_done, timeout_s=60, interval_s=0.1)
    with running_up(tmp_path, "--time-scale", "0.05") as up:
        api = up.client()
        before = api.batches.retrieve(batch.id)
        assert before.request_counts is not None and 3 <= before.request_counts.completed < total
        done = _finished(api, batch.id, timeout_s=120)
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (total, 0)
        output = _rows(api, done.output_file_id)
        assert sorted(row["custom_id"] for row in output) == sorted(f"u-{i}" for i in range(1, total + 1))
        assert api.files.content(batch.input_file_id).content == content

        def completed_lines() -> Counter[str] | None:
            with sqlite3.connect(f"file:{up.data_dir / 'ledger.db'}?mode=ro", uri=True, timeout=10) as conn:
                rows = conn.execute(
                    "SELECT request_id FROM request_costs WHERE request_id LIKE ? AND status = 'completed'",
                    (f"{batch.id}-%",),
                ).fetchall()
            lines = Counter(r[0].split("-")[1] for r in rows)
            return lines if sum(lines.values()) >= total else None

        lines = wait_until(completed_lines, timeout_s=30, interval_s=0.5)
        assert set(lines) == {str(i) for i in range(1, total + 1)} and set(lines.values()) == {1}


async def test_interactive_pressure_pauses_the_batch_and_it_resumes_after(mesh: Mesh, bus: Bus) -> None:
    """While admission says it is deferring interactive requests (its decisions on the bus, as
    admission publishes them), the runner releases no line; once they stop, the batch runs."""
    wait_for_workers(mesh)
    api = AsyncOpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key=TEST_KEY, max_retries=0)
    runner = mesh.child("batch").url

    async def press() -> None:
        decision = AdmissionDecision(
            event_id=new_event_id(),
            occurred_at=time.time(),
            request_id=f"interactive-{new_event_id()}",
            tenant="acme",
            admission="admission",
            outcome="deferred",
            reason="saturated",
            priority="standard",
        )
        await bus.publish(event_subject("admission"), decision)

    await press()
    await asyncio.sleep(0.3)
    uploaded = await api.files.create(
        file=("p.jsonl", io.BytesIO(_jsonl([_chat_line(f"p-{i}", "later", 8) for i in range(5)]))),
        purpose="batch",
    )
    batch = await api.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    paused_until = time.monotonic() + 3.0
    async with httpx.AsyncClient(base_url=runner, timeout=5) as http:
        while time.monotonic() < paused_until:
            await press()
            health = (await http.get("/healthz")).json()
            counts = (await api.batches.retrieve(batch.id)).request_counts
            assert counts is None or counts.completed == 0
            await asyncio.sleep(0.5)
        assert "interactive_pressure" in str(health), health

    async def done() -> bool:
        return (await api.batches.retrieve(batch.id)).status == "completed"

    deadline = time.monotonic() + 30
    while not await done():
        assert time.monotonic() < deadline, "the batch did not resume after the pressure ended"
        await asyncio.sleep(0.3)
    await api.close()


async def test_a_batch_past_its_window_expires_with_what_did_not_run(mesh: Mesh, bus: Bus) -> None:
    """A batch whose 24 h went by (written so, through the store ingress uses) is not run: it
    expires, and its error file says for each line that it expired."""
    wait_for_workers(mesh)
    store = BatchStore(bus)
    content = _jsonl([_chat_line(f"x-{i}", "too late") for i in range(1, 4)])
    now = int(time.time())
    source = FileRecord(
        id=new_id("file-"),
        tenant="acme",
        bytes=len(content),
        created_at=now,
        filename="late.jsonl",
        purpose="batch",
    )
    await store.put_file(source, content)
    late = BatchRecord(
        id=new_id("batch_"),
        tenant="acme",
        endpoint="/v1/chat/completions",
        input_file_id=source.id,
        completion_window="24h",
        status="in_progress",
        created_at=now - 86_401,
        in_progress_at=now - 86_400,
        expires_at=now - 1,
    )
    await store.create_batch(late)
    api = AsyncOpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key=TEST_KEY, max_retries=0)
    deadline = time.monotonic() + 30
    while (batch := await api.batches.retrieve(late.id)).status != "expired":
        assert time.monotonic() < deadline, batch.status
        await asyncio.sleep(0.2)
    assert batch.expired_at and batch.output_file_id is None and batch.error_file_id
    assert batch.request_counts is not None and batch.request_counts.completed == 0
    errors = [
        msgspec.json.decode(line) for line in (await api.files.content(batch.error_file_id)).text.splitlines()
    ]
    assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [
        (i, "batch_expired") for i in range(1, 4)
    ]
    await api.close()


def test_a_completions_batch(api: OpenAI) -> None:
    lines: list[dict[str, Any] | bytes] = [
        {
            "custom_id": f"t-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"Once {i}", "max_tokens": 6},
        }
        for i in range(2)
    ]
    done = _finished(api, _submit(api, _jsonl(lines), endpoint="/v1/completions").id)
    assert done.status == "completed" and done.error_file_id is None
    bodies = {row["custom_id"]: row["response"]["body"] for row in _rows(api, done.output_file_id)}
    assert set(bodies) == {"t-0", "t-1"}
    for body in bodies.values():
        assert body["object"] == "text_completion" and body["choices"][0]["text"]
        assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_batch_routes_are_in_the_openapi_document(mesh: Mesh) -> None:
    document = httpx.get(f"http://127.0.0.1:{mesh.http_port}/openapi.json", timeout=10).json()
    paths = document["paths"]
    assert set(paths["/v1/files"]) == {"post"} and set(paths["/v1/batches"]) == {"get", "post"}
    assert set(paths["/v1/batches/{batch_id}/cancel"]) == {"post"}
    for path in ("/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches/{batch_id}"):
        assert set(paths[path]) == {"get"}
    upload = paths["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert upload["properties"]["purpose"]["enum"] == ["batch"]
    body = document["components"]["schemas"]["CreateBatchBody"]
    assert set(body["required"]) == {"input_file_id", "endpoint", "completion_window"}
    assert "409" in paths["/v1/batches/{batch_id}/cancel"]["post"]["responses"]


def test_an_id_with_non_ascii_letters_is_unknown_not_an_error(mesh: Mesh) -> None:
    """NATS keys are ASCII: `²` or `é` (letters and digits to str.isalnum) is a 404, not a 500
    (found by the fuzzer over the OpenAPI document)."""
    headers = {"Authorization": f"Bearer {TEST_KEY}"}
    base = f"http://127.0.0.1:{mesh.http_port}/v1"
    for path in ("/files/file-²", "/files/fé/content", "/batches/batch_é", "/batches/batch_²/cancel"):
        method = "POST" if path.endswith("/cancel") else "GET"
        response = httpx.request(method, base + path, headers=headers, timeout=10)
        assert response.status_code == 404, (path, response.text)
        assert response.json()["error"]["code"] == "not_found"


async def test_the_store_reads_back_every_line_of_one_batch_and_none_of_another(bus: Bus) -> None:
    """What a resumed runner and the final files are built from: every recorded line of the
    batch, read in one request to the bucket's stream (nats-py's `keys()` could answer "none"
    on a busy machine and a finished batch said 0 of 60 completed), and no other batch's."""
    store = BatchStore(bus)
    mine, other = new_id("batch_"), new_id("batch_")
    assert await store.lines(mine) == {} and await store.sent(mine) == {}

    def result(line: int) -> LineResult:
        return LineResult(line=line, ok=line % 7 != 0, output={"custom_id": f"c-{line}"})

    await asyncio.gather(*(store.record_line(mine, result(n)) for n in range(1, 301)))
    await asyncio.gather(*(store.record_line(other, result(n)) for n in range(1, 6)))
    assert not await store.record_line(mine, result(1)), "a line is recorded once"
    await asyncio.gather(*(store.mark_sent(mine, n, f"{mine}-{n}") for n in range(1, 11)))

    lines = await store.lines(mine)
    assert sorted(lines) == list(range(1, 301))
    assert lines[14] == result(14) and not lines[14].ok
    assert sorted(await store.lines(other)) == [1, 2, 3, 4, 5]
    assert await store.sent(mine) == {n: f"{mine}-{n}" for n in range(1, 11)}
    assert await store.sent(other) == {}
