"""OpenTelemetry set-up: one TracerProvider per service process.

With an `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) set, spans go to that collector
over OTLP/HTTP. With none, they are appended as JSON lines under ``<data_dir>/traces/`` so that
``ripplemesh trace <request_id>`` can show a request's tree without any collector.

Trace context crosses the bus in NATS headers (W3C ``traceparent``/``tracestate``), following the
OTel messaging conventions: a producer span per publish, and a consumer "process" span per
delivery whose parent is the context the message was created in.

A receiver that is down or slow never holds a request: ending a span only appends it to a
bounded queue (`MAX_QUEUE_SIZE`), which one export thread drains, each export given
`EXPORT_TIMEOUT_S` at most. A span that does not fit the queue, or whose export failed, is
dropped and counted in ``ripplemesh_tracing_spans_dropped_total{reason}``. The standard
``OTEL_BSP_*`` and ``OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT`` variables override these defaults, and
``OTEL_SDK_DISABLED=true`` turns tracing off: no spans, no trace context sent on.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from random import getrandbits
from typing import Any

import msgspec
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
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
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes, AttributeValue
from prometheus_client import Counter

# Attribute every span about one request carries, so the request's trace can be found.
REQUEST_ID = "ripple.request_id"

_provider: TracerProvider | None = None
# The provider's one span processor, where LateSpans may be handed to it finished.
_processor: SpanProcessor | None = None
# Its exporter where that is the local file (LateSpans are written to it directly), and the
# service's name as spans carry it.
_local: LocalSpanExporter | None = None
_service_name: str | None = None
_SCOPE = InstrumentationScope("ripplemesh")
_encoder = msgspec.json.Encoder(enc_hook=str)


class _ReservableIds(RandomIdGenerator):
    """Random ids, except those reserved just before a span is built: a span recorded after
    the fact (LateSpan) gets the ids that its children and its message's headers already carry
    (a root's trace id too)."""

    def __init__(self) -> None:
        self._reserved = threading.local()

    def reserve(self, span_id: int, trace_id: int | None = None) -> None:
        self._reserved.span_id = span_id
        self._reserved.trace_id = trace_id or 0

    def generate_span_id(self) -> int:
        reserved: int = getattr(self._reserved, "span_id", 0)
        if reserved:
            self._reserved.span_id = 0
            return reserved
        return super().generate_span_id()

    def generate_trace_id(self) -> int:
        reserved: int = getattr(self._reserved, "trace_id", 0)
        if reserved:
            self._reserved.trace_id = 0
            return reserved
        return super().generate_trace_id()


_ids = _ReservableIds()


class LocalSpanExporter(SpanExporter):
    """Appends finished spans to a JSON-lines file, one file per process.

    It runs synchronously in the thread that ends the span (a SimpleSpanProcessor; a LateSpan's
    entry is written directly, `write`): encoding one span costs microseconds, far less than
    handing it to an export thread that would compete with the event loop for the GIL. A daemon
    thread only flushes the file buffer every 200 ms.
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

    def write(self, entry: dict[str, Any]) -> None:
        """One span, as `span_to_dict` gives it (a LateSpan's, written without a ReadableSpan)."""
        line = _encoder.encode(entry)
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.write(b"\n")

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
            {
                "trace_id": f"{link.context.trace_id:032x}",
                "span_id": f"{link.context.span_id:016x}",
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ]
    return entry


def otlp_configured(env: Mapping[str, str] = os.environ) -> bool:
    """An OTLP endpoint set in `env` (this process's environment, or a child's to be)."""
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def tracing_disabled(env: Mapping[str, str] = os.environ) -> bool:
    """``OTEL_SDK_DISABLED=true``: the standard switch, read as the SDK reads it."""
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


# Export to a receiver (OTLP). The queue holds spans ended since the last export: about 3 KB each,
# so at most ~12 MB a process. A busy service ends ~1,000 spans/s; 4096 spans cover the 0.5 s
# between exports plus one export that takes its whole timeout, so a receiver's hiccup loses
# nothing, and a receiver that stays down costs that memory and no more.
MAX_QUEUE_SIZE = 4096
MAX_EXPORT_BATCH_SIZE = 512
SCHEDULE_DELAY_MS = 500
# One export, retries included (the exporter's default is 10 s). A receiver on the same host or
# network answers a 512-span batch in tens of ms; one that takes 2 s is not keeping up, and a
# shorter wait frees the export thread for the next batch (a dead one fails in about 1 s: a
# refused connection is retried once after a backoff).
EXPORT_TIMEOUT_S = 2.0
# What a service's shutdown gives its queued spans (it waits on nothing else of tracing's).
SHUTDOWN_TIMEOUT_MS = 3000

SPANS_DROPPED = Counter(
    "ripplemesh_tracing_spans_dropped",
    "Spans never delivered to the trace receiver, by reason: queue_full (ended while the export "
    "queue was full: the receiver is down or slower than spans come), export_failed (the receiver "
    "refused them or did not answer within the export timeout), shutdown (ended after tracing "
    "was shut down).",
    ["reason"],
)
for _reason in ("queue_full", "export_failed", "shutdown"):
    SPANS_DROPPED.labels(_reason)
SPANS_EXPORTED = Counter(
    "ripplemesh_tracing_spans_exported", "Spans the trace receiver accepted (OTLP export succeeded)."
)

log = logging.getLogger(__name__)


class CountingExporter(SpanExporter):
    """An exporter that counts the spans of each export: accepted, or dropped when it failed (the
    SDK's batch processor discards a failed batch without a word)."""

    def __init__(self, exporter: SpanExporter):
        self.exporter = exporter
        self._failed = SPANS_DROPPED.labels("export_failed")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.exporter.export(spans)
        except Exception:
            self._failed.inc(len(spans))
            raise
        if result is SpanExportResult.SUCCESS:
            SPANS_EXPORTED.inc(len(spans))
        else:
            self._failed.inc(len(spans))
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class _CountingProcessorMetrics:
    """Stands in for the batch processor's own metrics hook (`ProcessorMetricsT`, called where
    it drops a span: the queue full, or shut down), counting those drops; the SDK's own
    self-metrics, if enabled, still get every call."""

    _REASONS = {"queue_full": "queue_full", "already_shutdown": "shutdown"}

    def __init__(self, inner: Any):
        self._inner = inner

    def register_queue_size(self, get_queue_size: Any) -> None:
        self._inner.register_queue_size(get_queue_size)

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        SPANS_DROPPED.labels(self._REASONS.get(error_type, error_type)).inc(count)
        self._inner.drop_items(count, error_type)

    def finish_items(self, count: int) -> None:
        self._inner.finish_items(count)


class BoundedBatchSpanProcessor(BatchSpanProcessor):
    """The SDK's BatchSpanProcessor, its drops counted (`SPANS_DROPPED`) and its shutdown
    bounded (the SDK's waits up to 30 s on a receiver that does not answer). Its force_flush is
    the SDK's: it ignores its timeout and exports the whole queue, one export timeout a batch at
    most; shutdown, which exports what is queued too, is what `shutdown_tracing` calls."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue_size: int | None = None,
        max_export_batch_size: int | None = None,
        schedule_delay_millis: float | None = None,
        shutdown_timeout_millis: int = SHUTDOWN_TIMEOUT_MS,
    ):
        queue = max_queue_size or _env_int("OTEL_BSP_MAX_QUEUE_SIZE", MAX_QUEUE_SIZE)
        batch = max_export_batch_size or _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", MAX_EXPORT_BATCH_SIZE)
        delay = schedule_delay_millis or _env_int("OTEL_BSP_SCHEDULE_DELAY", SCHEDULE_DELAY_MS)
        super().__init__(
            CountingExporter(exporter),
            max_queue_size=queue,
            max_export_batch_size=min(queue, batch),
            schedule_delay_millis=delay,
        )
        self._shutdown_timeout_millis = shutdown_timeout_millis
        sdk = getattr(self, "_batch_processor", None)
        if sdk is not None and hasattr(sdk, "_metrics"):
            sdk._metrics = _CountingProcessorMetrics(sdk._metrics)
        else:  # an SDK other than the one this was written against (1.45): drops go uncounted
            log.warning("the OpenTelemetry SDK's batch processor has changed: span drops are not counted")

    def shutdown(self) -> None:
        """Export what is queued within the shutdown timeout; drop the rest."""
        self._batch_processor.shutdown(timeout_millis=self._shutdown_timeout_millis)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        log.warning("%s is not an integer: %s used", name, default)
        return default


def otlp_span_exporter(endpoint: str | None = None) -> SpanExporter:
    """The OTLP/HTTP exporter to `endpoint` (a ``.../v1/traces`` URL) or, with none, where the
    ``OTEL_EXPORTER_OTLP_*`` variables say; each export given `EXPORT_TIMEOUT_S` unless they
    say otherwise."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    timeout_set = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TIMEOUT"
    )
    return OTLPSpanExporter(endpoint=endpoint, timeout=None if timeout_set else EXPORT_TIMEOUT_S)


def otlp_processor(endpoint: str | None = None) -> BoundedBatchSpanProcessor:
    """Export over OTLP/HTTP from this process (see `otlp_span_exporter`)."""
    return BoundedBatchSpanProcessor(otlp_span_exporter(endpoint))


def traces_shipped() -> bool:
    """``RIPPLEMESH_TRACES_SHIPPED=1`` (set by `up` when it runs the trace shipper): spans go to
    the local file even with an OTLP endpoint set; the shipper exports them
    (services/trace_shipper/)."""
    return os.environ.get("RIPPLEMESH_TRACES_SHIPPED", "") == "1"


# The provider installed with tracing disabled (it hands out no-op tracers): there is then no
# `_provider`, so LateSpans and ReservedSpans take no ids and build nothing.
_disabled_provider: TracerProvider | None = None


def setup_tracing(service: str, data_dir: Path) -> TracerProvider:
    """Install this process's TracerProvider (idempotent)."""
    global _provider, _processor, _disabled_provider, _local, _service_name
    if _provider is not None:
        return _provider
    if _disabled_provider is not None:
        return _disabled_provider
    resource = Resource.create({"service.name": f"ripplemesh-{service}", "service.namespace": "ripplemesh"})
    if tracing_disabled():
        # The SDK's provider reads the same variable: its tracers are no-ops, so no span is
        # built and no trace context is injected into messages.
        _disabled_provider = TracerProvider(resource=resource)
        trace.set_tracer_provider(_disabled_provider)
        return _disabled_provider
    provider = TracerProvider(resource=resource, id_generator=_ids)
    processor: SpanProcessor
    local: LocalSpanExporter | None = None
    if otlp_configured() and not traces_shipped():
        processor = otlp_processor()
    else:
        local = LocalSpanExporter(traces_dir(data_dir) / f"{service}-{os.getpid()}.jsonl")
        processor = SimpleSpanProcessor(local)
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _provider = provider
    # A LateSpan is handed finished to the processor (or written to the local file) only where
    # the sampler is the default (parent-based): it would sample it, as its parent was, or as a
    # root (LateSpan.record).
    default_sampler = ParentBased(ALWAYS_ON).get_description()  # type: ignore[no-untyped-call]
    _processor = processor if provider.sampler.get_description() == default_sampler else None
    _local = local if _processor is not None else None
    _service_name = str(resource.attributes.get("service.name"))
    return provider


def shutdown_tracing() -> None:
    """Write or export what is left and stop: within `SHUTDOWN_TIMEOUT_MS` whatever the receiver
    does (each processor's shutdown flushes its exporter: the local file is closed, the OTLP
    queue exported until that timeout)."""
    global _provider, _processor, _disabled_provider, _local
    _processor = None
    _local = None
    _disabled_provider = None
    if _provider is not None:
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


# ------------------------------------------------------------ trace context on messages
#
# The request path injects a context into every message it sends and extracts one from every
# message it takes: four times on the way to the first token. The API's propagator (the
# composite of W3C tracecontext and baggage, `OTEL_PROPAGATORS`'s default) does that through
# layers of getters, setters and a regular expression per header; where the global propagator
# is that default, or tracecontext alone, the common case is read and written here directly,
# with the same results: a ``traceparent`` of the current span, a ``tracestate`` when it has
# one, ``baggage`` when the context carries some (those two, and anything unusual, by the API's
# own propagators). Any other propagator configured is used as it is.

_TRACEPARENT_RE = TraceContextTextMapPropagator._TRACEPARENT_HEADER_FORMAT_RE
_TRACEPARENT_LENGTH = 55  # "00-" + 32 + "-" + 16 + "-" + 2: the only form read here directly
_INVALID_TRACE_ID = "0" * 32
_INVALID_SPAN_ID = "0" * 16
_TRACECONTEXT = TraceContextTextMapPropagator()
_BAGGAGE = W3CBaggagePropagator()
# The global propagator last looked at, and whether it is one read here directly: None (no),
# False (tracecontext alone), True (tracecontext and baggage, the default).
_textmap_seen: object = None
_textmap_fast: bool | None = None


def _fast_textmap(textmap: object) -> bool | None:
    global _textmap_seen, _textmap_fast
    if textmap is not _textmap_seen:
        kinds = [type(p) for p in getattr(textmap, "_propagators", None) or ()]
        if type(textmap) is not CompositePropagator or not kinds:
            _textmap_fast = None
        elif kinds == [TraceContextTextMapPropagator, W3CBaggagePropagator]:
            _textmap_fast = True
        elif kinds == [TraceContextTextMapPropagator]:
            _textmap_fast = False
        else:
            _textmap_fast = None
        _textmap_seen = textmap
    return _textmap_fast


def inject_headers(headers: dict[str, str], context: otel_context.Context | None = None) -> dict[str, str]:
    """The trace context (the current one by default) written into `headers`, as the global
    propagator writes it."""
    textmap = propagate.get_global_textmap()
    with_baggage = _fast_textmap(textmap)
    if with_baggage is None:
        textmap.inject(headers, context)
        return headers
    if context is None:
        context = otel_context.get_current()
    _write_context(headers, trace.get_current_span(context).get_span_context(), context, with_baggage)
    return headers


def _write_context(
    headers: dict[str, str], span_context: SpanContext, context: otel_context.Context, with_baggage: bool
) -> None:
    """What the tracecontext (and baggage) propagator writes for this span in this context."""
    if span_context.is_valid:
        headers["traceparent"] = (
            f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{span_context.trace_flags:02x}"
        )
        if span_context.trace_state:
            headers["tracestate"] = span_context.trace_state.to_header()
    if with_baggage and baggage.get_all(context):
        _BAGGAGE.inject(headers, context)


def _remote_span_context(traceparent: str) -> SpanContext | None:
    """The span a well-formed version-00 traceparent (55 characters) names, read as the W3C
    tracecontext propagator reads it; None for a malformed one."""
    match = _TRACEPARENT_RE.match(traceparent)
    if match is None:
        return None
    version, trace_id, span_id, flags = match.group(1, 2, 3, 4)
    if trace_id == _INVALID_TRACE_ID or span_id == _INVALID_SPAN_ID or version == "ff":
        return None
    if version == "00" and match.group(5):
        return None
    return SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16))
    )


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context `headers` carry (a fresh, empty one if none), as the global propagator
    reads it."""
    textmap = propagate.get_global_textmap()
    with_baggage = _fast_textmap(textmap)
    if with_baggage is None or not headers:
        return textmap.extract(dict(headers or {}))
    traceparent = headers.get("traceparent")
    if (
        traceparent is not None and (type(traceparent) is not str or len(traceparent) != _TRACEPARENT_LENGTH)
    ) or "tracestate" in headers:
        context = _TRACECONTEXT.extract(dict(headers))  # the unusual: as the propagator reads it
    else:
        context = otel_context.Context()
        span_context = _remote_span_context(traceparent) if traceparent else None
        if span_context is not None:
            context = trace.set_span_in_context(NonRecordingSpan(span_context), context)
    if with_baggage and "baggage" in headers:
        context = _BAGGAGE.extract(dict(headers), context)
    return context


def link_to(
    traceparent: str | None, attributes: Mapping[str, AttributeValue] | None = None
) -> list[trace.Link]:
    """A link to the span a W3C traceparent names (none for None or a malformed one)."""
    if not traceparent:
        return []
    if len(traceparent) == _TRACEPARENT_LENGTH and _fast_textmap(propagate.get_global_textmap()) is not None:
        span: SpanContext | None = _remote_span_context(traceparent)
    else:
        span = trace.get_current_span(extract_context({"traceparent": traceparent})).get_span_context()
    return [trace.Link(span, attributes)] if span is not None and span.is_valid else []


def subject_family(subject: str) -> str:
    """A low-cardinality span name part: ``rmesh.tokens.acme.r1`` -> ``rmesh.tokens``."""
    second_dot = subject.find(".", subject.find(".") + 1)
    return subject if second_dot < 0 else subject[:second_dot]


# ------------------------------------------------------------ spans built late

# A root span's flags under the default sampler: sampled, and the trace id random (the SDK's
# for a root from its random id generator).
_ROOT_FLAGS = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)


def _late_ids(parent: SpanContext) -> SpanContext | None:
    """The ids of a span to be built late under `parent`: a child's under a sampled parent; a
    root's, where there is no valid parent and the sampler is the default (a root is sampled);
    None where the SDK must decide (tracing off, another sampler, an unsampled parent)."""
    if _provider is None:
        return None
    if parent.is_valid:
        if not parent.trace_flags.sampled:
            return None
        return SpanContext(
            parent.trace_id,
            getrandbits(64) or 1,
            is_remote=False,
            trace_flags=parent.trace_flags,
            trace_state=parent.trace_state,
        )
    if _processor is None:
        return None
    return SpanContext(getrandbits(128) or 1, getrandbits(64) or 1, is_remote=False, trace_flags=_ROOT_FLAGS)


class _Pending(trace.Span):
    """A span whose ids are taken and whose SDK span is built later (`finish`), keeping what is
    set on it meanwhile. While current, it is the parent its children and injected headers
    name."""

    __slots__ = (
        "_attributes",
        "_context",
        "_ends",
        "_events",
        "_exceptions",
        "_finished",
        "_given",
        "_kind",
        "_links",
        "_name",
        "_parent",
        "_parent_context",
        "_start_ns",
        "_status",
    )

    def __init__(
        self,
        name: str,
        context: SpanContext,
        parent_context: otel_context.Context,
        parent: SpanContext,
        kind: SpanKind,
        attributes: Mapping[str, AttributeValue] | None,
        links: Sequence[trace.Link],
        start_ns: int,
        *,
        ends: bool = False,
    ):
        self._name = name
        self._context = context
        self._parent_context = parent_context
        self._parent = parent if parent.is_valid else None
        self._kind = kind
        self._given = attributes
        self._attributes: dict[str, AttributeValue] | None = None  # those set on it
        self._links = links
        self._start_ns = start_ns
        self._status: Status | None = None
        self._events: list[tuple[str, Attributes, int]] | None = None
        self._exceptions: list[tuple[BaseException, Attributes, int, bool]] | None = None
        self._ends = ends  # end() finishes it (a ReservedSpan's); a LateSpan's is finished by record()
        self._finished = False

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return not self._finished

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        if self._finished:
            return  # as the SDK's: an ended span keeps what it had
        if self._attributes is None:
            self._attributes = dict(attributes)
        else:
            self._attributes.update(attributes)

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        if self._finished:
            return
        if self._attributes is None:
            self._attributes = {key: value}
        else:
            self._attributes[key] = value

    def add_event(self, name: str, attributes: Attributes = None, timestamp: int | None = None) -> None:
        if self._events is None:
            self._events = []
        self._events.append((name, attributes, timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        pass  # links are given when a span starts; none of ours adds one later

    def update_name(self, name: str) -> None:
        self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        self._status = status if isinstance(status, Status) else Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        if self._exceptions is None:
            self._exceptions = []
        self._exceptions.append((exception, attributes, timestamp or time.time_ns(), escaped))

    def end(self, end_time: int | None = None) -> None:
        if self._ends:
            self.finish(end_time or time.time_ns())

    def finish(self, end_ns: int) -> None:
        """Build the span, once, with the times it covered and what was set on it."""
        if self._finished:
            return
        self._finished = True
        given, added = self._given, self._attributes
        attributes: Mapping[str, AttributeValue] = (
            (given or {}) if added is None else ({**given, **added} if given else added)
        )
        processor, local = _processor, _local
        replay = self._events is not None or self._exceptions is not None
        if processor is not None and _provider is not None and not replay:
            # The finished span as the SDK would have built it (its sampler would sample it: its
            # parent is sampled, or it is a root under the default sampler), without the SDK's
            # per-span machinery: to the local file directly, or handed to the processor.
            status = self._status or _UNSET
            if local is not None:
                local.write(self._entry(_valid_attributes(attributes), status, end_ns))
                return
            processor.on_end(
                ReadableSpan(
                    self._name,
                    context=self._context,
                    parent=self._parent,
                    resource=_provider.resource,
                    attributes=_valid_attributes(attributes),
                    kind=self._kind,
                    links=self._links,
                    status=status,
                    start_time=self._start_ns,
                    end_time=end_ns,
                    instrumentation_scope=_SCOPE,
                )
            )
            return
        # Events or exceptions to replay (or another sampler): the SDK builds it, with these ids.
        _ids.reserve(self._context.span_id, None if self._parent is not None else self._context.trace_id)
        try:
            span = tracer().start_span(
                self._name,
                self._parent_context,
                self._kind,
                attributes,
                links=self._links,
                start_time=self._start_ns,
            )
        finally:
            _ids.reserve(0)  # unused if the SDK built no span (its provider was shut down)
        for name, event_attributes, timestamp in self._events or ():
            span.add_event(name, event_attributes, timestamp)
        for exception, exception_attributes, timestamp, escaped in self._exceptions or ():
            span.record_exception(exception, exception_attributes, timestamp, escaped)
        if self._status is not None:
            span.set_status(self._status)
        span.end(end_time=end_ns)

    def _entry(self, attributes: dict[str, Any], status: Status, end_ns: int) -> dict[str, Any]:
        """The span as `span_to_dict` writes it."""
        context, parent = self._context, self._parent
        entry: dict[str, Any] = {
            "trace_id": f"{context.trace_id:032x}",
            "span_id": f"{context.span_id:016x}",
            "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
            "name": self._name,
            "kind": self._kind.name,
            "service": _service_name,
            "start_ns": self._start_ns,
            "end_ns": end_ns,
            "status": status.status_code.name,
            "attributes": attributes,
        }
        if self._links:
            entry["links"] = [
                {
                    "trace_id": f"{link.context.trace_id:032x}",
                    "span_id": f"{link.context.span_id:016x}",
                    "attributes": dict(link.attributes or {}),
                }
                for link in self._links
            ]
        return entry


class ReservedSpan:
    """A span whose id is taken now and whose span is started later (`start`), so a message
    sent before it exists can already point at it: the router's decision span, built after the
    placement is on its way, is what the prefill span links to as ``placed_by``."""

    __slots__ = ("_ids", "span_id", "traceparent")

    def __init__(self) -> None:
        self.span_id = 0
        self.traceparent: str | None = None
        parent = trace.get_current_span().get_span_context()
        self._ids = _late_ids(parent) if parent.is_valid else None
        if self._ids is not None:
            self.span_id = self._ids.span_id
            self.traceparent = f"00-{parent.trace_id:032x}-{self.span_id:016x}-01"

    def start(self, name: str, *, start_time: int | None = None) -> trace.Span:
        """Start the span under the current context, with the reserved id when one was taken.
        It is built (written or handed to the processor) when it ends."""
        start_ns = start_time or time.time_ns()
        context = otel_context.get_current()
        parent = trace.get_current_span(context).get_span_context()
        ids = self._ids
        if ids is not None and parent.is_valid and parent.trace_id == ids.trace_id:
            return _Pending(name, ids, context, parent, SpanKind.INTERNAL, None, (), start_ns, ends=True)
        if self.span_id:
            _ids.reserve(self.span_id)
        try:
            return tracer().start_span(name, start_time=start_ns)
        finally:
            _ids.reserve(0)  # unused if the SDK built no span


class LateSpan:
    """A span built only when `record` is called, with the times it covered.

    Building an SDK span (sampler, attribute checks, processors) costs about 0.1 ms here, and
    the request path has one or two per service before its next message leaves. A LateSpan
    takes its ids at once: while it is current (`activate`), its children and the trace
    context injected into a message name it as their parent; the span, with those ids, its
    start and end times and what was set on it meanwhile, is built once the message is on its
    way. Same spans, same tree, off the critical path.

    Under a sampled parent, or as a root under the default sampler, and this module's provider;
    otherwise the SDK span is started at once (tracing off, an unsampled trace, another
    sampler's root) and `record` just ends it.
    """

    __slots__ = (
        "_context",
        "_end_ns",
        "_pending",
        "_record_on_exit",
        "_recorded",
        "_sdk",
        "_token",
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
        self._context = context if context is not None else otel_context.get_current()
        self.start_ns = time.time_ns()
        self._end_ns: int | None = None
        self._recorded = False
        self._record_on_exit = False
        self._token: object = None
        parent = trace.get_current_span(self._context).get_span_context()
        ids = _late_ids(parent)
        if ids is not None:
            self._sdk: trace.Span | None = None
            self._pending: _Pending | None = _Pending(
                name, ids, self._context, parent, kind, attributes, links, self.start_ns
            )
            self.span: trace.Span = self._pending
        else:
            self._pending = None
            self._sdk = tracer().start_span(
                name, self._context, kind, attributes, links=links, start_time=self.start_ns
            )
            self.span = self._sdk

    def activate(self, *, record: bool = False) -> LateSpan:
        """Make the span current, in a `with` block (which gives the span); its end is when
        the block ends. An exception escaping the block is recorded on it, with an error
        status (as the SDK's own spans do). With `record`, the span is built as the block
        ends (where nothing waits on that); otherwise `record` builds it later."""
        self._record_on_exit = record
        return self

    def __enter__(self) -> trace.Span:
        self._token = otel_context.attach(trace.set_span_in_context(self.span, self._context))
        return self.span

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: object
    ) -> None:
        try:
            if exc is not None:
                self.failed(exc)
        finally:
            self._end_ns = time.time_ns()
            otel_context.detach(self._token)  # type: ignore[arg-type]
            if self._record_on_exit:
                self.record()

    def failed(self, exc: BaseException) -> None:
        """An exception escaped what the span covers: recorded on it, with an error status."""
        self.span.record_exception(exc, escaped=True)
        self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        """This span's trace context written into `headers`, as `inject_headers` writes it
        while the span is current, without making it current (a message it sends)."""
        with_baggage = _fast_textmap(propagate.get_global_textmap())
        if with_baggage is None or self._pending is None:
            return inject_headers(headers, trace.set_span_in_context(self.span, self._context))
        _write_context(headers, self._pending.get_span_context(), self._context, with_baggage)
        return headers

    def record(self) -> None:
        """Build (if late) and end the span, once, with the times it covered."""
        if self._recorded:
            return
        self._recorded = True
        end_ns = self._end_ns or time.time_ns()
        if self._pending is not None:
            self._pending.finish(end_ns)
        else:
            assert self._sdk is not None
            self._sdk.end(end_time=end_ns)


_UNSET = Status(StatusCode.UNSET)
_SCALARS = (str, bool, int, float)
_SCALAR_TYPES = frozenset(_SCALARS)


def _valid_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """What the SDK would keep of them: scalar values, and sequences of one scalar type as
    tuples (others it drops, as here). A copy: the span's own."""
    for value in attributes.values():
        if type(value) not in _SCALAR_TYPES:
            break
    else:
        return dict(attributes)  # all scalars (the usual): kept as they are
    valid: dict[str, Any] = {}
    for key, value in attributes.items():
        if isinstance(value, _SCALARS):
            valid[key] = value
        elif isinstance(value, list | tuple) and all(isinstance(v, _SCALARS) for v in value):
            if len({type(v) for v in value}) <= 1:
                valid[key] = tuple(value)
    return valid
