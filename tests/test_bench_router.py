"""`ripplemesh bench router` runs end to end on a small index: what it reports is what it built and
timed, and the decisions it writes are placements on the index's workers."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from ripplemesh.bench.router import run_router_bench


def test_the_router_bench_reports_the_index_it_built_and_the_decisions_it_timed(tmp_path: Path) -> None:
    out = io.StringIO()
    placements = tmp_path / "placements.txt"
    result = run_router_bench(
        workers=20,
        blocks=20_000,
        requests=50,
        console=Console(file=out, width=160),
        placements_out=str(placements),
    )
    printed = out.getvalue()

    assert result.workers == 20
    # The index holds about the blocks asked for (the bench's chains round to whole prompts).
    assert 15_000 <= result.indexed_blocks <= 25_000
    assert 0 < result.distinct_blocks <= result.indexed_blocks
    assert 0 < result.p50_us <= result.p90_us <= result.p99_us <= result.max_us
    assert result.decision_p99_us > 0 and result.apply_batches_per_s > 0
    assert {"conversation", "shared prompt", "unseen"} <= set(result.p99_by_kind_us)
    assert "decision latency p99 under 1000 µs" in printed

    # Every timed decision is written, each a placement on one of the index's workers.
    lines = placements.read_text().splitlines()
    assert len(lines) == 50
    assert all(line.startswith("Placement(") and "prefill_worker='worker-00" in line for line in lines)
