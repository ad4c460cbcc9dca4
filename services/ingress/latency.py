"""What a client of the HTTP API waited, by tenant and class: time to first token, the mean gap
between tokens and the whole request; each observation carries its trace id as an exemplar, so
a Grafana panel jumps from a spike to the trace behind it."""

from __future__ import annotations

from prometheus_client import Histogram

from schemas.events import InferenceRequest, Usage

_LABELS = ["tenant", "priority"]
TTFT = Histogram(
    "ripplemesh_ingress_ttft_seconds",
    "Time to first token seen by the ingress, from the request's arrival.",
    _LABELS,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
ITL = Histogram(
    "ripplemesh_ingress_itl_seconds",
    "A request's mean time between output tokens (first token to last, per gap).",
    _LABELS,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1),
)
E2E = Histogram(
    "ripplemesh_ingress_e2e_seconds",
    "From a request's arrival to its last token.",
    _LABELS,
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160),
)


def _exemplar(trace_id: str | None) -> dict[str, str] | None:
    return {"trace_id": trace_id} if trace_id else None


def first_token(request: InferenceRequest, at: float, trace_id: str | None) -> None:
    TTFT.labels(request.tenant, request.priority).observe(
        max(0.0, at - request.submitted_at), _exemplar(trace_id)
    )


def finished(
    request: InferenceRequest, first_at: float | None, at: float, usage: Usage | None, trace_id: str | None
) -> None:
    labels = (request.tenant, request.priority)
    exemplar = _exemplar(trace_id)
    E2E.labels(*labels).observe(max(0.0, at - request.submitted_at), exemplar)
    if first_at is not None and usage is not None and usage.completion_tokens > 1:
        ITL.labels(*labels).observe(max(0.0, at - first_at) / (usage.completion_tokens - 1), exemplar)
