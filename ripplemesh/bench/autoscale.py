"""`ripplemesh bench autoscale`: the autoscaler against its baselines and fixed fleets, side by
side on the fleet simulator, by cost per successful task at the SLO attainment each reaches.

Per workload, on the same heterogeneous fleet (`FLEET`: a prefill pool of H100s and decode pools
of H100s and H200s, each 0..16, priced by the mesh config; where cost-aware choice matters):

- the ripple policy (services/autoscaler/policy.py) and the two baselines of
  services/autoscaler/baselines.py, `dynamo-sla` and `hpa-queue`, each driving the autoscaled
  pools (simulator/autoscaling.py);
- fixed fleets: the ripple run's peak size per pool scaled by each of `fixed` (0.25, 0.5, 0.75,
  1 by default), nothing autoscaled; and a search of its own (`searched_fleets`): per decode GPU
  type alone, the fewest replicas reaching ripple's SLO attainment (the fixed fleet an operator
  would find by trying sizes), and the size below. Those at ripple's attainment or better are
  marked.

Workloads: (a) an Azure LLM inference trace from ../shared/traces/ (conversation, rate-scaled;
skipped, and said so, where the traces are absent) and (b) the agentic generator with bursts
(each period of `burst_every_s` ends with `burst_s` at `burst_factor` x the base rate).

Printed per workload: a table of cost per successful task, SLO attainment (TTFT <= 2 s and time
per output token <= 0.1 s, over every request issued), tasks succeeded, GPU-hours, mean
replicas, and each run's cost per successful task over the best baseline's (the cheapest of the
baselines and fixed fleets at ripple's SLO attainment or better: `verdict`); then whether the
issue's target holds: ripple's cost per successful task at least 20% below the best baseline's,
at equal or better SLO attainment. Written under
`out`: a PNG per workload (replicas over time per autoscaler and the SLO-matching fixed fleet,
beside the arrivals per second) and summary.json.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from services.simulator import AgenticWorkload, AzureTrace, SimOptions, Workload, run_simulation
from services.simulator.autoscaling import AUTOSCALER_NAMES
from services.simulator.fleet import FleetSpec, parse_fleet
from services.simulator.metrics import SimResult
from services.simulator.workload import load_workload

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
FLEET = "prefill:0..16xH100,decode:0..16xH100,decode:0..16xH200"
AZURE_FILE = "AzureLLMInferenceTrace_conv.csv"
AZURE_RATE_SCALE = 6.0
AGENTIC = "agentic:workflows=3000,rate_per_s=3,burst_factor=5,burst_s=60,burst_every_s=300,seed=0"
FIXED = (0.25, 0.5, 0.75, 1.0)
QUICK_AZURE_WINDOW = (0.0, 1200.0)
QUICK_AGENTIC = "agentic:workflows=150,rate_per_s=1,burst_factor=6,burst_s=20,burst_every_s=60,seed=0"
QUICK_FIXED = (0.5, 1.0)
TARGET = 0.8  # ripple's cost per successful task at most this times the best baseline's
# Each autoscaled pool starts with this many replicas (within its limits), serving at once: the
# comparison is of scaling a running fleet, not of every autoscaler's first cold start.
START = 1


@dataclass(frozen=True, slots=True)
class BenchRun:
    label: str
    kind: str  # "autoscaled" or "fixed"
    fleet: str
    result: SimResult

    @property
    def cost(self) -> float | None:
        return self.result.cost_per_successful_task_usd

    @property
    def slo(self) -> float:
        value = self.result.slo.get("attainment")
        return float(value) if value is not None else 0.0

    @property
    def gpu_hours(self) -> float:
        return self.result.provisioned_gpu_seconds / 3600.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """The best baseline: the cheapest per successful task among the baselines (the other
    autoscalers and the fixed fleets) at ripple's SLO attainment or better; where none reaches
    it, the one with the highest SLO attainment. The target holds where ripple's cost per
    successful task is at most `TARGET` times the best baseline's (its SLO attainment is then
    equal or better by construction). `cheapest`: the cheapest baseline whatever its SLO."""

    best: BenchRun | None
    ratio: float | None  # ripple's cost over the best baseline's
    holds: bool
    cheapest: BenchRun | None


def started(spec: FleetSpec, start: int) -> FleetSpec:
    """The fleet with each autoscaled pool starting at `start` replicas (within its limits)."""
    pools = [
        msgspec.structs.replace(p, replicas=max(p.min_replicas, min(p.high, start))) if p.autoscale else p
        for p in spec.pools
    ]
    return msgspec.structs.replace(spec, pools=pools)


def _fixed_fleet(spec: FleetSpec, sizes: Sequence[int]) -> FleetSpec:
    pools = [
        msgspec.structs.replace(p, replicas=n, autoscale=False, min_replicas=n, max_replicas=n)
        for p, n in zip(spec.pools, sizes, strict=True)
    ]
    return msgspec.structs.replace(spec, pools=pools)


def _compact(spec: FleetSpec) -> str:
    parts = []
    for pool in spec.pools:
        if pool.replicas:
            tp = f"@{pool.tensor_parallel}" if pool.tensor_parallel > 1 else ""
            parts.append(f"{pool.role}:{pool.replicas}x{pool.gpu}{tp}")
    return ",".join(parts)


def peak_sizes(result: SimResult, spec: FleetSpec) -> list[int]:
    """Each pool's largest size in the run's plans (replicas wanted, serving or warming)."""
    peaks = {p.label(i): 0 for i, p in enumerate(spec.pools)}
    for plan in result.autoscale_plans:
        for pool in plan.pools:
            if pool.pool in peaks:
                peaks[pool.pool] = max(peaks[pool.pool], pool.desired, pool.serving + pool.warming)
    return [peaks[p.label(i)] for i, p in enumerate(spec.pools)]


def fixed_ladder(spec: FleetSpec, peaks: Sequence[int], fractions: Sequence[float]) -> list[FleetSpec]:
    """Fixed fleets of the pools' peaks scaled by each fraction (at least one decode replica),
    smallest first, without repeats."""
    fleets: list[FleetSpec] = []
    seen: set[tuple[int, ...]] = set()
    decode = [i for i, p in enumerate(spec.pools) if p.role == "decode"]
    for fraction in sorted(fractions):
        sizes = [min(p.high, round(fraction * n)) for p, n in zip(spec.pools, peaks, strict=True)]
        if not any(sizes[i] for i in decode):
            best = max(decode, key=lambda i: (peaks[i], -i))
            sizes[best] = 1
        key = tuple(sizes)
        if key not in seen:
            seen.add(key)
            fleets.append(_fixed_fleet(spec, sizes))
    return fleets


def searched_fleets(
    spec: FleetSpec, fixed_run: Callable[[FleetSpec], BenchRun], slo_target: float
) -> list[BenchRun]:
    """Per decode pool's GPU type, that type alone (serving prompts and outputs): the fewest
    replicas, by bisection over 1..its maximum, whose SLO attainment reaches `slo_target`, and
    the size below it. A search of its own, not scaled from any autoscaler's run: the fixed
    fleet an operator would find by trying sizes."""
    found: list[BenchRun] = []
    for index, pool in enumerate(spec.pools):
        if pool.role != "decode" or pool.high < 1:
            continue

        def sized(n: int, index: int = index) -> FleetSpec:
            return _fixed_fleet(spec, [n if i == index else 0 for i in range(len(spec.pools))])

        runs: dict[int, BenchRun] = {}
        low, high = 1, pool.high
        runs[high] = fixed_run(sized(high))
        if runs[high].slo < slo_target:
            found.append(runs[high])  # even the largest falls short: it, for the table
            continue
        while low < high:
            middle = (low + high) // 2
            runs[middle] = runs.get(middle) or fixed_run(sized(middle))
            if runs[middle].slo >= slo_target:
                high = middle
            else:
                low = middle + 1
        found.append(runs[high])
        if high - 1 in runs:
            found.append(runs[high - 1])
    return found


def verdict(runs: Sequence[BenchRun]) -> Verdict:
    ripple = next((r for r in runs if r.label == "ripple"), None)
    baselines = [r for r in runs if r.label != "ripple" and r.cost is not None]
    cheapest = min(baselines, key=lambda r: (r.cost or math.inf, -r.slo), default=None)
    if ripple is None or ripple.cost is None:
        return Verdict(None, None, False, cheapest)
    serving = [r for r in baselines if r.slo >= ripple.slo]
    best: BenchRun | None = (
        min(serving, key=lambda r: (r.cost or math.inf, -r.slo))
        if serving
        else max(baselines, key=lambda r: (r.slo, -(r.cost or math.inf)), default=None)
    )
    ratio = ripple.cost / best.cost if best is not None and best.cost else None
    holds = best is not None and ratio is not None and ratio <= TARGET and ripple.slo >= best.slo
    return Verdict(best, ratio, holds, cheapest)


def table(name: str, runs: Sequence[BenchRun], slo_target: float | None) -> Table:
    result = runs[0].result
    title = f"{name}: {result.workload['name']}, {result.tasks:,} tasks, {result.requests:,} requests"
    out = Table(title=title, title_justify="left")
    for column in (
        "policy",
        "fleet",
        "$/successful task",
        "SLO attainment",
        "tasks succeeded",
        "GPU-hours",
        "mean replicas",
        "x best baseline",
    ):
        out.add_column(column, justify="left" if column in ("policy", "fleet") else "right")
    best = verdict(runs).best
    for run in runs:
        r = run.result
        mark = ""
        if run.kind == "fixed" and slo_target is not None and run.slo >= slo_target:
            mark = " *"
        ratio = run.cost / best.cost if best is not None and best.cost and run.cost is not None else None
        out.add_row(
            run.label + mark,
            run.fleet,
            "-" if run.cost is None else f"${run.cost:.5f}",
            f"{run.slo:.1%}",
            f"{r.tasks_succeeded:,}/{r.tasks:,}",
            f"{run.gpu_hours:.2f}",
            "-" if r.mean_replicas is None else f"{r.mean_replicas:.1f}",
            "-" if ratio is None else f"{ratio:.2f}",
        )
    return out


def plot(
    name: str, runs: Sequence[BenchRun], slo_target: float | None, interval_s: float, path: Path
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    fixed = [r for r in runs if r.kind == "fixed" and slo_target is not None and r.slo >= slo_target]
    shown = [r for r in runs if r.kind == "autoscaled"] + fixed[:1]
    for run in shown:
        timeline = run.result.fleet_timeline
        if timeline:
            style = "--" if run.kind == "fixed" else "-"
            ax.step(
                [s.t for s in timeline],
                [s.provisioned for s in timeline],
                where="post",
                linestyle=style,
                label=f"{run.label} (replicas billed)",
            )
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("replicas")
    ax.grid(True, alpha=0.3)
    load = next((r.result.fleet_timeline for r in runs if r.label == "ripple"), [])
    if load:
        twin = ax.twinx()
        width = max(1, round(30.0 / interval_s))  # a 30 s moving mean
        rates = [s.arrivals / interval_s for s in load]
        smooth = [
            sum(rates[max(0, i - width + 1) : i + 1]) / len(rates[max(0, i - width + 1) : i + 1])
            for i in range(len(rates))
        ]
        twin.plot([s.t for s in load], smooth, color="grey", alpha=0.5, label="arrivals/s (30 s mean)")
        twin.set_ylabel("requests arriving per second")
        twin.legend(loc="upper right", fontsize="small")
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title(f"{name}: replicas over time, beside the load")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _workloads(
    traces: Path, quick: bool, azure_rate_scale: float, azure_window: tuple[float, float] | None, agentic: str
) -> tuple[list[tuple[str, Workload]], list[str]]:
    found: list[tuple[str, Workload]] = []
    skipped: list[str] = []
    azure = traces / AZURE_FILE
    if azure.is_file():
        window = QUICK_AZURE_WINDOW if quick and azure_window is None else azure_window
        found.append(("azure", AzureTrace(azure, rate_scale=azure_rate_scale, window=window)))
    else:
        skipped.append(f"azure: no trace at {azure} (--traces)")
    spec = QUICK_AGENTIC if quick and agentic == AGENTIC else agentic
    workload = load_workload(spec)
    if not isinstance(workload, AgenticWorkload):
        raise ValueError(f"--agentic {agentic!r}: expected agentic[:key=value,...]")
    found.append(("agentic-bursts", workload))
    return found, skipped


def run_autoscale_bench(
    *,
    console: Console,
    traces: Path = TRACES,
    fleet: str = FLEET,
    quick: bool = False,
    azure_rate_scale: float = AZURE_RATE_SCALE,
    azure_window: tuple[float, float] | None = None,
    agentic: str = AGENTIC,
    fixed: Sequence[float] | None = None,
    autoscalers: Sequence[str] = AUTOSCALER_NAMES,
    start: int = START,
    policy: str = "ripplemesh",
    admission: str = "ripplemesh",
    out: Path | None = Path("sim-out/autoscale"),
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[BenchRun]]:
    """Every autoscaler and the fixed ladder on each workload; prints the tables and verdicts."""
    spec = started(parse_fleet(fleet), start)
    if not any(p.autoscale for p in spec.pools):
        raise ValueError(f"fleet {fleet!r} has no autoscaled pool (LOW..HIGHxGPU)")
    if "ripple" not in autoscalers:
        raise ValueError("the bench compares the ripple autoscaler: keep it in --autoscaler")
    fractions = tuple(fixed) if fixed else (QUICK_FIXED if quick else FIXED)
    workloads, skipped = _workloads(traces, quick, azure_rate_scale, azure_window, agentic)
    console.print(
        f"fleet: {fleet}, each autoscaled pool starting at {start} (GPU prices from the mesh config); "
        f"router {policy}, admission {admission}"
    )
    for line in skipped:
        console.print(f"[yellow]skipped {line}[/yellow]")
    say = progress or (lambda text: console.print(f"[dim]{text}[/dim]"))
    everything: dict[str, list[BenchRun]] = {}
    summary: dict[str, Any] = {"fleet": fleet, "workloads": {}}
    for name, workload in workloads:
        runs: list[BenchRun] = []
        for autoscaler in autoscalers:
            say(f"{name}: {autoscaler}")
            options = SimOptions(autoscaler=autoscaler)
            result = run_simulation(workload, spec, policy, options=options, admission=admission)
            runs.append(BenchRun(autoscaler, "autoscaled", fleet, result))
        ripple = runs[[r.label for r in runs].index("ripple")]

        def fixed_run(fixed_spec: FleetSpec, name: str = name, workload: Workload = workload) -> BenchRun:
            compact = _compact(fixed_spec)
            say(f"{name}: fixed {compact}")
            result = run_simulation(workload, fixed_spec, policy, admission=admission)
            return BenchRun(f"fixed {sum(p.replicas for p in fixed_spec.pools)}", "fixed", compact, result)

        for fixed_spec in fixed_ladder(spec, peak_sizes(ripple.result, spec), fractions):
            runs.append(fixed_run(fixed_spec))
        tried = {r.fleet for r in runs}
        for found in searched_fleets(spec, fixed_run, ripple.slo):
            if found.fleet not in tried:
                runs.append(found)
        everything[name] = runs
        console.print(table(name, runs, ripple.slo))
        console.print("  * marks the fixed fleets at ripple's SLO attainment or better")
        v = verdict(runs)
        _print_verdict(console, name, ripple, v)
        summary["workloads"][name] = {
            "workload": ripple.result.workload,
            "runs": [
                {
                    "policy": r.label,
                    "fleet": r.fleet,
                    "cost_per_successful_task_usd": r.cost,
                    "slo_attainment": r.slo,
                    "tasks_succeeded": r.result.tasks_succeeded,
                    "tasks": r.result.tasks,
                    "gpu_hours": r.gpu_hours,
                    "mean_replicas": r.result.mean_replicas,
                    "rejections": r.result.rejections,
                }
                for r in runs
            ],
            "best_baseline": v.best.label if v.best is not None else None,
            "ratio_to_best_baseline": v.ratio,
            "target_holds": v.holds,
        }
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            try:
                path = plot(name, runs, ripple.slo, spec.autoscale_interval_s, out / f"autoscale_{name}.png")
                console.print(f"wrote {path}")
            except ImportError:
                console.print("[yellow]no plot: matplotlib is not installed[/yellow]")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary), indent=2))
        console.print(f"wrote {out / 'summary.json'}")
    return everything


def _print_verdict(console: Console, name: str, ripple: BenchRun, v: Verdict) -> None:
    if v.best is None or v.ratio is None:
        console.print(f"{name}: no baseline succeeded a task: no comparison")
        return
    at = "at ripple's SLO attainment or better" if v.best.slo >= ripple.slo else "none reaches ripple's SLO"
    word = "holds"
    if not v.holds:
        why = "the cost ratio is above it" if v.ratio > TARGET else "ripple's SLO attainment is lower"
        word = f"does not hold ({why})"
    console.print(
        f"{name}: best baseline ({at}): {v.best.label} {v.best.fleet}, ${v.best.cost or 0:.5f} per "
        f"successful task at SLO {v.best.slo:.1%}; ripple ${ripple.cost or 0:.5f} at SLO "
        f"{ripple.slo:.1%}: ratio {v.ratio:.2f}. "
        f"Target (ratio <= {TARGET:g} at equal or better SLO attainment) {word}.",
        soft_wrap=True,  # one line, whatever the terminal's width: it is read and grepped whole
    )
    if v.cheapest is not None and v.cheapest is not v.best:
        console.print(
            f"{name}: (the cheapest baseline whatever its SLO: {v.cheapest.label} {v.cheapest.fleet}, "
            f"${v.cheapest.cost or 0:.5f} at SLO {v.cheapest.slo:.1%})"
        )
