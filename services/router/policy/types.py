"""What the router's decision reads and answers, shared by its modules: the workers as their
heartbeats describe them (`WorkerView`), the operator's knobs (`RouterConfig`), one request
(`RouteRequest`), and the answers (`Placement` with its `ScoredOption`s, `NoPlacement`,
`FirstToken`). Plain data, no decisions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from services.router.policy.speed import DEFAULT_SPEED, WorkerSpeed

# A worker heard from within this many seconds is live (a candidate); older, it is passed over.
LIVENESS_S = 3.0


Role = Literal["prefill", "decode"]
Mode = Literal["aggregated", "disaggregated"]
Priority = Literal["critical", "standard", "sheddable"]


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: str
    role: Role
    model: str
    block_size: int
    queue_depth: int
    running: int
    kv_blocks_total: int
    kv_blocks_used: int  # held by sequences (cached blocks they share included)
    heartbeat_at: float
    draining: bool = False
    gpu_type: str = ""
    pool: str = ""  # the worker's pool, as its heartbeat names it (for the metrics' labels)
    price_per_hour: float = 0.0  # US$ per hour for the whole worker (all its GPUs)
    speed: WorkerSpeed = DEFAULT_SPEED
    # Blocks neither held nor cached (allocating beyond them evicts cached blocks); None: unknown.
    kv_blocks_free: int | None = None
    # Uncached prompt tokens waiting for their prefill; None: unknown (estimated from the depth).
    queued_tokens: int | None = None
    # KV tokens of the running batch; None: unknown (estimated from the blocks in use).
    context_tokens: int | None = None
    warm: bool = True  # the model's weights are loaded
    cold_load_s: float = 0.0  # loading them (when not warm)
    adapters: tuple[str, ...] = ()  # LoRA adapters loaded
    adapter_load_s: float = 0.0  # loading an adapter it lacks


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """What the objective weighs that is the operator's call, not the workers' state."""

    kv_transfer_usd_per_gb: float = 0.01  # the ledger's price of KV moved between workers
    # What a second of a request's latency (to its first token; for a workflow's step, to its
    # last, which the next step waits for) is worth, in US$, per priority class, against GPU
    # time (an H100 at $3/h costs $0.00083/s). Critical traffic buys speed; sheddable traffic is
    # placed mostly for cost.
    latency_worth_usd_per_s: Mapping[str, float] = field(
        default_factory=lambda: {"critical": 0.002, "standard": 0.0005, "sheddable": 0.0001}
    )
    # GPU time costs the fleet what it takes from other work: a worker's price times how busy it
    # is (an idle GPU's time is paid for whether used or not). A worker counts as fully busy
    # with this much prefill backlog, or with its KV cache full.
    saturation_backlog_s: float = 1.0
    # The window of the prefill arrival rate the router keeps per worker (its placements).
    rate_window_s: float = 10.0
    # The spread of a completion-time prediction (the log of actual over predicted) before a
    # GPU type has shown its own (calibration.py: learned online per GPU type from then on).
    # 0.4 was fitted, as a normal spread of 0.4 x predicted + 0.25 s, on the agentic and
    # Mooncake runs (docs/experiments.md); as a prior it weighs 20 completions.
    relative_error: float = 0.4
    # No option gives the task at least this chance of meeting its deadlines: infeasible.
    min_success_probability: float = 0.05
    # The chance a task that takes its steps' full price from the fleet must have to be worth
    # trying (`refuse.refuse`: scaled by the marginal over the full cost of what is left). Fitted on
    # the agentic workload (0.9, 1.0, 1.1 at x10 and x20, two seeds, both admissions;
    # docs/experiments.md): above 1 was cheaper on a fixed fleet, but a saturated fleet then tries no
    # new task at all, and an autoscaled one never sees the load that would grow it.
    worth_probability: float = 0.9
    # ... and only while the fleet is pressed (`refuse.fleet_pressure`): admission held the request back at
    # least `saturation_backlog_s`, or its best placement's decode batch is at least this share
    # of its limit, or that placement's prefill backlog is `saturation_backlog_s`. With room to
    # spare a refusal frees little, and the chance it rests on is pessimistic: a task refused
    # there is a task lost. Agentic workload, five seeds, both admissions: x5's SLO against the
    # best baseline's +0.01 / +0.02 pp, where every fleet counted as pressed gave -0.09 / -0.05;
    # x10 and x20 as before within 0.3 points of cost. At 0.25 and 0.35 x5 stays short or
    # level; at 0.5 and 0.65 too little is refused at x10 (docs/experiments.md).
    pressed_occupancy: float = 0.42
    # When set: a new workflow (its first step) is refused while its best predicted time per
    # output token is above this, the decode batches past their knee (each extra sequence's KV
    # read adds about as much step time as throughput), where a new task only stretches the
    # steps of those in flight and the backlog that outlives the arrivals. Off by default: it
    # pays where the router alone controls the load (the agentic workload under rate_limit
    # admission, 0.04 s: 2.5-9% cheaper per successful task at x10 and x20, two seeds), but
    # behind the project's admission, which defers new workflows on its own saturation bounds,
    # it refuses first steps admission has just let through (9-15% dearer; docs/experiments.md).
    new_task_max_tpot_s: float | None = None
    # Under overload the router sheds the dearest new tasks first (`refuse.dearest`): a task's first
    # step is refused as saturated when what its steps take from the fleet is above
    # `dearest_task_factor` x the typical new task's price x its chance of success, while the
    # fleet is past keeping up (more than `dearest_gate` of recent first steps refused for
    # their cost, as not worth it or by this rule, or the decode batch full; counting the rule's
    # own refusals keeps it armed while the overload lasts: agentic x20 behind the project's
    # admission 12.0% under the best baseline against 7.9%, Mooncake x40 42.1% against 33.4%,
    # pooled over the seeds; docs/experiments.md). With the fleet's spend fixed, the GPU time
    # goes to the tasks that take the least of it. Where admission only enforces quotas it is
    # the only shedding (agentic x20 under rate_limit: 27-33% under the best baseline, five
    # seeds); behind the project's admission, which sheds by priority and saturation, it still
    # picks among the tasks admission lets through (agentic x10 and x20, five seeds: 2.4% and
    # 7.4% under the best baseline; with it off, 1.2-5.0% dearer than with one bar for all
    # classes, in all ten runs; docs/experiments.md). None: off.
    dearest_task_factor: float | None = 1.0
    dearest_gate: float = 0.005
    # Where admission controls no load (`admission_controls_load` false: its control enforces
    # quotas at most), the router is the only shedding under overload and that rule's bar is
    # this instead (None: `dearest_task_factor`). Behind the project's admission the tasks have
    # been deferred and shed already, and a lower bar there refuses what would have succeeded
    # (agentic x20, seeds 0-9: SLO 1.46 pp under the best baseline's at 0.8). Chosen on seeds
    # 0-9 under rate_limit among 0.4, 0.5, 0.6 and 0.8 (x20 -29.4% at 0.8 against -28.2% at
    # 1.0, x10 the least given up); on seeds 10-14, held out, x20 -26.5% against -25.4%, x10
    # -14.8% against -15.2% (docs/experiments.md, "The router's own bar where it is the
    # only shedding").
    dearest_task_factor_alone: float | None = 0.8
    # Whether admission keeps the fleet at its capacity (`AdmissionLimits.controls_load`): set by
    # whoever runs the router from admission's own config (the router service from the mesh
    # config, the simulator from its admission variant), not a knob of its own.
    admission_controls_load: bool = True
    # A class's bar in that rule: `dearest_task_factor` x this (1 where absent). The rule weighs
    # cost alone; a higher bar keeps more of the operator's most valued class (agentic x20
    # behind the project's admission, five seeds: 3,627 critical tasks succeed against 3,455
    # with one bar for all; docs/experiments.md).
    dearest_priority_factor: Mapping[str, float] = field(default_factory=lambda: {"critical": 1.5})
    # The chance that a cached block the request evicts would have been reused (its re-prefill
    # is then charged to this placement).
    evicted_reuse_probability: float = 0.25
    # Candidates: the workers caching the longest prefix, and the least loaded per role and GPU.
    cache_candidates: int = 3
    load_candidates: int = 2
    # Disaggregated pairs scored: the best prefill workers x the best decode workers.
    pair_candidates: int = 2


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
    admission_wait_s: float = 0.0  # how long admission held it back (RequestAdmitted.waited_s)

    @property
    def in_workflow(self) -> bool:
        """A step of a workflow of two or more steps (a later step waits for this one)."""
        return (self.workflow_steps or 1) > 1


@dataclass(frozen=True, slots=True)
class ScoredOption:
    """One placement the policy weighed: its predictions and its score (lower is better)."""

    mode: Mode
    prefill_worker: str
    decode_worker: str
    cached_tokens: int
    ttft_s: float
    cost_usd: float
    success_probability: float
    expected_cost_per_success_usd: float
    completion_s: float = 0.0  # predicted time from now to the last token
    score: float = 0.0  # the objective (lower is better)


@dataclass(frozen=True, slots=True)
class Placement:
    mode: Mode
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
    predicted_completion_s: float = 0.0
    # The objective the options were ranked by (lower is better); None from a policy without one.
    score: float | None = None
    # The prefix the KV index says the prefill worker caches (the prediction discounts it by the
    # share prefills there have found: `Calibration.found_share`); what that share is learned on.
    indexed_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class NoPlacement:
    # "infeasible": no placement can meet the request's hard deadline (admission is told so);
    # retrying cannot help. "saturated": the fleet is too busy for the task to be worth trying
    # now (its chance against what it would take from other work); later it may be.
    reason: Literal["no_workers", "invalid", "infeasible", "saturated"]
    message: str
    # When a retry may be placed, in seconds (the rejection's Retry-After); None: retrying cannot
    # help. Saturated: when the work queued ahead of the request's likeliest placement is
    # predicted done (`refuse.room_in`); no worker: a heartbeat or two, for one to announce itself.
    retry_after_s: float | None = None


NO_WORKERS_RETRY_S = 5.0


def no_workers(model: str) -> NoPlacement:
    return NoPlacement("no_workers", f"no live decode worker serves model {model!r}", NO_WORKERS_RETRY_S)


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The earliest first token over the live placements: when (`ttft_s`), and how much of that
    is waiting behind other work (`wait_s`) rather than the request's own prefill and load."""

    ttft_s: float
    wait_s: float
