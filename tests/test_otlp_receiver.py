"""A request's trace in a real OTLP receiver: `ripplemesh up` exports over OTLP/HTTP to Arize
Phoenix (from ``.venv-receivers``, `make receivers`), and the trace is read back through
Phoenix's REST API as a user's tooling would.

Phoenix 20.26.1 keeps a span's ids, name, times, attributes, status and events, and drops at
ingestion its resource (so ``service.name``), its kind and its links. What it drops is checked
where it crossed the wire: the mesh exports through `OtlpTap`, a pass-through that keeps a
decoded copy of each OTLP request and hands Phoenix the same bytes, as a collector in front of it
would.

With ``RIPPLEMESH_PHOENIX_SCREENSHOT=<png>`` set, the test also saves Phoenix's view of the trace
there (headless Chromium):

    RIPPLEMESH_PHOENIX_SCREENSHOT=docs/img/phoenix-trace.png pytest tests/test_otlp_receiver.py
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan

import tests.test_up as test_up
from ripplemesh.bench.overhead import RECEIVERS_VENV, Phoenix, phoenix_binary, running_phoenix
from tests.conftest import wait_until
from tests.test_up import running_up

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        phoenix_binary() is None, reason=f"no Phoenix OTLP receiver in {RECEIVERS_VENV}: run make receivers"
    ),
]

SCREENSHOT = os.environ.get("RIPPLEMESH_PHOENIX_SCREENSHOT")
MODEL = "llama-3-8b"


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


class OtlpTap:
    """An OTLP/HTTP pass-through to `upstream`: each request is relayed as it came (body and
    content headers) and the receiver's answer returned as it came, and a decoded copy of its
    spans kept in `spans`, with their resource's ``service.name``, kind and links."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        tap = self

        class Relay(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k: v for k, v in self.headers.items() if k.lower().startswith("content-")}
                request = urllib.request.Request(f"{tap.upstream}{self.path}", data=body, headers=headers)
                try:
                    with urllib.request.urlopen(request, timeout=10) as response:
                        status, answer, kind = (
                            response.status,
                            response.read(),
                            response.headers["Content-Type"],
                        )
                except urllib.error.HTTPError as error:
                    status, answer, kind = error.code, error.read(), error.headers["Content-Type"]
                if self.path == "/v1/traces" and 200 <= status < 300:
                    encoding = self.headers.get("Content-Encoding", "")
                    tap._keep(gzip.decompress(body) if encoding == "gzip" else body)
                self.send_response(status)
                self.send_header("Content-Type", kind or "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-tap", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpTap:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _keep(self, body: bytes) -> None:
        export = ExportTraceServiceRequest.FromString(body)
        kept = []
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    kept.append(
                        {
                            "service": resource.get("service.name"),
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_id": span.parent_span_id.hex() or None,
                            "name": span.name,
                            "kind": OtlpSpan.SpanKind.Name(span.kind),
                            "links": [
                                {
                                    "trace_id": link.trace_id.hex(),
                                    "span_id": link.span_id.hex(),
                                    "attributes": {a.key: _value(a.value) for a in link.attributes},
                                }
                                for link in span.links
                            ],
                        }
                    )
        with self._lock:
            self.spans += kept


def _phoenix_spans(phoenix: Phoenix, **filters: str) -> list[dict[str, Any]]:
    """Spans of Phoenix's default project through its REST API (`/v1/projects/{project}/spans/
    otlpv1`, OTLP's JSON shape), every page, their attributes as a flat dict."""
    spans: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        query = {"limit": "1000", **filters, **({"cursor": cursor} if cursor else {})}
        url = f"{phoenix.url}/v1/projects/default/spans/otlpv1?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            page = json.load(response)
        for span in page["data"]:
            span["attributes"] = {
                a["key"]: next((v for v in a["value"].values() if v is not None), None)
                for a in span["attributes"] or []
            }
            spans.append(span)
        cursor = page.get("next_cursor")
        if not cursor:
            return spans


def _export_to(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    """`running_up` as a user runs it, with these variables set in the user's shell."""
    user_env = test_up._user_env
    monkeypatch.setattr(test_up, "_user_env", lambda: {**user_env(), **env})


def test_a_streamed_chat_completion_reaches_phoenix_as_one_trace_across_the_services(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_phoenix(tmp_path / "phoenix") as phoenix, OtlpTap(phoenix.url) as tap:
        _export_to(monkeypatch, OTEL_EXPORTER_OTLP_ENDPOINT=tap.url)
        with running_up(tmp_path, "--time-scale", "0.05") as up:
            client = OpenAI(
                base_url=f"http://127.0.0.1:{up.port}/v1", api_key="rm-demo-key", max_retries=0, timeout=30
            )
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me about the sea. " * 8}],
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
            response_id, usage, pieces = "", None, []
            for chunk in stream:
                response_id = chunk.id
                pieces += [c.delta.content or "" for c in chunk.choices]
                usage = chunk.usage or usage
            assert usage is not None and usage.completion_tokens == 12 and "".join(pieces).strip()
        # The mesh has stopped: each service exported what it had left on its way out.

        # The request's trace, found in Phoenix by the id the client got.
        request_id = response_id.removeprefix("chatcmpl-")
        ingress = wait_until(
            lambda: _phoenix_spans(phoenix, attribute=f'ripple.request_id:"{request_id}"'), timeout_s=30
        )
        (trace_id,) = {s["trace_id"] for s in ingress}
        sent = {s["span_id"]: s for s in tap.spans if s["trace_id"] == trace_id}
        stored = wait_until(
            lambda: (got := _phoenix_spans(phoenix, trace_id=trace_id)) and len(got) >= len(sent) and got,
            timeout_s=30,
        )
        by_name = {s["name"]: s for s in stored}

        # One trace, as Phoenix has it: every span the mesh sent is there, under one root (the
        # ingress's HTTP span), each span's parent in the trace.
        assert {s["span_id"] for s in stored} == set(sent)
        roots = [s for s in stored if not s["parent_span_id"]]
        assert [r["name"] for r in roots] == ["POST /v1/chat/completions"]
        assert all(s["parent_span_id"] in sent for s in stored if s is not roots[0])

        # Every service of the request's path took part (their spans' resources say which).
        services = {s["service"] for s in sent.values()}
        assert {
            "ripplemesh-ingress",
            "ripplemesh-admission",
            "ripplemesh-router",
            "ripplemesh-decode",
        } <= services
        assert sent[by_name["POST /v1/chat/completions"]["span_id"]]["kind"] == "SPAN_KIND_SERVER"

        # The ripple link: the prefill span names the router's decision that placed it.
        prefill, decide = by_name[f"prefill {MODEL}"], by_name["router.decide"]
        assert sent[prefill["span_id"]]["service"] in ("ripplemesh-prefill", "ripplemesh-decode")
        assert sent[decide["span_id"]]["service"] == "ripplemesh-router"
        placed_by = [
            link
            for link in sent[prefill["span_id"]]["links"]
            if link["attributes"].get("ripple.link") == "placed_by"
        ]
        assert placed_by == [
            {"trace_id": trace_id, "span_id": decide["span_id"], "attributes": {"ripple.link": "placed_by"}}
        ]

        # GenAI attributes on the model's spans, in Phoenix, with the figures the client got.
        decode = by_name[f"decode {MODEL}"]
        for span, operation in ((prefill, "prefill"), (decode, "decode")):
            assert span["attributes"]["gen_ai.request.model"] == MODEL
            assert span["attributes"]["gen_ai.operation.name"] == operation
        assert int(prefill["attributes"]["gen_ai.usage.input_tokens"]) == usage.prompt_tokens
        assert int(decode["attributes"]["gen_ai.usage.output_tokens"]) == usage.completion_tokens
        assert int(by_name["POST /v1/chat/completions"]["attributes"]["gen_ai.usage.input_tokens"]) == (
            usage.prompt_tokens
        )

        # Messaging attributes on every NATS hop: a producer span per publish, a consumer span
        # per delivery, each naming its subject.
        hops = [s for s in stored if s["name"].startswith(("send ", "process "))]
        assert {s["name"].split()[0] for s in hops} == {"send", "process"}
        for hop in hops:
            family = hop["name"].split()[1]
            assert hop["attributes"]["messaging.system"] == "nats"
            assert hop["attributes"]["messaging.destination.name"].startswith(family + ".")
            expected = "SPAN_KIND_PRODUCER" if hop["name"].startswith("send ") else "SPAN_KIND_CONSUMER"
            assert sent[hop["span_id"]]["kind"] == expected
        # Each delivery's span is the child of the publish of its message.
        for hop in hops:
            if hop["name"].startswith("process "):
                parent = next(s for s in stored if s["span_id"] == hop["parent_span_id"])
                assert parent["name"].startswith("send ")
                assert (
                    parent["attributes"]["messaging.message.id"] == hop["attributes"]["messaging.message.id"]
                )

        if SCREENSHOT:
            _screenshot(phoenix, trace_id, prefill["span_id"], Path(SCREENSHOT), tmp_path)


def _screenshot(phoenix: Phoenix, trace_id: str, span_id: str, out: Path, tmp_path: Path) -> None:
    """Phoenix's view of the trace, the prefill span selected, by headless Chromium."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "RIPPLEMESH_PHOENIX_SCREENSHOT needs chromium on PATH"
    project = phoenix.graphql("{ projects { edges { node { id name } } } }")["projects"]["edges"]  # type: ignore[index]
    (project_id,) = [edge["node"]["id"] for edge in project if edge["node"]["name"] == "default"]
    # The span's node id in Phoenix's UI (the REST API's span `id`).
    query = urllib.parse.urlencode({"trace_id": trace_id, "limit": 1000})
    with urllib.request.urlopen(f"{phoenix.url}/v1/projects/default/spans?{query}", timeout=10) as response:
        (node_id,) = [s["id"] for s in json.load(response)["data"] if s["context"]["span_id"] == span_id]
    selected = urllib.parse.urlencode({"selectedSpanNodeId": node_id})
    view = f"{phoenix.url}/projects/{project_id}/traces/{trace_id}?{selected}"
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium'}",
            "--window-size=1600,1250",
            "--virtual-time-budget=15000",
            f"--screenshot={out.resolve()}",
            view,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert out.stat().st_size > 10_000  # a rendered page, not a blank one
