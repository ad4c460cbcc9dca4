"""`ripplemesh bench simulator`: how fast the fleet simulator runs, on this machine.

One run of `requests` requests on a fleet of `workers` H100s (llama-3.1-8b), on one of three
workloads, each rate-scaled so that the fleet is busy but not saturated (the load per worker is
the same whatever the fleet size):

- azure: the Azure LLM inference trace (conversation), replayed back to back as often as needed,
  at 100 x its rate per 64 workers; 16-token blocks, no prefix sharing;
- mooncake: the Mooncake conversation trace, likewise, at 12 x its rate per 64 workers, in its
  native 512-token blocks;
- agentic: the synthetic agent workload (about 5 steps per workflow), 60 workflows/s per 64
  workers, 16-token blocks;
- workflow: a recorded workflow trace (services/simulator/recorded.py) of the same shape, written
  by `write_workflow_trace` into a scratch directory before the clock starts, replayed closed
  loop in its native 512-token blocks; reading and checking the file is timed with the run.

Reports wall and CPU seconds (the machine may be shared: CPU time is the steadier figure), and
of the CPU seconds those spent in the routing policy's decisions and in admission (its
decisions, deferral re-checks and the router predictions they ask for), timed around those calls;
the rest is the simulator itself (events, workers, KV blocks, workload, metrics). Also requests
per second, events, simulated time, requests completed, and the process's peak RSS (so far: run
one scenario per process for each scenario's own).
"""

from __future__ import annotations

import json
import math
import random
import resource
import tempfile
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
from services.simulator.recorded import WorkflowTrace

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
SCENARIOS = ("azure", "mooncake", "agentic", "workflow")
AZURE_REQUESTS = 19_366
MOONCAKE_REQUESTS = 12_031
WORKFLOW_TRACE = "workflow_trace.jsonl"  # in the run's scratch directory
BLOCK_TOKENS = 512  # the workflow format's blocks, as Mooncake's

# The recorded workflows' tenants: (name, priority, share, system prompt blocks, first-token and
# last-token deadlines in ms), as the agentic generator's default tenants.
_RECORDED_TENANTS = (
    ("assistant", "critical", 0.3, 3, 5_000, 30_000),
    ("agents", "standard", 0.5, 6, 10_000, 60_000),
    ("batch", "sheddable", 0.2, 2, None, 300_000),
)


def write_workflow_trace(path: Path, requests: int, workflows_per_s: float, seed: int = 0) -> int:
    """A workflow trace of exactly `requests` lines, as the mesh would record agent runs: workflows
    of 2-8 steps arriving at `workflows_per_s` (Poisson), each step's prompt its previous prompt
    plus its output and a tool result (so it shares the previous step's full blocks), the
    tenant's system prompt shared by its workflows, completions a little after each arrival and
    think times of 3 s on average between steps. Returns the number of workflows."""
    rng = random.Random(seed)
    lines: list[tuple[float, int, str]] = []  # (timestamp ms, order, JSON)
    next_id = 1_000_000  # the workflows' own block ids, after the system prompts'
    systems = [list(range(i * 100, i * 100 + t[3])) for i, t in enumerate(_RECORDED_TENANTS)]
    at_ms = 0.0
    workflow = 0
    while len(lines) < requests:
        at_ms += rng.expovariate(workflows_per_s) * 1000.0
        which = rng.choices(range(len(_RECORDED_TENANTS)), weights=[t[2] for t in _RECORDED_TENANTS])[0]
        name, priority, _, _, first_ms, last_ms = _RECORDED_TENANTS[which]
        steps = min(rng.randint(2, 8), requests - len(lines))
        ids = list(systems[which])
        tokens = len(ids) * BLOCK_TOKENS + round(rng.lognormvariate(math.log(600), 0.6))
        arrival = at_ms
        for step in range(1, steps + 1):
            blocks = -(-tokens // BLOCK_TOKENS)
            while len(ids) < blocks:  # a new id for each block no earlier prompt had
                ids.append(next_id)
                next_id += 1
            output = max(1, round(rng.lognormvariate(math.log(250), 0.6)))
            completed = arrival + 200.0 + 10.0 * output
            fields = {
                "timestamp": round(arrival, 3),
                "input_length": tokens,
                "output_length": output,
                "hash_ids": ids,
                "tenant": name,
                "priority": priority,
                "workflow_id": f"wf{workflow}",
                "step": step,
                "steps": steps,
                "e2e_deadline_ms": last_ms,
                "completed_ms": round(completed, 3),
                **({"deadline_ms": first_ms} if first_ms is not None else {}),
            }
            lines.append((arrival, len(lines), json.dumps(fields)))
            # The next prompt keeps this one's full blocks; its partly filled last block changes.
            del ids[tokens // BLOCK_TOKENS :]
            tokens += output + round(rng.lognormvariate(math.log(400), 0.6))
            arrival = completed + rng.expovariate(1 / 3.0) * 1000.0
        workflow += 1
    lines.sort()
    with path.open("w") as handle:
        handle.writelines(f"{text}\n" for _, _, text in lines)
    return workflow


def scenario(
    name: str, requests: int, workers: int, traces: Path = TRACES, scratch: Path | None = None
) -> Workload:
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
    if name == "workflow":
        if scratch is None:
            raise ValueError("the workflow scenario reads its trace from a scratch directory")
        return WorkflowTrace(scratch / WORKFLOW_TRACE)
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
    label = f"{requests:,} requests on {workers} workers ({policy}, admission {admission})"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-simulator-") as scratch:
        for name in scenarios:
            if name == "workflow":  # before the clock: the recording exists before its replay
                with console.status(f"writing a workflow trace of {requests:,} requests"):
                    write_workflow_trace(Path(scratch) / WORKFLOW_TRACE, requests, 60.0 * workers / 64.0)
            with console.status(f"simulating {name}: {label}"):
                wall, cpu = time.perf_counter(), time.process_time()
                workload = scenario(name, requests, workers, traces, Path(scratch))
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
