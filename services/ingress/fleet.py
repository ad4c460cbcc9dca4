"""What ingress knows of the fleet: the latest heartbeat of each worker (the WORKERS bucket).

It answers three questions a client's request needs before it goes on the bus: can the mesh
serve at all (`/health`), which models have live workers (`/v1/models`), and what the engines
serving a model honour beyond plain generation (log-probabilities, forced tool calls, JSON),
so that a parameter no live worker honours is refused with a 400 naming it, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from schemas.events import WorkerState
from services.router.policy import LIVENESS_S

_decoder = msgspec.json.Decoder(WorkerState)


@dataclass
class FleetView:
    liveness_s: float = LIVENESS_S
    workers: dict[str, WorkerState] = field(default_factory=dict)

    def observe(self, key: str, value: bytes | None, operation: str | None) -> None:
        if operation in ("DEL", "PURGE") or value is None:
            self.workers.pop(key, None)
            return
        try:
            self.workers[key] = _decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # the router logs it; a bad heartbeat is no worker here either

    def live(self, now: float, model: str | None = None) -> list[WorkerState]:
        """Workers heard from within the liveness window, not draining (of `model`, if given)."""
        return [
            w
            for w in self.workers.values()
            if now - w.occurred_at <= self.liveness_s
            and not w.draining
            and (model is None or w.model == model)
        ]

    def features(self, model: str, now: float) -> frozenset[str] | None:
        """What every live worker of `model` honours (any of them may be given the request);
        None while none is live: admission holds or refuses the request, and the engine it meets
        refuses what it cannot do."""
        live = self.live(now, model)
        if not live:
            return None
        return frozenset.intersection(*(frozenset(w.features) for w in live))
