"""`ripplemesh bench batch`: a day of interactive traffic with a daily shape, alone and with a
Batch API job beside it on the same fleet and seeds; the job released by the mesh's own policy
(services/batch/policy.py, through services/simulator/batch.py).

Per seed it prints, alone / with the batch and their ratio: the interactive class's p99 TTFT and
SLO attainment; whether the batch completed inside its window; the fleet's idle share (idle spend
over total spend); each class's cost per successful task (the ledger's: its attributed spend over
its tasks that succeeded) and the fleet's (its whole spend over every task that succeeded).

The interactive day is the rag-chat family (services/simulator/workload.py, `RagChatWorkload`:
chat with retrieval, 1-3 turns) with its bursts off and a daily shape instead: each hour's rate
is the mean x (1 + a cos(2 pi (the hour's middle - 14:00) / 24 h)), a = 0.6 (the curve's
peak / trough = 4; a chosen illustration, not a fit). The batch: `lines` requests of about 1,000
prompt and 300 output tokens (log-normal, sigma 0.6; chosen), submitted at 00:00 with a 24 h
window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy
from rich.console import Console
from rich.table import Table

from services.simulator.batch import BATCH_CLASS, INTERACTIVE_CLASS, BatchJob
from services.simulator.core import SimOptions, run_simulation
from services.simulator.fleet import parse_fleet
from services.simulator.metrics import SimResult
from services.simulator.records import RequestRecord
from services.simulator.workload import RagChatWorkload

DAY_S = 86_400.0
AMPLITUDE = 0.6
PEAK_S = 14 * 3600.0
FLEET = "2xH100"
RATE = 0.3  # interactive conversations per second, the day's mean
LINES = 60_000
SEEDS = (0, 1, 2)


@dataclass(frozen=True, slots=True)
class DayConfig:
    fleet: str = FLEET
    rate: float = RATE
    lines: int = LINES
    day_s: float = DAY_S
    amplitude: float = AMPLITUDE

    def workload(self, seed: int) -> RagChatWorkload:
        return RagChatWorkload(
            workflows=round(self.rate * self.day_s),
            rate_per_s=self.rate,
            burst_factor=1.0,
            burst_s=0.0,
            burst_every_s=0.0,
            daily_amplitude=self.amplitude,
            day_s=self.day_s,
            peak_s=PEAK_S * self.day_s / DAY_S,
            seed=seed,
        )

    def job(self, seed: int) -> BatchJob:
        return BatchJob(lines=self.lines, window_s=self.day_s, seed=seed)


# The test's run: an hour's "day", about a thousand conversations and 300 lines (seconds).
QUICK = DayConfig(lines=300, day_s=3600.0)
QUICK_SEEDS = (0,)


@dataclass(frozen=True, slots=True)
class Day:
    """The day alone and with the batch, and the interactive requests' first-token latencies
    of each (every one, for an exact p99: the results' sketches are good to 1%, and the goal's
    2% is two of their steps)."""

    alone: SimResult
    mixed: SimResult
    ttft_alone_s: list[float]
    ttft_mixed_s: list[float]


def run_day(config: DayConfig, seed: int) -> Day:
    """The interactive day alone, and with the batch job: the same fleet, workload and seed."""
    job = config.job(seed)
    ttfts: tuple[list[float], list[float]] = ([], [])

    def collect(into: list[float]) -> Callable[[RequestRecord], None]:
        def log(record: RequestRecord) -> None:
            if record.first_token_at is not None and record.tenant != job.tenant:
                into.append(record.first_token_at - record.arrival)

        return log

    fleet = parse_fleet(config.fleet)
    alone = run_simulation(config.workload(seed), fleet, seed=seed, request_log=collect(ttfts[0]))
    mixed = run_simulation(
        config.workload(seed),
        fleet,
        seed=seed,
        options=SimOptions(batch=job),
        request_log=collect(ttfts[1]),
    )
    return Day(alone, mixed, *ttfts)


def _ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None


def _p99(values: list[float]) -> float | None:
    return float(numpy.percentile(values, 99)) if values else None


def figures(day: Day) -> dict[str, Any]:
    """The comparison's figures (alone, with the batch, ratio)."""
    alone, mixed = day.alone, day.mixed
    ia, im = alone.by_class[INTERACTIVE_CLASS], mixed.by_class[INTERACTIVE_CLASS]
    exact = [_p99(day.ttft_alone_s), _p99(day.ttft_mixed_s)]
    batch = mixed.by_class.get(BATCH_CLASS, {})
    job = mixed.batch or {}
    idle_a = alone.idle_spend_usd / alone.total_spend_usd if alone.total_spend_usd else None
    idle_m = mixed.idle_spend_usd / mixed.total_spend_usd if mixed.total_spend_usd else None
    return {
        "seed": mixed.seed,
        "interactive_requests": ia["requests"],
        "ttft_p99_s": [ia["ttft_p99_s"], im["ttft_p99_s"], _ratio(ia["ttft_p99_s"], im["ttft_p99_s"])],
        # Over every interactive request's first token (the line above: the results' sketch).
        "ttft_p99_exact_s": [*exact, _ratio(*exact)],
        "slo_attainment": [
            ia["slo_attainment"],
            im["slo_attainment"],
            _ratio(ia["slo_attainment"], im["slo_attainment"]),
        ],
        "batch_lines": job.get("lines"),
        "batch_completed": job.get("completed"),
        "batch_completed_in_s": job.get("completed_in_s"),
        "batch_within_window": job.get("within_window"),
        "idle_share": [idle_a, idle_m, _ratio(idle_a, idle_m)],
        "interactive_cost_per_successful_task_usd": [
            ia["cost_per_successful_task_usd"],
            im["cost_per_successful_task_usd"],
            _ratio(ia["cost_per_successful_task_usd"], im["cost_per_successful_task_usd"]),
        ],
        "batch_cost_per_successful_task_usd": batch.get("cost_per_successful_task_usd"),
        "batch_to_interactive_cost": _ratio(
            im["cost_per_successful_task_usd"], batch.get("cost_per_successful_task_usd")
        ),
        "fleet_cost_per_successful_task_usd": [
            alone.cost_per_successful_task_usd,
            mixed.cost_per_successful_task_usd,
            _ratio(alone.cost_per_successful_task_usd, mixed.cost_per_successful_task_usd),
        ],
        "total_spend_usd": [alone.total_spend_usd, mixed.total_spend_usd],
        "duration_s": [alone.duration_s, mixed.duration_s],
        "release_decisions": job.get("release_decisions"),
    }


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.2%}"


def _usd(v: float | None) -> str:
    return "-" if v is None else f"${v:.6f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def table(rows: list[dict[str, Any]], config: DayConfig) -> Table:
    t = Table(
        title=(
            f"interactive day (rag-chat, {config.rate}/s mean, daily amplitude {config.amplitude}, "
            f"day {config.day_s:,.0f} s) alone / with a {config.lines:,}-line batch, on {config.fleet}"
        ),
        title_justify="left",
    )
    for c in (
        "seed",
        "interactive TTFT p99, exact (ratio)",
        "interactive SLO (ratio)",
        "batch done / in window (took)",
        "idle share (ratio)",
        "interactive $/task (ratio)",
        "batch $/task (x interactive)",
        "fleet $/task (ratio)",
    ):
        t.add_column(c, justify="right")
    for r in rows:
        ttft, slo, idle = r["ttft_p99_exact_s"], r["slo_attainment"], r["idle_share"]
        ic, fc = r["interactive_cost_per_successful_task_usd"], r["fleet_cost_per_successful_task_usd"]
        took = r["batch_completed_in_s"]
        took_h = "-" if took is None else f"{took / 3600:.2f} h"
        t.add_row(
            str(r["seed"]),
            f"{ttft[0] * 1000:,.1f} / {ttft[1] * 1000:,.1f} ms ({ttft[2]:.4f})",
            f"{_pct(slo[0])} / {_pct(slo[1])} ({_x(slo[2])})",
            f"{r['batch_completed']:,}/{r['batch_lines']:,} "
            f"{'yes' if r['batch_within_window'] else 'NO'} ({took_h})",
            f"{_pct(idle[0])} / {_pct(idle[1])} ({_x(idle[2])})",
            f"{_usd(ic[0])} / {_usd(ic[1])} ({_x(ic[2])})",
            f"{_usd(r['batch_cost_per_successful_task_usd'])} ({_x(r['batch_to_interactive_cost'])})",
            f"{_usd(fc[0])} / {_usd(fc[1])} ({_x(fc[2])})",
        )
    return t


def run_batch_bench(
    *,
    console: Console,
    config: DayConfig | None = None,
    seeds: tuple[int, ...] = SEEDS,
    out: Path | None = None,
) -> list[dict[str, Any]]:
    """Every seed's day alone and with the batch; the table, and `out`/summary.json."""
    config = config or DayConfig()
    rows = []
    for seed in seeds:
        rows.append(figures(run_day(config, seed)))
    console.print(table(rows, config))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "summary.json"
        path.write_bytes(
            msgspec.json.format(
                msgspec.json.encode({"config": dataclasses.asdict(config), "runs": rows}),
                indent=2,
            )
        )
        console.print(f"wrote {path}")
    return rows
