"""Running the mesh: `run` (one service in this process), `up` (NATS and every service,
supervised) and `status` (where the services of a running `up` stand)."""

from __future__ import annotations

import importlib
import signal
import time
from pathlib import Path
from typing import Any

import click
import uvloop
from rich.console import Console
from rich.table import Table

from ripplemesh.commands import ENGINE_CHOICES, console
from ripplemesh.supervision import RestartPolicy
from services.mesh.config import ConfigError, config_path, default_data_dir, load_config

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
    "batch": ("services.batch.service", "BatchService"),
    "trace-shipper": ("services.trace_shipper.service", "TraceShipperService"),
}
SERVICES = tuple(_SERVICE_CLASSES)


def _service(name: str) -> Any:
    if name not in _SERVICE_CLASSES:
        raise click.BadParameter(f"unknown service {name!r}")
    module, cls = _SERVICE_CLASSES[name]
    return getattr(importlib.import_module(module), cls)()


@click.command()
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
@click.option("--pool", default=None, help="Worker: its pool's name (default: <role>-<gpu>).")
@click.option("--time-scale", type=float, default=1.0, help="Sim engine: 1 real time, 0 no compute time.")
@click.option("--database-url", default=None, help="Ledger database (default SQLite in the data dir).")
@click.option(
    "--actuator",
    type=click.Choice(["launcher", "kubernetes"]),
    default=None,
    help="Autoscaler: act through `ripplemesh up --autoscale`'s supervisor or Kubernetes (default: "
    "observe only, publishing its plans).",
)
@click.option(
    "--scaling-decision",
    default=None,
    help="Worker: the autoscaler's decision that started it (its spans link to that plan).",
)
@click.option("--scaling-traceparent", default=None, help="Worker: the W3C traceparent of that plan's span.")
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
    pool: str | None,
    time_scale: float,
    database_url: str | None,
    actuator: str | None,
    scaling_decision: str | None,
    scaling_traceparent: str | None,
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
        "pool": pool,
        "model_path": model_path,
        "device": device,
        "time_scale": time_scale,
        "database_url": database_url,
        "actuator": actuator,
        "scaling_decision": scaling_decision,
        "scaling_traceparent": scaling_traceparent,
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


@click.command()
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
@click.option(
    "--autoscale",
    is_flag=True,
    help="The autoscaler acts: it starts and drains workers of each pool (to zero when idle), "
    "within --min-workers and --max-workers (the config's [autoscaler] pools come first).",
)
@click.option("--min-workers", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--max-workers", type=click.IntRange(min=1), default=4, show_default=True)
@click.option(
    "--model",
    "models",
    multiple=True,
    help="A model of the config to run workers of (--prefill and --decode of each, its own pools); "
    "repeat for several. Default: the config's first.",
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
    autoscale: bool,
    min_workers: int,
    max_workers: int,
    models: tuple[str, ...],
) -> None:
    """Start NATS (embedded unless --nats-url) and every service; Ctrl-C stops them all. A
    service that exits on its own is restarted (`ripplemesh status` shows the restarts)."""
    from ripplemesh.launcher import Mesh
    from services.mesh.nats_auth import CredentialsError, auth_for_config, load_credentials

    if decode < 1 and not autoscale:
        raise click.UsageError("the mesh needs at least one decode worker")
    if autoscale and (min_workers > max_workers or max(prefill, decode) > max_workers):
        raise click.UsageError("--min-workers, --prefill and --decode must not exceed --max-workers")
    if nats_url and nats_cluster != 1:
        raise click.UsageError("--nats-cluster starts an embedded cluster; it cannot go with --nats-url")
    try:
        config = load_config(config_file)
        service_credentials = load_credentials(nats_credentials) if nats_credentials else None
        # Users per tenant and their permissions: checked here, before anything starts.
        auth = auth_for_config(config) if nats_url is None and not no_nats_auth else None
    except (ConfigError, CredentialsError) as exc:
        raise click.ClickException(str(exc)) from exc
    unknown = [m for m in models if config.model(m) is None]
    if unknown:
        known = ", ".join(m.name for m in config.models)
        raise click.UsageError(f"--model {', '.join(unknown)}: not in the config (its models: {known})")
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
        autoscale=autoscale,
        autoscale_min=min_workers,
        autoscale_max=max_workers,
        models=tuple(dict.fromkeys(models)),
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
        if name == "subscribers":
            table.add_row(
                "NATS user of subscribers",
                f"{path}  (ripplemesh run-subscriber --nats-credentials {path} ...)",
            )
            continue
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


@click.command()
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
