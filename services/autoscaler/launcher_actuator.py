"""The actuator of `ripplemesh up --autoscale`: the launcher's process supervisor is the platform.

The autoscaler asks it over core NATS (``rmesh.control.launcher``, request/reply): a
`ScaleOrder` to start workers of a pool or to drain and stop named ones, answered with what it
runs (`LauncherFleet`). The supervisor (ripplemesh/launcher.py) starts a worker as `up` starts
any, under a new worker id, and drains one with the worker's own `drain` order; a drained
worker that exits is not restarted.
"""

from __future__ import annotations

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient

from schemas.events import LauncherFleet, ScaleOrder, new_event_id
from schemas.subjects import LAUNCHER_SUBJECT
from services.autoscaler.actuator import ActuatorError, PoolActual, ScaleAction

_decoder = msgspec.json.Decoder(LauncherFleet)
_encoder = msgspec.json.Encoder()


class LauncherActuator:
    def __init__(self, nc: NatsClient, *, timeout_s: float = 5.0) -> None:
        self._nc = nc
        self._timeout_s = timeout_s

    async def apply(self, action: ScaleAction) -> None:
        order = ScaleOrder(
            event_id=new_event_id(),
            occurred_at=0.0,
            pool=action.pool,
            add=action.add,
            remove=list(action.remove),
            decision_id=action.decision_id,
            traceparent=action.traceparent,
        )
        fleet = await self._ask(order)
        if fleet.error:
            raise ActuatorError(f"the supervisor refused {action.pool}: {fleet.error}")

    async def actual(self) -> dict[str, PoolActual]:
        fleet = await self._ask(ScaleOrder(event_id=new_event_id(), occurred_at=0.0))
        return {
            p.pool: PoolActual(
                p.pool,
                replicas=tuple(p.replicas),
                stopping=tuple(p.stopping),
                model=p.model,
                min_replicas=p.min_replicas,
                max_replicas=p.max_replicas,
                startup_s=p.startup_s,
            )
            for p in fleet.pools
        }

    async def _ask(self, order: ScaleOrder) -> LauncherFleet:
        try:
            reply = await self._nc.request(LAUNCHER_SUBJECT, _encoder.encode(order), timeout=self._timeout_s)
        except nats.errors.NoRespondersError:
            raise ActuatorError(
                "no supervisor answers (is this mesh run by `ripplemesh up --autoscale`?)"
            ) from None
        except nats.errors.TimeoutError:
            raise ActuatorError(f"the supervisor did not answer within {self._timeout_s:g} s") from None
        try:
            return _decoder.decode(reply.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ActuatorError(f"the supervisor's answer does not decode: {exc}") from None
