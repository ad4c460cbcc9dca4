"""Reading the locally written spans (``<data_dir>/traces/*.jsonl``) back as a request's tree.

A span that carries a prediction shows it next to what happened: the prefill span's actual cached
tokens and TTFT (from the routing decision) with the router's predictions for them, and the
router's decision span its chosen placement's predictions, score and runners-up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.tree import Tree

from services.mesh.tracing import REQUEST_ID, traces_dir

KEY_ATTRIBUTES = (
    "messaging.destination.name",
    "ripple.admission.outcome",
    "ripple.router.policy",
    "ripple.router.outcome",
    "ripple.router.mode",
    "ripple.router.prefill_worker",
    "ripple.router.decode_worker",
    "ripple.router.predicted_cached_tokens",
    "ripple.router.predicted_ttft_s",
    "ripple.router.predicted_cost_usd",
    "ripple.router.success_probability",
    "ripple.router.expected_cost_per_success_usd",
    "ripple.router.score",
    "ripple.worker_id",
    "ripple.cached_tokens",
    "ripple.ttft_s",
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


# The ids a client sees for a request: the OpenAI response's ("chatcmpl-<id>", "cmpl-<id>"), or
# its own x-request-id, which ingress echoes and records on its span.
RESPONSE_ID_PREFIXES = ("chatcmpl-", "cmpl-")
CLIENT_REQUEST_ID = "ripple.client_request_id"


def load_request_trace(data_dir: Path, request_id: str) -> list[dict[str, Any]]:
    """Every span of the trace(s) of this request: by the mesh's id, the response's id
    (``chatcmpl-...``, ``cmpl-...``) or the client's own ``x-request-id``."""
    return request_trace(load_spans(data_dir), request_id)


def request_trace(spans: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    """`load_request_trace` on spans already loaded."""
    wanted = {request_id}
    for prefix in RESPONSE_ID_PREFIXES:
        if request_id.startswith(prefix):
            wanted.add(request_id.removeprefix(prefix))
    trace_ids = {
        s["trace_id"]
        for s in spans
        if s.get("attributes", {}).get(REQUEST_ID) in wanted
        or s.get("attributes", {}).get(CLIENT_REQUEST_ID) == request_id
    }
    return sorted((s for s in spans if s["trace_id"] in trace_ids), key=lambda s: s["start_ns"])


# An actual value's attribute -> the attribute of what was predicted for it.
PREDICTED = {
    "ripple.cached_tokens": "ripple.predicted.cached_tokens",
    "ripple.ttft_s": "ripple.predicted.ttft_s",
}
# Shown on lines of their own under the span's label.
LISTED_ATTRIBUTES = ("ripple.router.runners_up",)


def _value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _label(span: dict[str, Any]) -> str:
    duration_ms = (span["end_ns"] - span["start_ns"]) / 1e6
    service = (span.get("service") or "?").removeprefix("ripplemesh-")
    attrs = span.get("attributes", {})
    shown = []
    for key in KEY_ATTRIBUTES:
        if key not in attrs:
            continue
        text = f"{key.split('.')[-1]}={_value(attrs[key])}"
        predicted = PREDICTED.get(key)
        if predicted is not None and predicted in attrs:
            text += f" (predicted {_value(attrs[predicted])})"
        shown.append(text)
    status = " [red]ERROR[/]" if span.get("status") == "ERROR" else ""
    details = " ".join(shown)
    label = f"[bold]{span['name']}[/] [cyan]{service}[/] {duration_ms:.2f} ms{status} [dim]{details}[/]"
    for key in LISTED_ATTRIBUTES:
        for i, item in enumerate(attrs.get(key) or ()):
            label += f"\n  [dim]{key.split('.')[-1]}[{i}]: {item}[/]"
    return label


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


# ---------------------------------------------------------------- the ripple view

# What a span that links to another says about it (its link's ``ripple.link``), read from the
# cause's side: services/engines/ripple.py and the autoscaler make these links.
EFFECTS = {
    "placed_by": "placed the work",
    "reused_kv": "its cached prefix served",
    "in_batch": "in the batch a utilisation sample measured",
    "used_sample": "planned on by the autoscaler",
    "arrival": "counted in the traffic an autoscaler plan forecast from",
    "slow_request": "the autoscaler reacted to it (TTFT over the SLO)",
    "started_by_plan": "served by a worker this plan started",
    "original_placement": "re-placed mid-stream (its worker was lost or drained)",
}
RIPPLE_ATTRIBUTES = (
    "ripple.worker.running",
    "ripple.worker.queue_depth",
    "ripple.worker.kv_usage",
    "ripple.sample.requests",
    "ripple.batch.sequences",
    "ripple.batch.cache_hit_share",
    "ripple.autoscaler.trigger",
    "ripple.autoscaler.cost_per_hour",
    REQUEST_ID,
)


def _effects_index(spans: list[dict[str, Any]]) -> dict[str, list[tuple[dict[str, Any], str]]]:
    """Span id -> the spans that link to it, with the link's kind."""
    index: dict[str, list[tuple[dict[str, Any], str]]] = {}
    for span in spans:
        for link in span.get("links") or ():
            kind = (link.get("attributes") or {}).get("ripple.link", "link")
            index.setdefault(link["span_id"], []).append((span, str(kind)))
    return index


def _ripple_label(span: dict[str, Any]) -> str:
    attrs = span.get("attributes", {})
    extra = " ".join(
        f"{key.split('.')[-1]}={_value(attrs[key])}" for key in RIPPLE_ATTRIBUTES if key in attrs
    )
    desired = " ".join(
        f"{key.removeprefix('ripple.autoscaler.').removesuffix('.desired')}={attrs[key]}"
        for key in sorted(attrs)
        if key.startswith("ripple.autoscaler.") and key.endswith(".desired")
    )
    label = _label(span)
    return f"{label} [dim]{extra} {desired}[/]".rstrip() if extra or desired else label


def render_ripple(
    request_spans: list[dict[str, Any]],
    all_spans: list[dict[str, Any]],
    *,
    depth: int = 4,
    fan_out: int = 5,
) -> Tree:
    """The request's decisions and model calls, each followed forward to the spans that name it
    as their cause (span links), and those to theirs, `depth` steps deep; `fan_out` shown per
    kind of effect, the rest counted."""
    effects = _effects_index(all_spans)
    request_ids = {s["attributes"].get(REQUEST_ID) for s in request_spans} - {None}
    root = Tree(f"ripple of request {', '.join(sorted(request_ids)) or '?'}")
    seen = {s["span_id"] for s in request_spans}

    def follow(node: Tree, span_id: str, level: int) -> int:
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for effect, kind in effects.get(span_id, ()):
            if effect["span_id"] not in seen or kind == "placed_by":
                by_kind.setdefault(kind, []).append(effect)
        for kind, found in sorted(by_kind.items()):
            group = node.add(f"[yellow]{EFFECTS.get(kind, kind)}[/] ({len(found)})")
            for effect in sorted(found, key=lambda s: s["start_ns"])[:fan_out]:
                seen.add(effect["span_id"])
                child = group.add(_ripple_label(effect))
                if level < depth:
                    follow(child, effect["span_id"], level + 1)
            if len(found) > fan_out:
                group.add(f"[dim]... and {len(found) - fan_out} more[/]")
        return len(by_kind)

    for span in request_spans:
        node = Tree(_ripple_label(span))
        if follow(node, span["span_id"], 1):
            root.add(node)
    if not root.children:
        root.add(
            "[dim]no effects recorded yet (spans are written every 200 ms; later requests and "
            "plans add more)[/]"
        )
    return root
