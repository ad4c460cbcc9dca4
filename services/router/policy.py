"""The router's decision: where a request's prefill and decode run. Pure; clock passed in.

This first policy places each request on the least-loaded live worker for its model, and
disaggregates (prefill on a prefill worker, decode on a decode worker) whenever a prefill worker
is live. Load counts the worker's queue and running batch, its KV occupancy, and the work this
router placed there since the worker's last heartbeat, so a burst between two heartbeats does
not herd onto one worker. Ties break by a hash of (request, worker), again to avoid herding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

LIVENESS_S = 3.0


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: str
    role: Literal["prefill", "decode"]
    model: str
    block_size: int
    queue_depth: int
    running: int
    kv_blocks_total: int
    kv_blocks_used: int
    heartbeat_at: float
    draining: bool = False


@dataclass(slots=True)
class RouterState:
    workers: dict[str, WorkerView] = field(default_factory=dict)
    # Requests this router placed on a worker since that worker's last heartbeat.
    placed_since_heartbeat: dict[str, int] = field(default_factory=dict)

    def observe(self, worker: WorkerView) -> None:
        previous = self.workers.get(worker.worker_id)
        if previous is None or worker.heartbeat_at >= previous.heartbeat_at:
            self.workers[worker.worker_id] = worker
            self.placed_since_heartbeat[worker.worker_id] = 0

    def forget(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self.placed_since_heartbeat.pop(worker_id, None)


Priority = Literal["critical", "standard", "sheddable"]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the policy knows about one request (the service builds it from InferenceRequest and
    the ledger's workflow spend; the simulator from its workload)."""

    request_id: str
    tenant: str
    model: str
    block_size: int
    block_hashes: Sequence[int]
    prompt_tokens: int
    max_tokens: int
    priority: Priority = "standard"
    deadline_at: float | None = None  # absolute, on the clock passed in as `now`
    workflow_id: str | None = None
    workflow_step: int | None = None  # 1-based
    workflow_steps: int | None = None
    workflow_spent_usd: float = 0.0  # what the workflow's earlier steps already cost
    adapter: str | None = None


@dataclass(frozen=True, slots=True)
class ScoredOption:
    """One placement the policy weighed: its predictions and its score (lower is better)."""

    mode: Literal["aggregated", "disaggregated"]
    prefill_worker: str
    decode_worker: str
    cached_tokens: int
    ttft_s: float
    cost_usd: float
    success_probability: float
    expected_cost_per_success_usd: float


@dataclass(frozen=True, slots=True)
class Placement:
    mode: Literal["aggregated", "disaggregated"]
    prefill_worker: str
    decode_worker: str
    candidates: int
    decode_load: float
    # The policy's predictions for the chosen placement, and the best options it passed over;
    # they go on the router.decide span (ripple.*) and the RouteDecision event.
    predicted_cached_tokens: int = 0
    predicted_ttft_s: float = 0.0
    predicted_cost_usd: float = 0.0
    success_probability: float = 1.0
    expected_cost_per_success_usd: float = 0.0
    runners_up: tuple[ScoredOption, ...] = ()
    policy: str = "ripplemesh"


@dataclass(frozen=True, slots=True)
class NoPlacement:
    # "infeasible": no placement can meet the request's hard deadline (admission is told so).
    reason: Literal["no_workers", "invalid", "infeasible"]
    message: str


def load(worker: WorkerView, state: RouterState) -> float:
    kv = worker.kv_blocks_used / worker.kv_blocks_total if worker.kv_blocks_total else 1.0
    return worker.queue_depth + worker.running + state.placed_since_heartbeat.get(worker.worker_id, 0) + kv


def _tie_break(request_id: str, worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{request_id}/{worker_id}".encode(), digest_size=4).digest())


def _least_loaded(workers: Iterable[WorkerView], state: RouterState, request_id: str) -> WorkerView | None:
    return min(
        workers,
        key=lambda w: (load(w, state), _tie_break(request_id, w.worker_id)),
        default=None,
    )


def live_workers(state: RouterState, model: str, now: float) -> list[WorkerView]:
    return [
        w
        for w in state.workers.values()
        if w.model == model and not w.draining and now - w.heartbeat_at <= LIVENESS_S
    ]


def place(
    state: RouterState, *, request_id: str, model: str, block_size: int, now: float
) -> Placement | NoPlacement:
    """Choose workers for one request and count the placement in `state`."""
    live = live_workers(state, model, now)
    mismatched = sorted(w.worker_id for w in live if w.block_size != block_size)
    if mismatched:
        # Routing across a block-size mismatch would turn every cache hit into a miss.
        return NoPlacement(
            "invalid",
            f"block size mismatch: the request was hashed with {block_size}-token blocks but "
            f"worker(s) {', '.join(mismatched)} use another size; refusing to route",
        )
    decode = _least_loaded((w for w in live if w.role == "decode"), state, request_id)
    if decode is None:
        return NoPlacement("no_workers", f"no live decode worker serves model {model!r}")
    prefill = _least_loaded((w for w in live if w.role == "prefill"), state, request_id)
    decode_load = load(decode, state)
    state.placed_since_heartbeat[decode.worker_id] = state.placed_since_heartbeat.get(decode.worker_id, 0) + 1
    if prefill is None:
        return Placement("aggregated", decode.worker_id, decode.worker_id, len(live), decode_load)
    state.placed_since_heartbeat[prefill.worker_id] = (
        state.placed_since_heartbeat.get(prefill.worker_id, 0) + 1
    )
    return Placement("disaggregated", prefill.worker_id, decode.worker_id, len(live), decode_load)
