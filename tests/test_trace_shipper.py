"""The trace shipper (services/trace_shipper/): the services' span files, read as they grow and
exported as the spans they were; where it got to kept across restarts; a receiver's refusal
loses nothing. Through `up` against a real receiver: tests/test_otlp_receiver.py and
tests/test_tracing_safety.py."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as PbResource
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, StatusCode
from prometheus_client import REGISTRY

from services.mesh.tracing import LocalSpanExporter
from services.trace_shipper.files import SpanFiles, mark_existing_as_shipped
from services.trace_shipper.otlp import OtlpHttpSender, encode_span, traces_endpoint
from services.trace_shipper.service import TraceShipperService


def _write_spans(directory: Path, name: str, count: int) -> list[ReadableSpan]:
    """Real SDK spans, ended into a service's span file as the services write them."""
    memory, local = InMemorySpanExporter(), LocalSpanExporter(directory / name)
    provider = TracerProvider(
        resource=Resource.create({"service.name": "ripplemesh-router", "service.namespace": "ripplemesh"}),
        shutdown_on_exit=False,
    )
    provider.add_span_processor(SimpleSpanProcessor(local))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("ripplemesh")  # the services' tracer (tracing.tracer)
    with tracer.start_as_current_span("router.decide", kind=SpanKind.SERVER) as root:
        root.set_attribute("ripple.request_id", "r1")
        for i in range(count - 1):
            with tracer.start_as_current_span(
                f"send rmesh.work {i}",
                kind=SpanKind.PRODUCER,
                links=[Link(root.get_span_context(), {"ripple.link": "placed_by"})],
            ) as child:
                child.set_attribute("ripple.score", 0.5 + i)
                child.set_status(StatusCode.ERROR)
    provider.shutdown()
    return list(memory.get_finished_spans())


class _Receiver:
    """A receiver of serialized OTLP export requests, refusing while `refuse` is set (one that
    is down); what it took, decoded."""

    refuse = False

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.bodies: list[bytes] = []

    def __call__(self, body: bytes) -> bool:
        if self.refuse:
            return False
        self.requests.append(ExportTraceServiceRequest.FromString(body))
        self.bodies.append(body)
        return True

    def spans(self) -> list[tuple[str, PbSpan]]:
        """(service.name, span) for every span taken."""
        return [
            (_service_of(resource_spans.resource), span)
            for request in self.requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]


def _service_of(resource: PbResource) -> str:
    return next(kv.value.string_value for kv in resource.attributes if kv.key == "service.name")


def _attributes(resource: PbResource, *, but: str) -> dict[str, object]:
    return {kv.key: MessageToDict(kv.value) for kv in resource.attributes if kv.key != but}


def _skipped() -> float:
    return REGISTRY.get_sample_value("ripplemesh_trace_shipper_lines_skipped_total") or 0.0


def _shipper(directory: Path, receiver: _Receiver) -> TraceShipperService:
    shipper = TraceShipperService(send=receiver)
    shipper._files = SpanFiles.open(directory)
    return shipper


async def test_spans_reach_the_receiver_as_the_sdk_would_have_sent_them(tmp_path: Path) -> None:
    written = _write_spans(tmp_path, "router-1.jsonl", 5)
    receiver = _Receiver()
    await _shipper(tmp_path, receiver).ship_round()
    # The SDK's own OTLP encoding of the same spans, as a service exporting directly sends them.
    (expected,) = encode_spans(written).resource_spans
    (request,) = receiver.requests
    # Written as the protobuf library itself serializes the message, byte for byte.
    assert receiver.bodies == [request.SerializeToString()]
    (got,) = request.resource_spans
    # The resource as the service described itself, but for its instance id: a random one a
    # process, which its span file does not keep.
    assert _attributes(got.resource, but="service.instance.id") == _attributes(
        expected.resource, but="service.instance.id"
    )
    assert got.scope_spans[0].scope == expected.scope_spans[0].scope
    assert _service_of(got.resource) == "ripplemesh-router"
    shipped = {span.span_id: span for span in got.scope_spans[0].spans}
    assert len(shipped) == 5
    for span in expected.scope_spans[0].spans:
        # Flags say whether the parent was remote; a span file does not know, so they are unset.
        span.flags = 0
        for link in span.links:
            link.flags = 0
        assert shipped[span.span_id] == span


def test_every_attribute_type_a_span_keeps_is_encoded_as_the_sdk_does() -> None:
    entry = {
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "span_id": "b7ad6b7169203331",
        "parent_id": None,
        "name": "router.decide",
        "kind": "INTERNAL",
        "service": "ripplemesh-router",
        "start_ns": 1,
        "end_ns": 2,
        "status": "OK",
        "attributes": {"s": "x", "i": 7, "n": -3, "f": 0.5, "b": True, "strings": ["a", "b"], "ints": [1, 2]},
        "links": [{"trace_id": "0af7651916cd43dd8448eb211c80319d", "span_id": "b7ad6b7169203332"}],
    }
    got = PbSpan.FromString(encode_span(entry))
    assert {kv.key: MessageToDict(kv.value) for kv in got.attributes} == {
        "s": {"stringValue": "x"},
        "i": {"intValue": "7"},
        "n": {"intValue": "-3"},
        "f": {"doubleValue": 0.5},
        "b": {"boolValue": True},
        "strings": {"arrayValue": {"values": [{"stringValue": "a"}, {"stringValue": "b"}]}},
        "ints": {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": "2"}]}},
    }
    assert (got.status.code, got.parent_span_id, got.kind) == (1, b"", PbSpan.SPAN_KIND_INTERNAL)
    assert [link.span_id.hex() for link in got.links] == ["b7ad6b7169203332"]
    broken_entries = (
        {**entry, "span_id": "b7ad"},
        {**entry, "kind": "SIDEWAYS"},
        {**entry, "attributes": {"o": object()}},
        {**entry, "attributes": {"big": 2**64}},
        {**entry, "start_ns": -1},
        {key: value for key, value in entry.items() if key != "end_ns"},
    )
    for broken in broken_entries:
        with pytest.raises((KeyError, ValueError, TypeError)):
            encode_span(broken)


def test_the_sender_posts_where_and_as_the_otlp_variables_say() -> None:
    """A real HTTP server on a free port stands in for the receiver."""
    received: list[tuple[str, dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        sender = OtlpHttpSender(
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": base + "/",
                "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20abc,x-tenant=acme",
                "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
            }
        )
        assert sender(b"\x0a\x00") is True
        sender.close()
        path, headers, body = received[-1]
        assert (path, gzip.decompress(body)) == ("/v1/traces", b"\x0a\x00")
        assert headers["authorization"] == "Bearer abc" and headers["x-tenant"] == "acme"
        assert headers["content-type"] == "application/x-protobuf" and headers["content-encoding"] == "gzip"
        # The traces endpoint is taken as it is; a receiver that refuses is a False.
        refused = OtlpHttpSender({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": base + "/elsewhere"})
        assert refused(b"") is False and received[-1][0] == "/elsewhere"
        refused.close()
    finally:
        server.shutdown()
        server.server_close()
    # Nobody listening: a False, not an exception.
    gone = OtlpHttpSender({"OTEL_EXPORTER_OTLP_ENDPOINT": base, "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
    assert gone(b"") is False
    gone.close()
    assert traces_endpoint({}) == "http://localhost:4318/v1/traces"


async def test_a_refused_export_is_tried_again_and_a_restarted_shipper_goes_on_where_it_stopped(
    tmp_path: Path,
) -> None:
    _write_spans(tmp_path, "router-1.jsonl", 3)
    receiver = _Receiver()
    receiver.refuse = True
    shipper = _shipper(tmp_path, receiver)
    await shipper.ship_round()
    assert receiver.spans() == [] and shipper._files is not None
    assert shipper._files.behind_bytes() > 0  # kept, not dropped
    receiver.refuse = False
    await shipper.ship_round()
    assert len(receiver.spans()) == 3

    # More spans, a line half written, a line that is no span; then a new shipper process.
    _write_spans(tmp_path, "router-1.jsonl", 2)
    with (tmp_path / "router-1.jsonl").open("ab") as file:
        file.write(b"not a span\n")
        file.write(b'{"trace_id": "00", "span_id": "11"}\n')  # JSON, but no span
        file.write(b'{"trace_id": "ab')  # the writer is mid-line
    skipped = _skipped()
    restarted = _shipper(tmp_path, receiver)
    await restarted.ship_round()
    assert len(receiver.spans()) == 3 + 2  # none twice, the half line not yet
    assert _skipped() == skipped + 2


async def test_files_there_before_the_run_are_not_shipped(tmp_path: Path) -> None:
    _write_spans(tmp_path, "router-old.jsonl", 4)
    mark_existing_as_shipped(tmp_path)  # as `up` does before its services start
    _write_spans(tmp_path, "router-old.jsonl", 1)  # a reused pid's file, appended to
    _write_spans(tmp_path, "router-new.jsonl", 2)
    receiver = _Receiver()
    await _shipper(tmp_path, receiver).ship_round()
    assert len(receiver.spans()) == 1 + 2
