"""What carries out a plan: the one small protocol every actuator implements.

The autoscaler's policy (policy.py) decides, per pool, how many replicas it wants and which ones
go; an actuator makes it so on a platform: local processes under `ripplemesh up --autoscale`
(the launcher), Kubernetes Deployments, or the simulator's fleet. A replica chosen to go is
drained (no new work; its running work finishes or migrates) before it stops, so an action
names the replicas to remove, and the actuator removes those and no others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class ActuatorError(RuntimeError):
    """The platform refused or failed an action (the plan is kept and tried again)."""


@dataclass(frozen=True, slots=True)
class ScaleAction:
    """One pool's change: start `add` replicas, drain and then stop the replicas in `remove`;
    `desired` is the pool's size once both are done (an actuator that sets a size, such as a
    Deployment's replicas, uses it). `decision_id` is the `ScalingDecision` that asked for it:
    a replica started by it announces that id, so its first requests link back to the plan."""

    pool: str
    desired: int
    add: int = 0
    remove: tuple[str, ...] = ()
    decision_id: str = ""
    reason: str = ""
    traceparent: str | None = None  # the plan's span, which a replica it starts links its spans to


@dataclass(frozen=True, slots=True)
class PoolActual:
    """A pool as the platform runs it: replicas it has started (ready or not) and the ones it is
    draining or stopping."""

    pool: str
    replicas: tuple[str, ...] = ()
    stopping: tuple[str, ...] = field(default=())
    # Where the platform sets the pool's limits (`up --autoscale`): the model and the bounds.
    model: str | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    startup_s: float | None = None


class Actuator(Protocol):
    async def apply(self, action: ScaleAction) -> None:
        """Carry out one pool's change; raises ActuatorError when the platform fails it. The
        caller bounds it with a timeout."""
        ...

    async def actual(self) -> dict[str, PoolActual]:
        """Every pool the actuator manages, as the platform runs it now."""
        ...
