"""What the router knows of its workers and has placed on them since their last heartbeats
(`RouterState`), and what follows from that for one worker now: which workers are live
(`live_workers`), the prompt tokens waiting there (`backlog_tokens`), the key of the
least-loaded heaps (`backlog_seconds`) and the figures of its running batch (`worker_figures`).
The bookkeeping the decisions read; it decides nothing. The clock is passed in."""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from services.router.policy.calibration import Calibration
from services.router.policy.speed import prefill_seconds
from services.router.policy.types import LIVENESS_S, Role, RouterConfig, WorkerView


@dataclass(slots=True)
class Placed:
    """What this router placed on a worker since its last heartbeat."""

    requests: int = 0
    tokens: int = 0  # uncached prompt tokens to prefill
    blocks: int = 0  # KV blocks the requests will hold


# The weight of one first step in the decaying averages of `NewTasks` (about the last 50).
NEW_TASK_WEIGHT = 0.02


@dataclass(slots=True)
class NewTasks:
    """Decaying averages over the first steps of tasks the router decided (`refuse.dearest`)."""

    price_usd: float | None = None  # a new task's full price: steps x its best option's cost
    refused: float = 0.0  # the share refused for their cost (as not worth it, or the dearest)


@dataclass(slots=True)
class RouterState:
    workers: dict[str, WorkerView] = field(default_factory=dict)
    # Requests this router placed on a worker since that worker's last heartbeat.
    placed_since_heartbeat: dict[str, int] = field(default_factory=dict)
    config: RouterConfig = field(default_factory=RouterConfig)
    placed: dict[str, Placed] = field(default_factory=dict)
    # Per (model, role, gpu type): a heap of (load key, stamp, worker id); an entry is current
    # while its stamp is the worker's in `_stamps` (stale ones are skipped and dropped lazily).
    _heaps: dict[tuple[str, str, str], list[tuple[float, int, str]]] = field(default_factory=dict)
    _stamps: dict[str, int] = field(default_factory=dict)
    _counter: itertools.count[int] = field(default_factory=itertools.count)
    # Per model: worker id -> block size (a mismatch is looked for only when two sizes exist).
    _block_sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    _size_counts: dict[str, dict[int, int]] = field(default_factory=dict)  # model -> size -> workers
    # Per worker: its figures as of its current stamp (`worker_figures`).
    _figures: dict[str, WorkerFigures] = field(default_factory=dict)
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
    # The last `decide.options_for`: what they were computed from (the match, the instant,
    # config, the request, the prefix view) and the result. Admission asks for a request's
    # earliest first token and the router then places it at the same instant (the simulator
    # does both in one process): the second call reuses the first's options.
    _last_options: tuple[object, ...] | None = None
    # New tasks' first steps as placed lately (`refuse.dearest`).
    _new_tasks: NewTasks = field(default_factory=lambda: NewTasks())
    # How the predictions turned out, per GPU type (calibration.py); its prior from `config`.
    calibration: Calibration = field(default_factory=Calibration)

    def __post_init__(self) -> None:
        if not self.calibration.completion and not self.calibration.cached_share:
            self.calibration.prior_spread = self.config.relative_error

    def observe_completion(self, gpu_type: str, predicted_s: float, actual_s: float) -> None:
        """A placement's completion time as it turned out (`Calibration.observe_completion`)."""
        self._version += 1
        self.calibration.observe_completion(gpu_type, predicted_s, actual_s)

    def observe_cached(self, gpu_type: str, predicted_tokens: int, actual_tokens: int) -> None:
        """A prefill's cached prefix as it turned out (`Calibration.observe_cached`)."""
        self._version += 1
        self.calibration.observe_cached(gpu_type, predicted_tokens, actual_tokens)

    def observe(self, worker: WorkerView) -> None:
        previous = self.workers.get(worker.worker_id)
        if previous is None or worker.heartbeat_at >= previous.heartbeat_at:
            self._version += 1
            if previous is not None and previous.model != worker.model:
                self._drop_size(previous)
            self.workers[worker.worker_id] = worker
            self._index(worker, previous)
            self.placed_since_heartbeat[worker.worker_id] = 0
            self.placed[worker.worker_id] = Placed()
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
        self.placed.setdefault(worker_id, Placed()).requests += 1
        self.add_work(worker_id, tokens, blocks, now)

    def add_work(self, worker_id: str, tokens: int, blocks: int, now: float | None = None) -> None:
        """Work a placement on the worker brings: `tokens` to prefill there, `blocks` of KV."""
        self._version += 1
        placed = self.placed.setdefault(worker_id, Placed())
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


def live_workers(state: RouterState, model: str, now: float) -> list[WorkerView]:
    """The model's live, non-draining workers, in the order the router came to know them (kept
    per model by `RouterState`, refiltered only when a worker changes or falls silent)."""
    return list(state.live(model, now)[0])


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


@dataclass(slots=True)
class WorkerFigures:
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


def worker_figures(state: RouterState, worker: WorkerView) -> WorkerFigures:
    """The worker's `WorkerFigures`, recomputed only when its stamp changed."""
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
    figures = WorkerFigures(
        stamp=stamp,
        decodes=decodes,
        context=context,
        rate=chunk / prefill_seconds(speed, chunk, 0.0, decodes, context),
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
