"""The comparison harness: every named routing policy (and admission variant) on the identical
workload and fleet, rich tables, JSON results and PNG plots. `ripplemesh simulate` is a thin
command over `compare`.

Identical means identical: each run re-reads the same trace file or re-draws the same seeded
generator from its start, and builds a fresh fleet of the same spec, so the runs differ only in
the policy's decisions (and what they lead to).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.simulator.admission import DEFAULT_ADMISSION, parse_admission
from services.simulator.core import SimOptions, run_simulation
from services.simulator.fleet import FleetSpec
from services.simulator.metrics import SimResult, run_label
from services.simulator.policies import POLICY_NAMES
from services.simulator.workload import Workload

MATPLOTLIB_HINT = "PNG plots need matplotlib (in the dev extra; or pip install matplotlib)"


def compare(
    workload: Workload,
    fleet: FleetSpec,
    policies: Sequence[str],
    *,
    seed: int = 0,
    options: SimOptions | None = None,
    out: Path | None = None,
    console: Console | None = None,
    plots: bool = True,
    admissions: Sequence[str] = (DEFAULT_ADMISSION,),
) -> list[SimResult]:
    """Run each policy under each admission variant (simulator/admission.py) on `workload` and
    `fleet`; print the comparison, write it under `out`."""
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policy {', '.join(unknown)}; known: {', '.join(POLICY_NAMES)}")
    variants = [parse_admission(a) for a in admissions]  # a bad spec fails before any run
    runs = [(p, v) for p in policies for v in variants]
    console = console or Console(stderr=True)
    total = workload.count_hint()
    results: list[SimResult] = []
    with Progress(
        TextColumn("{task.description:<20}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tasks"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        bars = {(p, v.name): progress.add_task(run_label(p, v.name), total=total) for p, v in runs}
        for name, variant in runs:
            bar = bars[(name, variant.name)]

            def advance(done: int, hint: int | None, bar: Any = bar) -> None:
                progress.update(bar, completed=done, total=hint)

            result = run_simulation(
                workload, fleet, name, seed=seed, options=options, progress=advance, admission=variant
            )
            progress.update(bar, completed=result.tasks, total=result.tasks)
            results.append(result)
    console.print(comparison_table(results))
    if any(len(r.by_model) > 1 for r in results):
        console.print(model_table(results))
    console.print(admission_table(results))
    if any(r.router_calibration for r in results):
        console.print(calibration_table(results))
    if out is not None:
        written = write_results(results, out, plots=plots, console=console)
        console.print(f"wrote {', '.join(str(p) for p in written)}")
    return results


def _money(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"${value:,.{digits}f}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:,.0f} ms" if value < 10 else f"{value:,.1f} s"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def comparison_table(results: Sequence[SimResult]) -> Table:
    first = results[0] if results else None
    title = "policy comparison"
    if first is not None:
        several = len({p.get("model") for p in first.fleet["pools"]}) > 1
        pools = ", ".join(
            (
                f"{p['min_replicas']}..{p['max_replicas']}x{p['gpu']} {p['role']}"
                if p["autoscale"]
                else f"{p['replicas']}x{p['gpu']} {p['role']}"
            )
            + (f" {p['model']}" if several else "")
            for p in first.fleet["pools"]
        )
        title = f"{first.workload['name']} on {pools}: {first.tasks:,} tasks, {first.requests:,} requests"
        if any(p["autoscale"] for p in first.fleet["pools"]):
            title += f", autoscaler {first.autoscaler}"
        skipped = first.workload.get("skipped_lines")
        if skipped:
            title += f", {skipped:,} bad lines skipped (first: {first.workload.get('first_skipped')})"
    table = Table(title=title, title_justify="left")
    columns = (
        "policy",
        "$/successful task",
        "succeeded",
        "wasted $",
        "idle $",
        "total $",
        "goodput/s",
        "TTFT p50/p99",
        "TPOT p50/p99",
        "SLO",
        "cache hit (bound)",
        "GPU util",
        "rejected",
        "peak/mean fleet",
        "wall",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    best = min(
        (r.cost_per_successful_task_usd for r in results if r.cost_per_successful_task_usd is not None),
        default=None,
    )
    for r in results:
        cost = _money(r.cost_per_successful_task_usd, 5)
        if best is not None and r.cost_per_successful_task_usd == best and len(results) > 1:
            cost = f"[bold green]{cost}[/bold green]"
        rejected = sum(r.rejections.values())
        hit = r.prefix_cache.get("hit_rate")
        bound = r.prefix_cache.get("upper_bound_hit_rate")
        table.add_row(
            r.label,
            cost,
            f"{r.tasks_succeeded:,}/{r.tasks:,} ({r.tasks_succeeded / r.tasks:.1%})" if r.tasks else "-",
            _money(r.wasted_spend_usd, 2),
            _money(r.idle_spend_usd, 2),
            _money(r.total_spend_usd, 2),
            "-" if r.goodput_tasks_per_s is None else f"{r.goodput_tasks_per_s:,.2f}",
            f"{_seconds(r.ttft_s.p50)} / {_seconds(r.ttft_s.p99)}",
            f"{_seconds(r.tpot_s.p50)} / {_seconds(r.tpot_s.p99)}",
            _percent(r.slo.get("attainment")),
            f"{_percent(hit)} ({_percent(bound)})",
            _percent(r.gpu_utilisation),
            f"{rejected:,}" if rejected else "0",
            f"{r.peak_replicas}/{r.mean_replicas:.1f}" if r.mean_replicas is not None else "-",
            f"{r.wall_s:.1f} s",
        )
    return table


def write_results(
    results: Sequence[SimResult], out: Path, *, plots: bool = True, console: Console | None = None
) -> list[Path]:
    """results.json (every run) and <policy>.json each; PNG plots when matplotlib is present."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    import msgspec

    combined = out / "results.json"
    combined.write_bytes(msgspec.json.format(msgspec.json.encode(list(results)), indent=2))
    written.append(combined)
    for r in results:
        path = out / f"{_file_name(r.label)}.json"
        path.write_bytes(r.to_json())
        written.append(path)
    if plots:
        try:
            written.extend(plot_results(results, out))
        except ImportError:
            if console is not None:
                console.print(f"[yellow]no plots: {MATPLOTLIB_HINT}[/yellow]")
    return written


def _file_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "+-_." else "_" for c in label)


def model_table(results: Sequence[SimResult]) -> Table:
    """Each run's figures per model (several models on one fleet, each its own pools)."""
    table = Table(title="by model", title_justify="left")
    for column in (
        "run",
        "model",
        "pools",
        "$/successful task",
        "succeeded",
        "total $",
        "requests",
        "completed",
        "rejected",
        "held",
        "SLO",
        "TTFT p99",
    ):
        table.add_column(column, justify="left" if column in ("run", "model", "pools") else "right")
    for r in results:
        for model, m in r.by_model.items():
            table.add_row(
                r.label,
                model,
                ", ".join(m["pools"]) or "-",
                _money(m["cost_per_successful_task_usd"], 5),
                f"{m['tasks_succeeded']:,}/{m['tasks']:,}",
                _money(m["total_spend_usd"], 2),
                f"{m['requests']:,}",
                f"{m['completed']:,}",
                f"{m['rejected']:,}",
                f"{m['held']:,}",
                _percent(m["slo_attainment"]),
                _seconds(m["ttft_p99_s"]),
            )
    return table


def calibration_table(results: Sequence[SimResult]) -> Table:
    """How ripplemesh's predictions turned out per GPU type, as its calibration learned them
    (the chance of success and the cached prefix counted on read it)."""
    table = Table(title="router calibration", title_justify="left")
    for column in ("run", "GPU", "actual/predicted", "spread", "completions", "prefix found", "prefills"):
        table.add_column(column, justify="left" if column in ("run", "GPU") else "right")
    for r in results:
        for gpu_type, c in r.router_calibration.items():
            table.add_row(
                r.label,
                gpu_type or "-",
                f"{c['completion_ratio']:.2f}" if "completion_ratio" in c else "-",
                f"{c['completion_spread']:.2f}" if "completion_spread" in c else "-",
                f"{int(c.get('completion_samples', 0)):,}",
                _percent(c["cached_share"]) if "cached_share" in c else "-",
                f"{int(c.get('cached_samples', 0)):,}",
            )
    return table


def admission_table(results: Sequence[SimResult]) -> Table:
    """What admission did: goodput, waste, SLO attainment by class, rejections, deferrals, and
    each tenant's share of the tokens admitted in its class against its share of the weight."""
    table = Table(title="admission", title_justify="left")
    for column in (
        "run",
        "goodput/s",
        "wasted % of spend",
        "SLO critical / standard / sheddable",
        "rejected at admission",
        "deferred (wait p50/p99)",
        "tenant token share in class (weight share)",
    ):
        table.add_column(
            column,
            justify="left" if column in ("run", "tenant token share in class (weight share)") else "right",
        )
    for r in results:
        slo = " / ".join(_percent(r.slo_by_priority.get(p)) for p in ("critical", "standard", "sheddable"))
        admission_rejects = {
            k.split(":", 1)[1]: v for k, v in r.rejections.items() if k.startswith("admission:")
        }
        rejected = ", ".join(f"{k} {v:,}" for k, v in sorted(admission_rejects.items())) or "0"
        wait = r.deferral_s
        deferred = f"{r.deferred_requests:,}"
        if wait is not None and wait.count:
            deferred += f" ({_seconds(wait.p50)} / {_seconds(wait.p99)})"
        shares = ", ".join(
            f"{name} {_percent(t.get('token_share_in_class'))} ({_percent(t.get('weight_share_in_class'))})"
            for name, t in r.tenants.items()
        )
        table.add_row(
            r.label,
            "-" if r.goodput_tasks_per_s is None else f"{r.goodput_tasks_per_s:,.2f}",
            _percent(r.wasted_spend_usd / r.total_spend_usd if r.total_spend_usd else None),
            slo,
            rejected,
            deferred,
            shares,
        )
    return table


def plot_results(results: Sequence[SimResult], out: Path) -> list[Path]:
    """latency_cdf.png, cost_per_task.png and fleet_size.png under `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in results:
        for ax, stats, label in (
            (axes[0], r.ttft_s, "time to first token (s)"),
            (axes[1], r.tpot_s, "time per output token (s)"),
            (axes[2], r.e2e_s, "request latency (s)"),
        ):
            if stats.cdf:
                xs = [max(x, 1e-4) for x, _ in stats.cdf]
                ax.step(xs, [y for _, y in stats.cdf], where="post", label=r.label)
            ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel("fraction of requests")
            ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle("latency CDFs")
    fig.tight_layout()
    path = out / "latency_cdf.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [r.label for r in results]
    useful = [(r.successful_spend_usd / r.tasks_succeeded) if r.tasks_succeeded else 0.0 for r in results]
    wasted = [(r.wasted_spend_usd / r.tasks_succeeded) if r.tasks_succeeded else 0.0 for r in results]
    idle = [(r.idle_spend_usd / r.tasks_succeeded) if r.tasks_succeeded else 0.0 for r in results]
    ax.bar(names, useful, label="GPU time of successful tasks")
    ax.bar(names, wasted, bottom=useful, label="GPU time of failed tasks (waste)")
    ax.bar(names, idle, bottom=[u + w for u, w in zip(useful, wasted, strict=True)], label="idle GPU time")
    ax.set_ylabel("US$ per successful task")
    ax.set_title("cost per successful task")
    ax.legend(fontsize="small")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    path = out / "cost_per_task.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        if r.fleet_timeline:
            ax.step(
                [s.t for s in r.fleet_timeline],
                [s.provisioned for s in r.fleet_timeline],
                where="post",
                label=f"{r.label} (provisioned)",
            )
            ax.step(
                [s.t for s in r.fleet_timeline],
                [s.desired for s in r.fleet_timeline],
                where="post",
                linestyle=":",
                alpha=0.7,
                label=f"{r.label} ({r.autoscaler}'s desired)",
            )
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("replicas")
    ax.set_title("fleet size over time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    path = out / "fleet_size.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)
    return paths


def summary(result: SimResult) -> dict[str, Any]:
    """The headline figures of a run (for logs and the bench)."""
    return {
        "policy": result.policy,
        "cost_per_successful_task_usd": result.cost_per_successful_task_usd,
        "tasks_succeeded": result.tasks_succeeded,
        "tasks": result.tasks,
        "wasted_spend_usd": result.wasted_spend_usd,
        "ttft_p99_s": result.ttft_s.p99,
        "hit_rate": result.prefix_cache.get("hit_rate"),
        "wall_s": result.wall_s,
    }
