"""Hostile events on every consumed subject: no consumer dies, every bad message is dead-lettered.

Hypothesis generates batches of payloads (raw bytes, bad UTF-8, arbitrary JSON, every event type
of the contract, and the subject's own event type with one field removed or set to an absurd
value) and publishes them to each subject a service consumes, on a mesh of its own (valid work on
a worker's subject is real work). A payload the consumer's type cannot decode must reach the dead
letter stream with the reason; one it can decode must be handled without killing anything; after
every batch each service is still alive and healthy, and at the end the mesh still serves.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from schemas.events import (
    ClientEvent,
    DeadLetter,
    DecodeWork,
    LifecycleEvent,
    PrefillWork,
    RequestAdmitted,
    RequestPrepared,
)
from schemas.subjects import DLQ, dlq_subject
from services.mesh.embedded_nats import free_port
from tests.test_schemas import SAMPLES

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Target:
    """A subject a service consumes, the stream it lands on and the type its consumer decodes."""

    subject: str
    stream: str
    event_type: Any


# One subject per durable consumer of the mesh (see schemas/subjects.py's ConsumerSpecs and the
# `runtime.consume(...)` call of each service).
TARGETS = [
    Target("rmesh.req.acme", "REQUESTS", ClientEvent),
    Target("rmesh.prepared.acme", "REQUESTS", RequestPrepared),
    Target("rmesh.admitted.standard", "ADMITTED", RequestAdmitted),
    Target("rmesh.work.prefill.prefill-0", "WORK", PrefillWork),
    Target("rmesh.work.decode.decode-0", "WORK", DecodeWork),
    Target("rmesh.events.fuzz", "LIFECYCLE", LifecycleEvent),
]

SAMPLE_BUILTINS = [msgspec.to_builtins(sample) for sample in SAMPLES]

hostile_values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=200),
    st.none(),
    st.booleans(),
    st.lists(st.integers(min_value=-(2**64), max_value=2**64), max_size=40),
    st.dictionaries(st.text(max_size=10), st.integers(), max_size=5),
)

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=50)),
    lambda children: st.one_of(
        st.lists(children, max_size=5), st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)


def _encode(value: Any) -> bytes:
    # allow_nan: NaN and Infinity are not JSON; they must be refused like any other bad input.
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def mutated_sample(draw: st.DrawFn) -> bytes:
    sample: dict[str, Any] = dict(draw(st.sampled_from(SAMPLE_BUILTINS)))
    sample["event_id"] = uuid.uuid4().hex  # a fresh id, so the consumer's dedupe does not hide it
    fields = sorted(k for k in sample if k != "type")
    field = draw(st.sampled_from(fields))
    if draw(st.booleans()):
        del sample[field]
    else:
        sample[field] = draw(hostile_values)
    return _encode(sample)


@st.composite
def bad_utf8(draw: st.DrawFn) -> bytes:
    raw = _encode(draw(st.sampled_from(SAMPLE_BUILTINS)))
    at = draw(st.integers(min_value=0, max_value=len(raw)))
    return raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"])) + raw[at:]


payloads = st.one_of(
    st.binary(max_size=2048),
    bad_utf8(),
    json_values.map(_encode),
    st.sampled_from(SAMPLE_BUILTINS).map(lambda s: _encode({**s, "event_id": uuid.uuid4().hex})),
    mutated_sample(),
)


def _decodes(payload: bytes, event_type: Any) -> bool:
    try:
        msgspec.json.decode(payload, type=event_type)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def fuzz_mesh(test_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A mesh with its own NATS server: the fuzzed work must not reach other tests' workers."""
    running = Mesh(
        data_dir=tmp_path_factory.mktemp("fuzz-mesh"),
        config_path=test_config,
        http_port=free_port(),
        time_scale=0.01,
    ).start()
    yield running
    running.stop()


def _assert_alive(mesh: Mesh) -> None:
    for child in mesh.children:
        assert child.process is not None and child.process.poll() is None, f"{child.name} died"
        with urllib.request.urlopen(f"{child.url}/healthz", timeout=5) as response:
            assert json.loads(response.read())["ready"] is True, f"{child.name} not ready"


async def _dead_letters(js: Any, stream: str, since_seq: int) -> list[DeadLetter]:
    sub = await js.subscribe(dlq_subject(stream), stream=DLQ.name, ordered_consumer=True)
    letters: list[DeadLetter] = []
    try:
        while True:
            msg = await sub.next_msg(timeout=0.3)
            if msg.metadata.sequence.stream > since_seq:
                letters.append(msgspec.json.decode(msg.data, type=DeadLetter))
    except (TimeoutError, nats.errors.TimeoutError):
        pass
    finally:
        await sub.unsubscribe()
    return letters


async def _publish_and_check(mesh: Mesh, batch: list[tuple[Target, bytes]]) -> None:
    nc = await nats.connect(mesh.servers, **mesh.connect_options())
    try:
        js = nc.jetstream()
        dlq_start = (await js.stream_info(DLQ.name)).state.last_seq
        expected: dict[str, Target] = {}
        for target, payload in batch:
            marker = uuid.uuid4().hex
            await js.publish(target.subject, payload, headers={"Fuzz-Case": marker}, timeout=5)
            if not _decodes(payload, target.event_type):
                expected[marker] = target
        found: dict[str, DeadLetter] = {}
        deadline = time.monotonic() + 20
        while len(found) < len(expected) and time.monotonic() < deadline:
            for stream in {t.stream for t in expected.values()}:
                for letter in await _dead_letters(js, stream, dlq_start):
                    marker = letter.headers.get("Fuzz-Case", "")
                    if marker in expected:
                        found[marker] = letter
        missing = [expected[m].subject for m in expected if m not in found]
        assert not missing, f"undecodable messages not dead-lettered, on: {missing}"
        for marker, letter in found.items():
            assert letter.subject == expected[marker].subject
            # By its consumer, or (a worker's work) by the router that took over a worker it
            # thought lost, on a loaded machine: "undecodable work of gone worker ...".
            assert letter.reason.startswith("undecodable"), letter.reason
    finally:
        await nc.drain()


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(st.tuples(st.sampled_from(TARGETS), payloads), min_size=1, max_size=15))
def test_hostile_events_are_dead_lettered_and_no_consumer_dies(
    fuzz_mesh: Mesh, batch: list[tuple[Target, bytes]]
) -> None:
    asyncio.run(asyncio.wait_for(_publish_and_check(fuzz_mesh, batch), timeout=60))
    _assert_alive(fuzz_mesh)


def test_every_event_type_on_every_subject(fuzz_mesh: Mesh) -> None:
    """Not left to chance: each event type of the contract on each consumed subject."""
    batch = [
        (target, _encode({**sample, "event_id": uuid.uuid4().hex}))
        for target in TARGETS
        for sample in SAMPLE_BUILTINS
    ]
    asyncio.run(asyncio.wait_for(_publish_and_check(fuzz_mesh, batch), timeout=90))
    _assert_alive(fuzz_mesh)


async def test_the_mesh_still_serves_after_the_fuzzing(fuzz_mesh: Mesh) -> None:
    async with MeshClient(fuzz_mesh.url, "acme", credentials=fuzz_mesh.credentials("acme")) as client:
        done = await asyncio.wait_for(client.complete(prompt="still here", max_tokens=5), timeout=30)
    assert done.usage.completion_tokens == 5


# ---------------------------------------------------------------- the HTTP API


GOOD_CHAT: dict[str, Any] = {
    "model": "llama-3-8b",
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 3,
}
GOOD_COMPLETION: dict[str, Any] = {"model": "llama-3-8b", "prompt": "hello there", "max_tokens": 3}
HEADERS_TO_FUZZ = [
    "x-ripple-priority",
    "x-ripple-deadline-ms",
    "x-ripple-workflow-step",
    "x-ripple-workflow-id",
]


@st.composite
def hostile_body(draw: st.DrawFn) -> tuple[str, bytes]:
    route, good = draw(st.sampled_from([("chat/completions", GOOD_CHAT), ("completions", GOOD_COMPLETION)]))
    kind = draw(st.sampled_from(["field", "missing", "json", "bytes", "utf8"]))
    body: dict[str, Any] = dict(good)
    if kind == "field":
        field = draw(st.sampled_from([*good, "temperature", "stream", "n", "max_completion_tokens"]))
        body[field] = draw(hostile_values)
        body["stream"] = body.get("stream") if field == "stream" else False
        return route, _encode(body)
    if kind == "missing":
        del body[draw(st.sampled_from(sorted(good)))]
        return route, _encode(body)
    if kind == "json":
        return route, _encode(draw(json_values))
    if kind == "bytes":
        return route, draw(st.binary(max_size=512))
    raw = _encode(good)
    at = draw(st.integers(min_value=0, max_value=len(raw)))
    return route, raw[:at] + b"\xff\xfe" + raw[at:]


def _api(mesh: Mesh) -> str:
    return f"http://127.0.0.1:{mesh.http_port}/v1"


def _assert_clear_answer(status: int, body: bytes) -> None:
    """200, or a 4xx whose JSON body says what is wrong; never a 5xx or an empty error."""
    assert status == 200 or 400 <= status < 500, (status, body[:300])
    if status != 200:
        message = json.loads(body)["error"]["message"]
        assert isinstance(message, str) and message.strip()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    case=hostile_body(),
    header=st.one_of(
        st.none(),
        # What HTTP allows in a header value: visible latin-1 and spaces, no control characters.
        st.tuples(
            st.sampled_from(HEADERS_TO_FUZZ),
            st.text(
                st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40
            ),
        ),
    ),
)
def test_hostile_http_bodies_get_a_4xx_with_a_message(
    fuzz_mesh: Mesh, case: tuple[str, bytes], header: tuple[str, str] | None
) -> None:
    import httpx

    from tests.conftest import TEST_KEY

    route, body = case
    headers: dict[str, str | bytes] = {
        "Authorization": f"Bearer {TEST_KEY}",
        "content-type": "application/json",
    }
    if header is not None:
        # Raw bytes on the wire (latin-1), including ones that are not valid UTF-8.
        name, value = header
        headers[name] = value.strip(" \t").encode("latin-1", "replace")  # h11: no edge whitespace
    response = httpx.post(f"{_api(fuzz_mesh)}/{route}", content=body, headers=headers, timeout=30)
    _assert_clear_answer(response.status_code, response.content)


def test_absurd_numbers_and_oversized_bodies(fuzz_mesh: Mesh) -> None:
    import httpx

    from tests.conftest import TEST_KEY

    url = f"{_api(fuzz_mesh)}/chat/completions"
    auth = {"Authorization": f"Bearer {TEST_KEY}"}
    with httpx.Client(timeout=30) as http:
        for absurd in [
            {"max_tokens": 2**70},
            {"max_tokens": -1},
            {"max_tokens": 0},
            {"temperature": 1e308},
            {"temperature": -3},
            {"n": 17},  # more choices than one request may fan out to
            {"max_completion_tokens": 10**30},
        ]:
            r = http.post(url, json={**GOOD_CHAT, **absurd}, headers=auth)
            assert r.status_code == 400, (absurd, r.status_code, r.text)
            assert r.json()["error"]["message"]
        for name, value in [
            ("x-ripple-deadline-ms", "-5"),
            ("x-ripple-deadline-ms", "1e400"),
            ("x-ripple-deadline-ms", "99999999999999999999"),
            ("x-ripple-workflow-step", "-1"),
        ]:
            r = http.post(url, json=GOOD_CHAT, headers={**auth, name: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, value, r.text)
        # Declared too big: refused before the body is read. Streamed too big (chunked): refused
        # once it passes the limit.
        r = http.post(url, content=b"x" * 5_000_000, headers=auth)
        assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
        r = http.post(url, content=iter([b"x" * 65536] * 80), headers=auth)
        assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]


async def _open(mesh: Mesh) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", mesh.http_port), timeout=5)


async def test_slow_and_disconnecting_clients_do_not_block_others(fuzz_mesh: Mesh) -> None:
    import httpx

    from tests.conftest import TEST_KEY

    body = json.dumps(GOOD_CHAT).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TEST_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    # A slow client: headers, then one byte now and then. It is answered 408 once the body
    # read timeout (3 s in the test config) passes, and it holds nobody else up meanwhile.
    slow_reader, slow_writer = await _open(fuzz_mesh)
    slow_writer.write(head + body[:1])
    await slow_writer.drain()

    async def dribble() -> None:
        for byte in body[1:20]:
            await asyncio.sleep(0.3)
            slow_writer.write(bytes([byte]))
            await slow_writer.drain()

    dribbling = asyncio.create_task(dribble())
    # Clients that vanish: mid-headers, mid-body, and mid-stream after the first SSE event.
    for cut in (head[:30], head + body[:10]):
        _, writer = await _open(fuzz_mesh)
        writer.write(cut)
        await writer.drain()
        writer.close()
    streaming = json.dumps({**GOOD_CHAT, "stream": True, "max_tokens": 200}).encode()
    reader, writer = await _open(fuzz_mesh)
    writer.write(head.replace(str(len(body)).encode(), str(len(streaming)).encode()) + streaming)
    await writer.drain()
    assert b"200" in await asyncio.wait_for(reader.readline(), timeout=30)
    await asyncio.wait_for(reader.readuntil(b"data: "), timeout=30)
    writer.close()
    async with httpx.AsyncClient(timeout=30) as http:
        started = time.monotonic()
        r = await http.post(
            f"{_api(fuzz_mesh)}/chat/completions",
            json=GOOD_CHAT,
            headers={"Authorization": f"Bearer {TEST_KEY}"},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert time.monotonic() - started < 3, "a slow client held up another request"
    answer = b""
    read_until = time.monotonic() + 15
    # The status line and the body may come in separate reads.
    while b"not received within" not in answer and time.monotonic() < read_until:
        part = await asyncio.wait_for(slow_reader.read(4096), timeout=max(0.1, read_until - time.monotonic()))
        if not part:
            break
        answer += part
    dribbling.cancel()
    slow_writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"not received within" in answer
    _assert_alive(fuzz_mesh)
