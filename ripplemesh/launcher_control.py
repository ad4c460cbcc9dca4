"""`ripplemesh up --autoscale`: the supervisor answers the autoscaler's orders.

A thread of the launcher with its own event loop and NATS connection (the services' user)
answers `ScaleOrder`s on ``rmesh.control.launcher``: it starts workers of a pool (the mesh's
`add_workers`) and drains the ones named — the worker's own `drain` order (no new work, running
work finishes or is handed to the routers, then it exits), after which the supervisor lets it
go instead of restarting it. Every answer is what runs now (`LauncherFleet`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING

import msgspec
import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from schemas.events import LauncherFleet, ScaleOrder, WorkerControl, encode_event, new_event_id
from schemas.subjects import LAUNCHER_SUBJECT, control_subject

if TYPE_CHECKING:
    from ripplemesh.launcher import Mesh

log = logging.getLogger(__name__)

# A drained worker gets this long to finish its running work before the rest is handed off.
DRAIN_GRACE_S = 30.0
_decoder = msgspec.json.Decoder(ScaleOrder)


class LauncherControl:
    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        self._thread = threading.Thread(target=self._run, name="launcher-control", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("the supervisor's control connection did not start")
        if self._error is not None:
            raise RuntimeError(f"the supervisor's control connection failed: {self._error}")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start(), or logged once running
            self._error = exc
            self._ready.set()
            log.exception("the supervisor's control connection stopped")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        nc = await nats.connect(
            servers=self.mesh.servers,
            name="launcher",
            connect_timeout=5,
            max_reconnect_attempts=-1,
            **self.mesh.connect_options(),
        )
        try:

            async def on_order(msg: Msg) -> None:
                await self._on_order(nc, msg)

            await nc.subscribe(LAUNCHER_SUBJECT, cb=on_order)
            await nc.flush(timeout=5)
            self._ready.set()
            await self._stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await nc.drain()

    async def _on_order(self, nc: NatsClient, msg: Msg) -> None:
        error: str | None = None
        try:
            order = _decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            order, error = None, f"not a ScaleOrder: {exc}"
        if order is not None and (order.add or order.remove):
            try:
                if order.add:
                    self.mesh.add_workers(order.pool, order.add, order.decision_id, order.traceparent)
                retiring = self.mesh.retire_workers(order.pool, order.remove)
                for worker_id in retiring:
                    await self._drain(nc, worker_id, order.decision_id)
            except ValueError as exc:
                error = str(exc)
        reply = LauncherFleet(
            event_id=new_event_id(), occurred_at=time.time(), pools=self.mesh.fleet(), error=error
        )
        if msg.reply:
            with contextlib.suppress(Exception):
                await nc.publish(msg.reply, encode_event(reply))

    async def _drain(self, nc: NatsClient, worker_id: str, decision_id: str) -> None:
        order = WorkerControl(
            event_id=new_event_id(),
            occurred_at=time.time(),
            worker_id=worker_id,
            action="drain",
            grace_s=DRAIN_GRACE_S,
            reason=f"scale-down ({decision_id})" if decision_id else "scale-down",
        )
        try:
            await nc.request(control_subject(worker_id), encode_event(order), timeout=2.0)
        except Exception as exc:
            # Not answering: the supervisor stops it (SIGTERM drains too) once its wait is over.
            log.warning("drain order not answered", extra={"worker": worker_id, "error": repr(exc)})
