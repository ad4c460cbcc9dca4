"""`ripplemesh simulate` and `ripplemesh sweep`: the fleet simulator (services/simulator/)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

SIM_POLICIES = (
    "ripplemesh",
    "round_robin",
    "least_loaded",
    "dynamo_kv",
    "llmd_weighted",
    "sglang_cache_aware",
)


@click.command()
@click.option(
    "--workload",
    required=True,
    help="A trace: Mooncake or workflow (.jsonl, options as PATH:kind=workflow,replay=open,...) or "
    "Azure (.csv); or a generator: agentic, coding or rag-chat[:key=value,...].",
)
@click.option(
    "--fleet",
    "fleet_spec",
    required=True,
    help="Pools, e.g. 64xH100, prefill:8xH100,decode:24xH100, 4..32xH100 (autoscaled), "
    "16xH200/llama-3.1-8b:fp8@2, a pool per model: 2xH100/llama-3.1-8b,2xH100/qwen-7b=llama-3.1-8b "
    "(MODEL=SHAPE); or a .toml file.",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(SIM_POLICIES),
    help="A routing policy to run; repeat it to compare several (default: all).",
)
@click.option(
    "--admission",
    "admissions",
    multiple=True,
    help="An admission variant: ripplemesh (default), rate_limit (the tenants' token buckets only; "
    "rate_limit:tokens_per_s=N splits N tokens/s between tenants by weight) or none; options as "
    "NAME:key=value,... Repeat it to compare several: every --policy runs under every --admission.",
)
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="Directory for JSON results and PNG plots."
)
@click.option(
    "--rate-scale", type=float, default=1.0, show_default=True, help="Replay at k x the arrival rate."
)
@click.option("--window", default=None, help="START:END seconds of the trace to replay.")
@click.option("--limit", type=int, default=None, help="At most N tasks.")
@click.option(
    "--repeat", type=int, default=1, show_default=True, help="Replay a trace N times, back to back."
)
@click.option(
    "--block-size", type=int, default=None, help="KV block size (default: the workload's; Mooncake 512)."
)
@click.option(
    "--model", default=None, help="The model name requests naming none carry (default: the workload's)."
)
@click.option(
    "--deadline", "deadline_s", type=float, default=None, help="Traces: a per-request deadline in seconds."
)
@click.option("--seed", type=int, default=None, help="The generator's seed.")
@click.option("--slo-ttft", type=float, default=2.0, show_default=True, help="TTFT SLO in seconds.")
@click.option(
    "--slo-tpot", type=float, default=0.1, show_default=True, help="Time-per-output-token SLO in seconds."
)
@click.option(
    "--no-upper-bound",
    is_flag=True,
    help="Skip the infinite-cache bound (its memory grows with the workload).",
)
@click.option("--no-plots", is_flag=True, help="JSON only.")
@click.option(
    "--skip-bad",
    is_flag=True,
    help="Workflow traces: count and skip bad lines (the results' workload.skipped_lines) "
    "rather than stop at the first.",
)
@click.option(
    "--router-config",
    default=None,
    help="A variant of ripplemesh's policy: RouterConfig's number fields as key=value,... "
    "(none turns one off), e.g. dearest_task_factor=0.6,dearest_gate=-1.",
)
@click.option(
    "--autoscaler",
    default="ripple",
    show_default=True,
    help="What autoscaled pools (LOW..HIGHxGPU) follow: ripple (services/autoscaler/policy.py), "
    "dynamo-sla or hpa-queue (services/autoscaler/baselines.py); options as NAME:key=value,...",
)
def simulate(
    workload: str,
    fleet_spec: str,
    policies: tuple[str, ...],
    admissions: tuple[str, ...],
    out: Path | None,
    rate_scale: float,
    window: str | None,
    limit: int | None,
    repeat: int,
    block_size: int | None,
    model: str | None,
    deadline_s: float | None,
    seed: int | None,
    slo_ttft: float,
    slo_tpot: float,
    no_upper_bound: bool,
    no_plots: bool,
    skip_bad: bool,
    router_config: str | None,
    autoscaler: str,
) -> None:
    """Replay a workload on a simulated fleet under each routing policy; compare cost per successful task."""
    import msgspec

    from services.simulator.command import simulate as run_simulate

    try:
        run_simulate(
            workload=workload,
            fleet=fleet_spec,
            policies=policies,
            out=out,
            rate_scale=rate_scale,
            window=window,
            limit=limit,
            repeat=repeat,
            block_size=block_size,
            model=model,
            deadline_s=deadline_s,
            seed=seed,
            slo_ttft_s=slo_ttft,
            slo_tpot_s=slo_tpot,
            upper_bound=not no_upper_bound,
            plots=not no_plots,
            console=Console(),
            admissions=admissions,
            router_config=router_config,
            autoscaler=autoscaler,
            skip_bad=skip_bad,
        )
    except (ValueError, msgspec.ValidationError) as exc:
        raise click.UsageError(str(exc)) from exc


@click.command()
@click.option(
    "--suite",
    type=click.Choice(("router", "families")),
    default="router",
    show_default=True,
    help="router: the Mooncake trace and the agentic generator at fixed multiples of their rates; "
    "families: the agentic, coding and rag-chat generators and the Mooncake and Azure traces, each "
    "at light load, at capacity and at 2x and 5x (docs/simulator.md).",
)
@click.option(
    "--trace",
    type=click.Path(path_type=Path, dir_okay=False),
    default=Path("../shared/traces/conversation_trace.jsonl"),
    show_default=True,
    help="The router suite: the Mooncake conversation trace.",
)
@click.option(
    "--traces",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("../shared/traces"),
    show_default=True,
    help="The families suite: the folder of the Mooncake and Azure traces.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Where the runs go [default: sim-out/sweep, or sim-out/families for the families suite].",
)
@click.option(
    "--only",
    default=None,
    help="Only the points whose name matches this regex, e.g. 'agentic-s.-x20', or '-(2x|5x)$' "
    "for the families' overload points.",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(SIM_POLICIES),
    help="Policies to run (repeatable; default: all; ripplemesh and one baseline at least).",
)
@click.option(
    "--admission",
    "admissions",
    multiple=True,
    help="Admission variants, as for simulate (repeatable; default: ripplemesh and rate_limit).",
)
@click.option(
    "--jobs", type=click.IntRange(min=1), default=2, show_default=True, help="Runs at once (processes)."
)
@click.option(
    "--router-config",
    default=None,
    help="A variant of ripplemesh's policy, as for simulate, for its runs (one made with another "
    "config is made again); the baselines run as they are.",
)
@click.option(
    "--seeds",
    default=None,
    help="The generators' seeds, e.g. 10-14: 0-4 are those the router's knobs were fitted on, "
    "5-9 those their variants were weighed on again, 10 and up are held out [default: 0-4 for "
    "the router suite, 10-12 for the families].",
)
def sweep(
    suite: str,
    trace: Path,
    traces: Path,
    out: Path | None,
    only: str | None,
    policies: tuple[str, ...],
    admissions: tuple[str, ...],
    jobs: int,
    router_config: str | None,
    seeds: str | None,
) -> None:
    """The router's comparison with the baselines at every rate, window and seed (docs/router.md),
    or every workload family at light load, at capacity and overloaded (--suite families).

    Finished runs under --out are read, not run again: delete a policy's files to re-run it."""
    import re

    from services.simulator.admission import parse_admission
    from services.simulator.policies import parse_router_config
    from services.simulator.sweep import (
        DEFAULT_ADMISSIONS,
        FAMILY_SEEDS,
        FITTED_SEEDS,
        SweepPoint,
        family_points,
        parse_seeds,
        router_points,
        run_sweep,
        sweep_tables,
        write_summary,
    )

    try:
        pattern = re.compile(only) if only else None
        for admission in admissions:
            parse_admission(admission)
        config = parse_router_config(router_config)
        default_seeds = FAMILY_SEEDS if suite == "families" else FITTED_SEEDS
        generator_seeds = parse_seeds(seeds) if seeds is not None else default_seeds
    except (re.error, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc

    def wanted(name: str) -> bool:
        return pattern is None or bool(pattern.search(name))

    points: list[SweepPoint]
    if suite == "families":
        out = out or Path("sim-out/families")
        try:
            points = family_points(traces, generator_seeds, wanted)
        except FileNotFoundError as exc:
            raise click.UsageError(f"{exc} (--traces)") from exc
    else:
        out = out or Path("sim-out/sweep")
        points = [p for p in router_points(trace, generator_seeds) if wanted(p.name)]
    if not points:
        raise click.UsageError(f"no point matches {only!r}")
    if suite == "router" and any(p.workload == str(trace) for p in points) and not trace.is_file():
        raise click.UsageError(f"the Mooncake trace {trace} is not there (--trace)")
    console = Console()
    try:
        result = run_sweep(
            points,
            out,
            policies=policies or SIM_POLICIES,
            admissions=admissions or DEFAULT_ADMISSIONS,
            jobs=jobs,
            console=console,
            router_config=config,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    for table in sweep_tables(result):
        console.print(table)
    written = ", ".join(str(path) for path in write_summary(result, out))
    console.print(f"wrote {written} ({result.ran} runs made, {result.read} read)")
