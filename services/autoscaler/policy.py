"""The autoscaler's plan: from the workers' live state, the size each pool should be. Pure.

This first version observes and recommends; it does not act. A pool's demand is the work it holds
(queued and running sequences) and its KV occupancy; the recommended size keeps each replica
near its target concurrency and its KV below the high-water mark, and never drops below one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    worker_id: str
    pool: str
    role: Literal["prefill", "decode"]
    gpu_type: str
    queue_depth: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    heartbeat_at: float


@dataclass(frozen=True, slots=True)
class Targets:
    sequences_per_replica: float = 64.0
    kv_high_water: float = 0.8
    liveness_s: float = 3.0
    max_replicas: int = 64


@dataclass(frozen=True, slots=True)
class PoolPlan:
    pool: str
    role: Literal["prefill", "decode"]
    gpu_type: str
    replicas: int
    desired_replicas: int
    queue_depth: int
    running: int
    kv_utilisation: float
    reason: str


def plan(workers: Iterable[WorkerLoad], targets: Targets, now: float) -> list[PoolPlan]:
    pools: dict[str, list[WorkerLoad]] = defaultdict(list)
    for worker in workers:
        if now - worker.heartbeat_at <= targets.liveness_s:
            pools[worker.pool].append(worker)
    plans = []
    for pool, members in sorted(pools.items()):
        replicas = len(members)
        queue = sum(w.queue_depth for w in members)
        running = sum(w.running for w in members)
        total_blocks = sum(w.kv_blocks_total for w in members)
        kv = sum(w.kv_blocks_used for w in members) / total_blocks if total_blocks else 0.0
        by_concurrency = math.ceil((queue + running) / targets.sequences_per_replica)
        by_memory = math.ceil(replicas * kv / targets.kv_high_water)
        desired = min(targets.max_replicas, max(1, by_concurrency, by_memory))
        if desired > replicas:
            reason = "memory" if by_memory >= by_concurrency else "concurrency"
            reason = f"scale up: {reason} above target"
        elif desired < replicas:
            reason = "scale down: demand fits fewer replicas"
        else:
            reason = "steady"
        plans.append(
            PoolPlan(
                pool,
                members[0].role,
                members[0].gpu_type,
                replicas,
                desired,
                queue,
                running,
                round(kv, 4),
                reason,
            )
        )
    return plans
