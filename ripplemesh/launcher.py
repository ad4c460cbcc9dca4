"""`ripplemesh up`: embedded NATS plus every service as its own child process.

Used by the command, by the tests and by the benchmarks, so all three run the same mesh.
Children are told by Linux to exit if this process dies, so nothing is ever left behind. A
child that exits on its own is restarted, with the same arguments (its worker id, its durable
consumers, its port), by `tend`, which `up` calls a few times a second (supervision.py decides
when, and when to give up on a crash loop); the rest keep running. `<data_dir>/supervisor.json`
says where each child stands (`ripplemesh status`), `<data_dir>/supervisor.prom` the same as
metrics.

The embedded NATS is one server or a cluster of `nats_cluster` nodes (streams then get that
many replicas, up to 3), with the mesh's users: the services' and one per tenant (see
`services/mesh/nats_auth.py`). Their credentials are written under ``<data_dir>/credentials/``;
each child reads the services' file (`--nats-credentials`), so no secret is on a command line.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from ripplemesh.spawner import ChildProcess, start_warm, warm_starts_enabled
from ripplemesh.supervision import ChildHistory, GiveUp, RestartPolicy, on_exit
from schemas.events import PoolMembers
from services.mesh.bus import nats_servers
from services.mesh.config import load_config
from services.mesh.embedded_nats import EmbeddedNats, free_port
from services.mesh.nats_auth import NatsAuth, NatsCredentials, auth_for_config, save_credentials
from services.mesh.processes import die_with_parent
from services.mesh.tracing import otlp_configured, traces_dir, tracing_disabled
from services.trace_shipper.files import mark_existing_as_shipped

log = logging.getLogger("ripplemesh.launcher")

TRACE_SHIPPER = "trace-shipper"
SERVICES_IN_ORDER = ("ledger", "autoscaler", "router", "admission", "ingress", "batch")


# pending: asked for by the autoscaler, started at the next `tend`; retiring: drained by it, let
# go (not restarted) once it exits.
ChildState = Literal["pending", "running", "starting", "restarting", "gave_up", "retiring"]
WORKER_ROLES = ("prefill", "decode")
# `up --autoscale` with the sim engine: a worker serves about this long after its start.
SIM_STARTUP_S = 5.0
REAL_STARTUP_S = 60.0
# A retiring worker not gone this long after its drain order is stopped (SIGTERM), then killed.
RETIRE_WAIT_S = 60.0


@dataclass
class Child:
    name: str
    args: list[str]
    http_port: int
    log_path: Path
    process: ChildProcess | None = None
    # Supervision (monotonic times).
    state: ChildState = "running"
    started_at: float = 0.0
    exited_at: float | None = None
    restart_at: float = 0.0
    last_returncode: int | None = None
    restarts: int = 0
    recoveries_s: list[float] = field(default_factory=list)  # from each exit to healthy again
    history: ChildHistory = field(default_factory=ChildHistory)
    # How to start it again, for a child that is not a `ripplemesh run` (an embedded NATS node).
    respawn: Callable[[], ChildProcess] | None = None
    pool: str | None = None  # a worker's: <role>-<gpu>
    retire_at: float | None = None  # retiring: stopped if not gone by then

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@dataclass
class Mesh:
    data_dir: Path
    config_path: Path | None = None
    nats_url: str | None = None
    http_port: int = 8000
    prefill: int = 1
    decode: int = 1
    # Ingress processes: one serves on http_port; several share it (SO_REUSEPORT), each with a
    # port of its own for /healthz and /metrics, so a client's retry lands on a live one.
    ingress: int = 1
    engine: str = "sim"
    gpu: str = "H100"
    time_scale: float = 1.0
    model_path: str | None = None
    database_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    # Nodes of the embedded NATS (1: one server; 3: a JetStream cluster with R3 streams).
    nats_cluster: int = 1
    # Embedded NATS: users per tenant plus the services' (False: no authorization at all).
    nats_auth: bool = True
    # An external NATS (`nats_url`): its users, or just the services' credentials.
    auth: NatsAuth | None = None
    service_credentials: NatsCredentials | None = None
    # Stream replicas on an external NATS (an embedded one: from nats_cluster).
    nats_replicas: int | None = None
    children: list[Child] = field(default_factory=list)
    nats: EmbeddedNats | None = None
    credential_files: dict[str, Path] = field(default_factory=dict)
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    stopping: bool = False
    # The embedded NATS nodes, supervised as children are (stopped with NATS, not with them).
    nats_children: list[Child] = field(default_factory=list)
    # `up --autoscale`: the autoscaler acts through this supervisor (launcher_control.py),
    # sizing each worker pool within these bounds.
    autoscale: bool = False
    autoscale_min: int = 0
    autoscale_max: int = 4
    control: Any = None
    # With an OTLP endpoint set: the services write their local span files and one trace
    # shipper exports them (services/trace_shipper/); False: each service exports itself.
    # None: ship unless RIPPLEMESH_SHIP_TRACES=0.
    ship_traces: bool | None = None
    # The models whose workers it runs, `prefill` and `decode` of each, each model its own
    # pools (the router never places across models); empty: the config's first model.
    models: tuple[str, ...] = ()
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _next_worker: dict[tuple[str, str], int] = field(default_factory=dict)

    def _child(self, name: str, service: str, *extra: str, http_port: int | None = None) -> Child:
        port = http_port or self._unassigned_port()
        args = [
            sys.executable,
            "-m",
            "ripplemesh",
            "run",
            service,
            "--nats-url",
            self.url,
            "--data-dir",
            str(self.data_dir),
            "--http-port",
            str(port),
            "--nats-replicas",
            str(self.replicas),
            *extra,
        ]
        if "services" in self.credential_files:
            args += ["--nats-credentials", str(self.credential_files["services"])]
        if self.config_path is not None:
            args += ["--config", str(self.config_path)]
        return Child(name, args, port, self.data_dir / "logs" / f"{name}.log")

    def _unassigned_port(self) -> int:
        """A free port no other child has been given: the children bind theirs only once
        started, so the OS may offer one port twice meanwhile."""
        taken = {self.http_port, *(c.http_port for c in self.children)}
        while (port := free_port()) in taken:
            pass
        return port

    @property
    def shipping_traces(self) -> bool:
        env = {**os.environ, **self.env}
        if not otlp_configured(env) or tracing_disabled(env):
            return False
        if self.ship_traces is not None:
            return self.ship_traces
        return env.get("RIPPLEMESH_SHIP_TRACES", "1") != "0"

    @property
    def replicas(self) -> int:
        if self.nats_replicas is not None:
            return self.nats_replicas
        return min(3, self.nats_cluster) if self.nats_url is None else 1

    @property
    def servers(self) -> list[str]:
        """The NATS server URLs, as `nats.connect` takes them."""
        return nats_servers(self.url)

    def credentials(self, tenant: str) -> NatsCredentials:
        """A tenant's NATS credentials (a mesh whose NATS has users and made this tenant's password)."""
        if self.auth is None:
            raise RuntimeError("this mesh's NATS has no users")
        return self.auth.credentials(tenant)

    def connect_options(self) -> dict[str, Any]:
        """`nats.connect` keyword arguments for the services' user (empty without authorization)."""
        creds = self.service_credentials or (self.auth.service if self.auth else None)
        return creds.connect_options() if creds else {}

    def _prepare_nats(self) -> None:
        """Start the embedded NATS (or adopt the external one's users) and write the credentials."""
        directory = self.data_dir / "credentials"
        if self.nats_url is None:
            if self.nats_auth and self.auth is None:
                self.auth = auth_for_config(load_config(self.config_path))
            nats = self.nats = EmbeddedNats(
                self.data_dir / "nats", nodes=self.nats_cluster, auth=self.auth
            ).start()
            self.nats_children = [
                Child(
                    f"nats-{node.name}",
                    [],
                    node.http_port,
                    node.data_dir / "nats-server.log",
                    process=node.process,
                    started_at=time.monotonic(),
                    respawn=functools.partial(nats.respawn, node),
                )
                for node in nats.nodes
            ]
        servers = nats_servers(self.url)
        if self.auth is not None:
            self.credential_files = self.auth.write(directory, servers)
        elif self.service_credentials is not None:
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(0o700)
            creds = msgspec.structs.replace(self.service_credentials, servers=servers)
            self.credential_files = {"services": save_credentials(creds, directory / "services.json")}

    @property
    def url(self) -> str:
        if self.nats_url:
            return self.nats_url
        if self.nats is None:
            raise RuntimeError("NATS not started")
        return self.nats.url

    def _engine_args(self, gpu: str | None = None) -> list[str]:
        engine = ["--engine", self.engine, "--gpu", gpu or self.gpu, "--time-scale", str(self.time_scale)]
        if self.model_path:
            engine += ["--model-path", self.model_path]
        return engine

    def served_models(self) -> list[str]:
        """The models it runs workers of, the first as the config's default."""
        if not self.models:  # read once: every worker's name and every plan asks
            self.models = (load_config(self.config_path).models[0].name,)
        return list(self.models)

    def _model_tag(self, model: str) -> str:
        """What names a model's workers and pools: nothing for the first model (worker names
        stay `decode-0`), `-<model>` (subject-safe) for the others."""
        if model == self.served_models()[0]:
            return ""
        return "-" + re.sub(r"[^A-Za-z0-9_-]", "_", model)

    def _worker(self, role: str, *extra: str, gpu: str | None = None, model: str | None = None) -> Child:
        model = model or self.served_models()[0]
        tag = self._model_tag(model)
        index = self._next_worker.get((role, tag), 0)
        self._next_worker[(role, tag)] = index + 1
        name, pool = f"{role}{tag}-{index}", f"{role}-{gpu or self.gpu}{tag}"
        args = ("--worker-id", name, *self._engine_args(gpu), "--model", model, "--pool", pool)
        child = self._child(name, role, *args, *extra)
        child.pool = pool
        return child

    def plan(self) -> list[Child]:
        children = self.children = []  # filled as planned, so that no two children share a port
        self._next_worker = {}
        if self.shipping_traces:
            children.append(self._child(TRACE_SHIPPER, TRACE_SHIPPER))
        for model in self.served_models():
            for _ in range(self.decode):
                children.append(self._worker("decode", model=model))
            for _ in range(self.prefill):
                children.append(self._worker("prefill", model=model))
        for name in SERVICES_IN_ORDER:
            if name == "ingress" and self.ingress > 1:
                for i in range(self.ingress):
                    children.append(self._child(f"ingress-{i}", name, "--shared-port", str(self.http_port)))
                continue
            extra = ["--database-url", self.database_url] if name == "ledger" and self.database_url else []
            if name == "autoscaler" and self.autoscale:
                extra = ["--actuator", "launcher"]
            port = self.http_port if name == "ingress" else None
            children.append(self._child(name, name, *extra, http_port=port))
        return children

    def start(self, ready_timeout_s: float = 60.0) -> Mesh:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        try:
            self._prepare_nats()
            self.children = self.plan()
            if self.shipping_traces:  # only this run's spans go to the receiver
                mark_existing_as_shipped(traces_dir(self.data_dir))
            for child in self.children:
                self._spawn(child)
            self.wait_ready(ready_timeout_s)
            if self.autoscale:
                from ripplemesh.launcher_control import LauncherControl

                self.control = LauncherControl(self)
                self.control.start()
            self._write_status()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.children)
        while pending:
            child = pending[0]
            if child.process is not None and child.process.poll() is not None:
                tail = child.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{child.name} exited with {child.process.returncode}:\n{tail}")
            if _healthy(child.url):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} not healthy within {timeout_s}s; see {child.log_path}")
            time.sleep(0.1)

    def _spawn(self, child: Child) -> None:
        if child.respawn is not None:
            child.process = child.respawn()
            child.started_at = time.monotonic()
            return
        env = {**os.environ, **self.env}
        if self.shipping_traces and child.name != TRACE_SHIPPER:
            env["RIPPLEMESH_TRACES_SHIPPED"] = "1"  # the shipper exports their spans
        warm: ChildProcess | None = None
        if warm_starts_enabled(child.args):
            # A fork of a parent that imported the services already: a restart is not slowed
            # by a second of imports (ripplemesh/spawner.py).
            try:
                warm = start_warm(child.args, env, child.log_path)
            except (OSError, RuntimeError) as exc:
                log.warning("warm start failed (%s); starting %s as a new process", exc, child.name)
        if warm is not None:
            child.process = warm
        else:
            with child.log_path.open("ab") as output:
                child.process = subprocess.Popen(
                    child.args,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=output,
                    env=env,
                    preexec_fn=die_with_parent,
                )
        child.started_at = time.monotonic()

    def tend(self, now: float | None = None) -> list[str]:
        """Restart what exited on its own, when the restart policy says; report what happened
        (lines for the console). Nothing while the mesh is stopping."""
        if self.stopping:
            return []
        with self._lock:
            return self._tend(time.monotonic() if now is None else now)

    def _tend(self, now: float) -> list[str]:
        said: list[str] = []
        for child in [*self.nats_children, *self.children]:
            process = child.process
            if child.state == "pending":
                # Spawned here, on the main thread: Linux ends a child when the thread that
                # started it ends (PR_SET_PDEATHSIG), and this one lasts as long as `up`.
                self._spawn(child)
                child.state = "starting"
                said.append(f"{child.name} started by the autoscaler")
            elif child.state == "retiring":
                if process is None or process.poll() is not None:
                    self.children.remove(child)
                    said.append(f"{child.name} drained and stopped (scale-down)")
                elif child.retire_at is not None and now > child.retire_at:
                    process.send_signal(signal.SIGTERM if now < child.retire_at + 20 else signal.SIGKILL)
            elif (
                child.state in ("running", "starting") and process is not None and process.poll() is not None
            ):
                child.exited_at = child.exited_at if child.state == "starting" else now
                child.last_returncode = process.returncode
                decision = on_exit(self.restart_policy, child.history, now, now - child.started_at)
                if isinstance(decision, GiveUp):
                    child.state = "gave_up"
                    said.append(
                        f"{child.name} exited ({process.returncode}); given up on: {decision.reason}. "
                        f"The rest keep running; see {child.log_path}"
                    )
                else:
                    child.state = "restarting"
                    child.restart_at = decision.at
                    said.append(
                        f"{child.name} exited ({process.returncode}); restarting in "
                        f"{decision.at - now:.1f} s; see {child.log_path}"
                    )
            elif child.state == "restarting" and now >= child.restart_at:
                self._spawn(child)
                child.state = "starting"
                child.restarts += 1
            elif child.state == "starting" and (health := _health(child.url)) is not None:
                child.state = "running"
                if child.exited_at is not None:
                    child.recoveries_s.append(round(_back_after(child.exited_at, health), 3))
                    said.append(f"{child.name} is back, {child.recoveries_s[-1]:.1f} s after it exited")
                child.exited_at = None
        if said:
            self._write_status()
        return said

    # ------------------------------------------------------------ `up --autoscale`

    def pools(self) -> dict[str, str]:
        """The worker pools this supervisor runs, and each one's role."""
        return {pool: role for pool, (role, _) in self._pool_specs().items()}

    def _pool_specs(self) -> dict[str, tuple[str, str]]:
        """Each worker pool: its role and its model."""
        roles = ["decode", "prefill"] if self.prefill > 0 else ["decode"]
        return {
            f"{role}-{self.gpu}{self._model_tag(model)}": (role, model)
            for model in self.served_models()
            for role in roles
        }

    def add_workers(
        self, pool: str, count: int, decision_id: str = "", traceparent: str | None = None
    ) -> list[str]:
        """Workers for `pool`, started at the next `tend`; a pool it does not run, or one past
        its maximum, is refused (ValueError)."""
        with self._lock:
            spec = self._pool_specs().get(pool)
            if spec is None:
                raise ValueError(f"no pool {pool!r} here; this mesh runs {', '.join(self.pools())}")
            role, model = spec
            if len(self._members(pool)) + count > self.autoscale_max:
                raise ValueError(f"pool {pool} would exceed its maximum of {self.autoscale_max} workers")
            extra = ["--scaling-decision", decision_id] if decision_id else []
            if traceparent:
                extra += ["--scaling-traceparent", traceparent]
            added = []
            first_service = next(
                (i for i, c in enumerate(self.children) if c.pool is None), len(self.children)
            )
            for _ in range(count):
                child = self._worker(role, *extra, model=model)
                child.state = "pending"
                self.children.insert(first_service, child)  # stopped after the services, as at start
                added.append(child.name)
            return added

    def retire_workers(self, pool: str, worker_ids: list[str]) -> list[str]:
        """Mark the named workers of `pool` retiring (the caller sends their drain order);
        those not running here are skipped. Those marked."""
        with self._lock:
            marked = []
            for child in self._members(pool):
                if child.name in worker_ids and child.state in ("running", "starting", "pending"):
                    if child.state == "pending":
                        self.children.remove(child)
                        continue
                    child.state = "retiring"
                    child.retire_at = time.monotonic() + RETIRE_WAIT_S
                    marked.append(child.name)
            return marked

    def _members(self, pool: str) -> list[Child]:
        return [c for c in self.children if c.pool == pool and c.state != "gave_up"]

    def fleet(self) -> list[PoolMembers]:
        with self._lock:
            startup = SIM_STARTUP_S if self.engine == "sim" else REAL_STARTUP_S
            return [
                PoolMembers(
                    pool=pool,
                    replicas=[c.name for c in self._members(pool)],
                    stopping=[c.name for c in self._members(pool) if c.state == "retiring"],
                    model=model,
                    min_replicas=self.autoscale_min,
                    max_replicas=self.autoscale_max,
                    startup_s=startup,
                )
                for pool, (_, model) in self._pool_specs().items()
            ]

    def status(self) -> dict[str, Any]:
        return {
            child.name: {
                "state": child.state,
                "pid": child.process.pid if child.process is not None else None,
                "restarts": child.restarts,
                "last_exit_code": child.last_returncode,
                "recoveries_s": child.recoveries_s,
                "url": child.url,
                "log": str(child.log_path),
            }
            for child in [*self.nats_children, *self.children]
        }

    def _write_status(self) -> None:
        """`supervisor.json` for `ripplemesh status`, and the same as Prometheus metrics in
        `supervisor.prom` (a node exporter's textfile collector reads it)."""
        status = self.status()
        self._write(
            self.data_dir / "supervisor.json", json.dumps({"pid": os.getpid(), "children": status}, indent=1)
        )
        registry = CollectorRegistry()
        restarts = Gauge(
            "ripplemesh_up_restarts", "Restarts of a service by `up`.", ["child"], registry=registry
        )
        given_up = Gauge(
            "ripplemesh_up_given_up", "1: a crash loop, left stopped.", ["child"], registry=registry
        )
        for name, child in status.items():
            restarts.labels(name).set(child["restarts"])
            given_up.labels(name).set(1 if child["state"] == "gave_up" else 0)
        self._write(self.data_dir / "supervisor.prom", generate_latest(registry).decode())

    @staticmethod
    def _write(path: Path, text: str) -> None:
        temporary = path.with_suffix(path.suffix + ".tmp")
        temporary.write_text(text)
        temporary.replace(path)

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def stop_child(self, name: str, *, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        child = self.child(name)
        if child.process is None or child.process.poll() is not None:
            return
        child.process.send_signal(sig)
        try:
            child.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait(5)

    def restart_child(self, name: str, ready_timeout_s: float = 30.0) -> None:
        child = self.child(name)
        self.stop_child(name)
        self._spawn(child)
        deadline = time.monotonic() + ready_timeout_s
        while not _healthy(child.url):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy after restart")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every service (front door first), wait, then kill stragglers; then NATS."""
        self.stopping = True
        if self.control is not None:
            self.control.stop()
            self.control = None
        # The trace shipper last: it ships what the others wrote as they stopped.
        shipper = [c for c in self.children if c.name == TRACE_SHIPPER]
        deadline = time.monotonic() + timeout_s
        for group in ([c for c in self.children if c.name != TRACE_SHIPPER], shipper):
            for child in reversed(group):
                if child.process is not None and child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            for child in group:
                if child.process is None:
                    continue
                try:
                    child.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.process.wait(5)
        if self.nats is not None:
            self.nats.stop()
            self.nats = None

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _healthy(url: str) -> bool:
    return _health(url) is not None


def _health(url: str) -> dict[str, Any] | None:
    """The body of a healthy answer from `url`'s /healthz ({} when it is not JSON); None when
    unhealthy or not answering."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=1.0) as response:
            if response.status != 200:
                return None
            body = response.read()
    except Exception:
        return None
    try:
        decoded = json.loads(body)
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


def _back_after(exited_at: float, health: dict[str, Any]) -> float:
    """Seconds from an exit (monotonic) to the service ready again: by its own `ready_at` where
    its /healthz says (the supervisor looks at several starting children in turn, a second each
    at worst on a busy host, so it may see the moment late), else now."""
    now = time.monotonic()
    ready_at = health.get("ready_at")
    if isinstance(ready_at, int | float):
        ready = now - max(0.0, time.time() - float(ready_at))  # never after now
        return max(0.0, ready - exited_at)
    return now - exited_at
