"""LateSpan: spans built after the message leaves keep the ids, times, attributes and parents
that spans started at once would have had (the request's trace reads the same)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from services.mesh import tracing
from services.mesh.tracing import LateSpan, extract_context, inject_headers, tracer


@pytest.fixture(scope="module")
def spans(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # One provider per process (OpenTelemetry allows the global one to be set once): a test
    # that left a service's tracing running in this process would make these spans go elsewhere;
    # that is a failure to see, not a reason to skip.
    assert tracing._provider is None, "this process already traces into another directory"
    data_dir = tmp_path_factory.mktemp("late-spans")
    tracing.setup_tracing("late-test", data_dir)
    try:
        yield data_dir
    finally:
        tracing.shutdown_tracing()


def _written(data_dir: Path, name: str) -> dict[str, dict]:  # type: ignore[type-arg]
    """The spans written so far, by name, once `name` is among them (the file is flushed every
    200 ms)."""
    deadline = time.monotonic() + 5.0
    while True:
        lines = [
            line for f in tracing.traces_dir(data_dir).glob("*.jsonl") for line in f.read_text().splitlines()
        ]
        written = {entry["name"]: entry for entry in map(json.loads, lines)}
        if name in written or time.monotonic() > deadline:
            return written
        time.sleep(0.05)


def test_late_spans_keep_the_tree_the_times_and_what_was_set_on_them(spans: Path) -> None:
    with tracer().start_as_current_span("request"):
        producer = LateSpan("send x", kind=SpanKind.PRODUCER, attributes={"messaging.system": "nats"})
        with producer.activate():
            headers = inject_headers({})
        consumer = LateSpan("process x", context=extract_context(headers), kind=SpanKind.CONSUMER)
        with consumer.activate() as span:
            span.set_attribute("ripple.request_id", "r1")
            with tracer().start_as_current_span("child"):  # an SDK span under a late one
                pass
        consumer.record()  # the consumer's span may be recorded before its producer's
        producer.record()
    written = _written(spans, "send x")
    send, process, child = written["send x"], written["process x"], written["child"]
    assert send["parent_id"] == written["request"]["span_id"]
    assert process["parent_id"] == send["span_id"] and child["parent_id"] == process["span_id"]
    assert headers["traceparent"].split("-")[2] == send["span_id"]
    assert {send["trace_id"], process["trace_id"], child["trace_id"]} == {written["request"]["trace_id"]}
    assert (send["kind"], process["kind"]) == ("PRODUCER", "CONSUMER")
    assert send["attributes"] == {"messaging.system": "nats"}
    assert process["attributes"] == {"ripple.request_id": "r1"}
    assert process["start_ns"] <= child["start_ns"] <= child["end_ns"] <= process["end_ns"]


def test_an_escaping_error_is_recorded_on_the_late_span(spans: Path) -> None:
    with tracer().start_as_current_span("request"):
        late = LateSpan("failing")
        with pytest.raises(ValueError), late.activate():
            raise ValueError("no")
        late.record()
    failing = _written(spans, "failing")["failing"]
    assert failing["status"] == StatusCode.ERROR.name


def test_without_a_sampled_parent_the_span_is_an_ordinary_root(spans: Path) -> None:
    late = LateSpan("root")
    assert trace.get_current_span() is not late.span
    with late.activate():
        assert trace.get_current_span() is late.span
    late.record()
    assert _written(spans, "root")["root"]["parent_id"] is None
