"""`ripplemesh bench overhead` runs end to end: a real mesh and a real NATS server, a short run."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ripplemesh.bench.overhead import paired_interval, phoenix_binary, run_overhead_bench

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


def test_the_tracing_verdict_reads_round_by_round_differences_with_their_interval() -> None:
    # Tracing off's meshes drift (2.0 -> 3.0 ms) and each OTLP mesh ran beside one: the pairs
    # differ by 0.1 ms every round, 5% of a 2 ms overhead, however far the rounds drift.
    mean, low, high = paired_interval([2.1, 2.6, 3.1], [2.0, 2.5, 3.0], scale_ms=2.0)
    assert (mean, low, high) == pytest.approx((0.05, 0.05, 0.05))
    # Noisy pairs: the interval widens past the 10% goal on both sides, so neither can be claimed.
    mean, low, high = paired_interval([2.4, 1.8, 2.3, 1.9], [2.0, 2.2, 2.0, 2.1], scale_ms=2.0)
    assert low < 0.10 < high
    assert paired_interval([2.2], [2.0], scale_ms=2.0)[1:] == (float("-inf"), float("inf"))


def test_the_bench_refuses_an_unknown_tracing_mode() -> None:
    with pytest.raises(ValueError, match="unknown tracing modes"):
        run_overhead_bench(
            rate=50.0, count=10, prefill=1, console=Console(file=io.StringIO()), modes=("otpl",)
        )
