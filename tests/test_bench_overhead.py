"""`ripplemesh bench overhead` runs end to end: a real mesh and a real NATS server, a short run."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ripplemesh.bench.overhead import run_overhead_bench

SERVICES = ("ingress", "admission", "router", "prefill-0", "decode-0", "ledger", "autoscaler", "batch")


def test_the_overhead_bench_prints_mesh_floor_ratio_and_cpu_by_service() -> None:
    out = io.StringIO()
    rows = run_overhead_bench(rate=50.0, count=40, prefill=1, console=Console(file=out, width=120))
    printed = out.getvalue()

    # Five services and five JetStream or core hops cannot beat five bare round trips in one hot
    # process: a mesh figure under the floor would mean the bench timed the wrong thing.
    assert rows["floor_p50_ms"] > 0
    assert rows["mesh_p50_ms"] > rows["floor_p50_ms"]
    assert rows["overhead_p50_ms"] == rows["mesh_p50_ms"] - rows["floor_p50_ms"]
    for row in ("mesh (5 services, JetStream)", "floor (5 bare NATS round trips)", "ratio mesh / floor"):
        assert row in printed
    # The table names every service; each on a short request's path used CPU for it (the
    # prefill worker and the autoscaler may use less than a clock tick in 40 requests).
    for service in SERVICES:
        assert service in printed
    assert all(rows[f"cpu_ms_{s}"] > 0 for s in ("ingress", "admission", "router", "decode-0", "ledger"))
    assert rows["cpu_ms_total"] == pytest.approx(sum(rows[f"cpu_ms_{s}"] for s in SERVICES))
    assert "the 5 ms target" in printed
