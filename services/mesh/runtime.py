"""The process shell every service runs in.

`run_service(service, options)` connects to the bus, provisions streams, serves ``/metrics`` and
``/healthz``, starts the service, and on SIGTERM/SIGINT shuts down in order: stop fetching,
finish in-flight handlers, stop the service, cancel background tasks, drain NATS, flush spans.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import uvicorn
from prometheus_client import REGISTRY, Gauge
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from schemas.subjects import ConsumerSpec
from services.mesh.bus import Bus
from services.mesh.config import MeshConfig
from services.mesh.consumer import Consumer, Handler, UndecodableHook
from services.mesh.nats_auth import NatsCredentials
from services.mesh.tracing import setup_tracing, shutdown_tracing

log = logging.getLogger("ripplemesh")

UP = Gauge("ripplemesh_service_up", "1 while the service is serving.", ["service"])

_STANDARD_LOG_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line, with the service name and any `extra=` fields."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_LOG_FIELDS:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(service: str, level: str | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("RIPPLEMESH_LOG_LEVEL", "INFO"))
    for noisy in ("uvicorn.access", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@dataclass(frozen=True)
class ServiceOptions:
    nats_url: str
    data_dir: Path
    config: MeshConfig
    http_host: str = "127.0.0.1"
    http_port: int = 0
    # Also serve on this port, bound with SO_REUSEPORT so that several processes (ingress
    # replicas) share it: the kernel spreads connections over the live ones.
    shared_port: int | None = None
    # The services' NATS user (None: a server without authorization).
    nats_credentials: NatsCredentials | None = None
    # Copies of each stream and bucket: 3 on a 3-node cluster.
    nats_replicas: int = 1
    # Service-specific settings (worker id, engine, GPU type...), from the command line.
    extra: dict[str, Any] = field(default_factory=dict)


class Service(Protocol):
    name: ClassVar[str]

    async def start(self, runtime: Runtime) -> None: ...

    async def stop(self) -> None: ...

    def routes(self) -> list[BaseRoute]: ...

    def health(self) -> dict[str, Any]: ...


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the runtime owns shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Runtime:
    """What a running service holds: its bus, its consumers and its background tasks."""

    def __init__(self, service_name: str, options: ServiceOptions, bus: Bus):
        self.service_name = service_name
        self.options = options
        self.config = options.config
        self.bus = bus
        self.consumers: list[Consumer[Any]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.started_at = time.time()
        # Set by run_service: ends the service as a SIGTERM would (a drained worker exits).
        self._stop_requested: Callable[[], None] | None = None
        self._stopping_hooks: list[Callable[[], Awaitable[None]]] = []

    def request_stop(self) -> None:
        """Shut the service down gracefully, as SIGTERM does."""
        if self._stop_requested is not None:
            self._stop_requested()

    def on_stopping(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run `hook` first thing on shutdown, before the consumers stop (a worker says it is
        draining, so that no new work is placed on it meanwhile)."""
        self._stopping_hooks.append(hook)

    async def run_stopping_hooks(self, timeout_s: float = 5.0) -> None:
        for hook in self._stopping_hooks:
            try:
                await asyncio.wait_for(hook(), timeout=timeout_s)
            except Exception as exc:
                log.warning("stopping hook failed", extra={"error": repr(exc)})

    async def consume(
        self,
        spec: ConsumerSpec,
        event_type: Any,
        handler: Handler[Any],
        *,
        max_inflight: int = 64,
        direct: bool = False,
        on_undecodable: UndecodableHook | None = None,
    ) -> Consumer[Any]:
        """Run a durable consumer. `direct`: the request path's hand-off (consumer.py), when
        ``RIPPLEMESH_DIRECT_HANDOFF=1`` turns it on for the process (off by default).
        `on_undecodable`: told of each message that does not decode, before its dead letter."""
        direct = direct and self.bus.direct
        consumer: Consumer[Any] = Consumer(
            self.bus,
            spec,
            event_type,
            handler,
            max_inflight=max_inflight,
            fast_path=direct,
            on_undecodable=on_undecodable,
        )
        await consumer.start()
        self.consumers.append(consumer)
        return consumer

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A background task, logged if it fails and cancelled on shutdown."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("background task failed", extra={"task": name, "error": repr(t.exception())})

        task.add_done_callback(done)
        return task

    async def every(self, interval_s: float, tick: Callable[[], Awaitable[None]], name: str) -> None:
        """Run `tick` every `interval_s` until cancelled; a failing tick is logged, not fatal."""
        while True:
            try:
                await tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("periodic task failed", extra={"task": name, "error": repr(exc)})
            await asyncio.sleep(interval_s)

    async def stop_consumers(self, grace_s: float = 10.0) -> None:
        await asyncio.gather(*(c.stop(grace_s) for c in self.consumers), return_exceptions=True)

    async def cancel_tasks(self, timeout_s: float = 5.0) -> None:
        # Cancelled again while still pending: a library call may swallow one cancellation
        # (nats-py while it sets up a KV watch's consumer), and the task would run on.
        deadline = time.monotonic() + timeout_s
        while self._tasks and time.monotonic() < deadline:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.wait(set(self._tasks), timeout=0.2)


def _http_app(runtime_ref: dict[str, Any], service: Service) -> Starlette:
    async def metrics(request: Request) -> Response:
        # OpenMetrics when the scraper asks for it (Prometheus does): the only format that
        # carries the histograms' exemplars, the trace ids a Grafana panel jumps to.
        encode, content_type = choose_encoder(request.headers.get("accept"))
        return Response(encode(REGISTRY), media_type=content_type)

    async def healthz(_: Request) -> Response:
        runtime: Runtime | None = runtime_ref.get("runtime")
        ready = runtime is not None and runtime_ref.get("ready", False)
        connected = bool(runtime and runtime.bus.nc.is_connected)
        body = {
            "service": service.name,
            "ready": ready,
            "ready_at": runtime_ref.get("ready_at"),  # epoch seconds: when this process could serve
            "nats_connected": connected,
            **service.health(),
        }
        return JSONResponse(body, status_code=200 if ready and connected else 503)

    routes: list[BaseRoute] = [
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        *service.routes(),
    ]
    handlers = getattr(service, "exception_handlers", None)
    return Starlette(routes=routes, exception_handlers=handlers() if handlers is not None else None)


# Off the requests' path (the ledger, the autoscaler): CPU goes to the services on it first
# when a host is busy; their events wait in durable streams meanwhile. A service says so with a
# `background = True` class attribute; RIPPLEMESH_BACKGROUND_NICENESS=0 turns it off. 19, not
# 10: the bench's p50 overhead was 1.5 ms lower, four pairs (architecture §20). Applied once
# the service has started, so that a busy host does not hold its start-up back.
BACKGROUND_NICENESS = 19


def _lower_priority_if_background(service: Service) -> None:
    if not getattr(service, "background", False):
        return
    niceness = int(os.environ.get("RIPPLEMESH_BACKGROUND_NICENESS", BACKGROUND_NICENESS))
    if niceness > 0:
        with contextlib.suppress(OSError):
            os.nice(niceness)


def _start_profile() -> cProfile.Profile | None:
    """With ``RIPPLEMESH_PROFILE_DIR`` set, profile the running service (cProfile on CPU time,
    from start-up done to shutdown) into ``<dir>/<service>-<pid>.prof``: where each request's
    CPU goes."""
    if not os.environ.get("RIPPLEMESH_PROFILE_DIR"):
        return None
    profiler = cProfile.Profile(time.process_time)  # CPU time: descheduled time is not cost
    profiler.enable()
    return profiler


def _save_profile(profiler: cProfile.Profile | None, name: str) -> None:
    if profiler is None:
        return
    profiler.disable()
    directory = Path(os.environ["RIPPLEMESH_PROFILE_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(directory / f"{name}-{os.getpid()}.prof")


def _shared_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


HTTP_START_TIMEOUT_S = 10.0


async def _serving(server: uvicorn.Server, task: asyncio.Task[None], port: int) -> None:
    """Wait for the HTTP server to listen; a port it cannot take ends the service with a clear
    error, rather than a service that works with no /metrics and no /healthz."""
    deadline = time.monotonic() + HTTP_START_TIMEOUT_S
    while not server.started:
        if task.done() or time.monotonic() > deadline:
            task.cancel()
            raise SystemExit(f"cannot serve HTTP on port {port} (in use, or not allowed): see the log above")
        await asyncio.sleep(0.02)


async def run_service(service: Service, options: ServiceOptions) -> None:
    """Run one service until SIGTERM/SIGINT, then shut it down gracefully."""
    log.info("starting")  # with "service started", how long a (re)start takes, and where
    setup_tracing(service.name, options.data_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    runtime_ref: dict[str, Any] = {}
    server = _QuietServer(
        uvicorn.Config(
            _http_app(runtime_ref, service),
            host=options.http_host,
            port=options.http_port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
    )
    server_task = asyncio.create_task(server.serve(), name="http")
    shared: _QuietServer | None = None
    shared_task: asyncio.Task[None] | None = None
    await _serving(server, server_task, options.http_port)

    async def start_up() -> Runtime:
        bus = await Bus.connect(
            options.nats_url,
            service.name,
            credentials=options.nats_credentials,
            replicas=options.nats_replicas,
        )
        runtime_ref["bus"] = bus
        await bus.provision()
        log.info("connected to NATS")
        runtime = Runtime(service.name, options, bus)
        runtime._stop_requested = stop.set
        runtime_ref["runtime"] = runtime
        await service.start(runtime)
        return runtime

    # A stop asked for while starting (NATS unreachable, a stream electing its leader) ends the
    # start at once rather than once it is over.
    starting = asyncio.create_task(start_up(), name="start")
    stopping = asyncio.create_task(stop.wait(), name="stop-requested")
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("stopped while starting")
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        if "runtime" in runtime_ref:
            with contextlib.suppress(Exception):
                await runtime_ref["runtime"].cancel_tasks()
        if "bus" in runtime_ref:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runtime_ref["bus"].close(), timeout=5.0)
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server_task, timeout=6.0)
        shutdown_tracing()
        return
    stopping.cancel()
    runtime = starting.result()  # a start that failed raises here, as before
    bus = runtime.bus
    _lower_priority_if_background(service)
    runtime_ref["ready"] = True
    runtime_ref["ready_at"] = round(time.time(), 3)
    if options.shared_port is not None:
        # The shared port joins the kernel's SO_REUSEPORT group only now: a restarted ingress
        # takes no client's connection while it cannot yet serve it (a stream electing its
        # leader can hold its start for seconds); its own port says 503 meanwhile.
        shared = _QuietServer(server.config)
        sockets = [_shared_socket(options.http_host, options.shared_port)]
        shared_task = asyncio.create_task(shared.serve(sockets=sockets), name="http-shared")
    UP.labels(service.name).set(1)
    log.info("service started", extra={"nats_url": options.nats_url, "http_port": options.http_port})
    profiler = _start_profile()
    try:
        await stop.wait()
    finally:
        _save_profile(profiler, service.name)
        log.info("shutting down")
        runtime_ref["ready"] = False
        UP.labels(service.name).set(0)
        await runtime.run_stopping_hooks()
        await runtime.stop_consumers()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(service.stop(), timeout=15.0)
        await runtime.cancel_tasks()
        for http, task in ((shared, shared_task), (server, server_task)):
            if http is not None and task is not None:
                http.should_exit = True
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, timeout=6.0)
        await bus.close()
        shutdown_tracing()
        log.info("stopped")
