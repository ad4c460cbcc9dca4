"""`ripplemesh bench`: the benchmarks of ripplemesh/bench/, each imported when it runs."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ripplemesh.commands import ENGINE_CHOICES
from ripplemesh.commands.simulate import SIM_POLICIES


@click.group()
def bench() -> None:
    """Benchmarks that compare side by side in one run and print ratios."""


@bench.command("overhead")
@click.option("--rate", default=50.0, show_default=True, help="Requests per second.")
@click.option("--requests", "count", default=500, show_default=True)
@click.option("--prefill", default=1, show_default=True)
@click.option(
    "--rounds", default=4, show_default=True, help="Meshes per tracing mode, the modes' order rotated each."
)
@click.option(
    "--modes",
    default="off,local,otlp,otlp_direct",
    show_default=True,
    help="Tracing modes to measure, comma-separated; off always is.",
)
def bench_overhead(rate: float, count: int, prefill: int, rounds: int, modes: str) -> None:
    """Mesh time to first token (zero compute) against bare NATS request/reply round trips."""
    from ripplemesh.bench.overhead import run_overhead_bench

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    try:
        run_overhead_bench(
            rate=rate, count=count, prefill=prefill, console=Console(), rounds=rounds, modes=chosen
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--modes") from exc


@bench.command("engine")
@click.option("--engine", default="sim", type=click.Choice(ENGINE_CHOICES), show_default=True)
@click.option("--gpu", default="H100", show_default=True, help="sim: the GPU profile.")
@click.option(
    "--model",
    default="llama-3-8b",
    show_default=True,
    help="sim: a model shape (e.g. llama-3-8b:fp8); others: a configured model or directory.",
)
@click.option("--batches", default="1,8,32,128", show_default=True, help="Decode batch sizes.")
@click.option("--prompt-tokens", default=1000, show_default=True)
@click.option("--output-tokens", default=128, show_default=True)
@click.option(
    "--published-requests",
    default=1000,
    show_default=True,
    help="Requests in the saturated published-throughput run (3000 reproduces it).",
)
@click.option("--tensor-parallel", default=1, show_default=True)
def bench_engine(
    engine: str,
    gpu: str,
    model: str,
    batches: str,
    prompt_tokens: int,
    output_tokens: int,
    published_requests: int,
    tensor_parallel: int,
) -> None:
    """Prefill and decode tokens/s by batch size; sim next to the public figures it is calibrated to."""
    from ripplemesh.bench.engine import run_engine_bench

    run_engine_bench(
        engine=engine,
        gpu=gpu,
        model=model,
        console=Console(),
        batches=[int(b) for b in batches.split(",") if b.strip()],
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        published_requests=published_requests,
        tensor_parallel=tensor_parallel,
    )


@bench.command("router")
@click.option("--workers", default=1000, show_default=True, help="Workers in the index.")
@click.option(
    "--blocks",
    default=10_000_000,
    show_default=True,
    help="Indexed (worker, block) pairs, all workers together.",
)
@click.option("--requests", "count", default=5000, show_default=True, help="Requests to time.")
@click.option("--seed", default=7, show_default=True)
@click.option(
    "--placements", type=click.Path(dir_okay=False), help="Write every timed decision here, one a line."
)
def bench_router(workers: int, blocks: int, count: int, seed: int, placements: str | None) -> None:
    """The router's KV index: each worker's cached prefix per request, p50/p99 and memory."""
    from ripplemesh.bench.router import run_router_bench

    run_router_bench(
        workers=workers,
        blocks=blocks,
        requests=count,
        seed=seed,
        console=Console(),
        placements_out=placements,
    )


@bench.command("migration")
@click.option("--rounds", default=5, show_default=True, help="Workers killed (or drained), one per round.")
@click.option("--streams", default=8, show_default=True, help="Concurrent streaming requests per round.")
@click.option("--tokens", default=400, show_default=True, help="Tokens per request.")
@click.option("--decode", default=2, show_default=True, help="Decode workers (one prefill worker).")
@click.option("--mode", type=click.Choice(["kill", "drain"]), default="kill", show_default=True)
def bench_migration(rounds: int, streams: int, tokens: int, decode: int, mode: str) -> None:
    """Mid-stream migration: streams completed across a worker's SIGKILL (or drain) and the
    latency the failure adds to them, p50/p99."""
    from ripplemesh.bench.migration import run_migration_bench

    run_migration_bench(
        rounds=rounds,
        streams=streams,
        tokens=tokens,
        decode=decode,
        mode=mode,  # type: ignore[arg-type]
        console=Console(),
    )


@bench.command("chaos")
@click.option("--duration", "duration_s", default=120.0, show_default=True, help="Seconds of load.")
@click.option("--rate", default=20.0, show_default=True, help="Streaming requests per second.")
@click.option("--kill-every", "kill_every_s", default=5.0, show_default=True, help="Seconds between kills.")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--prefill", default=1, show_default=True)
@click.option("--decode", default=2, show_default=True)
@click.option("--ingress", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--nats-cluster", type=click.IntRange(1, 5), default=1, show_default=True)
@click.option("--time-scale", type=float, default=1.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--data-dir", type=click.Path(path_type=Path), default=None, help="Keep the mesh's logs and data here."
)
def bench_chaos(
    duration_s: float,
    rate: float,
    kill_every_s: float,
    max_tokens: int,
    prefill: int,
    decode: int,
    ingress: int,
    nats_cluster: int,
    time_scale: float,
    seed: int,
    data_dir: Path | None,
) -> None:
    """The mesh as `up` runs it under streaming load while a service is killed (SIGKILL) every
    few seconds, each kind in turn: requests completed and failed, tokens duplicated or missing,
    the ledger against the requests, time to recover per kill."""
    from ripplemesh.bench.chaos import run_chaos_bench

    run_chaos_bench(
        duration_s=duration_s,
        rate=rate,
        kill_every_s=kill_every_s,
        max_tokens=max_tokens,
        prefill=prefill,
        decode=decode,
        nats_cluster=nats_cluster,
        time_scale=time_scale,
        seed=seed,
        console=Console(),
        ingress=ingress,
        data_dir=data_dir,
    )


@bench.command("restart")
@click.option("--rounds", default=4, show_default=True, help="Kills of each service kind per mode.")
def bench_restart(rounds: int) -> None:
    """How soon a killed service is ready again: restarted as a new process against a fork of
    the launcher's warm zygote, per service kind, side by side; and `up`'s start in each."""
    from ripplemesh.bench.restart import run_restart_bench

    run_restart_bench(rounds=rounds, console=Console())


@bench.command("ledger")
@click.option("--events", default=20_000, show_default=True, help="Lifecycle events to record.")
@click.option("--batch", default=256, show_default=True, help="Events per transaction (group commit).")
@click.option(
    "--postgres-url",
    default=None,
    help="PostgreSQL to measure too (a fresh schema, dropped afterwards). "
    "[default: postgresql+asyncpg://postgres@127.0.0.1:5432/test]",
)
def bench_ledger(events: int, batch: int, postgres_url: str | None) -> None:
    """Ledger ingestion: events/s on SQLite and PostgreSQL against the 5,000 events/s target."""
    from ripplemesh.bench.ledger import run_ledger_bench

    run_ledger_bench(events=events, batch=batch, postgres_url=postgres_url, console=Console())


@bench.command("simulator")
@click.option("--requests", default=100_000, show_default=True, help="Requests per scenario.")
@click.option("--workers", default=64, show_default=True, help="H100 workers in the fleet.")
@click.option(
    "--scenario",
    "scenarios",
    multiple=True,
    type=click.Choice(["azure", "mooncake", "agentic", "workflow"]),
    help="Workloads to time (repeatable; default: all four; workflow: a recorded workflow trace "
    "the bench writes, replayed closed loop).",
)
@click.option("--policy", default="ripplemesh", show_default=True, type=click.Choice(SIM_POLICIES))
@click.option(
    "--admission",
    default="ripplemesh",
    show_default=True,
    help="The admission variant (as for simulate): ripplemesh, rate_limit or none.",
)
@click.option("--no-upper-bound", is_flag=True, help="Skip the infinite-cache bound (less memory).")
def bench_simulator(
    requests: int, workers: int, scenarios: tuple[str, ...], policy: str, admission: str, no_upper_bound: bool
) -> None:
    """The fleet simulator's speed: wall and CPU seconds for N requests on W workers."""
    from ripplemesh.bench.simulator import SCENARIOS, run_simulator_bench

    try:
        run_simulator_bench(
            console=Console(),
            scenarios=scenarios or SCENARIOS,
            requests=requests,
            workers=workers,
            policy=policy,
            admission=admission,
            upper_bound=not no_upper_bound,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


@bench.command("autoscale")
@click.option("--quick", is_flag=True, help="A small run (seconds): a few hundred requests per workload.")
@click.option(
    "--fleet",
    default="prefill:0..16xH100,decode:0..16xH100,decode:0..16xH200",
    show_default=True,
    help="The autoscaled fleet (LOW..HIGHxGPU pools); the fixed fleets scale its pools.",
)
@click.option(
    "--traces",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Where the Azure trace is. [default: ../shared/traces]",
)
@click.option("--azure-rate-scale", default=6.0, show_default=True, help="Azure: replay at k x its rate.")
@click.option("--azure-window", default=None, help="Azure: START:END seconds of the trace (default: all).")
@click.option(
    "--agentic",
    default=None,
    help="The bursty agentic workload, agentic:key=value,... "
    "[default: workflows=3000,rate_per_s=3,burst_factor=5,burst_s=60,burst_every_s=300,seed=0]",
)
@click.option(
    "--fixed",
    default=None,
    help="Fixed fleets: fractions of ripple's peak per pool. [default: 0.25,0.5,0.75,1]",
)
@click.option(
    "--autoscaler",
    "autoscalers",
    multiple=True,
    help="Autoscalers to run (repeatable; NAME[:key=value,...]; default: ripple, dynamo-sla, hpa-queue).",
)
@click.option("--start", default=1, show_default=True, help="Replicas each autoscaled pool starts with.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("sim-out/autoscale"), show_default=True)
def bench_autoscale(
    quick: bool,
    fleet: str,
    traces: Path | None,
    azure_rate_scale: float,
    azure_window: str | None,
    agentic: str | None,
    fixed: str | None,
    autoscalers: tuple[str, ...],
    start: int,
    out: Path,
) -> None:
    """The autoscaler against Dynamo's SLA planner, an HPA queue rule and fixed fleets, on an Azure
    trace and bursty agents: cost per successful task at the SLO attainment each reaches."""
    import msgspec

    from ripplemesh.bench.autoscale import AGENTIC, TRACES, run_autoscale_bench
    from services.simulator.autoscaling import AUTOSCALER_NAMES
    from services.simulator.command import parse_window

    try:
        fractions = [float(f) for f in fixed.split(",") if f.strip()] if fixed else None
        run_autoscale_bench(
            console=Console(width=200),
            traces=traces or TRACES,
            fleet=fleet,
            quick=quick,
            azure_rate_scale=azure_rate_scale,
            azure_window=parse_window(azure_window),
            agentic=agentic or AGENTIC,
            fixed=fractions,
            autoscalers=autoscalers or AUTOSCALER_NAMES,
            start=start,
            out=out,
        )
    except (ValueError, msgspec.ValidationError) as exc:
        raise click.UsageError(str(exc)) from exc


@bench.command("batch")
@click.option("--quick", is_flag=True, help="The test's run (seconds): an hour's day, 300 lines, seed 0.")
@click.option("--fleet", default="2xH100", show_default=True, help="The fixed fleet both runs share.")
@click.option(
    "--rate", default=0.3, show_default=True, help="Interactive conversations per second, the day's mean."
)
@click.option(
    "--amplitude",
    default=0.6,
    show_default=True,
    help="The daily shape's amplitude (peak/trough (1+a)/(1-a)).",
)
@click.option(
    "--lines", default=60_000, show_default=True, help="Lines of the batch job, submitted at 00:00."
)
@click.option(
    "--day", "day_s", default=86_400.0, show_default=True, help="The day's (and window's) length, seconds."
)
@click.option("--seeds", default="0-2", show_default=True, help="Seeds: 0-2 or 0,3,5.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("sim-out/batch"), show_default=True)
def bench_batch(
    quick: bool, fleet: str, rate: float, amplitude: float, lines: int, day_s: float, seeds: str, out: Path
) -> None:
    """A day of interactive traffic alone and with a Batch API job on the same fleet and seeds (the
    job released by services/batch/policy.py): interactive p99 TTFT and SLO, the batch inside its
    window, idle share, cost per successful task per class and for the fleet, side by side."""
    import dataclasses

    from ripplemesh.bench.batch import QUICK, QUICK_SEEDS, DayConfig, run_batch_bench
    from services.simulator.sweep import parse_seeds

    try:
        if quick:
            config = dataclasses.replace(QUICK, fleet=fleet, amplitude=amplitude)
            chosen: tuple[int, ...] = QUICK_SEEDS
        else:
            config = DayConfig(fleet=fleet, rate=rate, lines=lines, day_s=day_s, amplitude=amplitude)
            chosen = tuple(parse_seeds(seeds))
        run_batch_bench(console=Console(width=220), config=config, seeds=chosen, out=out)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


@bench.command("subscriber")
@click.option("--events", "count", default=20000, show_default=True, help="Events of backlog to read.")
@click.option("--rate", default=500.0, show_default=True, help="Live events per second.")
@click.option("--seconds", default=10.0, show_default=True, help="Seconds of live events.")
@click.option(
    "--mesh-seconds", default=20.0, show_default=True, help="Seconds of load on a real mesh (0: none)."
)
@click.option("--concurrency", default=32, show_default=True, help="Clients driving the mesh at once.")
def bench_subscriber(count: int, rate: float, seconds: float, mesh_seconds: float, concurrency: int) -> None:
    """The subscriber SDK's consume path against the mesh's own consume loop: backlog events/s
    and live lag, side by side, with their ratio."""
    from ripplemesh.bench.subscriber import run_subscriber_bench

    run_subscriber_bench(
        count=count,
        rate=rate,
        seconds=seconds,
        console=Console(),
        mesh_seconds=mesh_seconds,
        concurrency=concurrency,
    )
