"""What the parts of `IngressService` (the HTTP API, the NATS path) share: the service's runtime,
read per call (it is set when the service starts), and its view of the fleet."""

from __future__ import annotations

from collections.abc import Callable

from services.ingress.fleet import FleetView
from services.mesh.runtime import Runtime


class ServicePart:
    def __init__(self, runtime: Callable[[], Runtime], fleet: FleetView) -> None:
        self._runtime = runtime
        self.fleet = fleet

    @property
    def _rt(self) -> Runtime:
        return self._runtime()
