"""What a run keeps per task and per request while they are in flight, what it logs of a request
when it ends (`RequestRecord`), and the run's options (`SimOptions`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from services.router.policy import RouterConfig, RouteRequest
from services.simulator.autoscaling import TrafficWindow
from services.simulator.metrics import LatencySketch
from services.simulator.workload import Step, Task

if TYPE_CHECKING:
    from services.simulator.batch import BatchJob
    from services.simulator.worker import Seq, SimWorker

Progress = Callable[[int, int | None], None]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's outcome, for `Simulator(request_log=...)` (tests, per-request exports)."""

    request_id: str
    tenant: str
    arrival: float
    first_token_at: float | None
    finished_at: float
    outcome: str  # "completed", or "stage:reason" of its rejection or failure
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    gpu_seconds: float
    workers: tuple[str, ...]
    model: str = ""  # the model it named (its workers are that model's)


RequestLog = Callable[[RequestRecord], None]


@dataclass(frozen=True, slots=True)
class SimOptions:
    abandon_past_deadline: bool = True  # clients give up on a request at its deadline
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    # The infinite-cache upper bound keeps every distinct prompt block hash seen (about 70 bytes
    # each): the one metric whose memory grows with the workload. Off for the largest runs.
    prefix_upper_bound: bool = True
    progress_every: int = 2000  # tasks between progress callbacks
    # ripplemesh's policy's knobs (and what admission's predictions read): the default's, or a
    # variant's (`policies.parse_router_config`).
    router_config: RouterConfig = field(default_factory=RouterConfig)
    # The autoscaler the fleet's autoscaled pools follow (simulator/autoscaling.py).
    autoscaler: str = "ripple"
    # A Batch API job run beside the workload (simulator/batch.py), released by the mesh's own
    # policy (services/batch/policy.py); None: none.
    batch: BatchJob | None = None


class _TaskRun:
    """A task in flight, with the facts the ledger keeps of it (services/ledger/tasks.py)."""

    __slots__ = (
        "deadline_misses",
        "ended",
        "final_completed_at",
        "gpu_s",
        "max_completed_step",
        "max_failed_step",
        "model",
        "spend",
        "step_index",
        "succeeded",
        "task",
    )

    def __init__(self, task: Task):
        self.task = task
        self.step_index = 0
        self.spend = 0.0
        self.gpu_s = 0.0
        self.ended = False
        self.succeeded = False
        self.max_completed_step = 0
        self.max_failed_step = 0
        self.final_completed_at: float | None = None
        self.deadline_misses = 0
        self.model: str | None = None  # its step 1's (a task's steps name one model)


class _RequestRun:
    __slots__ = (
        "arrival",
        "cached",
        "deadline_at",
        "done",
        "first_token_at",
        "gpu_s",
        "index",
        "model",
        "outcome",
        "placed",
        "predicted",
        "queue_s",
        "reserved",
        "rid",
        "route_request",
        "spec",
        "task_run",
        "upper_bound",
        "workers",
    )

    def __init__(self, task_run: _TaskRun, index: int, rid: str, spec: Step, arrival: float, model: str):
        self.task_run = task_run
        self.model = model  # the model it names: placed only on that model's workers
        self.index = index
        self.rid = rid
        self.spec = spec
        self.arrival = arrival
        self.deadline_at = arrival + spec.deadline_s if spec.deadline_s is not None else None
        self.first_token_at: float | None = None
        self.workers: dict[Seq, SimWorker] = {}
        self.queue_s: float | None = None
        self.reserved: SimWorker | None = None  # a decode worker holding a place for the KV
        self.upper_bound = 0  # prompt tokens an infinite cache would hold for it
        self.gpu_s = 0.0
        self.cached = 0
        self.placed: tuple[str, ...] = ()
        self.outcome: tuple[str, float] | None = None  # to log once its GPU time is all charged
        self.done = False
        self.route_request: RouteRequest | None = None  # as last built (`Simulator._route_request`)
        # The router's prediction for its placement, for its calibration: (the decode worker's
        # GPU type, the prefill worker's, when decided, completion seconds, indexed cached tokens).
        self.predicted: tuple[str, str, float, float, int] | None = None


class _TenantFigures:
    __slots__ = ("admitted", "admitted_tokens", "requests", "slo_met")

    def __init__(self) -> None:
        self.requests = 0
        self.admitted = 0
        self.admitted_tokens = 0
        self.slo_met = 0


class ClassFigures:
    """One service class's figures (interactive, batch): requests issued and meeting their SLO,
    their first-token latencies, tasks succeeded, and the ledger's spend attributed to them."""

    __slots__ = ("attributed_usd", "completed", "requests", "slo_met", "succeeded", "tasks", "ttft")

    def __init__(self) -> None:
        self.requests = 0
        self.completed = 0
        self.slo_met = 0
        self.tasks = 0
        self.succeeded = 0
        self.attributed_usd = 0.0
        self.ttft = LatencySketch()


class ModelFigures:
    """One model's figures (several models on one fleet, each its own pools): requests issued,
    completed, rejected and failed, held for a replica (ever, and now), in flight, meeting their
    SLO, their first-token latencies, tasks and tasks succeeded (a task is its step 1's model),
    the ledger's spend attributed to them and their KV hand-offs' spend; and the traffic since
    the autoscaler's last plan (`window`, its `Observation` of the model)."""

    __slots__ = (
        "attributed_usd",
        "completed",
        "failed",
        "held",
        "holding",
        "in_flight",
        "kv_transfer_usd",
        "rejected",
        "requests",
        "slo_met",
        "succeeded",
        "tasks",
        "ttft",
        "window",
    )

    def __init__(self) -> None:
        self.requests = 0
        self.completed = 0
        self.rejected = 0
        self.failed = 0
        self.held = 0
        self.holding = 0
        self.in_flight = 0
        self.slo_met = 0
        self.tasks = 0
        self.succeeded = 0
        self.attributed_usd = 0.0
        self.kv_transfer_usd = 0.0
        self.ttft = LatencySketch()
        self.window = TrafficWindow()


class _SloCount(Protocol):
    slo_met: int


@contextmanager
def completion_counted(
    figures: ClassFigures | ModelFigures, req: _RequestRun, now: float, sim: _SloCount
) -> Iterator[None]:
    """Count a completing request in a group's figures (its class's, its model's): its first
    token, the completion, and whether the completion the block runs met the SLO."""
    met = sim.slo_met
    first = req.first_token_at if req.first_token_at is not None else now
    figures.ttft.add(first - req.arrival)
    figures.completed += 1
    yield
    figures.slo_met += sim.slo_met - met
