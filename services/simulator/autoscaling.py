"""The autoscalers the simulator can run, by name, and the window of traffic each plan observes.

A run's autoscaler is named on the command line as ``NAME[:key=value,...]``:

- ``ripple`` (the default): `services.autoscaler.policy.plan`, the mesh's autoscaler, with the
  fleet's settings (`FleetSpec.settings`: its SLO, `autoscale_interval_s`, scale-down delay,
  idle-to-zero time, budget). Keys: `Settings`' number fields (e.g. ``ripple:scale_down_band=0.8``).
  It plans every interval and at once when a request is held for a model with no replica.
- ``dynamo-sla``: `services.autoscaler.baselines.dynamo_sla` (NVIDIA Dynamo's SLA planner) every
  `adjustment_interval_s` (180 s, Dynamo's default). Keys: `DynamoSettings`' fields.
- ``hpa-queue``: `services.autoscaler.baselines.hpa_queue` (a Kubernetes HPA on queued + running
  sequences per replica, KEDA's scale to and from zero) every `interval_s` (15 s, HPA's sync
  period), with the fleet's `sequences_per_replica` targets. Keys: `HpaSettings`' fields.

The baselines plan at their own interval only: a held request waits for their next sync (HPA's
and KEDA's controllers poll; Dynamo's planner never goes to zero). Every function is looked up
on its module at each plan, never copied here (tests patch the policy module).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from services.autoscaler import baselines as autoscaler_baselines
from services.autoscaler import policy as autoscaler_policy
from services.autoscaler.policy import Observation, Plan, Pool, Replica
from services.simulator.fleet import FleetSpec
from services.simulator.options import convert, key_values

AUTOSCALER_NAMES = ("ripple", "dynamo-sla", "hpa-queue")
DEFAULT_AUTOSCALER = "ripple"


class Autoscaler(Protocol):
    name: str  # the spec as given
    interval_s: float
    plans_on_hold: bool  # plans at once when a request is held for a model with no replica

    def plan(
        self,
        observations: Sequence[Observation],
        pools: Sequence[Pool],
        replicas: Sequence[Replica],
        queued: Mapping[str, int],
        now: float,
    ) -> Plan: ...


# One step of a planner: its state, the window's observations, the pools, their replicas, the
# sequences queued on each replica, now -> the new state and the plan.
Step = Callable[
    [Any, Sequence[Observation], Sequence[Pool], Sequence[Replica], Mapping[str, int], float],
    tuple[Any, Plan],
]


class _Rule:
    """A planner (the ripple policy or a baseline) with its state kept between plans."""

    def __init__(self, name: str, interval_s: float, plans_on_hold: bool, state: Any, step: Step) -> None:
        self.name = name
        self.interval_s = interval_s
        self.plans_on_hold = plans_on_hold
        self.state = state
        self._step = step

    def plan(
        self,
        observations: Sequence[Observation],
        pools: Sequence[Pool],
        replicas: Sequence[Replica],
        queued: Mapping[str, int],
        now: float,
    ) -> Plan:
        self.state, result = self._step(self.state, observations, pools, replicas, queued, now)
        return result


def _changes(spec: str, cls: Any, skip: tuple[str, ...]) -> dict[str, Any]:
    """`key=value` options over the number (and bool) fields of the settings class `cls`."""
    kinds = {f.name: f.type for f in dataclasses.fields(cls) if f.name not in skip}
    changes: dict[str, Any] = {}
    for key, value in key_values(spec, "autoscaler").items():
        if key not in kinds:
            raise ValueError(f"unknown autoscaler option {key!r}; known: {', '.join(kinds)}")
        if str(kinds[key]) == "bool":
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"autoscaler option {key}={value!r}: expected true or false")
            changes[key] = value.lower() in ("true", "1", "yes")
        else:
            changes[key] = convert(key, value, kinds[key], "autoscaler")
    return changes


def parse_autoscaler(spec: str, fleet: FleetSpec, kv_usd_per_gb: float = 0.0) -> Autoscaler:
    """The autoscaler `spec` names (module docstring), set up for `fleet`; the ripple policy
    weighs a KV hand-off at `kv_usd_per_gb`, as the simulated ledger prices it."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name == "ripple":
        settings = dataclasses.replace(fleet.settings(), kv_transfer_usd_per_gb=kv_usd_per_gb)
        ripple = dataclasses.replace(
            settings, **_changes(rest, autoscaler_policy.Settings, ("slo", "forecast"))
        )
        return _Rule(
            spec,
            ripple.interval_s,
            True,
            autoscaler_policy.PlannerState(),
            lambda state, obs, pools, replicas, queued, now: autoscaler_policy.plan(
                state, obs, pools, replicas, ripple, now
            ),
        )
    if name == "dynamo-sla":
        dynamo = autoscaler_baselines.DynamoSettings(slo=fleet.settings().slo)
        dynamo = dataclasses.replace(dynamo, **_changes(rest, autoscaler_baselines.DynamoSettings, ("slo",)))
        return _Rule(
            spec,
            dynamo.adjustment_interval_s,
            False,
            autoscaler_baselines.DynamoState(),
            lambda state, obs, pools, replicas, queued, now: autoscaler_baselines.dynamo_sla(
                state, obs, pools, replicas, dynamo, now
            ),
        )
    if name == "hpa-queue":
        hpa = autoscaler_baselines.HpaSettings(
            decode_target=fleet.sequences_per_replica, prefill_target=fleet.prefill_sequences_per_replica
        )
        hpa = dataclasses.replace(hpa, **_changes(rest, autoscaler_baselines.HpaSettings, ()))
        return _Rule(
            spec,
            hpa.interval_s,
            False,
            autoscaler_baselines.HpaState(),
            lambda state, obs, pools, replicas, queued, now: autoscaler_baselines.hpa_queue(
                state, obs, pools, replicas, hpa, now, queued=queued
            ),
        )
    raise ValueError(f"unknown autoscaler {name!r}; known: {', '.join(AUTOSCALER_NAMES)}")


class TrafficWindow:
    """One model's traffic since the last plan: what its `Observation.window` and measured
    latencies are made of (TTFT at each first token, time per output token at each completion)."""

    __slots__ = (
        "arrivals",
        "cached_tokens",
        "completed",
        "itls",
        "output_tokens",
        "prefilled",
        "prompt_tokens",
        "ttfts",
        "uncached_tokens",
        "uncached_tokens_sq",
    )

    def __init__(self) -> None:
        self.arrivals = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        # The prompts prefilled, their uncached tokens and those tokens' squares (the spread the
        # policy plans prefill for, as the mesh's TrafficMeter counts it).
        self.prefilled = 0
        self.uncached_tokens = 0
        self.uncached_tokens_sq = 0.0
        self.output_tokens = 0
        self.completed = 0
        self.ttfts: list[float] = []
        self.itls: list[float] = []
