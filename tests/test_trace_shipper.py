"""The trace shipper (services/trace_shipper/): the services' span files, read as they grow and
exported as the spans they were; where it got to kept across restarts; a receiver's refusal
loses nothing. Through `up` against a real receiver: tests/test_otlp_receiver.py and
tests/test_tracing_safety.py."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, StatusCode
from prometheus_client import REGISTRY

from services.mesh.tracing import LocalSpanExporter
from services.trace_shipper.files import SpanFiles, mark_existing_as_shipped
from services.trace_shipper.service import TraceShipperService


def _write_spans(directory: Path, name: str, count: int) -> list[ReadableSpan]:
    """Real SDK spans, ended into a service's span file as the services write them."""
    memory, local = InMemorySpanExporter(), LocalSpanExporter(directory / name)
    provider = TracerProvider(
        resource=Resource.create({"service.name": "ripplemesh-router"}), shutdown_on_exit=False
    )
    provider.add_span_processor(SimpleSpanProcessor(local))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
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


class _Receiver(InMemorySpanExporter):
    """The SDK's in-memory exporter, refusing while `refuse` is set (a receiver that is down)."""

    refuse = False

    def export(self, spans):  # type: ignore[no-untyped-def]
        if self.refuse:
            return SpanExportResult.FAILURE
        return super().export(spans)


def _skipped() -> float:
    return REGISTRY.get_sample_value("ripplemesh_trace_shipper_lines_skipped_total") or 0.0


def _shipper(directory: Path, receiver: _Receiver) -> TraceShipperService:
    shipper = TraceShipperService(exporter=receiver)
    shipper._files = SpanFiles.open(directory)
    return shipper


async def test_spans_reach_the_receiver_as_they_were_written(tmp_path: Path) -> None:
    written = _write_spans(tmp_path, "router-1.jsonl", 5)
    receiver = _Receiver()
    await _shipper(tmp_path, receiver).ship_round()
    shipped = {s.context.span_id: s for s in receiver.get_finished_spans()}
    assert len(shipped) == 5
    for span in written:
        got = shipped[span.context.span_id]
        assert (got.name, got.kind, got.status.status_code) == (span.name, span.kind, span.status.status_code)
        assert got.context.trace_id == span.context.trace_id
        assert (got.parent.span_id if got.parent else None) == (span.parent.span_id if span.parent else None)
        assert (got.start_time, got.end_time) == (span.start_time, span.end_time)
        assert dict(got.attributes or {}) == dict(span.attributes or {})
        assert [(link.context.span_id, dict(link.attributes or {})) for link in got.links] == [
            (link.context.span_id, dict(link.attributes or {})) for link in span.links
        ]
        assert got.resource.attributes["service.name"] == "ripplemesh-router"


async def test_a_refused_export_is_tried_again_and_a_restarted_shipper_goes_on_where_it_stopped(
    tmp_path: Path,
) -> None:
    _write_spans(tmp_path, "router-1.jsonl", 3)
    receiver = _Receiver()
    receiver.refuse = True
    shipper = _shipper(tmp_path, receiver)
    await shipper.ship_round()
    assert receiver.get_finished_spans() == () and shipper._files is not None
    assert shipper._files.behind_bytes() > 0  # kept, not dropped
    receiver.refuse = False
    await shipper.ship_round()
    assert len(receiver.get_finished_spans()) == 3

    # More spans, a line half written, a line that is no span; then a new shipper process.
    _write_spans(tmp_path, "router-1.jsonl", 2)
    with (tmp_path / "router-1.jsonl").open("ab") as file:
        file.write(b"not a span\n")
        file.write(b'{"trace_id": "ab')  # the writer is mid-line
    skipped = _skipped()
    restarted = _shipper(tmp_path, receiver)
    await restarted.ship_round()
    assert len(receiver.get_finished_spans()) == 3 + 2  # none twice, the half line not yet
    assert _skipped() == skipped + 1


async def test_files_there_before_the_run_are_not_shipped(tmp_path: Path) -> None:
    _write_spans(tmp_path, "router-old.jsonl", 4)
    mark_existing_as_shipped(tmp_path)  # as `up` does before its services start
    _write_spans(tmp_path, "router-old.jsonl", 1)  # a reused pid's file, appended to
    _write_spans(tmp_path, "router-new.jsonl", 2)
    receiver = _Receiver()
    await _shipper(tmp_path, receiver).ship_round()
    assert len(receiver.get_finished_spans()) == 1 + 2
