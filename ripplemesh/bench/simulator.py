"""`ripplemesh bench simulator`: how fast the fleet simulator runs, on this machine.

One run of `requests` requests on a fleet of `workers` H100s (llama-3.1-8b), on one of three
workloads, each rate-scaled so that the fleet is busy but not saturated (the load per worker is
the same whatever the fleet size):

- azure: the Azure LLM inference trace (conversation), replayed back to back as often as needed,
  at 100 x its rate per 64 workers; 16-token blocks, no prefix sharing;
- mooncake: the Mooncake conversation trace, likewise, at 12 x its rate per 64 workers, in its
  native 512-token blocks;
- agentic: the synthetic agent workload (about 5 steps per workflow), 60 workflows/s per 64
  workers, 16-token blocks.

Reports wall and CPU seconds (the machine may be shared: CPU time is the steadier figure), and
of the CPU seconds those spent in the routing policy's decisions and in admission (its
decisions, deferral re-checks and the router predictions they ask for), timed around those calls;
the rest is the simulator itself (events, workers, KV blocks, workload, metrics). Also requests
per second, events, simulated time, requests completed, and the process's peak RSS (so far: run
one scenario per process for each scenario's own).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from services.admission import policy as admission_policy
from services.simulator import (
    AgenticWorkload,
    AzureTrace,
    MooncakeTrace,
    SimOptions,
    Simulator,
    Workload,
)
from services.simulator.admission import DEFAULT_ADMISSION
from services.simulator.fleet import FleetSpec, PoolSpec

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
SCENARIOS = ("azure", "mooncake", "agentic")
AZURE_REQUESTS = 19_366
MOONCAKE_REQUESTS = 12_031


def scenario(name: str, requests: int, workers: int, traces: Path = TRACES) -> Workload:
    load = workers / 64.0
    if name == "azure":
        return AzureTrace(
            traces / "AzureLLMInferenceTrace_conv.csv",
            rate_scale=100.0 * load,
            repeat=-(-requests // AZURE_REQUESTS),
            limit=requests,
        )
    if name == "mooncake":
        return MooncakeTrace(
            traces / "conversation_trace.jsonl",
            rate_scale=12.0 * load,
            repeat=-(-requests // MOONCAKE_REQUESTS),
            limit=requests,
        )
    if name == "agentic":
        # Steps are uniform in [2, 8]: 5 requests per workflow on average.
        return AgenticWorkload(workflows=max(1, requests // 5), rate_per_s=60.0 * load)
    raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")


class _CpuTimer:
    """CPU seconds spent inside the calls it wraps (not counting calls nested in one)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0

    def wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            started = time.process_time() if self._depth == 1 else 0.0
            try:
                return call(*args, **kwargs)
            finally:
                if self._depth == 1:
                    self.seconds += time.process_time() - started
                self._depth -= 1

        return timed


@contextmanager
def _timed_admission(timer: _CpuTimer) -> Iterator[None]:
    """Time admission's entry points for one run (the simulator calls them through the module)."""
    saved = {name: getattr(admission_policy, name) for name in ("decide", "drain")}
    try:
        for name, call in saved.items():
            setattr(admission_policy, name, timer.wrap(call))
        yield
    finally:
        for name, call in saved.items():
            setattr(admission_policy, name, call)


def run_simulator_bench(
    *,
    console: Console,
    scenarios: tuple[str, ...] = SCENARIOS,
    requests: int = 100_000,
    workers: int = 64,
    policy: str = "ripplemesh",
    admission: str = DEFAULT_ADMISSION,
    upper_bound: bool = True,
    traces: Path = TRACES,
) -> list[dict[str, Any]]:
    fleet = FleetSpec(pools=[PoolSpec(replicas=workers)])
    rows: list[dict[str, Any]] = []
    for name in scenarios:
        workload = scenario(name, requests, workers, traces)
        label = f"{requests:,} requests on {workers} workers ({policy}, admission {admission})"
        with console.status(f"simulating {name}: {label}"):
            wall, cpu = time.perf_counter(), time.process_time()
            options = SimOptions(prefix_upper_bound=upper_bound)
            simulator = Simulator(workload, fleet, policy, options=options, admission=admission)
            routing, admitting = _CpuTimer(), _CpuTimer()
            simulator.router = routing.wrap(simulator.router)
            with _timed_admission(admitting):
                result = simulator.run()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        rows.append(
            {
                "scenario": name,
                "block_size": workload.block_size,
                "requests": result.requests,
                "completed": result.requests_completed,
                "tasks": result.tasks,
                "workers": workers,
                "policy": policy,
                "admission": admission,
                "wall_s": wall,
                "cpu_s": cpu,
                "router_cpu_s": routing.seconds,
                "admission_cpu_s": admitting.seconds,
                "requests_per_wall_s": result.requests / wall if wall else None,
                "events": result.events,
                "simulated_s": result.duration_s,
                "gpu_utilisation": result.gpu_utilisation,
                "cost_per_successful_task_usd": result.cost_per_successful_task_usd,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    table = Table(title=f"fleet simulator speed: {label}")
    # CPU: all of it; router, admission: the CPU seconds inside those calls.
    for column in (
        "workload/block",
        "requests",
        "completed",
        "wall",
        "CPU",
        "router",
        "admission",
        "req/s",
        "events",
        "simulated",
        "GPU",
        "peak RSS",
    ):
        table.add_column(column, justify="left" if column == "workload/block" else "right")
    for row in rows:
        table.add_row(
            f"{row['scenario']}/{row['block_size']}",
            f"{row['requests']:,}",
            f"{row['completed']:,}",
            f"{row['wall_s']:.1f} s",
            f"{row['cpu_s']:.1f} s",
            f"{row['router_cpu_s']:.1f} s",
            f"{row['admission_cpu_s']:.1f} s",
            f"{row['requests_per_wall_s']:,.0f}",
            f"{row['events']:,}",
            f"{row['simulated_s']:,.0f} s",
            f"{row['gpu_utilisation']:.0%}" if row["gpu_utilisation"] is not None else "-",
            f"{row['peak_rss_mb']:,.0f} MB",
        )
    if not console.is_terminal:  # a file or a pipe: no need to squeeze the table into 80 columns
        console.width = max(console.width, 160)
    console.print(table)
    return rows
