"""`ripplemesh bench overhead` runs end to end: a real mesh and a real NATS server, a short run."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ripplemesh.bench.overhead import phoenix_binary, run_overhead_bench

SERVICES = ("ingress", "admission", "router", "prefill-0", "decode-0", "ledger", "autoscaler", "batch")


def test_the_overhead_bench_prints_mesh_floor_ratio_and_cpu_by_service() -> None:
    out = io.StringIO()
    rows = run_overhead_bench(rate=50.0, count=40, prefill=1, console=Console(file=out, width=120), rounds=1)
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

    # Tracing's cost, mode by mode; with Phoenix installed (`make receivers`), both ways of
    # exporting over OTLP (the shipped span files, each service itself) reached it.
    for mode in ("off", "local"):
        assert f"tracing_{mode}_overhead_p50_ms" in rows
    if phoenix_binary():
        for mode in ("otlp", "otlp_direct"):
            assert rows[f"tracing_{mode}_spans_exported"] > 0, printed
            assert rows[f"tracing_{mode}_spans_received"] > 0, printed
            assert f"tracing_{mode}_vs_off_mesh_p50" in rows
        assert "OTLP to Phoenix, shipped" in printed and "from each service" in printed
