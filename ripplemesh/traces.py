"""Reading the locally written spans (``<data_dir>/traces/*.jsonl``) back as a request's tree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.tree import Tree

from services.mesh.tracing import REQUEST_ID, traces_dir

KEY_ATTRIBUTES = (
    "messaging.destination.name",
    "ripple.admission.outcome",
    "ripple.router.mode",
    "ripple.router.decode_worker",
    "ripple.worker_id",
    "ripple.cached_tokens",
    "ripple.gpu_seconds",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "ripple.cost_usd",
    "http.response.status_code",
)


def load_spans(data_dir: Path) -> list[dict[str, Any]]:
    spans = []
    for path in sorted(traces_dir(data_dir).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
    return spans


def load_request_trace(data_dir: Path, request_id: str) -> list[dict[str, Any]]:
    """Every span of the trace(s) that carry this request id."""
    spans = load_spans(data_dir)
    trace_ids = {s["trace_id"] for s in spans if s.get("attributes", {}).get(REQUEST_ID) == request_id}
    return sorted((s for s in spans if s["trace_id"] in trace_ids), key=lambda s: s["start_ns"])


def _label(span: dict[str, Any]) -> str:
    duration_ms = (span["end_ns"] - span["start_ns"]) / 1e6
    service = (span.get("service") or "?").removeprefix("ripplemesh-")
    attrs = span.get("attributes", {})
    shown = " ".join(f"{k.split('.')[-1]}={attrs[k]}" for k in KEY_ATTRIBUTES if k in attrs)
    status = " [red]ERROR[/]" if span.get("status") == "ERROR" else ""
    return f"[bold]{span['name']}[/] [cyan]{service}[/] {duration_ms:.2f} ms{status} [dim]{shown}[/]"


def render_tree(spans: list[dict[str, Any]]) -> Tree:
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        parent = span.get("parent_id") if span.get("parent_id") in by_id else None
        children.setdefault(parent, []).append(span)
    root = Tree(f"trace {spans[0]['trace_id']}" if spans else "no spans")

    def add(node: Tree, parent_id: str | None) -> None:
        for span in children.get(parent_id, []):
            add(node.add(_label(span)), span["span_id"])

    add(root, None)
    return root
