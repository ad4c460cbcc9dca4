"""The `ripplemesh` command."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click
import uvloop
from rich.console import Console
from rich.table import Table

from ripplemesh.supervision import RestartPolicy
from services.mesh.config import ConfigError, config_path, default_data_dir, load_config

console = Console(stderr=True)

ENGINE_CHOICES = ["sim", "hf", "vllm"]


# Imported on demand: a service process loads only its own dependencies (torch for a worker
# with the hf engine, SQLAlchemy for the ledger).
_SERVICE_CLASSES = {
    "ingress": ("services.ingress.service", "IngressService"),
    "admission": ("services.admission.service", "AdmissionService"),
    "router": ("services.router.service", "RouterService"),
    "prefill": ("services.prefill.service", "PrefillService"),
    "decode": ("services.decode.service", "DecodeService"),
    "autoscaler": ("services.autoscaler.service", "AutoscalerService"),
    "ledger": ("services.ledger.service", "LedgerService"),
}
SERVICES = tuple(_SERVICE_CLASSES)


def _service(name: str) -> Any:
    if name not in _SERVICE_CLASSES:
        raise click.BadParameter(f"unknown service {name!r}")
    module, cls = _SERVICE_CLASSES[name]
    return getattr(importlib.import_module(module), cls)()


@click.group()
def main() -> None:
    """ripplemesh: a control plane for LLM inference on a GPU fleet."""


@main.command()
@click.argument("service", type=click.Choice(SERVICES))
@click.option("--nats-url", envvar="NATS_URL", required=True, help="NATS server(s) to join, comma-separated.")
@click.option(
    "--nats-credentials",
    envvar="RIPPLEMESH_NATS_CREDENTIALS",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The services' NATS user and password (a JSON file, as `ripplemesh up` writes).",
)
@click.option(
    "--nats-replicas",
    envvar="RIPPLEMESH_NATS_REPLICAS",
    type=click.IntRange(1, 5),
    default=1,
    show_default=True,
    help="Copies of each stream and KV bucket: 3 on a 3-node cluster.",
)
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
@click.option("--config", "config_file", type=click.Path(path_type=Path), default=None)
@click.option("--http-port", type=int, default=0, help="Port for /metrics and /healthz (and the API).")
@click.option("--http-host", default="127.0.0.1")
@click.option(
    "--shared-port",
    type=int,
    default=None,
    help="Also serve on this port, shared with other processes (SO_REUSEPORT): ingress replicas.",
)
@click.option("--worker-id", default=None, help="Worker id (prefill/decode); stable across restarts.")
@click.option("--engine", default="sim", type=click.Choice(ENGINE_CHOICES))
@click.option("--gpu", default="H100", help="GPU type the sim engine models.")
@click.option("--model-path", default=None, help="hf/vllm: a local Hugging Face model directory.")
@click.option("--device", default=None, help="hf: torch device (default: cuda if present, else cpu).")
@click.option("--model", default=None, help="Model to serve (default: the config's first).")
@click.option("--time-scale", type=float, default=1.0, help="Sim engine: 1 real time, 0 no compute time.")
@click.option("--database-url", default=None, help="Ledger database (default SQLite in the data dir).")
def run(
    service: str,
    nats_url: str,
    nats_credentials: Path | None,
    nats_replicas: int,
    data_dir: Path | None,
    config_file: Path | None,
    http_port: int,
    http_host: str,
    shared_port: int | None,
    worker_id: str | None,
    engine: str,
    gpu: str,
    model_path: str | None,
    device: str | None,
    model: str | None,
    time_scale: float,
    database_url: str | None,
) -> None:
    """Run one service in this process until SIGTERM or Ctrl-C."""
    from services.mesh.nats_auth import CredentialsError, load_credentials
    from services.mesh.runtime import ServiceOptions, run_service, setup_logging

    setup_logging(service)
    if service in ("prefill", "decode") and not worker_id:
        raise click.UsageError(f"{service} needs --worker-id")
    try:
        config = load_config(config_file)
        credentials = load_credentials(nats_credentials) if nats_credentials else None
    except (ConfigError, CredentialsError) as exc:
        raise click.ClickException(str(exc)) from exc
    extra = {
        "worker_id": worker_id,
        "engine": engine,
        "gpu": gpu,
        "model": model,
        "model_path": model_path,
        "device": device,
        "time_scale": time_scale,
        "database_url": database_url,
    }
    options = ServiceOptions(
        nats_url=nats_url,
        data_dir=(data_dir or default_data_dir()).resolve(),
        config=config,
        http_host=http_host,
        http_port=http_port,
        shared_port=shared_port,
        nats_credentials=credentials,
        nats_replicas=nats_replicas,
        extra=extra,
    )
    uvloop.run(run_service(_service(service), options))


@main.command()
@click.option("--engine", default="sim", type=click.Choice(ENGINE_CHOICES))
@click.option("--prefill", default=1, show_default=True, help="Prefill workers (0: aggregated serving).")
@click.option("--decode", default=1, show_default=True, help="Decode workers.")
@click.option("--http-port", default=8000, show_default=True)
@click.option("--nats-url", envvar="NATS_URL", default=None, help="Use this NATS instead of an embedded one.")
@click.option(
    "--nats-cluster",
    type=click.IntRange(1, 9),
    default=1,
    show_default=True,
    help="Embedded NATS nodes: 3 runs a JetStream cluster on loopback with R3 streams.",
)
@click.option(
    "--nats-credentials",
    envvar="RIPPLEMESH_NATS_CREDENTIALS",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    default=None,
    help="With --nats-url: the services' NATS user (a JSON file: user, password).",
)
@click.option(
    "--nats-replicas",
    type=click.IntRange(1, 5),
    default=None,
    help="With --nats-url: copies of each stream (default 1; embedded: up to 3, one per node).",
)
@click.option(
    "--no-nats-auth", is_flag=True, help="Embedded NATS without users or permissions (development only)."
)
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
@click.option("--config", "config_file", type=click.Path(path_type=Path), default=None)
@click.option("--gpu", default="H100", show_default=True)
@click.option("--model-path", default=None, help="hf/vllm: a local Hugging Face model directory.")
@click.option("--time-scale", type=float, default=1.0, show_default=True)
@click.option("--database-url", default=None)
@click.option(
    "--ingress",
    "ingress_count",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Ingress processes sharing --http-port (SO_REUSEPORT): a client's retry after one dies "
    "lands on another.",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=RestartPolicy().max_restarts,
    show_default=True,
    help="Restarts in a row of a service that exits within 10 s of its start before it counts as a "
    "crash loop and is left stopped.",
)
def up(
    engine: str,
    prefill: int,
    decode: int,
    http_port: int,
    nats_url: str | None,
    nats_cluster: int,
    nats_credentials: Path | None,
    nats_replicas: int | None,
    no_nats_auth: bool,
    data_dir: Path | None,
    config_file: Path | None,
    gpu: str,
    model_path: str | None,
    time_scale: float,
    database_url: str | None,
    ingress_count: int,
    max_restarts: int,
) -> None:
    """Start NATS (embedded unless --nats-url) and every service; Ctrl-C stops them all. A
    service that exits on its own is restarted (`ripplemesh status` shows the restarts)."""
    from ripplemesh.launcher import Mesh
    from services.mesh.nats_auth import CredentialsError, auth_for_config, load_credentials

    if decode < 1:
        raise click.UsageError("the mesh needs at least one decode worker")
    if nats_url and nats_cluster != 1:
        raise click.UsageError("--nats-cluster starts an embedded cluster; it cannot go with --nats-url")
    try:
        config = load_config(config_file)
        service_credentials = load_credentials(nats_credentials) if nats_credentials else None
        # Users per tenant and their permissions: checked here, before anything starts.
        auth = auth_for_config(config) if nats_url is None and not no_nats_auth else None
    except (ConfigError, CredentialsError) as exc:
        raise click.ClickException(str(exc)) from exc
    data = (data_dir or default_data_dir()).resolve()
    mesh = Mesh(
        data_dir=data,
        config_path=config_file.resolve() if config_file else None,
        nats_url=nats_url,
        http_port=http_port,
        prefill=prefill,
        decode=decode,
        engine=engine,
        gpu=gpu,
        model_path=model_path,
        time_scale=time_scale,
        database_url=database_url,
        nats_cluster=nats_cluster,
        nats_auth=not no_nats_auth,
        auth=auth,
        service_credentials=service_credentials,
        nats_replicas=nats_replicas,
        restart_policy=RestartPolicy(max_restarts=max_restarts),
        ingress=ingress_count,
    )
    stop_requested = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    console.print(f"starting ripplemesh in {data} ...")
    mesh.start()
    table = Table(title="ripplemesh is up", show_header=True)
    table.add_column("what")
    table.add_column("where")
    table.add_row(
        "OpenAI API",
        f"http://127.0.0.1:{http_port}/v1  (api key: rm-demo-key with the default config)",
    )
    nodes = f"{nats_cluster}-node cluster, R{mesh.replicas} streams" if nats_cluster > 1 else "one server"
    table.add_row("NATS", f"{mesh.url}  ({nodes})" if nats_url is None else mesh.url)
    for name, path in mesh.credential_files.items():
        what = "NATS user of the services" if name == "services" else f"NATS user of tenant {name}"
        table.add_row(what, f"{path}  (ripplemesh submit --nats-credentials {path} ...)")
    if auth is not None:
        for tenant in sorted(set(config.tenants) - set(auth.tenants)):
            table.add_row(
                f"NATS user of tenant {tenant}", "its password is configured (nats_password_bcrypt)"
            )
    for child in mesh.children:
        table.add_row(f"{child.name} metrics", f"{child.url}/metrics")
    table.add_row("traces", f"{data / 'traces'}  (ripplemesh trace <request_id>)")
    table.add_row("logs", str(data / "logs"))
    table.add_row("config", str(config_path(config_file)))
    console.print(table)
    print(f"READY http://127.0.0.1:{http_port}/v1 {mesh.url}", flush=True)
    try:
        # A service that exits on its own is restarted (and given up on if it crash-loops); only
        # a signal to `up` stops the mesh.
        while not stop_requested:
            for line in mesh.tend():
                console.print(f"[yellow]{line}")
            time.sleep(0.2)
    finally:
        console.print("stopping ...")
        mesh.stop()
        console.print("stopped")


@main.command()
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
def status(data_dir: Path | None) -> None:
    """Where each service of a running `ripplemesh up` stands: its state, restarts and how long
    each took to come back."""
    import json

    path = (data_dir or default_data_dir()) / "supervisor.json"
    try:
        children = json.loads(path.read_text())["children"]
    except (OSError, ValueError, KeyError) as exc:
        raise click.ClickException(f"no status in {path} (is `ripplemesh up` running there?): {exc}") from exc
    table = Table(show_header=True)
    for column in ("service", "state", "pid", "restarts", "last exit", "back after (s)"):
        table.add_column(column)
    for name, child in children.items():
        colour = {"running": "green", "gave_up": "red"}.get(child["state"], "yellow")
        table.add_row(
            name,
            f"[{colour}]{child['state']}",
            str(child["pid"]),
            str(child["restarts"]),
            "" if child["last_exit_code"] is None else str(child["last_exit_code"]),
            ", ".join(f"{s:.1f}" for s in child["recoveries_s"]),
        )
    Console().print(table)


@main.command()
@click.argument("prompt")
@click.option("--tenant", default=None, help="[default: the credentials' tenant, else demo]")
@click.option("--model", default="llama-3-8b", show_default=True)
@click.option("--max-tokens", default=64, show_default=True)
@click.option(
    "--nats-credentials",
    envvar="RIPPLEMESH_NATS_CREDENTIALS",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The tenant's NATS credentials [default: <data-dir>/credentials/tenant-<tenant>.json if "
    "`ripplemesh up` wrote it].",
)
@click.option(
    "--nats-url",
    envvar="NATS_URL",
    default=None,
    help="NATS server(s), comma-separated [default: the credentials' servers, else nats://127.0.0.1:4222].",
)
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
def submit(
    prompt: str,
    tenant: str | None,
    model: str,
    max_tokens: int,
    nats_credentials: Path | None,
    nats_url: str | None,
    data_dir: Path | None,
) -> None:
    """Submit a prompt over NATS, as a tenant, and print its tokens as they stream."""
    from ripplemesh.client import MeshClient, MeshError, MeshUnavailable
    from services.mesh.nats_auth import CredentialsError, load_credentials, tenant_credentials_path

    if nats_credentials is None:
        candidate = tenant_credentials_path(
            (data_dir or default_data_dir()) / "credentials", tenant or "demo"
        )
        nats_credentials = candidate if candidate.exists() else None
    try:
        credentials = load_credentials(nats_credentials) if nats_credentials else None
    except CredentialsError as exc:
        raise click.ClickException(str(exc)) from exc
    tenant = tenant or (credentials.tenant if credentials else None) or "demo"
    if credentials is not None and credentials.tenant not in (None, tenant):
        raise click.UsageError(f"{nats_credentials} holds the credentials of tenant {credentials.tenant!r}")
    url = nats_url or (",".join(credentials.servers) if credentials and credentials.servers else None)
    url = url or "nats://127.0.0.1:4222"

    async def go() -> None:
        async with MeshClient(url, tenant, model=model, credentials=credentials) as client:
            async for chunk in client.stream(prompt=prompt, max_tokens=max_tokens):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        sys.stdout.write("\n")

    try:
        asyncio.run(go())
    except (MeshError, MeshUnavailable) as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.argument("worker_id")
@click.option(
    "--grace", "grace_s", default=30.0, show_default=True, help="Seconds to finish the work in flight."
)
@click.option(
    "--nats-credentials",
    envvar="RIPPLEMESH_NATS_CREDENTIALS",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The services' NATS user [default: <data-dir>/credentials/services.json if it exists].",
)
@click.option(
    "--nats-url",
    envvar="NATS_URL",
    default=None,
    help="NATS server(s), comma-separated [default: the credentials' servers, else nats://127.0.0.1:4222].",
)
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
def drain(
    worker_id: str, grace_s: float, nats_credentials: Path | None, nats_url: str | None, data_dir: Path | None
) -> None:
    """Drain a worker: no new work from now on, its work in flight finished within the grace
    period (what is left moves to other workers), then it exits."""
    import msgspec
    import nats
    import nats.errors

    from schemas.events import WorkerControl, WorkerState, encode_event, new_event_id
    from schemas.subjects import control_subject
    from services.mesh.bus import nats_servers
    from services.mesh.nats_auth import CredentialsError, load_credentials

    if nats_credentials is None:
        candidate = (data_dir or default_data_dir()) / "credentials" / "services.json"
        nats_credentials = candidate if candidate.exists() else None
    try:
        credentials = load_credentials(nats_credentials) if nats_credentials else None
    except CredentialsError as exc:
        raise click.ClickException(str(exc)) from exc
    url = nats_url or (",".join(credentials.servers) if credentials and credentials.servers else None)
    url = url or "nats://127.0.0.1:4222"
    order = WorkerControl(
        event_id=new_event_id(), occurred_at=time.time(), worker_id=worker_id, action="drain", grace_s=grace_s
    )

    async def go() -> WorkerState:
        nc = await nats.connect(nats_servers(url), **(credentials.connect_options() if credentials else {}))
        try:
            reply = await nc.request(control_subject(worker_id), encode_event(order), timeout=5)
            return msgspec.json.decode(reply.data, type=WorkerState)
        finally:
            await nc.drain()

    try:
        state = asyncio.run(go())
    except nats.errors.NoRespondersError:
        raise click.ClickException(
            f"no worker {worker_id!r} answers on {control_subject(worker_id)}"
        ) from None
    except (nats.errors.Error, TimeoutError) as exc:
        raise click.ClickException(f"the drain order was not answered: {exc!r}") from exc
    console.print(
        f"{worker_id} is draining: {state.running} running, {state.queue_depth} queued; it exits "
        f"within {grace_s:g} s, and what is left moves to other workers"
    )


@main.command()
@click.argument("request_id")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
def trace(request_id: str, data_dir: Path | None) -> None:
    """Print a request's span tree from the locally written traces."""
    from ripplemesh.traces import load_request_trace, render_tree

    spans = load_request_trace((data_dir or default_data_dir()).resolve(), request_id)
    if not spans:
        raise click.ClickException(f"no spans found for request {request_id}")
    Console().print(render_tree(spans))


@main.group()
def bench() -> None:
    """Benchmarks that compare side by side in one run and print ratios."""


@bench.command("overhead")
@click.option("--rate", default=50.0, show_default=True, help="Requests per second.")
@click.option("--requests", "count", default=500, show_default=True)
@click.option("--prefill", default=1, show_default=True)
def bench_overhead(rate: float, count: int, prefill: int) -> None:
    """Mesh time to first token (zero compute) against bare NATS request/reply round trips."""
    from ripplemesh.bench.overhead import run_overhead_bench

    run_overhead_bench(rate=rate, count=count, prefill=prefill, console=Console())


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


SIM_POLICIES = (
    "ripplemesh",
    "round_robin",
    "least_loaded",
    "dynamo_kv",
    "llmd_weighted",
    "sglang_cache_aware",
)


@main.command()
@click.option(
    "--workload",
    required=True,
    help="A Mooncake trace (.jsonl), an Azure trace (.csv), or the generator: agentic[:key=value,...].",
)
@click.option(
    "--fleet",
    "fleet_spec",
    required=True,
    help="Pools, e.g. 64xH100, prefill:8xH100,decode:24xH100, 4..32xH100 (autoscaled), "
    "16xH200/llama-3.1-8b:fp8@2; or a .toml file.",
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
@click.option("--model", default=None, help="The model name requests carry (default: the workload's).")
@click.option(
    "--deadline", "deadline_s", type=float, default=None, help="Traces: a per-request deadline in seconds."
)
@click.option("--seed", type=int, default=None, help="The agentic generator's seed.")
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
    "--router-config",
    default=None,
    help="A variant of ripplemesh's policy: RouterConfig's number fields as key=value,... "
    "(none turns one off), e.g. dearest_task_factor=0.6,dearest_gate=-1.",
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
    router_config: str | None,
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
        )
    except (ValueError, msgspec.ValidationError) as exc:
        raise click.UsageError(str(exc)) from exc


@main.command()
@click.option(
    "--trace",
    type=click.Path(path_type=Path, dir_okay=False),
    default=Path("../shared/traces/conversation_trace.jsonl"),
    show_default=True,
    help="The Mooncake conversation trace.",
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("sim-out/sweep"), show_default=True)
@click.option(
    "--only", default=None, help="Only the points whose name matches this regex, e.g. 'agentic-s.-x20'."
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
    default="0-4",
    show_default=True,
    help="The agentic generator's seeds, e.g. 10-14: 0-4 are those the router's knobs were "
    "fitted on, 5-9 those their variants were weighed on again, 10 and up are held out.",
)
def sweep(
    trace: Path,
    out: Path,
    only: str | None,
    policies: tuple[str, ...],
    admissions: tuple[str, ...],
    jobs: int,
    router_config: str | None,
    seeds: str,
) -> None:
    """The router's comparison with the baselines at every rate, window and seed (docs/router.md).

    Finished runs under --out are read, not run again: delete a policy's files to re-run it."""
    import re

    from services.simulator.admission import parse_admission
    from services.simulator.policies import parse_router_config
    from services.simulator.sweep import (
        DEFAULT_ADMISSIONS,
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
        agentic_seeds = parse_seeds(seeds)
    except (re.error, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    points = [p for p in router_points(trace, agentic_seeds) if pattern is None or pattern.search(p.name)]
    if not points:
        raise click.UsageError(f"no point matches {only!r}")
    if any(p.workload == str(trace) for p in points) and not trace.is_file():
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


@bench.command("simulator")
@click.option("--requests", default=100_000, show_default=True, help="Requests per scenario.")
@click.option("--workers", default=64, show_default=True, help="H100 workers in the fleet.")
@click.option(
    "--scenario",
    "scenarios",
    multiple=True,
    type=click.Choice(["azure", "mooncake", "agentic"]),
    help="Workloads to time (repeatable; default: all three).",
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


@main.group()
def ledger() -> None:
    """The cost ledger: cost per successful task, wasted and idle spend."""


@ledger.command("report")
@click.option(
    "--by",
    type=click.Choice(["tenant", "pool", "workflow"]),
    default=None,
    help="After the fleet's figures, one row per tenant, pool or workflow (latest first).",
)
@click.option(
    "--since",
    default=None,
    help="Only what was spent, and the tasks that ended, since then: a duration back from now "
    "(90s, 15m, 2h, 7d), an ISO 8601 time (UTC unless it says) or Unix seconds.",
)
@click.option(
    "--database-url",
    default=None,
    help="Ledger database (sqlite+aiosqlite:///... or postgresql+asyncpg://...). "
    "[default: SQLite at <data-dir>/ledger.db]",
)
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path),
    default=None,
    help="Mesh config, for its task_timeout_s (when a quiet workflow counts as abandoned).",
)
@click.option("--limit", default=50, show_default=True, help="Rows of --by workflow.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def ledger_report(
    by: str | None,
    since: str | None,
    database_url: str | None,
    data_dir: Path | None,
    config_file: Path | None,
    limit: int,
    as_json: bool,
) -> None:
    """Cost per successful task, wasted and idle spend, read from the ledger's database."""
    from services.ledger.report import ReportError, default_database_url, run_report

    try:
        config = load_config(config_file)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    url = database_url or default_database_url(data_dir or default_data_dir())
    try:
        run_report(
            database_url=url,
            by=by,
            since=since,
            limit=limit,
            task_timeout_s=config.task_timeout_s,
            console=Console(),
            as_json=as_json,
        )
    except ReportError as exc:
        raise click.ClickException(str(exc)) from exc


@main.group()
def schemas() -> None:
    """The event contract's generated documents."""


@schemas.command("generate")
@click.option("--check", is_flag=True, help="Only check that the generated files are current.")
def schemas_generate(check: bool) -> None:
    """Write JSON Schema and AsyncAPI documents from the msgspec Structs."""
    from schemas.generate import main as generate_main

    raise SystemExit(generate_main(["--check"] if check else []))


@main.command("hash-key")
@click.argument("api_key")
def hash_key(api_key: str) -> None:
    """Print the SHA-256 digest to put in a tenant's api_keys_sha256."""
    click.echo(hashlib.sha256(api_key.encode()).hexdigest())
