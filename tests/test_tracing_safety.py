"""Tracing never holds a request: a trace receiver that is down or never answers costs the
requests nothing, and its spans wait in the span files for it (shipped by `up`) or are dropped
and counted (a service exporting itself); a malformed ``traceparent`` (HTTP or NATS)
is ignored and the request starts a trace of its own; and tracing can be turned off."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import ripplemesh.client
import tests.test_up as test_up
from ripplemesh.client import MeshClient
from ripplemesh.traces import load_request_trace
from services.mesh.embedded_nats import free_port
from services.mesh.nats_auth import load_credentials
from services.mesh.tracing import BoundedBatchSpanProcessor
from tests.conftest import wait_until
from tests.test_up import RunningUp, running_up
from tests.test_up_survives import _children

pytestmark = pytest.mark.timeout(240)

DROPPED = "ripplemesh_tracing_spans_dropped_total"


class SilentReceiver:
    """A TCP server that accepts every connection and reads what comes, and never answers: a
    trace receiver that hangs."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.setblocking(False)
        self.port: int = self._server.getsockname()[1]
        self.connections = 0
        self.bytes_received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="silent-receiver", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> SilentReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._server, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.1):
                    sock: socket.socket = key.fileobj  # type: ignore[assignment]
                    if sock is self._server:
                        with contextlib.suppress(BlockingIOError):
                            conn, _ = self._server.accept()
                            conn.setblocking(False)
                            selector.register(conn, selectors.EVENT_READ)
                            self.connections += 1
                        continue
                    try:
                        data = sock.recv(65536)
                    except BlockingIOError:
                        continue
                    except ConnectionError:
                        data = b""
                    if data:
                        self.bytes_received += len(data)
                    else:
                        selector.unregister(sock)
                        sock.close()
            for key in list(selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]


def _export_to(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    """`running_up` as a user runs it, with these variables set in the user's shell."""
    user_env = test_up._user_env
    monkeypatch.setattr(test_up, "_user_env", lambda: {**user_env(), **env})


def _counter(port: int, name: str, reason: str | None = None) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and (reason is None or sample.labels.get("reason") == reason)
    )


def _stream(client: OpenAI, prompt: str, max_tokens: int = 8) -> tuple[str, str | None, Any]:
    """A streamed chat completion: its id, finish reason and usage."""
    stream = client.chat.completions.create(
        model="llama-3-8b",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    response_id, finish, usage, pieces = "", None, None, []
    for chunk in stream:
        response_id = chunk.id
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces).strip()
    return response_id, finish, usage


class CountingReceiver(ThreadingHTTPServer):
    """An OTLP/HTTP receiver on `port` that takes every export and counts its spans."""

    def __init__(self, port: int) -> None:
        receiver = self
        self.spans = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                receiver.spans += sum(
                    len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans
                )
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", port), Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="counting-receiver", daemon=True)

    def __enter__(self) -> CountingReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


def _spans_written(up: RunningUp) -> int:
    return sum(len(path.read_bytes().splitlines()) for path in (up.data_dir / "traces").glob("*.jsonl"))


@pytest.mark.parametrize(
    ("receiver", "export"), [("down", "shipped"), ("never-answers", "shipped"), ("down", "direct")]
)
def test_a_receiver_down_or_never_answering_holds_no_request_and_its_spans_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, receiver: str, export: str
) -> None:
    """`up` ships the services' span files (export "shipped", the default): a receiver that is
    down costs the requests nothing and loses no span, which reaches it once it is up. Each
    service exporting itself ("direct", RIPPLEMESH_SHIP_TRACES=0): its spans are dropped and
    counted."""
    with contextlib.ExitStack() as stack:
        silent = stack.enter_context(SilentReceiver()) if receiver == "never-answers" else None
        # Nothing listens on a free port: each export's connection is refused.
        port = silent.port if silent is not None else free_port()
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
        _export_to(monkeypatch, **env, **({"RIPPLEMESH_SHIP_TRACES": "0"} if export == "direct" else {}))
        # Left last: the mesh stops (and flushes what it can) while the receiver still hangs.
        up = stack.enter_context(running_up(tmp_path, "--time-scale", "0.05"))
        client = OpenAI(
            base_url=f"http://127.0.0.1:{up.port}/v1", api_key="rm-demo-key", max_retries=0, timeout=30
        )

        for i in range(12):
            _, finish, usage = _stream(client, f"request {i} while the receiver is {receiver}")
            assert finish == "length" and usage is not None and usage.completion_tokens == 8

        if export == "direct":
            # The spans went nowhere, and the services say so.
            dropped = wait_until(
                lambda: _counter(up.port, DROPPED, "export_failed"), timeout_s=60, interval_s=0.5
            )
            assert dropped > 0
            assert _counter(up.port, "ripplemesh_tracing_spans_exported_total") == 0
        else:
            shipper = int(_children(up)["trace-shipper"]["url"].rsplit(":", 1)[1])
            wait_until(
                lambda: _counter(shipper, "ripplemesh_trace_shipper_export_failures_total"),
                timeout_s=60,
                interval_s=0.5,
            )
            assert _counter(shipper, "ripplemesh_tracing_spans_exported_total") == 0
            assert _counter(up.port, DROPPED) == 0  # the services only wrote their files
        if silent is not None:  # the exports did reach it: it is the receiver that hung
            assert silent.connections > 0 and silent.bytes_received > 0

        # Still serving as before, once exports have failed for a while.
        completion = client.completions.create(model="llama-3-8b", prompt="Once upon", max_tokens=5)
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        assert completion.choices[0].finish_reason == "length"

        if export == "shipped" and receiver == "down":
            # The receiver comes up where it was expected: every span waiting goes to it.
            written = _spans_written(up)
            with CountingReceiver(port) as counting:
                wait_until(lambda: counting.spans >= written, timeout_s=60, interval_s=0.5)


def test_a_full_export_queue_drops_and_counts_spans_instead_of_growing() -> None:
    """Spans ended faster than a hung receiver takes them: the queue stays at its bound, the rest
    are dropped and counted, and ending a span never waits on the receiver."""

    def dropped(reason: str) -> float:
        return REGISTRY.get_sample_value(DROPPED, {"reason": reason}) or 0.0

    with SilentReceiver() as silent:
        processor = BoundedBatchSpanProcessor(
            OTLPSpanExporter(endpoint=f"{silent.url}/v1/traces", timeout=1.0),
            max_queue_size=64,
            max_export_batch_size=16,
            schedule_delay_millis=50,
            shutdown_timeout_millis=500,
        )
        provider = TracerProvider(shutdown_on_exit=False)  # this test's own, not the process's
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("queue-test")
        full_before, failed_before = dropped("queue_full"), dropped("export_failed")
        ended = 2000
        for i in range(ended):
            with tracer.start_as_current_span(f"span {i}"):
                pass
        # At most the queue and the batches taken out for export are not dropped.
        assert dropped("queue_full") - full_before >= ended - 64 - 16 * 4
        # The batch sent to the hung receiver fails once its export timeout is up.
        wait_until(lambda: dropped("export_failed") > failed_before, timeout_s=30)
        provider.shutdown()
        assert silent.connections > 0


async def test_a_malformed_traceparent_is_ignored_and_the_request_starts_a_fresh_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    malformed = [
        "garbage",
        f"00-{'z' * 32}-{span_id}-01",  # not hex
        f"00-{'0' * 32}-{span_id}-01",  # the all-zero trace id
        f"00-{trace_id}-{'0' * 16}-01",  # the all-zero span id
        f"ff-{trace_id}-{span_id}-01",  # the forbidden version
        f"00-{trace_id}-{span_id}-01-extra",  # version 00 with a fifth field
        f"00-{trace_id}-{span_id}",  # no flags
        f"00-{trace_id}-{span_id}-01" + "0" * 8000,  # oversized
    ]
    with running_up(tmp_path, "--time-scale", "0.05") as up:
        client = OpenAI(
            base_url=f"http://127.0.0.1:{up.port}/v1", api_key="rm-demo-key", max_retries=0, timeout=30
        )
        # Over HTTP, to the ingress.
        for header in malformed:
            response = client.chat.completions.with_raw_response.create(
                model="llama-3-8b",
                messages=[{"role": "user", "content": "Say something."}],
                max_tokens=4,
                extra_headers={"traceparent": header},
            )
            assert response.status_code == 200, header[:80]
            completion = response.parse()
            assert completion.choices[0].message.content and completion.choices[0].finish_reason == "length"
            root = _fresh_root(up, completion.id, not_trace_id=trace_id)
            assert root["name"] == "POST /v1/chat/completions" and root["service"] == "ripplemesh-ingress"

        # A well-formed one over HTTP is honoured: the ingress's span is the caller's child.
        http_trace_id = "5c0a3f4688c45eb7b4df030e1f1f5847"
        response = client.chat.completions.with_raw_response.create(
            model="llama-3-8b",
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=4,
            extra_headers={"traceparent": f"00-{http_trace_id}-{span_id}-01"},
        )
        http_spans = _request_spans(up, response.parse().id.removeprefix("chatcmpl-"), parent=span_id)
        assert {s["trace_id"] for s in http_spans} == {http_trace_id}
        (http_entry,) = [s for s in http_spans if s["parent_id"] == span_id]
        assert (http_entry["service"], http_entry["kind"]) == ("ripplemesh-ingress", "SERVER")

        # Over NATS, as a `MeshClient` submits: its trace context rides in the message's headers.
        credentials = load_credentials(up.data_dir / "credentials" / "tenant-demo.json")
        nats_url = up.ready_line.split()[2]

        async def submit_with(traceparent: str) -> str:
            monkeypatch.setattr(
                ripplemesh.client, "inject_headers", lambda headers: {**headers, "traceparent": traceparent}
            )
            async with MeshClient(nats_url, "demo", credentials=credentials) as mesh_client:
                done = await mesh_client.complete(prompt="Hello over NATS", max_tokens=4)
            assert done.text.strip() and done.usage.completion_tokens == 4
            return done.request_id

        for header in malformed:
            request_id = await submit_with(header)
            root = _fresh_root(up, request_id, not_trace_id=trace_id)
            assert root["service"] == "ripplemesh-ingress" and root["kind"] == "CONSUMER"

        # A well-formed one is honoured: the request's trace is the caller's (so the malformed
        # ones above were refused, not missed).
        request_id = await submit_with(f"00-{trace_id}-{span_id}-01")
        spans = _request_spans(up, request_id, parent=span_id)
        assert {s["trace_id"] for s in spans} == {trace_id}
        # The caller's span is the parent of the ingress's first span (its caller span itself is
        # not the mesh's to write).
        (entry,) = [s for s in spans if s["parent_id"] == span_id]
        assert (entry["service"], entry["kind"]) == ("ripplemesh-ingress", "CONSUMER")


def _request_spans(up: RunningUp, request_id: str, parent: str | None = None) -> list[dict[str, Any]]:
    """The spans of a request's trace once it is written whole: its decode span (which ends with
    the last token) among them, and one tree under one top span, the ingress's, whose parent is
    `parent` (each process flushes its file every 200 ms: a child may be read before its parent)."""

    def top_spans(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ids = {s["span_id"] for s in spans}
        return [s for s in spans if s["parent_id"] not in ids]

    def whole(spans: list[dict[str, Any]]) -> bool:
        tops = top_spans(spans)
        return any(s["name"].startswith("decode ") for s in spans) and [t["parent_id"] for t in tops] == [
            parent
        ]

    deadline = time.monotonic() + 15
    while not whole(spans := load_request_trace(up.data_dir, request_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert whole(spans), [(s["service"], s["name"], s["span_id"], s["parent_id"]) for s in top_spans(spans)]
    (top,) = top_spans(spans)
    assert top["service"] == "ripplemesh-ingress"
    return spans


def _fresh_root(up: RunningUp, request_id: str, *, not_trace_id: str) -> dict[str, Any]:
    """The root span of the request's trace: one trace, a new one, with one root."""
    spans = _request_spans(up, request_id)
    (trace_id,) = {s["trace_id"] for s in spans}
    assert trace_id != not_trace_id and int(trace_id, 16) != 0
    (root,) = [s for s in spans if s["parent_id"] is None]
    return root


def test_tracing_turned_off_writes_no_span_and_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _export_to(monkeypatch, OTEL_SDK_DISABLED="true")
    with running_up(tmp_path, "--time-scale", "0.05") as up:
        client = OpenAI(
            base_url=f"http://127.0.0.1:{up.port}/v1", api_key="rm-demo-key", max_retries=0, timeout=30
        )
        response_id, finish, usage = _stream(client, "Say something.")
        assert finish == "length" and usage is not None and usage.completion_tokens == 8
        # No service writes spans (nor exports any): no trace to find.
        assert list((up.data_dir / "traces").glob("*.jsonl")) == []
        assert load_request_trace(up.data_dir, response_id) == []
        assert _counter(up.port, "ripplemesh_tracing_spans_exported_total") == 0
