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
import random
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode
from opentelemetry.util.types import Attributes, AttributeValue

# Attribute every span about one request carries, so the request's trace can be found.
REQUEST_ID = "ripple.request_id"

_provider: TracerProvider | None = None
# The provider's one span processor, where LateSpans may be handed to it finished.
_processor: SpanProcessor | None = None
_SCOPE = InstrumentationScope("ripplemesh")
_encoder = msgspec.json.Encoder(enc_hook=str)


class _ReservableIds(RandomIdGenerator):
    """Random ids, except a span id reserved just before a span is built: a span recorded after
    the fact (LateSpan) gets the id that its children and its message's headers already carry."""

    def __init__(self) -> None:
        self._reserved = threading.local()

    def reserve(self, span_id: int) -> None:
        self._reserved.span_id = span_id

    def generate_span_id(self) -> int:
        reserved: int = getattr(self._reserved, "span_id", 0)
        if reserved:
            self._reserved.span_id = 0
            return reserved
        return super().generate_span_id()


_ids = _ReservableIds()


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
    global _processor
    provider = TracerProvider(resource=resource, id_generator=_ids)
    processor: SpanProcessor
    if otlp_configured():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processor = BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=500)
    else:
        local = LocalSpanExporter(traces_dir(data_dir) / f"{service}-{os.getpid()}.jsonl")
        processor = SimpleSpanProcessor(local)
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _provider = provider
    # A LateSpan is handed finished to the processor only where the sampler is the default
    # (parent-based): it would sample it, as its parent was (LateSpan.record).
    default_sampler = ParentBased(ALWAYS_ON).get_description()  # type: ignore[no-untyped-call]
    _processor = processor if provider.sampler.get_description() == default_sampler else None
    return provider


def shutdown_tracing() -> None:
    global _provider, _processor
    _processor = None
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


def link_to(
    traceparent: str | None, attributes: Mapping[str, AttributeValue] | None = None
) -> list[trace.Link]:
    """A link to the span a W3C traceparent names (none for None or a malformed one)."""
    if not traceparent:
        return []
    span = trace.get_current_span(extract_context({"traceparent": traceparent})).get_span_context()
    return [trace.Link(span, attributes)] if span.is_valid else []


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))


def subject_family(subject: str) -> str:
    """A low-cardinality span name part: ``rmesh.tokens.acme.r1`` -> ``rmesh.tokens``."""
    return ".".join(subject.split(".")[:2])


class _Pending(trace.Span):
    """Stands for a LateSpan until it is recorded: the current span meanwhile (its context is
    the one the recorded span will have), keeping what is set on it."""

    def __init__(self, context: SpanContext):
        self._context = context
        self.attributes: dict[str, AttributeValue] = {}
        self.status: Status | None = None
        self.events: list[tuple[str, Attributes, int]] = []
        self.exceptions: list[tuple[BaseException, Attributes, int, bool]] = []
        self.name: str | None = None

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return True

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        self.attributes.update(attributes)

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self.attributes[key] = value

    def add_event(self, name: str, attributes: Attributes = None, timestamp: int | None = None) -> None:
        self.events.append((name, attributes, timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        pass  # links are given when a span starts; none of ours adds one later

    def update_name(self, name: str) -> None:
        self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        self.status = status if isinstance(status, Status) else Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        self.exceptions.append((exception, attributes, timestamp or time.time_ns(), escaped))

    def end(self, end_time: int | None = None) -> None:
        pass  # a LateSpan ends when it is recorded


class LateSpan:
    """A span built by the SDK only when `record` is called, with the times it covered.

    Building an SDK span (sampler, attribute checks, processors) costs about 0.1 ms here, and
    the request path has one or two per service before its next message leaves. A LateSpan
    takes its id at once: while it is current (`activate`), its children and the trace
    context injected into a message name it as their parent; the SDK span, with the same id,
    its start and end times and what was set on it meanwhile, is built once the message is
    on its way. Same spans, same tree, off the critical path.

    Only under a sampled parent and this module's provider; otherwise the SDK span is started
    at once (a root span, an unsampled trace) and `record` just ends it.
    """

    __slots__ = (
        "_attributes",
        "_context",
        "_end_ns",
        "_kind",
        "_links",
        "_name",
        "_parent",
        "_pending",
        "_recorded",
        "_sdk",
        "span",
        "start_ns",
    )

    def __init__(
        self,
        name: str,
        *,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
        links: Sequence[trace.Link] = (),
    ):
        self._name = name
        self._links = links
        self._context = context if context is not None else otel_context.get_current()
        self._kind = kind
        self._attributes = attributes
        self.start_ns = time.time_ns()
        self._end_ns: int | None = None
        self._recorded = False
        self._sdk: trace.Span | None = None
        self._pending: _Pending | None = None
        parent = self._parent = trace.get_current_span(self._context).get_span_context()
        if _provider is not None and parent.is_valid and parent.trace_flags.sampled:
            self._pending = _Pending(
                SpanContext(
                    parent.trace_id,
                    random.getrandbits(64) or 1,
                    is_remote=False,
                    trace_flags=parent.trace_flags,
                    trace_state=parent.trace_state,
                )
            )
            self.span: trace.Span = self._pending
        else:
            self._sdk = tracer().start_span(
                name, self._context, kind, attributes, links=links, start_time=self.start_ns
            )
            self.span = self._sdk

    @contextmanager
    def activate(self) -> Iterator[trace.Span]:
        """Make the span current; its end is when this block ends. An exception escaping the
        block is recorded on it, with an error status (as the SDK's own spans do)."""
        token = otel_context.attach(trace.set_span_in_context(self.span, self._context))
        try:
            yield self.span
        except BaseException as exc:
            self.span.record_exception(exc, escaped=True)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            self._end_ns = time.time_ns()
            otel_context.detach(token)

    def record(self) -> None:
        """Build (if late) and end the SDK span, once, with the times it covered."""
        if self._recorded:
            return
        self._recorded = True
        end_ns = self._end_ns or time.time_ns()
        pending = self._pending
        if pending is None:
            assert self._sdk is not None
            self._sdk.end(end_time=end_ns)
            return
        attributes = {**self._attributes, **pending.attributes} if self._attributes else pending.attributes
        if _processor is not None and _provider is not None and not pending.events and not pending.exceptions:
            # The finished span as the SDK would have built it (the sampler would sample it:
            # its parent is sampled), handed to the processor without the SDK's per-span
            # machinery: about half a span's CPU (architecture §20).
            _processor.on_end(
                ReadableSpan(
                    pending.name or self._name,
                    context=pending.get_span_context(),
                    parent=self._parent,
                    resource=_provider.resource,
                    attributes=_valid_attributes(attributes),
                    kind=self._kind,
                    links=self._links,
                    status=pending.status or _UNSET,
                    start_time=self.start_ns,
                    end_time=end_ns,
                    instrumentation_scope=_SCOPE,
                )
            )
            return
        _ids.reserve(pending.get_span_context().span_id)
        span = tracer().start_span(
            pending.name or self._name,
            self._context,
            self._kind,
            attributes,
            links=self._links,
            start_time=self.start_ns,
        )
        _ids.reserve(0)  # unused if the SDK built no span (its provider was shut down)
        for name, event_attributes, timestamp in pending.events:
            span.add_event(name, event_attributes, timestamp)
        for exception, exception_attributes, timestamp, escaped in pending.exceptions:
            span.record_exception(exception, exception_attributes, timestamp, escaped)
        if pending.status is not None:
            span.set_status(pending.status)
        span.end(end_time=end_ns)


_UNSET = Status(StatusCode.UNSET)
_SCALARS = (str, bool, int, float)


def _valid_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """What the SDK would keep of them: scalar values, and sequences of one scalar type as
    tuples (others it drops, as here)."""
    valid: dict[str, Any] = {}
    for key, value in attributes.items():
        if isinstance(value, _SCALARS):
            valid[key] = value
        elif isinstance(value, list | tuple) and all(isinstance(v, _SCALARS) for v in value):
            if len({type(v) for v in value}) <= 1:
                valid[key] = tuple(value)
    return valid
