"""What a simulation run measures, in bounded memory.

Latencies go into `LatencySketch`es: log-spaced buckets with 1% relative accuracy (DDSketch's
scheme), so a run of a million requests keeps a few thousand counters, not a million floats.
Everything else is a counter or a sum; the time series (fleet size, queueing) are sampled at the
autoscaler's interval.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import msgspec

RELATIVE_ACCURACY = 0.01


class LatencySketch:
    """Quantiles of non-negative values to within `RELATIVE_ACCURACY`, in O(log range) memory."""

    __slots__ = ("_gamma_log", "buckets", "count", "max", "min", "sum", "zeros")

    def __init__(self) -> None:
        gamma = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)
        self._gamma_log = math.log(gamma)
        self.buckets: dict[int, int] = {}
        self.zeros = 0
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.sum += value
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value
        if value <= 1e-9:
            self.zeros += 1
            return
        key = math.ceil(math.log(value) / self._gamma_log)
        self.buckets[key] = self.buckets.get(key, 0) + 1

    def _value(self, key: int) -> float:
        gamma = math.exp(self._gamma_log)
        return 2.0 * gamma**key / (gamma + 1.0)

    def quantile(self, q: float) -> float | None:
        if self.count == 0:
            return None
        rank = q * (self.count - 1)
        seen = self.zeros
        if rank < seen:
            return 0.0
        for key in sorted(self.buckets):
            seen += self.buckets[key]
            if rank < seen:
                return min(max(self._value(key), self.min), self.max)
        return self.max

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def cdf(self, points: int = 200) -> list[tuple[float, float]]:
        """(value, fraction at or below it), at most `points` of them, for plots."""
        if self.count == 0:
            return []
        out: list[tuple[float, float]] = []
        seen = self.zeros
        if seen:
            out.append((0.0, seen / self.count))
        keys = sorted(self.buckets)
        stride = max(1, len(keys) // points)
        for i, key in enumerate(keys):
            seen += self.buckets[key]
            if i % stride == 0 or i == len(keys) - 1:
                out.append((self._value(key), seen / self.count))
        return out

    def summary(self) -> dict[str, float | int | None]:
        return {
            "count": self.count,
            "mean": self.mean,
            "p50": self.quantile(0.50),
            "p90": self.quantile(0.90),
            "p99": self.quantile(0.99),
            "max": self.max if self.count else None,
        }


class FleetSample(msgspec.Struct, array_like=True):
    t: float
    serving: int  # replicas that take work (started, not draining)
    provisioned: int  # replicas billed (starting, serving and draining)
    desired: int  # the autoscaler's recommendation, summed over pools
    queued: int  # requests waiting for admission to a batch, fleet-wide
    running: int  # requests in running batches, fleet-wide
    kv_utilisation: float  # KV blocks in use / KV blocks, fleet-wide
    arrivals: int = 0  # requests issued since the previous sample
    held: int = 0  # requests held for a replica (their model has none serving)


class PoolPlanRecord(msgspec.Struct, array_like=True):
    """One pool's decision in an autoscaler plan (services/autoscaler/policy.py `PoolDecision`)."""

    pool: str
    serving: int
    warming: int
    draining: int
    desired: int
    add: int
    remove: list[str]
    reason: str


class PlanRecord(msgspec.Struct):
    """One autoscaler plan: when, why it ran ("interval" or "held"), the fleet's $/hour once it
    is done, and every pool's decision with its reason."""

    t: float
    trigger: str
    cost_per_hour: float
    pools: list[PoolPlanRecord]


class LatencyStats(msgspec.Struct):
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None
    cdf: list[tuple[float, float]]


def latency_stats(sketch: LatencySketch) -> LatencyStats:
    return LatencyStats(**sketch.summary(), cdf=sketch.cdf())  # type: ignore[arg-type]


class SimResult(msgspec.Struct, kw_only=True):
    """One policy's run on one workload and fleet: the JSON `ripplemesh simulate` writes."""

    policy: str
    workload: dict[str, Any]
    fleet: dict[str, Any]
    seed: int
    # The figure of merit: the fleet's whole spend over the tasks that succeeded.
    cost_per_successful_task_usd: float | None
    total_spend_usd: float  # provisioned GPU time and KV transfers, priced: what the fleet cost
    attributed_spend_usd: float  # what the requests used (GPU time, KV transfers): the ledger's spend
    idle_spend_usd: float  # provisioned GPU time no request used, priced (total minus attributed)
    wasted_spend_usd: float  # attributed spend of tasks that failed
    successful_spend_usd: float  # attributed spend of tasks that succeeded
    busy_gpu_seconds: float
    attributed_gpu_seconds: float
    provisioned_gpu_seconds: float
    gpu_utilisation: float | None
    kv_transfer_bytes: int
    kv_transfer_spend_usd: float
    tasks: int
    tasks_succeeded: int
    tasks_failed: dict[str, int]  # by the ledger's reason: step_failed, deadline_missed, abandoned
    task_success_by_priority: dict[str, list[int]]  # priority -> [succeeded, total]
    requests: int
    requests_completed: int
    rejections: dict[str, int]  # "stage:reason" -> count
    failures: dict[str, int]  # "stage:reason" -> count
    goodput_tasks_per_s: float | None  # tasks that succeeded (deadlines met) per second
    duration_s: float  # virtual time from the first arrival to the last event
    ttft_s: LatencyStats
    tpot_s: LatencyStats
    e2e_s: LatencyStats
    queue_s: LatencyStats  # arrival at the worker to the first admission into a batch
    slo: dict[str, Any]
    prefix_cache: dict[str, float | int | None]
    preemptions: int
    fleet_timeline: list[FleetSample]
    peak_replicas: int
    mean_replicas: float | None
    wall_s: float
    events: int
    # Admission: the variant (simulator/admission.py), requests it deferred and for how long,
    # SLO attainment per priority class (over the requests issued), and per tenant: priority,
    # weight, requests, admitted requests and tokens (prompt + max output), SLO attainment, and
    # its share of the tokens admitted in its class against its share of the class's weight.
    admission: str = "ripplemesh"
    deferred_requests: int = 0
    deferral_s: LatencyStats | None = None
    slo_by_priority: dict[str, float | None] = msgspec.field(default_factory=dict)
    tenants: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    # The RouterConfig fields the run set otherwise than the default (`--router-config`).
    router_config: dict[str, Any] = msgspec.field(default_factory=dict)
    # The autoscaler (simulator/autoscaling.py), every plan it made, and the requests held for a
    # replica (their model had none serving; those not served in time are rejections,
    # "admission:no_capacity_in_time").
    autoscaler: str = "ripple"
    autoscale_plans: list[PlanRecord] = msgspec.field(default_factory=list)
    held_requests: int = 0
    # Per service class (interactive; batch with a Batch API job, simulator/batch.py): requests,
    # SLO attainment, TTFT p99, tasks succeeded, the ledger's spend and cost per successful task.
    by_class: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    # The Batch API job's outcome (None without one): lines completed, failed and expired, how
    # long it took, whether within its window, the release policy's decisions by reason.
    batch: dict[str, Any] | None = None
    # Per model (each pool serves one; the router places a request only on its model's workers):
    # its pools, requests issued, completed, rejected, failed and held, SLO attainment (over the
    # requests issued), TTFT, tasks (a task is its step 1's model) and those succeeded, the spend
    # of its pools (provisioned GPU time and its KV hand-offs: the models' add up to
    # `total_spend_usd`), the ledger's spend of its requests, and cost per successful task.
    by_model: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    # How ripplemesh's predictions turned out, per GPU type, as its calibration learned them
    # (services/router/policy/calibration.py `Calibration.summary`); empty for a baseline.
    router_calibration: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)

    @property
    def label(self) -> str:
        """The run's name in tables and file names: the router policy, and the admission
        variant unless it is ripplemesh's own."""
        return run_label(self.policy, self.admission)

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=2)


def run_label(policy: str, admission: str) -> str:
    return policy if admission == "ripplemesh" else f"{policy}+{admission}"


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def total(values: Iterable[int]) -> int:
    return sum(values)
