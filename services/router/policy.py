"""The router's decision: where a request's prefill and decode run. Pure; clock passed in.

ripplemesh places each request where it minimises the **expected cost per successful
completion**. For every candidate placement (one worker serving both phases, aggregated; or a
prefill worker handing its KV to a decode worker, disaggregated) it predicts, from the seven axes:

- GPU generation and price: prefill and decode speed from the worker's roofline (`WorkerSpeed`:
  FLOPs, HBM bandwidth, weights, KV bytes per token), and its $/s;
- memory headroom: whether the request's KV blocks fit beside the running batch, the wait for
  blocks when they do not, and the cached blocks of others it would evict;
- KV cache state: the prefix the worker already caches (`PrefixView`), so only the uncached part
  is prefilled (and, disaggregated, only the blocks the decode worker lacks travel);
- warm weights: the model and adapter loaded, or the load time and its cost;
- tenant priority: what a second of the request's latency (to its first token; for a
  workflow's step, to its last) is worth for its class (`RouterConfig`);
- latency budget: predicted TTFT (queue + uncached prefill + cold load) and completion time
  (TTFT + KV transfer + decode at the worker's predicted time per token) against the deadline,
  as a probability of meeting it;
- workflow: the spend a late step of a workflow puts at risk (failing it wastes every earlier
  step), and the workflow's prefix, which lives where its earlier steps ran.

and scores it as

    (marginal cost + latency worth + sunk cost at risk) / P(success)

marginal cost = the request's GPU-seconds priced on each worker + KV transfer + cold load + the
re-prefill of evicted blocks; sunk cost = what the workflow spent already; P(success) = the
probability of completing by the deadline (1 without one). The lowest score wins; aggregated and
disaggregated options compete on the same score. With sunk cost 0 and P = 1 the score is just
the cheapest fast placement; as the sunk cost grows, the probability of success weighs more.
When no option has a useful probability of meeting a hard deadline, or placing the task is
expected to cost more per success than it is worth (its chance against the marginal over the
full cost of what is left: `_refuse`), the request is `NoPlacement("infeasible")` or
`NoPlacement("saturated")` respectively: it is rejected instead of spending GPU time on it.

Candidates are pruned so that a decision costs O(k log n), not O(n): the workers caching the
longest prefix of the request (from the prefix view's `overlaps`) plus the k least-loaded
workers of each role and GPU type (a lazily maintained heap in `RouterState`). Exact ties break
on a hash of (request, worker) computed only for the tied workers. Each placement is counted in
the state (requests, tokens and KV blocks placed since the worker's last heartbeat), so a burst
between two heartbeats spreads instead of herding.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import eq
from typing import Literal, Protocol

LIVENESS_S = 3.0
# The most of a worker's compute prompts are assumed to take from its decodes (at 1 the queue
# grows without bound; the prediction then says "very slow", not "never").
MAX_PREFILL_LOAD = 0.9

Role = Literal["prefill", "decode"]
Mode = Literal["aggregated", "disaggregated"]
Priority = Literal["critical", "standard", "sheddable"]


class PrefixView(Protocol):
    """Which leading blocks of a request each worker's prefix cache holds. The router's KV index
    (kv_index.py, from the workers' KvEvents) and the simulator's fleet view both serve it."""

    def overlap(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` the worker's prefix cache holds."""
        ...

    def overlaps(self, block_hashes: Sequence[int]) -> Mapping[str, int]:
        """Every worker's matched leading blocks; workers matching nothing may be left out."""
        ...

    # A view may also have `matches(block_hashes)`: the same mapping, read lazily, with
    # `deepest()` giving (depth, worker ids) longest first in the mapping's order (`KvIndex`);
    # the decision then resolves only the workers it reads (`_matched`, `_deepest`).


class NoPrefix:
    """A PrefixView that knows no cache (callers without a KV index)."""

    def overlap(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        return 0

    def overlaps(self, block_hashes: Sequence[int]) -> Mapping[str, int]:
        return {}


@dataclass(frozen=True, slots=True)
class WorkerSpeed:
    """A worker's roofline: what its GPU(s) and model make a step cost (the sim engine's
    PerfModel figures; services/router/speed.py builds one from a GPU profile and model shape).

    A step computing n new tokens (in p parts, with a attention query-key pairs, reading r KV
    tokens) lasts overhead + max(FLOPs / flops_per_s, bytes / bytes_per_s) with FLOPs =
    n x flops_per_token + a x flops_per_pair and bytes = weight_read_bytes + (r + n) x
    kv_bytes_per_token."""

    flops_per_s: float
    flops_per_token: float
    flops_per_pair: float
    bytes_per_s: float
    weight_read_bytes: float
    kv_bytes_per_token: int
    step_overhead_s: float
    kv_link_bytes_per_s: float
    max_batch_tokens: int = 8192
    max_running: int = 256

    @property
    def prefill_tokens_per_s(self) -> float:
        """Compute-bound prompt tokens per second, attention aside."""
        return self.flops_per_s / self.flops_per_token

    def step_seconds(self, new_tokens: float, pairs: float, read_tokens: float) -> float:
        compute = (new_tokens * self.flops_per_token + pairs * self.flops_per_pair) / self.flops_per_s
        memory = (
            self.weight_read_bytes + (read_tokens + new_tokens) * self.kv_bytes_per_token
        ) / self.bytes_per_s
        return self.step_overhead_s + (compute if compute > memory else memory)

    def decode_step_seconds(self, decodes: int, context_tokens: float) -> float:
        """One step of `decodes` one-token decodes over `context_tokens` of KV in all."""
        return self.step_seconds(decodes, context_tokens + decodes, context_tokens)


# Llama-3-8B in BF16 on one H100 SXM, as the sim engine models it (profiles.py, perf.py); what a
# worker that reports no speed is assumed to be. tests/test_router_policy.py holds it equal to
# speed.worker_speed of that profile.
DEFAULT_SPEED = WorkerSpeed(
    flops_per_s=989e12 * 0.5,
    flops_per_token=2.0 * (8.03e9 - 2 * 128256 * 4096),
    flops_per_pair=4.0 * 32 * 32 * 128,
    bytes_per_s=3.35e12 * 0.75,
    weight_read_bytes=(8.03e9 - 128256 * 4096) * 2,
    kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
    step_overhead_s=0.002,
    kv_link_bytes_per_s=50e9,
)


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
    # The spread of a completion-time prediction: sigma = relative x predicted + absolute seconds.
    # A fit, not a calibration: the predictions are pessimistic (a step predicted at 20-30 s
    # takes a median 0.75 of that) and the refusals read the chance, so a wider spread gives a
    # step predicted near its deadline the better odds it has. 0.4 against 0.3, over the 64
    # agentic and Mooncake runs: the cheapest in 49 either way, the SLO at least the best
    # baseline's in 57 against 54 (0.45, 0.5: agentic x20 SLO short at 2 seeds; docs/router-experiments.md).
    relative_error: float = 0.4
    absolute_error_s: float = 0.25
    # No option gives the task at least this chance of meeting its deadlines: infeasible.
    min_success_probability: float = 0.05
    # The chance a task that takes its steps' full price from the fleet must have to be worth
    # trying (`_refuse`: scaled by the marginal over the full cost of what is left). Fitted on
    # the agentic workload (0.9, 1.0, 1.1 at x10 and x20, two seeds, both admissions;
    # docs/router-experiments.md): above 1 was cheaper on a fixed fleet, but a saturated fleet then tries no
    # new task at all, and an autoscaled one never sees the load that would grow it.
    worth_probability: float = 0.9
    # ... and only while the fleet is pressed (`_pressure`): admission held the request back at
    # least `saturation_backlog_s`, or its best placement's decode batch is at least this share
    # of its limit, or that placement's prefill backlog is `saturation_backlog_s`. With room to
    # spare a refusal frees little, and the chance it rests on is pessimistic: a task refused
    # there is a task lost. Agentic workload, five seeds, both admissions: x5's SLO against the
    # best baseline's +0.01 / +0.02 pp, where every fleet counted as pressed gave -0.09 / -0.05;
    # x10 and x20 as before within 0.3 points of cost. At 0.25 and 0.35 x5 stays short or
    # level; at 0.5 and 0.65 too little is refused at x10 (docs/router-experiments.md).
    pressed_occupancy: float = 0.42
    # When set: a new workflow (its first step) is refused while its best predicted time per
    # output token is above this, the decode batches past their knee (each extra sequence's KV
    # read adds about as much step time as throughput), where a new task only stretches the
    # steps of those in flight and the backlog that outlives the arrivals. Off by default: it
    # pays where the router alone controls the load (the agentic workload under rate_limit
    # admission, 0.04 s: 2.5-9% cheaper per successful task at x10 and x20, two seeds), but
    # behind the project's admission, which defers new workflows on its own saturation bounds,
    # it refuses first steps admission has just let through (9-15% dearer; docs/router-experiments.md).
    new_task_max_tpot_s: float | None = None
    # Under overload the router sheds the dearest new tasks first (`_dearest`): a task's first
    # step is refused as saturated when what its steps take from the fleet is above
    # `dearest_task_factor` x the typical new task's price x its chance of success, while the
    # fleet is past keeping up (more than `dearest_gate` of recent first steps refused for
    # their cost, as not worth it or by this rule, or the decode batch full; counting the rule's
    # own refusals keeps it armed while the overload lasts: agentic x20 behind the project's
    # admission 12.0% under the best baseline against 7.9%, Mooncake x40 42.1% against 33.4%,
    # pooled over the seeds; docs/router-experiments.md). With the fleet's spend fixed, the GPU time
    # goes to the tasks that take the least of it. Where admission only enforces quotas it is
    # the only shedding (agentic x20 under rate_limit: 27-33% under the best baseline, five
    # seeds); behind the project's admission, which sheds by priority and saturation, it still
    # picks among the tasks admission lets through (agentic x10 and x20, five seeds: 2.4% and
    # 7.4% under the best baseline; with it off, 1.2-5.0% dearer than with one bar for all
    # classes, in all ten runs; docs/router-experiments.md). None: off.
    dearest_task_factor: float | None = 1.0
    dearest_gate: float = 0.005
    # Where admission controls no load (`admission_controls_load` false: its control enforces
    # quotas at most), the router is the only shedding under overload and that rule's bar is
    # this instead (None: `dearest_task_factor`). Behind the project's admission the tasks have
    # been deferred and shed already, and a lower bar there refuses what would have succeeded
    # (agentic x20, seeds 0-9: SLO 1.46 pp under the best baseline's at 0.8). Chosen on seeds
    # 0-9 under rate_limit among 0.4, 0.5, 0.6 and 0.8 (x20 -29.4% at 0.8 against -28.2% at
    # 1.0, x10 the least given up); on seeds 10-14, held out, x20 -26.5% against -25.4%, x10
    # -14.8% against -15.2% (docs/router-experiments.md, "The router's own bar where it is the
    # only shedding").
    dearest_task_factor_alone: float | None = 0.8
    # Whether admission keeps the fleet at its capacity (`AdmissionLimits.controls_load`): set by
    # whoever runs the router from admission's own config (the router service from the mesh
    # config, the simulator from its admission variant), not a knob of its own.
    admission_controls_load: bool = True
    # A class's bar in that rule: `dearest_task_factor` x this (1 where absent). The rule weighs
    # cost alone; a higher bar keeps more of the operator's most valued class (agentic x20
    # behind the project's admission, five seeds: 3,627 critical tasks succeed against 3,455
    # with one bar for all; docs/router-experiments.md).
    dearest_priority_factor: Mapping[str, float] = field(default_factory=lambda: {"critical": 1.5})
    # The chance that a cached block the request evicts would have been reused (its re-prefill
    # is then charged to this placement).
    evicted_reuse_probability: float = 0.25
    # Candidates: the workers caching the longest prefix, and the least loaded per role and GPU.
    cache_candidates: int = 3
    load_candidates: int = 2
    # Disaggregated pairs scored: the best prefill workers x the best decode workers.
    pair_candidates: int = 2


@dataclass(slots=True)
class _Placed:
    """What this router placed on a worker since its last heartbeat."""

    requests: int = 0
    tokens: int = 0  # uncached prompt tokens to prefill
    blocks: int = 0  # KV blocks the requests will hold


# The weight of one first step in the decaying averages of `_NewTasks` (about the last 50).
NEW_TASK_WEIGHT = 0.02


@dataclass(slots=True)
class _NewTasks:
    """Decaying averages over the first steps of tasks the router decided (`_dearest`)."""

    price_usd: float | None = None  # a new task's full price: steps x its best option's cost
    refused: float = 0.0  # the share refused for their cost (as not worth it, or the dearest)


@dataclass(slots=True)
class RouterState:
    workers: dict[str, WorkerView] = field(default_factory=dict)
    # Requests this router placed on a worker since that worker's last heartbeat.
    placed_since_heartbeat: dict[str, int] = field(default_factory=dict)
    config: RouterConfig = field(default_factory=RouterConfig)
    placed: dict[str, _Placed] = field(default_factory=dict)
    # Per (model, role, gpu type): a heap of (load key, stamp, worker id); an entry is current
    # while its stamp is the worker's in `_stamps` (stale ones are skipped and dropped lazily).
    _heaps: dict[tuple[str, str, str], list[tuple[float, int, str]]] = field(default_factory=dict)
    _stamps: dict[str, int] = field(default_factory=dict)
    _counter: itertools.count[int] = field(default_factory=itertools.count)
    # Per model: worker id -> block size (a mismatch is looked for only when two sizes exist).
    _block_sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    _size_counts: dict[str, dict[int, int]] = field(default_factory=dict)  # model -> size -> workers
    # Per worker: its figures as of its current stamp (`_figures`).
    _figures: dict[str, _Figures] = field(default_factory=dict)
    # Per worker: prompt tokens placed per second (decaying average over `rate_window_s`), and
    # when it was last updated.
    _rates: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Per worker: the requests this router placed there that should still be running, as a heap
    # of (predicted end, what a second of their latency is worth), and that worth summed.
    _inflight: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    _inflight_worth: dict[str, float] = field(default_factory=dict)
    # Per model: its workers, in the order of `workers` (`live_workers` filters them), and its
    # live ones as last filtered: (from, the oldest heartbeat among them, live, decoders,
    # prefillers), good from `from` until that heartbeat is older than LIVENESS_S, while no
    # worker of the model changes (`observe`, `forget`).
    _by_model: dict[str, dict[str, WorkerView]] = field(default_factory=dict)
    _live: dict[str, tuple[float, float, list[WorkerView], list[WorkerView], list[WorkerView]]] = field(
        default_factory=dict
    )
    # Bumped by every change a decision reads (`observe`, `forget`, `add_work`, `add_inflight`).
    _version: int = 0
    # The last `_options`: what they were computed from (the match, the instant, `_version`, the
    # config, the request, the prefix view) and the result. Admission asks for a request's
    # earliest first token and the router then places it at the same instant (the simulator
    # does both in one process): the second call reuses the first's options.
    _last_options: tuple[object, ...] | None = None
    # New tasks' first steps as placed lately (`_dearest`).
    _new_tasks: _NewTasks = field(default_factory=lambda: _NewTasks())

    def observe(self, worker: WorkerView) -> None:
        previous = self.workers.get(worker.worker_id)
        if previous is None or worker.heartbeat_at >= previous.heartbeat_at:
            self._version += 1
            if previous is not None and previous.model != worker.model:
                self._drop_size(previous)
            self.workers[worker.worker_id] = worker
            self._index(worker, previous)
            self.placed_since_heartbeat[worker.worker_id] = 0
            self.placed[worker.worker_id] = _Placed()
            sizes = self._block_sizes.setdefault(worker.model, {})
            if sizes.get(worker.worker_id) != worker.block_size:
                if worker.worker_id in sizes:
                    self._drop_size(worker)
                sizes[worker.worker_id] = worker.block_size
                counts = self._size_counts.setdefault(worker.model, {})
                counts[worker.block_size] = counts.get(worker.block_size, 0) + 1
            self._push(worker)

    def _index(self, worker: WorkerView, previous: WorkerView | None) -> None:
        """Keep `_by_model` (in the order of `workers`) and drop the models' live lists."""
        if previous is not None and previous.model != worker.model:
            self._by_model.get(previous.model, {}).pop(worker.worker_id, None)
            self._live.pop(previous.model, None)
            # A worker changing model keeps its place in `workers`: rebuild that model's order.
            self._by_model[worker.model] = {
                w.worker_id: w for w in self.workers.values() if w.model == worker.model
            }
        else:
            self._by_model.setdefault(worker.model, {})[worker.worker_id] = worker
        self._live.pop(worker.model, None)

    def live(self, model: str, now: float) -> tuple[list[WorkerView], list[WorkerView], list[WorkerView]]:
        """The model's live, non-draining workers (in the order of `workers`), and of them the
        decode and the prefill workers. Shared lists: read them, do not change them."""
        cached = self._live.get(model)
        if cached is not None and cached[0] <= now and now - cached[1] <= LIVENESS_S:
            return cached[2], cached[3], cached[4]
        live = [
            w
            for w in self._by_model.get(model, {}).values()
            if not w.draining and now - w.heartbeat_at <= LIVENESS_S
        ]
        oldest = min((w.heartbeat_at for w in live), default=math.inf)
        decoders = [w for w in live if w.role == "decode"]
        prefillers = [w for w in live if w.role == "prefill"] if len(decoders) < len(live) else []
        self._live[model] = (now, oldest, live, decoders, prefillers)
        return live, decoders, prefillers

    def forget(self, worker_id: str) -> None:
        self._version += 1
        worker = self.workers.pop(worker_id, None)
        self.placed_since_heartbeat.pop(worker_id, None)
        self.placed.pop(worker_id, None)
        self._stamps.pop(worker_id, None)
        self._figures.pop(worker_id, None)
        self._rates.pop(worker_id, None)
        self._inflight.pop(worker_id, None)
        self._inflight_worth.pop(worker_id, None)
        if worker is not None:
            self._drop_size(worker)
            self._by_model.get(worker.model, {}).pop(worker_id, None)
            self._live.pop(worker.model, None)

    def _drop_size(self, worker: WorkerView) -> None:
        size = self._block_sizes.get(worker.model, {}).pop(worker.worker_id, None)
        counts = self._size_counts.get(worker.model)
        if size is not None and counts is not None:
            counts[size] -= 1
            if not counts[size]:
                del counts[size]

    def count(self, worker_id: str, tokens: int, blocks: int, now: float | None = None) -> None:
        """One more request placed on the worker: `tokens` to prefill there, `blocks` of KV."""
        self.placed_since_heartbeat[worker_id] = self.placed_since_heartbeat.get(worker_id, 0) + 1
        self.placed.setdefault(worker_id, _Placed()).requests += 1
        self.add_work(worker_id, tokens, blocks, now)

    def add_work(self, worker_id: str, tokens: int, blocks: int, now: float | None = None) -> None:
        """Work a placement on the worker brings: `tokens` to prefill there, `blocks` of KV."""
        self._version += 1
        placed = self.placed.setdefault(worker_id, _Placed())
        placed.tokens += tokens
        placed.blocks += blocks
        if now is not None and tokens:
            window = self.config.rate_window_s
            self._rates[worker_id] = (self.prefill_rate(worker_id, now) + tokens / window, now)
        worker = self.workers.get(worker_id)
        if worker is not None:
            self._push(worker)

    def add_inflight(self, worker_id: str, end: float, worth: float) -> None:
        """A request placed on the worker, predicted to run until `end`, whose latency is worth
        `worth` US$ per second."""
        self._version += 1
        heapq.heappush(self._inflight.setdefault(worker_id, []), (end, worth))
        self._inflight_worth[worker_id] = self._inflight_worth.get(worker_id, 0.0) + worth

    def inflight(self, worker_id: str, now: float) -> tuple[int, float]:
        """How many of this router's placements should still be running on the worker, and what a
        second of their latency is worth in all."""
        heap = self._inflight.get(worker_id)
        if not heap:
            return 0, 0.0
        worth = self._inflight_worth[worker_id]
        while heap and heap[0][0] <= now:
            worth -= heapq.heappop(heap)[1]
        worth = max(0.0, worth) if heap else 0.0
        self._inflight_worth[worker_id] = worth
        return len(heap), worth

    def prefill_rate(self, worker_id: str, now: float) -> float:
        """Prompt tokens per second this router has been sending the worker to prefill."""
        rate = self._rates.get(worker_id)
        if rate is None:
            return 0.0
        value, at = rate
        return value * math.exp(-max(0.0, now - at) / self.config.rate_window_s)

    # ------------------------------------------------------------ the least-loaded heaps

    def _push(self, worker: WorkerView) -> None:
        stamp = next(self._counter)
        self._stamps[worker.worker_id] = stamp
        heap = self._heaps.setdefault((worker.model, worker.role, worker.gpu_type), [])
        heapq.heappush(heap, (backlog_seconds(worker, self), stamp, worker.worker_id))
        if len(heap) > 64 and len(heap) > 4 * len(self._stamps):
            # Mostly stale entries: keep the current ones only.
            current = [e for e in heap if self._stamps.get(e[2]) == e[1]]
            heapq.heapify(current)
            self._heaps[(worker.model, worker.role, worker.gpu_type)] = current

    def roles(self, model: str) -> set[str]:
        """The roles the model's workers have (live or not)."""
        return {role for heap_model, role, _ in self._heaps if heap_model == model}

    def least_loaded(self, model: str, role: Role, k: int, now: float) -> list[WorkerView]:
        """The k least-loaded live, non-draining workers of each GPU type for the model and role
        (O(k log n) per GPU type). Workers tied with the k-th come too (up to 4k), so that a
        hash over the tied options, not the order workers were heard, picks among equals."""
        out: list[WorkerView] = []
        for (heap_model, heap_role, _), heap in self._heaps.items():
            if heap_model != model or heap_role != role:
                continue
            taken: list[tuple[float, int, str]] = []
            live = 0
            last = math.inf
            while heap:
                if live >= k and (heap[0][0] != last or live >= 4 * k):
                    break
                entry = heapq.heappop(heap)
                key, stamp, worker_id = entry
                if self._stamps.get(worker_id) != stamp:
                    continue  # superseded: dropped
                worker = self.workers[worker_id]
                taken.append(entry)  # kept (a dead one may come back), maybe not a candidate
                if worker.draining or now - worker.heartbeat_at > LIVENESS_S:
                    continue
                out.append(worker)
                live += 1
                last = key
            for entry in taken:
                heapq.heappush(heap, entry)
        return out


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


@dataclass(frozen=True, slots=True)
class NoPlacement:
    # "infeasible": no placement can meet the request's hard deadline (admission is told so);
    # retrying cannot help. "saturated": the fleet is too busy for the task to be worth trying
    # now (its chance against what it would take from other work); later it may be.
    reason: Literal["no_workers", "invalid", "infeasible", "saturated"]
    message: str
    # When a retry may be placed, in seconds (the rejection's Retry-After); None: retrying cannot
    # help. Saturated: when the work queued ahead of the request's likeliest placement is
    # predicted done (`_room_in`); no worker: a heartbeat or two, for one to announce itself.
    retry_after_s: float | None = None


NO_WORKERS_RETRY_S = 5.0
# A saturated refusal's Retry-After is at least a second (the ingress's HTTP header is whole
# seconds) and at most a minute: past that the prediction says little, and the client should ask
# again rather than wait out a guess.
RETRY_AFTER_BOUNDS_S = (1.0, 60.0)


def no_workers(model: str) -> NoPlacement:
    return NoPlacement("no_workers", f"no live decode worker serves model {model!r}", NO_WORKERS_RETRY_S)


# ------------------------------------------------------------------ load (also the baselines')


def load(worker: WorkerView, state: RouterState) -> float:
    kv = worker.kv_blocks_used / worker.kv_blocks_total if worker.kv_blocks_total else 1.0
    return worker.queue_depth + worker.running + state.placed_since_heartbeat.get(worker.worker_id, 0) + kv


def _tie_break(request_id: str, worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{request_id}/{worker_id}".encode(), digest_size=4).digest())


def _least_loaded(workers: Iterable[WorkerView], state: RouterState, request_id: str) -> WorkerView | None:
    """The least-loaded worker by `load`; ties broken by `_tie_break`, hashed for the tied only."""
    keyed = [(load(w, state), w) for w in workers]
    if not keyed:
        return None
    low = min(k for k, _ in keyed)
    tied = [w for k, w in keyed if k == low]
    if len(tied) == 1:
        return tied[0]
    return min(tied, key=lambda w: _tie_break(request_id, w.worker_id))


def live_workers(state: RouterState, model: str, now: float) -> list[WorkerView]:
    """The model's live, non-draining workers, in the order the router came to know them (kept
    per model by `RouterState`, refiltered only when a worker changes or falls silent)."""
    return list(state.live(model, now)[0])


def _mismatch(state: RouterState, model: str, block_size: int, now: float) -> NoPlacement | None:
    counts = state._size_counts.get(model)
    if not counts or (len(counts) == 1 and block_size in counts):
        return None
    mismatched = sorted(w.worker_id for w in live_workers(state, model, now) if w.block_size != block_size)
    if not mismatched:
        return None
    # Routing across a block-size mismatch would turn every cache hit into a miss.
    return NoPlacement(
        "invalid",
        f"block size mismatch: the request was hashed with {block_size}-token blocks but "
        f"worker(s) {', '.join(mismatched)} use another size; refusing to route",
    )


# ------------------------------------------------------------------ predictions


def backlog_tokens(
    worker: WorkerView, state: RouterState, now: float, rate: float, typical_prompt: int = 0
) -> float:
    """Uncached prompt tokens waiting on the worker now: its queue at the heartbeat plus what
    this router placed there since, less what it can have prefilled (at `rate` tokens/s) since
    the heartbeat."""
    placed = state.placed.get(worker.worker_id)
    queued = worker.queued_tokens
    if queued is None:
        queued = worker.queue_depth * typical_prompt
    done = max(0.0, now - worker.heartbeat_at) * rate
    return max(0.0, queued + (placed.tokens if placed is not None else 0) - done)


def backlog_seconds(worker: WorkerView, state: RouterState) -> float:
    """The least-loaded heaps' key: seconds of prefill backlog, then KV occupancy (< 1 s)."""
    placed = state.placed.get(worker.worker_id)
    queued = worker.queued_tokens if worker.queued_tokens is not None else worker.queue_depth * 1024
    tokens = queued + (placed.tokens if placed is not None else 0)
    blocks = worker.kv_blocks_used + (placed.blocks if placed is not None else 0)
    kv = blocks / worker.kv_blocks_total if worker.kv_blocks_total else 1.0
    return tokens / worker.speed.prefill_tokens_per_s + 0.5 * min(1.0, kv) + 0.01 * worker.running


@dataclass(slots=True)  # not frozen: built a dozen times per decision, and frozen init is slower
class _Side:
    """One worker's predicted part in a placement."""

    worker: WorkerView
    cached_tokens: int
    ready_s: float  # until its first token (prefill side) or until it can take the KV (decode side)
    kv_ready_s: float  # until it can take the request's KV from a prefill worker
    own_prefill_s: float  # the wall time of its own prefill steps (prefill side)
    added_prefill_s: float  # how much longer they make the steps of the decodes running there
    prefill_gpu_s: float
    evicted_blocks: int
    decodes: int  # its running batch once this request joins
    context: float  # the batch's KV tokens once this request joins
    # The requests the heartbeat reported waiting there: by the time this request's prefill runs
    # (after theirs) they are decoding beside it. And the prompt tokens still to prefill there
    # (`backlog_tokens`), which their KV then holds.
    waiting: int
    waiting_tokens: float
    prefill_load: float  # the share of its compute new prompts are expected to take
    backlog_s: float  # prefill work queued ahead (seconds)
    utilisation: float  # how busy it is: the share of its price its GPU time costs the fleet
    new_blocks: int  # KV blocks the request adds there (its cached prefix is already there)
    kv_fraction: float  # the worker's KV in use once they are added
    cold_s: float = 0.0  # loading the weights or adapter it lacks for the request

    @property
    def batch_share(self) -> float:
        """Its decode batch once the request joins, as a share of the most it runs at once (over
        1: the request waits for a slot; a worker that reports no limit counts as full)."""
        limit = self.worker.speed.max_running
        return self.decodes / limit if limit > 0 else 1.0


def cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Whole matched blocks, but the last prompt token is always computed (the engines' rule)."""
    return max(0, min(matched_blocks * block_size, prompt_tokens - 1))


def _prefill_seconds(
    speed: WorkerSpeed,
    new: float,
    cached: float,
    decodes: int,
    context: float,
    prompt: float | None = None,
    step_read_bytes: float | None = None,
) -> float:
    """Wall time to prefill `new` tokens after `cached`, in chunks beside `decodes` decodes
    (holding `context` tokens of KV). `prompt`: the tokens are many prompts of about this size
    (a queue), not one (attention grows with each prompt's own length, not the queue's).
    `step_read_bytes`: what each step reads besides the prompt's own KV (the weights and the
    decodes' KV), when the caller has it already (`_figures`)."""
    if new <= 0:
        return 0.0
    chunk = max(1, speed.max_batch_tokens - decodes)
    steps = math.ceil(new / chunk)
    if prompt is None:
        pairs = new * cached + new * (new + 1) / 2.0
    else:
        pairs = new * (prompt + 1) / 2.0
    if step_read_bytes is None:
        step_read_bytes = speed.weight_read_bytes + context * speed.kv_bytes_per_token
    compute = (
        (new + steps * decodes) * speed.flops_per_token + (pairs + steps * context) * speed.flops_per_pair
    ) / (speed.flops_per_s)
    memory = (steps * step_read_bytes + (new + cached) * speed.kv_bytes_per_token) / speed.bytes_per_s
    return steps * speed.step_overhead_s + max(compute, memory)


def _prefill_gpu_seconds(speed: WorkerSpeed, new: float, cached: float) -> float:
    """The request's own share of its prefill steps (what the ledger charges it)."""
    if new <= 0:
        return 0.0
    pairs = new * cached + new * (new + 1) / 2.0
    compute = (new * speed.flops_per_token + pairs * speed.flops_per_pair) / speed.flops_per_s
    return compute + speed.step_overhead_s * math.ceil(new / speed.max_batch_tokens)


@dataclass(slots=True)
class _Figures:
    """A worker's figures that change only with its state (a heartbeat or a placement, i.e. its
    stamp in the least-loaded heaps), kept so that a decision does not recompute them: the
    running batch as the router sees it (what the heartbeat reported plus what was placed since)
    and what this router placed there."""

    stamp: int
    decodes: int  # its running batch's decodes
    context: float  # their KV tokens
    rate: float  # the prefill rate beside them (tokens/s)
    step_s: float  # a decode step's time
    chunk: int  # the prompt tokens a step has room for beside the decodes
    step_read_bytes: float  # what a prefill step reads besides the prompt's own KV
    held: int  # KV blocks held: the heartbeat's and those placed since
    free: int | None  # KV blocks neither held nor cached, less those placed (None: unknown)
    prefill_tokens_per_s: float
    price_per_s: float


def _figures(state: RouterState, worker: WorkerView) -> _Figures:
    """The worker's `_Figures`, recomputed only when its stamp changed."""
    worker_id = worker.worker_id
    stamp = state._stamps.get(worker_id, -1)
    known = state._figures.get(worker_id)
    if known is not None and known.stamp == stamp:
        return known
    placed = state.placed.get(worker_id)
    speed = worker.speed
    decodes = min(worker.running + (placed.requests if placed is not None else 0), speed.max_running)
    context = (
        float(worker.context_tokens)
        if worker.context_tokens is not None
        else float(worker.kv_blocks_used * worker.block_size)
    )
    chunk = max(1, speed.max_batch_tokens - decodes)
    placed_blocks = placed.blocks if placed is not None else 0
    figures = _Figures(
        stamp=stamp,
        decodes=decodes,
        context=context,
        rate=chunk / _prefill_seconds(speed, chunk, 0.0, decodes, context),
        step_s=speed.decode_step_seconds(max(1, decodes), context),
        chunk=chunk,
        step_read_bytes=speed.weight_read_bytes + context * speed.kv_bytes_per_token,
        held=worker.kv_blocks_used + placed_blocks,
        free=worker.kv_blocks_free - placed_blocks if worker.kv_blocks_free is not None else None,
        prefill_tokens_per_s=speed.prefill_tokens_per_s,
        price_per_s=worker.price_per_hour / 3600.0,
    )
    state._figures[worker_id] = figures
    return figures


def _side(
    worker: WorkerView,
    state: RouterState,
    request: RouteRequest,
    matched_blocks: int,
    now: float,
) -> _Side:
    """The worker's part if the request's prefill runs there (`ready_s`), or if its KV is handed
    to it after a prefill elsewhere (`kv_ready_s`).

    The hot path of a decision (a dozen calls each): what depends only on the worker's state
    comes from its `_figures`, computed once per heartbeat or placement."""
    speed = worker.speed
    fig = _figures(state, worker)
    block = request.block_size
    prompt = request.prompt_tokens
    cached = matched_blocks * block
    if cached > prompt - 1:
        cached = prompt - 1
    if cached < 0:
        cached = 0
    new = prompt - cached
    decodes = fig.decodes
    context = fig.context
    rate = fig.rate
    # The prompt tokens waiting there now (its queue estimated from the depth with prompts like
    # this one when the worker does not report it).
    queue_tokens = backlog_tokens(worker, state, now, rate, prompt)
    # Prefilling that queue, as many prompts of this size.
    wait = _prefill_seconds(speed, queue_tokens, 0.0, decodes, context, prompt, fig.step_read_bytes)
    # Its own prefill after the cached prefix (`_prefill_seconds`), what its prefill adds to the
    # steps of the decodes running beside it (a short prompt rides along in a memory-bound
    # decode step almost for free), and its own GPU time (the
    # steps' compute and overhead, what the ledger charges it).
    own = 0.0
    added = 0.0
    prefill_gpu_s = 0.0
    if new > 0:
        own = _prefill_seconds(speed, new, cached, decodes, context, None, fig.step_read_bytes)
        added = own
        if decodes:
            added = own - math.ceil(new / fig.chunk) * fig.step_s
            if not added > 0.0:
                added = 0.0
        prefill_gpu_s = _prefill_gpu_seconds(speed, new, cached)
    # Memory: the blocks it needs beyond the cached prefix, against what the running batch and
    # the placements since the heartbeat hold.
    max_tokens = request.max_tokens
    prompt_blocks = -(-prompt // block)
    need = -(-(prompt + max_tokens) // block) - (
        matched_blocks if matched_blocks < prompt_blocks else prompt_blocks
    )
    held = fig.held
    total = worker.kv_blocks_total
    available = total - held - int(queue_tokens // block)
    evicted = 0
    memory_wait = 0.0
    if need > available:
        # It waits for running sequences to finish and free their blocks. With n running, each
        # holding held/n blocks and ending uniformly within twice a typical remaining time
        # (half an output like this request's), the k-th end comes at 2 x remaining x k/(n+1).
        deficit = need - max(0, available)
        n = max(1, decodes)
        remaining = 0.5 * max_tokens * fig.step_s
        ends = min(n, math.ceil(deficit * n / max(1, held)))
        memory_wait = 2.0 * remaining * ends / (n + 1)
    elif fig.free is not None:
        evicted = max(0, min(need, need - fig.free))
    # Loading what it lacks (`_cold_seconds`).
    cold = _cold_seconds(worker, request)
    backlog_s = queue_tokens / rate
    if total:
        kv_fraction = (held + need) / total
        if not kv_fraction < 1.0:
            kv_fraction = 1.0
    else:
        kv_fraction = 1.0
    busy = backlog_s / state.config.saturation_backlog_s
    if not busy < 1.0:
        busy = 1.0
    utilisation = busy if busy > kv_fraction else kv_fraction
    # The share of its compute prompts placed by this router take (`prefill_rate`).
    prefill_load = 0.0
    placed_rate = state._rates.get(worker.worker_id)
    if placed_rate is not None:
        value, at = placed_rate
        since = now - at
        prefill_load = (
            value * math.exp(-(since if since > 0.0 else 0.0) / state.config.rate_window_s)
        ) / fig.prefill_tokens_per_s
        if not prefill_load < 1.0:
            prefill_load = 1.0
    return _Side(
        worker,
        cached,
        cold + (memory_wait if memory_wait > wait else wait) + own,
        # A hand-off's KV is admitted without prefill compute: it waits only for room.
        cold + memory_wait,
        own,
        added,
        prefill_gpu_s,
        evicted,
        decodes + 1,
        context + prompt + max_tokens / 2.0,
        worker.queue_depth,
        queue_tokens,
        prefill_load,
        backlog_s,
        utilisation,
        need,
        kv_fraction,
        cold,
    )


_SQRT2 = math.sqrt(2.0)


@dataclass(slots=True)
class _Option:
    mode: Mode
    prefill: _Side
    decode: _Side
    ttft_s: float
    completion_s: float
    cost_usd: float
    probability: float
    score: float
    marginal_usd: float = 0.0  # what the fleet gives up for it (GPU time at its utilisation, KV)
    tpot_s: float = 0.0  # predicted time per output token

    def scored(self, sunk: float) -> ScoredOption:
        return ScoredOption(
            mode=self.mode,
            prefill_worker=self.prefill.worker.worker_id,
            decode_worker=self.decode.worker.worker_id,
            cached_tokens=self.prefill.cached_tokens,
            ttft_s=self.ttft_s,
            cost_usd=self.cost_usd,
            success_probability=self.probability,
            expected_cost_per_success_usd=(
                (sunk + self.cost_usd) / self.probability if self.probability > 0 else math.inf
            ),
            completion_s=self.completion_s,
            score=self.score,
        )


@dataclass(slots=True)
class _AsPrefill:
    """A side's figures as the prefill of a placement, the same in every option it is in."""

    price_per_s: float
    prefill_s: float  # GPU seconds: its own prefill, the cold load, the re-prefill of evictions
    # What a second of delay to the decodes running there is worth (for a disaggregated option).
    imposed_worth: float


@dataclass(slots=True)
class _AsDecode:
    """A side's figures as the decode of a placement, the same in every option it is in."""

    price_per_s: float
    stretched_step_s: float  # a decode step, stretched by the prompts that share its compute
    chunk_s: float  # a full chunk of prompt tokens' compute
    decode_gpu_s: float  # the request's share of its decode steps
    per_step_s: float  # what the request's KV read adds to each decode step there
    imposed_worth: float  # what a second of delay to the decodes running there is worth


def _imposed_worth(state: RouterState, side: _Side, now: float) -> float:
    """What a second of delay to the requests decoding on the side's worker while this one runs
    is worth: known for those this router placed, the standard class's worth for the others the
    worker reports. They are the running batch and the requests waiting there (queued ahead,
    they decode while this request is prefilled and decoded)."""
    tracked, tracked_worth = state.inflight(side.worker.worker_id, now)
    standard = state.config.latency_worth_usd_per_s.get("standard", 0.0)
    beside = min(side.worker.speed.max_running, side.decodes - 1 + side.waiting)
    return tracked_worth + max(0, beside - tracked) * standard


def _as_prefill(
    state: RouterState, request: RouteRequest, side: _Side, now: float, disaggregated: bool
) -> _AsPrefill:
    price_per_s = side.worker.price_per_hour / 3600.0
    # Evicting cached blocks that would have been reused: their re-prefill, at this worker's rate.
    evicted_s = (
        side.evicted_blocks
        * request.block_size
        * state.config.evicted_reuse_probability
        / side.worker.speed.prefill_tokens_per_s
    )
    return _AsPrefill(
        price_per_s=price_per_s,
        prefill_s=side.prefill_gpu_s + side.cold_s + evicted_s,
        imposed_worth=_imposed_worth(state, side, now) if disaggregated else 0.0,
    )


def _as_decode(state: RouterState, request: RouteRequest, side: _Side, now: float) -> _AsDecode:
    speed = side.worker.speed
    # Decode: one token per step of the decode worker's batch. Chunked prefill puts prompts into
    # the same steps (decodes first, prompts fill the token budget), so while prompts take a
    # share rho of the worker's compute, the decode steps stretch by 1 / (1 - rho); a backlog of
    # prompts queued when it starts adds its whole prefill time, up to a full chunk per step
    # (`_option`).
    batch, context = side.decodes, side.context
    if side.waiting:
        # The requests waiting there are prefilled before it, so it decodes in their batch too.
        batch = min(speed.max_running, batch + side.waiting)
        context += side.waiting_tokens
    step = speed.decode_step_seconds(batch, context)
    chunk = max(1, speed.max_batch_tokens - side.decodes)
    rho = min(MAX_PREFILL_LOAD, side.prefill_load)
    # The request's share of its decode steps, as the ledger charges it: the weights' read and
    # the step overhead split over the batch, its own KV read.
    own_context = request.prompt_tokens + request.max_tokens / 2.0
    per_token = (
        speed.step_overhead_s / side.decodes
        + speed.weight_read_bytes / speed.bytes_per_s / side.decodes
        + own_context * speed.kv_bytes_per_token / speed.bytes_per_s
    )
    # The latency this request imposes on the requests already running where it goes: its KV is
    # read in every decode step they share (which matters as much as the worker is busy: on a
    # lightly used worker the extra read is a hair on a step that is mostly the weights' read).
    return _AsDecode(
        price_per_s=side.worker.price_per_hour / 3600.0,
        stretched_step_s=step / (1.0 - rho),
        chunk_s=chunk * speed.flops_per_token / speed.flops_per_s,
        decode_gpu_s=per_token * max(0, request.max_tokens - 1),
        per_step_s=own_context * speed.kv_bytes_per_token / speed.bytes_per_s * side.utilisation,
        imposed_worth=_imposed_worth(state, side, now),
    )


def _option(
    state: RouterState,
    request: RouteRequest,
    prefill: _Side,
    decode: _Side,
    as_prefill: _AsPrefill,
    as_decode: _AsDecode,
    now: float,
) -> _Option:
    """One placement's predictions and score: the prefill on `prefill`'s worker, the decode on
    `decode`'s (the same side: aggregated). The figures of each side that do not depend on the
    other come in `as_prefill` and `as_decode`, computed once per side per decision."""
    config = state.config
    aggregated = prefill is decode
    ttft = prefill.ready_s
    outputs = max(0, request.max_tokens - 1)
    transfer_usd = 0.0
    if aggregated:
        decode_start = ttft
        backlog_s = 0.0  # what was queued ahead is prefilled before this request's first token
        decode_s = as_decode.decode_gpu_s + 0.0
    else:
        p_speed, d_speed = prefill.worker.speed, decode.worker.speed
        moved = max(0, request.prompt_tokens - decode.cached_tokens) * d_speed.kv_bytes_per_token
        transfer_s = moved / min(p_speed.kv_link_bytes_per_s, d_speed.kv_link_bytes_per_s)
        transfer_usd = moved / 1e9 * config.kv_transfer_usd_per_gb
        decode_start = max(ttft + transfer_s, decode.kv_ready_s)
        backlog_s = decode.backlog_s
        decode_s = as_decode.decode_gpu_s + decode.cold_s
    tpot = as_decode.stretched_step_s + min(as_decode.chunk_s, backlog_s / outputs if outputs else 0.0)
    completion = decode_start + outputs * tpot
    p_price = as_prefill.price_per_s
    d_price = as_decode.price_per_s
    prefill_s = as_prefill.prefill_s
    # What the ledger will charge (reported), and what the fleet gives up for it (scored): GPU
    # time priced at the worker's price times its utilisation, plus the KV transfer.
    charged = prefill_s * p_price + decode_s * d_price + transfer_usd
    # The KV blocks it holds (beyond the prefix the worker already caches) are memory other
    # requests cannot have meanwhile: a share of the worker's price for as long as they are held,
    # weighted by how full the worker's KV is.
    kv_usd = (
        d_price * completion * decode.kv_fraction * decode.new_blocks / max(1, decode.worker.kv_blocks_total)
    )
    if not aggregated:
        kv_usd += (
            p_price * ttft * prefill.kv_fraction * prefill.new_blocks / max(1, prefill.worker.kv_blocks_total)
        )
    marginal = (
        prefill_s * p_price * prefill.utilisation
        + decode_s * d_price * decode.utilisation
        + kv_usd
        + transfer_usd
    )
    probability = 1.0
    if request.deadline_at is not None:
        slack = request.deadline_at - now
        sigma = config.relative_error * completion + config.absolute_error_s
        probability = 0.5 * math.erfc(-((slack - completion) / sigma) / _SQRT2)  # the normal CDF
    # The latency this request imposes on the requests already running where it goes (what a
    # second of theirs is worth: `_imposed_worth`): its prefill steps hold up their decodes, and
    # its KV is read in every decode step they share.
    if aggregated:
        imposed_usd = (
            0.0 + (outputs * as_decode.per_step_s + prefill.added_prefill_s) * as_decode.imposed_worth
        )
    else:
        imposed_usd = 0.0 + outputs * as_decode.per_step_s * as_decode.imposed_worth
        imposed_usd += prefill.added_prefill_s * as_prefill.imposed_worth
    # The request's own latency, at its class's worth of a second: to its first token, or for a
    # workflow's step to its last, which the next step waits for (the first token alone made a
    # step on a batch decoding at 80 ms a token look as good as one on a batch at 20 ms).
    waited = completion if request.in_workflow else ttft
    worth = config.latency_worth_usd_per_s.get(request.priority, 0.0) * waited + imposed_usd
    sunk = request.workflow_spent_usd
    score = (marginal + worth + sunk) / probability if probability > 1e-12 else math.inf
    return _Option(
        "aggregated" if aggregated else "disaggregated",
        prefill,
        decode,
        ttft,
        completion,
        charged,
        probability,
        score,
        marginal,
        tpot,
    )


def _cold_seconds(worker: WorkerView, request: RouteRequest) -> float:
    """Loading what the worker lacks for the request: the model's weights, the adapter."""
    seconds = 0.0 if worker.warm else worker.cold_load_s
    if request.adapter is not None and request.adapter not in worker.adapters:
        seconds += worker.adapter_load_s
    return seconds


# ------------------------------------------------------------------ the decision


def _candidates(
    state: RouterState, request: RouteRequest, matched: Mapping[str, int], now: float
) -> dict[Role, list[WorkerView]]:
    """The workers worth scoring, per role: those caching the longest prefix of the request,
    and the least loaded of each GPU type."""
    config = state.config
    chosen: dict[Role, dict[str, WorkerView]] = {"decode": {}, "prefill": {}}
    wanted = config.cache_candidates
    if matched:
        workers = state.workers
        # Workers leave a shared prefix in groups: few distinct depths, longest first. The
        # workers at a depth are picked out in C (a decision can match a thousand workers).
        # Places left, over the roles the model's fleet has: in a fleet of one role, the other's
        # places would never fill, and the walk would read every matched worker.
        missing = wanted * max(1, len(state.roles(request.model)))
        for _, worker_ids in _deepest(matched):
            for worker_id in worker_ids:
                worker = workers.get(worker_id)
                if (
                    worker is None
                    or worker.model != request.model
                    or worker.draining
                    or now - worker.heartbeat_at > LIVENESS_S
                ):
                    continue
                group = chosen[worker.role]
                if len(group) < wanted:
                    group[worker_id] = worker
                    missing -= 1
                    if not missing:
                        break
            if not missing:
                break
    for role, group in chosen.items():
        for worker in state.least_loaded(request.model, role, config.load_candidates, now):
            group.setdefault(worker.worker_id, worker)
    return {role: list(group.values()) for role, group in chosen.items()}


def _deepest(matched: Mapping[str, int]) -> Iterable[tuple[int, Iterable[str]]]:
    """The matched workers by depth, longest first, each depth's in the mapping's order: from
    `deepest()` where the match has it (`kv_index.Matches`), else picked out in C per depth (a
    decision can match a thousand workers)."""
    deepest = getattr(matched, "deepest", None)
    if deepest is not None:
        groups: Iterable[tuple[int, Iterable[str]]] = deepest()
        return groups
    depths = matched.values()
    return (
        (depth, compress(matched, map(eq, repeat(depth), depths)))
        for depth in sorted(set(depths), reverse=True)
    )


def _matched(prefix: PrefixView, block_hashes: Sequence[int]) -> Mapping[str, int]:
    """The prefix view's `overlaps`, or its `matches` where it has one (`KvIndex`: the same
    mapping, resolved into worker ids only for the workers the decision reads)."""
    if not block_hashes:
        return {}
    matches = getattr(prefix, "matches", None)
    if matches is not None:
        found: Mapping[str, int] = matches(block_hashes)
        return found
    return prefix.overlaps(block_hashes)


def _options(
    state: RouterState, request: RouteRequest, prefix: PrefixView, now: float
) -> tuple[list[_Option], int] | NoPlacement:
    mismatch = _mismatch(state, request.model, request.block_size, now)
    if mismatch is not None:
        return mismatch
    matched = _matched(prefix, request.block_hashes)
    last = state._last_options
    if (
        last is not None
        # The view's own answer, kept alive here (not a new one at its address); two empty
        # answers are the same answer (a view without prefix sharing gives a new {} each time).
        and (last[0] is matched or not (last[0] or matched))
        and last[1] == now
        and last[2] == state._version
        and last[3] is state.config
        and last[5] is prefix
        and last[4] == request
    ):
        return last[6]  # type: ignore[return-value]
    scored = _score(state, request, matched, now)
    state._last_options = (matched, now, state._version, state.config, request, prefix, scored)
    return scored


def _score(
    state: RouterState, request: RouteRequest, matched: Mapping[str, int], now: float
) -> tuple[list[_Option], int] | NoPlacement:
    """The options `_options` returns, computed."""
    candidates = _candidates(state, request, matched, now)
    decoders = candidates["decode"]
    if not decoders:
        return no_workers(request.model)
    prefillers = candidates["prefill"]
    options: list[_Option] = []
    decode_sides = []
    as_decodes: dict[int, _AsDecode] = {}
    depth = matched.get
    for worker in decoders:
        side = _side(worker, state, request, depth(worker.worker_id, 0), now)
        as_decode = as_decodes[id(side)] = _as_decode(state, request, side, now)
        options.append(
            _option(state, request, side, side, _as_prefill(state, request, side, now, False), as_decode, now)
        )
        decode_sides.append(side)
    if prefillers:
        pairs = state.config.pair_candidates
        prefill_sides = sorted(
            (_side(w, state, request, depth(w.worker_id, 0), now) for w in prefillers),
            key=lambda s: (s.ready_s, s.prefill_gpu_s * s.worker.price_per_hour),
        )[:pairs]
        # Decode workers for a hand-off: the soonest to have room for the KV.
        handoff = sorted(decode_sides, key=lambda s: (s.kv_ready_s, s.worker.price_per_hour))[:pairs]
        for p in prefill_sides:
            as_prefill = _as_prefill(state, request, p, now, True)
            for d in handoff:
                options.append(_option(state, request, p, d, as_prefill, as_decodes[id(d)], now))
    return options, len(decoders) + len(prefillers)


def _best(options: list[_Option], request_id: str) -> _Option:
    low = min(o.score for o in options)
    if math.isinf(low):
        # Nothing has a chance on the score; the likeliest to succeed, then the fastest.
        best_p = max(o.probability for o in options)
        tied = [o for o in options if o.probability == best_p]
        low_c = min(o.completion_s for o in tied)
        tied = [o for o in tied if o.completion_s == low_c]
    else:
        tied = [o for o in options if o.score == low]
    if len(tied) == 1:
        return tied[0]
    return min(
        tied,
        key=lambda o: _tie_break(request_id, f"{o.prefill.worker.worker_id}>{o.decode.worker.worker_id}"),
    )


def _refuse(
    config: RouterConfig, request: RouteRequest, options: list[_Option], now: float
) -> NoPlacement | None:
    """Refuse a request whose task is not worth trying: placing it must be expected to cost less
    per success than what the fleet pays per success.

    The task succeeds only if this step and the steps still to come meet their deadlines; with
    nothing known of the later ones, each is as likely as this one is now: P = p^(1 + left).
    Placing spends, in expectation, what this step and each later step take from the fleet (the
    best option's marginal cost, GPU time at the workers' utilisation, once per step left);
    declining loses the task. The task's worth is what it costs in full (its spend so far plus
    each step left at its full price) over `worth_probability`, the chance a task whose
    steps are all paid in full must have to be worth trying: refuse when P x worth < marginal
    cost, i.e. P < worth_probability x marginal / full. On an idle fleet the marginal cost is
    near nothing (idle GPU time is paid for anyway) and only a hopeless deadline is refused; on a
    saturated one a new workflow needs the full chance, a late step of an expensive one far
    less. A task short of that chance is refused only while the fleet is pressed (`_pressure`);
    one short of `min_success_probability` always."""
    likeliest = max(options, key=lambda o: o.probability)
    left = 0
    if request.workflow_step is not None and request.workflow_steps is not None:
        left = max(0, request.workflow_steps - request.workflow_step)
    task_probability = likeliest.probability ** (1 + left)
    best = min(options, key=lambda o: o.score)
    steps = 1 + left
    full = request.workflow_spent_usd + steps * best.cost_usd
    # (The marginal cost can exceed the charged one, the KV held for a long completion
    # included: no task needs more than the full chance.)
    floor = config.worth_probability * (min(1.0, steps * best.marginal_usd / full) if full > 0 else 0.0)
    floor = max(config.min_success_probability, floor)
    if task_probability >= floor and not _overloaded(config, request, options):
        return None
    if task_probability >= floor:
        return NoPlacement(
            "saturated",
            f"the fleet's decode batches are past their knee: a new workflow would decode at "
            f"{min(o.tpot_s for o in options) * 1000:.0f} ms a token (the bound is "
            f"{(config.new_task_max_tpot_s or 0.0) * 1000:.0f} ms); its steps would only slow "
            "those in flight",
            _room_in(options),
        )
    hopeless = task_probability < config.min_success_probability
    pressure = None if hopeless else _pressure(config, request, best)
    if not hopeless and pressure is None:
        return None
    reason = (
        f"{'no placement meets the deadline' if hopeless else 'no placement is worth its cost'}: "
        f"the likeliest completes in {likeliest.completion_s:.2f} s (probability "
        f"{likeliest.probability:.3f}), "
        f"{request.deadline_at - now if request.deadline_at is not None else math.inf:.2f} s are left"
    )
    if left:
        reason += f"; with {left} later step(s) the task's chance is {task_probability:.3f}"
    if hopeless:
        return NoPlacement("infeasible", reason + f" (needs {floor:.3f})")
    return NoPlacement(
        "saturated", reason + f" (needs {floor:.3f}; the fleet is pressed: {pressure})", _room_in(options)
    )


def _pressure(config: RouterConfig, request: RouteRequest, option: _Option) -> str | None:
    """What presses the fleet, as the request sees it (None: it has room): arrivals outrun it
    (admission held the request back at least `saturation_backlog_s`), or the option's decode
    batch is at least `pressed_occupancy` of its limit once the request joins, or its prefill
    waits behind `saturation_backlog_s` of other prompts."""
    if request.admission_wait_s >= config.saturation_backlog_s:
        return f"admission held it {request.admission_wait_s:.1f} s"
    decode = option.decode
    if decode.batch_share >= config.pressed_occupancy:
        return f"its decode batch would be {decode.decodes}/{decode.worker.speed.max_running}"
    if option.prefill.backlog_s >= config.saturation_backlog_s:
        return f"{option.prefill.backlog_s:.1f} s of prompts queued ahead of its prefill"
    return None


def _room_in(options: list[_Option]) -> float:
    """When the fleet is predicted to have room for the request: the least, over its options,
    of the wait for the prompts queued ahead of its prefill and for KV room on its decode
    worker (its own prefill and load are not waiting), within `RETRY_AFTER_BOUNDS_S`."""
    low, high = RETRY_AFTER_BOUNDS_S
    wait = min(max(_queued_wait_s(o), o.decode.kv_ready_s) for o in options)
    return min(high, max(low, wait))


def _queued_wait_s(option: _Option) -> float:
    """The part of the option's TTFT spent waiting behind other work: all but its own prefill
    and the load of what its worker lacks."""
    return max(0.0, option.ttft_s - (option.prefill.prefill_gpu_s + option.prefill.cold_s))


def _overloaded(config: RouterConfig, request: RouteRequest, options: list[_Option]) -> bool:
    """A new workflow (its first step) would decode slower than `new_task_max_tpot_s` a token."""
    if config.new_task_max_tpot_s is None or (request.workflow_step or 1) > 1:
        return False
    if not request.in_workflow:
        return False
    return min(o.tpot_s for o in options) > config.new_task_max_tpot_s


def _dearest(
    state: RouterState, request: RouteRequest, options: list[_Option], refused: NoPlacement | None
) -> NoPlacement | None:
    """A new task's first step: `refused` (`_refuse`'s answer), or a refusal of a task dearer
    than the typical one against its chance, once the fleet is past keeping up. On an
    overloaded fleet, whose spend is fixed, cost per successful task falls when its GPU time
    goes to the tasks that take the least of it.

    A step takes from the fleet its best option's marginal cost (GPU time at the workers'
    utilisation, KV held), and at least its charged cost times how full the decode batch it
    joins is (a batch at its limit is saturated however much KV and prefill it has to spare:
    each new sequence takes a slot other work would take). A typical new task costs
    `_NewTasks.price_usd` (steps x the best option's charged cost, a decaying average). Refused
    when steps x taken > `dearest_task_factor` x its class's `dearest_priority_factor` x
    typical x the task's chance of success, while the fleet is past keeping up: more than
    `dearest_gate` of recent first steps refused for their cost (as not worth it, or by this
    rule), or the best option's decode batch full."""
    config = state.config
    if config.dearest_task_factor is None:
        return refused
    steps = max(1, request.workflow_steps or 1)
    best = min(options, key=lambda o: o.score)
    seen = state._new_tasks
    price = steps * best.cost_usd
    if seen.price_usd is None:
        seen.price_usd = price
    else:
        seen.price_usd += NEW_TASK_WEIGHT * (price - seen.price_usd)
    worthless = refused is not None and refused.reason == "saturated"
    seen.refused += NEW_TASK_WEIGHT * (worthless - seen.refused)
    decode = best.decode
    limit_running = decode.worker.speed.max_running
    full = decode.decodes > limit_running  # the batch once it joins: over the limit, it waits
    if refused is not None or (seen.refused <= config.dearest_gate and not full):
        return refused
    occupancy = min(1.0, decode.batch_share)
    taken = steps * max(best.marginal_usd, occupancy * best.cost_usd)
    chance = max(o.probability for o in options) ** steps
    factor = config.dearest_task_factor
    if not config.admission_controls_load and config.dearest_task_factor_alone is not None:
        factor = config.dearest_task_factor_alone
    bar = factor * config.dearest_priority_factor.get(request.priority, 1.0)
    limit = bar * seen.price_usd * chance
    if taken <= limit:
        return None
    # Refused for its cost: it counts toward the share that keeps the rule armed, as a refusal
    # as not worth its cost does. Else the rule's own refusals, by easing the load, stop those
    # refusals and disarm it while the overload lasts.
    seen.refused += NEW_TASK_WEIGHT
    return NoPlacement(
        "saturated",
        f"the fleet is past keeping up ({seen.refused:.1%} of recent new tasks refused for "
        f"their cost; decode batch {decode.decodes - 1}/{limit_running}) and this task is among "
        f"the dearest: its {steps} step(s) would take ${taken:.6f} of the fleet's time, against "
        f"${limit:.6f} for a typical task at its chance ({chance:.3f}), x {bar:g} for its class",
        _room_in(options),
    )


def place(
    state: RouterState, request: RouteRequest, prefix: PrefixView, now: float
) -> Placement | NoPlacement:
    """Choose where the request's prefill and decode run, and count the placement in `state`."""
    scored = _options(state, request, prefix, now)
    if isinstance(scored, NoPlacement):
        return scored
    options, considered = scored
    if request.deadline_at is not None:
        refused = _refuse(state.config, request, options, now)
        if (request.workflow_step or 1) == 1:
            refused = _dearest(state, request, options, refused)
        if refused is not None:
            return refused
    best = _best(options, request.request_id)
    prefill, decode = best.prefill, best.decode
    block = request.block_size
    blocks = -(-(request.prompt_tokens + request.max_tokens) // block)
    state.count(prefill.worker.worker_id, request.prompt_tokens - prefill.cached_tokens, blocks, now)
    worth = state.config.latency_worth_usd_per_s.get(request.priority, 0.0)
    if decode.worker is not prefill.worker:
        state.count(decode.worker.worker_id, 0, blocks, now)
        state.add_inflight(prefill.worker.worker_id, now + best.ttft_s, worth)
    state.add_inflight(decode.worker.worker_id, now + best.completion_s, worth)
    sunk = request.workflow_spent_usd
    others = sorted((o for o in options if o is not best), key=lambda o: o.score)[:3]
    return Placement(
        mode=best.mode,
        prefill_worker=prefill.worker.worker_id,
        decode_worker=decode.worker.worker_id,
        candidates=considered,
        decode_load=load(decode.worker, state),
        predicted_cached_tokens=prefill.cached_tokens,
        predicted_ttft_s=best.ttft_s,
        predicted_cost_usd=best.cost_usd,
        success_probability=best.probability,
        expected_cost_per_success_usd=best.scored(sunk).expected_cost_per_success_usd,
        runners_up=tuple(o.scored(sunk) for o in others),
        policy="ripplemesh",
        predicted_completion_s=best.completion_s,
        score=best.score,
    )


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The earliest first token over the live placements: when (`ttft_s`), and how much of that
    is waiting behind other work (`wait_s`) rather than the request's own prefill and load."""

    ttft_s: float
    wait_s: float


def earliest_first_token(
    state: RouterState, request: RouteRequest, prefix: PrefixView, now: float
) -> FirstToken | None:
    """The lowest predicted time to first token over the live placements, and its wait (None: no
    live decode worker for the model, or a block-size mismatch). Changes nothing in `state`;
    admission uses it to tell a deadline no placement can meet, and the wait for how loaded the
    fleet is (a long prompt's own prefill on an idle worker is not load)."""
    scored = _options(state, request, prefix, now)
    if isinstance(scored, NoPlacement):
        return None
    best = min(scored[0], key=lambda o: o.ttft_s)
    return FirstToken(best.ttft_s, _queued_wait_s(best))


def earliest_ttft(state: RouterState, request: RouteRequest, prefix: PrefixView, now: float) -> float | None:
    """`earliest_first_token`'s time to first token."""
    first = earliest_first_token(state, request, prefix, now)
    return first.ttft_s if first is not None else None
