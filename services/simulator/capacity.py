"""A workload's capacity on a fleet: the arrival rate at which the work it offers equals what the
fleet serves at its roofline. Pure: the workload's tasks are built, nothing is simulated.

The families sweep's loads are multiples of it (`ripplemesh sweep --suite families`,
docs/simulator.md). The rule, so that no rate is fitted by hand to a run:

- **Offered work**, from the workload's own tasks (every step built, as the simulator would
  issue it): per request, the prompt tokens no earlier request of the run shares (what prefill
  computes with every reusable prefix cached: the infinite-cache bound the simulator reports)
  and the output tokens; and the tasks' arrival rate, tasks over the span of their arrivals.
- **What a replica serves**: `services.autoscaler.capacity.replica_capacity` on the pool's own
  sim engine (its PerfModel, KV capacity and batch limits, as the simulator's autoscaler sees
  it): prefill tokens/s in full chunks, and decode tokens/s at the largest batch whose step
  keeps the fleet's ITL SLO and whose KV fits at the mix's mean context. Prefill is compute-bound
  and decode memory-bound, and the engine's steps overlap them (a step lasts the longer of its
  compute and its memory time), so a replica serves the mix at the smaller of its prefill-bound
  and decode-bound request rates; a fleet, the sum over its replicas (a disaggregated fleet, the
  smaller of its prefill pools' and its decode pools' sums).
- **Capacity**: that rate in tasks per second; as a `rate_scale`, over the workload's own rate.

It is an upper bound on what the fleet can serve within the SLOs: a router that misses cached
prefixes, or batches worse, reaches overload sooner.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.autoscaler.capacity import EngineProfile, Slo, replica_capacity
from services.simulator.fleet import FleetSpec
from services.simulator.workload import Workload


@dataclass(frozen=True, slots=True)
class OfferedWork:
    """A workload's tasks and their requests' mean sizes (pooled over one or more runs)."""

    tasks: int
    requests: int
    span_s: float  # the arrivals' span, first to last, summed over the runs
    prompt_tokens: float  # per request
    uncached_tokens: float  # per request, every reusable prefix of its run cached
    output_tokens: float  # per request
    block_size: int
    model: str

    @property
    def arrival_rate(self) -> float:
        """Tasks per second, at the workload's own rate."""
        return self.tasks / self.span_s if self.span_s > 0 else float("inf")

    @property
    def requests_per_task(self) -> float:
        return self.requests / self.tasks if self.tasks else 0.0


def offered_work(workloads: Iterable[Workload]) -> OfferedWork:
    """The work of one or more runs (a family's seeds or windows), pooled. A prefix is cached
    only within its run: the runs are separate simulations."""
    tasks = requests = 0
    span = prompt = uncached = output = 0.0
    block_size, model = 0, ""
    for workload in workloads:
        block_size, model = workload.block_size, workload.model
        seen: set[int] = set()
        first: float | None = None
        last = 0.0
        for task in workload.tasks():
            tasks += 1
            first = task.arrival_s if first is None else first
            last = task.arrival_s
            for index in range(1, task.steps + 1):
                step = task.step(index)
                requests += 1
                prompt += step.prompt_tokens
                output += step.output_tokens
                new = len(set(step.block_hashes) - seen)
                seen.update(step.block_hashes)
                # A prompt's last, partial block is never hashed: always computed.
                uncached += new * block_size + step.prompt_tokens - len(step.block_hashes) * block_size
        span += last - (first or 0.0)
    if not requests:
        raise ValueError("a workload with no requests offers no work")
    return OfferedWork(
        tasks, requests, span, prompt / requests, uncached / requests, output / requests, block_size, model
    )


def fleet_request_rate(fleet: FleetSpec, work: OfferedWork) -> float:
    """Requests per second the fleet's pools of the workload's model serve of this mix at their
    roofline (the module docstring). A fixed fleet only: an autoscaled one has no one size."""
    slo = Slo(ttft_s=fleet.ttft_slo_s, itl_s=fleet.itl_slo_s)
    context = work.prompt_tokens + work.output_tokens / 2.0  # as the autoscaler's planner takes it
    prefill_side = decode_side = aggregated = 0.0
    disaggregated = any(pool.role == "prefill" for pool in fleet.pools)
    for pool in fleet.pools:
        if (pool.model or work.model) != work.model:
            continue  # a pool of another model serves none of this workload
        if pool.autoscale:
            raise ValueError(f"capacity is for a fixed fleet; pool {pool.gpu} is autoscaled")
        engine = pool.engine(model=pool.model or work.model, block_size=fleet.block_size or work.block_size)
        profile = EngineProfile(
            perf=engine.perf,
            kv_capacity_tokens=engine.blocks.total_blocks * engine.info.block_size,
            max_batch_tokens=engine.max_batch_tokens,
            max_running=engine.max_running,
        )
        cap = replica_capacity(profile, uncached_prompt=work.uncached_tokens, context=context, slo=slo)
        by_prefill = cap.prefill_tokens_per_s / max(work.uncached_tokens, 1.0)
        by_decode = cap.decode_tokens_per_s / max(work.output_tokens, 1.0)
        if pool.role == "prefill":
            prefill_side += pool.replicas * by_prefill
        else:
            decode_side += pool.replicas * by_decode
            aggregated += pool.replicas * min(by_prefill, by_decode)
    return min(prefill_side, decode_side) if disaggregated else aggregated


@dataclass(frozen=True, slots=True)
class Capacity:
    tasks_per_s: float  # the fleet's capacity for the workload's tasks
    own_rate: float  # the workload's own arrival rate, tasks per second
    work: OfferedWork

    @property
    def rate_scale(self) -> float:
        """The `rate_scale` that brings the workload to the fleet's capacity."""
        return self.tasks_per_s / self.own_rate


def capacity(workloads: Iterable[Workload], fleet: FleetSpec) -> Capacity:
    work = offered_work(workloads)
    return Capacity(fleet_request_rate(fleet, work) / work.requests_per_task, work.arrival_rate, work)
