"""OpenTelemetry set-up: one TracerProvider per service process.

With an `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) set, spans go to that collector
over OTLP/HTTP. With none, they are appended as JSON lines under ``<data_dir>/traces/`` so that
``ripplemesh trace <request_id>`` can show a request's tree without any collector.

Trace context crosses the bus in NATS headers (W3C ``traceparent``/``tracestate``), following the
OTel messaging conventions: a producer span per publish, and a consumer "process" span per
delivery whose parent is the context the message was created in.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

# Attribute every span about one request carries, so the request's trace can be found.
REQUEST_ID = "ripple.request_id"

_provider: TracerProvider | None = None
_encoder = msgspec.json.Encoder(enc_hook=str)


class LocalSpanExporter(SpanExporter):
    """Appends finished spans to a JSON-lines file, one file per process.

    It runs synchronously in the thread that ends the span (a SimpleSpanProcessor): encoding one
    span costs microseconds, far less than handing it to an export thread that would compete with
    the event loop for the GIL. A daemon thread only flushes the file buffer every 200 ms.
    """

    FLUSH_EVERY_S = 0.2

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._flusher = threading.Thread(target=self._flush_periodically, name="span-flush", daemon=True)
        self._flusher.start()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = b"".join(_encoder.encode(span_to_dict(span)) + b"\n" for span in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
        return SpanExportResult.SUCCESS

    def _flush_periodically(self) -> None:
        while not self._stopped.wait(self.FLUSH_EVERY_S):
            self.force_flush()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
        return True

    def shutdown(self) -> None:
        self._stopped.set()
        with self._lock:
            if not self._file.closed:
                self._file.close()


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    entry: dict[str, Any] = {
        "trace_id": f"{ctx.trace_id:032x}" if ctx else None,
        "span_id": f"{ctx.span_id:016x}" if ctx else None,
        "parent_id": f"{parent.span_id:016x}" if parent else None,
        "name": span.name,
        "kind": span.kind.name,
        "service": span.resource.attributes.get("service.name"),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }
    if span.links:
        entry["links"] = [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
            for link in span.links
        ]
    return entry


def otlp_configured() -> bool:
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup_tracing(service: str, data_dir: Path) -> TracerProvider:
    """Install this process's TracerProvider (idempotent)."""
    global _provider
    if _provider is not None:
        return _provider
    resource = Resource.create({"service.name": f"ripplemesh-{service}", "service.namespace": "ripplemesh"})
    provider = TracerProvider(resource=resource)
    if otlp_configured():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=500))
    else:
        local = LocalSpanExporter(traces_dir(data_dir) / f"{service}-{os.getpid()}.jsonl")
        provider.add_span_processor(SimpleSpanProcessor(local))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    global _provider
    if _provider is not None:
        _provider.force_flush(timeout_millis=3000)
        _provider.shutdown()
        _provider = None


def traces_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "traces"


@functools.cache
def tracer(name: str = "ripplemesh") -> trace.Tracer:
    """The process's tracer; cached, because get_tracer builds a new one (not cheap) per call.

    Before `setup_tracing` the API hands out a proxy that follows the provider installed later.
    """
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str]) -> dict[str, str]:
    propagate.inject(headers)
    return headers


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))


def subject_family(subject: str) -> str:
    """A low-cardinality span name part: ``rmesh.tokens.acme.r1`` -> ``rmesh.tokens``."""
    return ".".join(subject.split(".")[:2])
