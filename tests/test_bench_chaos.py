"""`ripplemesh bench chaos` runs end to end: `up`'s mesh under load, a kill of each kind in turn
(a short run: decode, prefill, router, admission), every stream checked against the reference."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ripplemesh.bench.chaos import run_chaos_bench

pytestmark = pytest.mark.timeout(300)


def test_the_chaos_drill_kills_services_and_every_stream_it_counts_is_whole() -> None:
    out = io.StringIO()
    figures = run_chaos_bench(
        duration_s=10.0,
        rate=5.0,
        kill_every_s=2.0,
        max_tokens=32,
        prefill=1,
        decode=2,
        nats_cluster=1,
        time_scale=1.0,
        seed=1,
        console=Console(file=out, width=140),
    )
    printed = out.getvalue()
    assert figures["kills"] >= 4 and figures["healed"]
    # No ingress was killed in 10 s (the fifth kind), so every request completes, whole.
    assert figures["completed"] == figures["sent"] == 50, printed
    assert figures["duplicated_tokens"] == figures["missing_tokens"] == figures["mismatched"] == 0
    assert figures["ledger_completed"] == figures["mesh_completed"], printed
    for row in ("requests sent", "tokens duplicated", "ledger completed", "back within (s)"):
        assert row in printed
