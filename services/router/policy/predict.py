"""One option's predictions: for a placement of a request (its prefill on one worker, its
decode on the same one or another), its time to first token and to completion, what the ledger
will charge for it and what it takes from the fleet, its chance of meeting the deadline, and
its score, the objective the options are ranked by:

    (marginal cost + latency worth + sunk cost at risk) / P(success)

Each worker's part comes first (`predict_side`: its queue, its prefill, the memory it needs, the
load of what it lacks), then its figures as the prefill or the decode side of an option
(`prefill_figures`, `decode_figures`), computed once per side per decision, then each option
(`predict_option`). Reads the router state; changes nothing in it but its caches (the
per-worker figures, the in-flight requests predicted done). The clock is passed in."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.router.policy.speed import prefill_gpu_seconds, prefill_seconds
from services.router.policy.state import RouterState, backlog_tokens, worker_figures
from services.router.policy.types import Mode, RouteRequest, ScoredOption, WorkerView

# The most of a worker's compute prompts are assumed to take from its decodes (at 1 the queue
# grows without bound; the prediction then says "very slow", not "never").
MAX_PREFILL_LOAD = 0.9


@dataclass(slots=True)  # not frozen: built a dozen times per decision, and frozen init is slower
class Side:
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
    indexed_tokens: int = 0  # the prefix the index says it caches (before `found_share`)

    @property
    def batch_share(self) -> float:
        """Its decode batch once the request joins, as a share of the most it runs at once (over
        1: the request waits for a slot; a worker that reports no limit counts as full)."""
        limit = self.worker.speed.max_running
        return self.decodes / limit if limit > 0 else 1.0


def predict_side(
    worker: WorkerView,
    state: RouterState,
    request: RouteRequest,
    matched_blocks: int,
    now: float,
) -> Side:
    """The worker's part if the request's prefill runs there (`ready_s`), or if its KV is handed
    to it after a prefill elsewhere (`kv_ready_s`).

    The hot path of a decision (a dozen calls each): what depends only on the worker's state
    comes from its `worker_figures`, computed once per heartbeat or placement."""
    speed = worker.speed
    fig = worker_figures(state, worker)
    block = request.block_size
    prompt = request.prompt_tokens
    # The share of an indexed prefix prefills there have lately found (evicted meanwhile, or
    # the index behind): what the prediction counts on.
    indexed = matched_blocks * block
    if indexed > prompt - 1:
        indexed = prompt - 1 if prompt > 0 else 0
    found = state.calibration.found_share(worker.gpu_type) if matched_blocks else 1.0
    if found < 1.0:
        matched_blocks = round(matched_blocks * found)
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
    wait = prefill_seconds(speed, queue_tokens, 0.0, decodes, context, prompt, fig.step_read_bytes)
    # Its own prefill after the cached prefix (`prefill_seconds`), what its prefill adds to the
    # steps of the decodes running beside it (a short prompt rides along in a memory-bound
    # decode step almost for free), and its own GPU time (the
    # steps' compute and overhead, what the ledger charges it).
    own = 0.0
    added = 0.0
    prefill_gpu_s = 0.0
    if new > 0:
        own = prefill_seconds(speed, new, cached, decodes, context, None, fig.step_read_bytes)
        added = own
        if decodes:
            added = own - math.ceil(new / fig.chunk) * fig.step_s
            if not added > 0.0:
                added = 0.0
        prefill_gpu_s = prefill_gpu_seconds(speed, new, cached)
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
    # Loading what it lacks (`cold_seconds`).
    cold = cold_seconds(worker, request)
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
    return Side(
        worker=worker,
        cached_tokens=cached,
        ready_s=cold + (memory_wait if memory_wait > wait else wait) + own,
        # A hand-off's KV is admitted without prefill compute: it waits only for room.
        kv_ready_s=cold + memory_wait,
        own_prefill_s=own,
        added_prefill_s=added,
        prefill_gpu_s=prefill_gpu_s,
        evicted_blocks=evicted,
        decodes=decodes + 1,
        context=context + prompt + max_tokens / 2.0,
        waiting=worker.queue_depth,
        waiting_tokens=queue_tokens,
        prefill_load=prefill_load,
        backlog_s=backlog_s,
        utilisation=utilisation,
        new_blocks=need,
        kv_fraction=kv_fraction,
        cold_s=cold,
        indexed_tokens=indexed,
    )


@dataclass(slots=True)
class Option:
    """One placement's predictions: its sides, when its first and last tokens come, what the
    ledger will charge for it, its chance of meeting the deadline, and its score (the
    objective, lower is better: `predict_option`)."""

    mode: Mode
    prefill: Side
    decode: Side
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
class AsPrefill:
    """A side's figures as the prefill of a placement, the same in every option it is in."""

    price_per_s: float
    prefill_s: float  # GPU seconds: its own prefill, the cold load, the re-prefill of evictions
    # What a second of delay to the decodes running there is worth (for a disaggregated option).
    imposed_worth: float


@dataclass(slots=True)
class AsDecode:
    """A side's figures as the decode of a placement, the same in every option it is in."""

    price_per_s: float
    stretched_step_s: float  # a decode step, stretched by the prompts that share its compute
    chunk_s: float  # a full chunk of prompt tokens' compute
    decode_gpu_s: float  # the request's share of its decode steps
    per_step_s: float  # what the request's KV read adds to each decode step there
    imposed_worth: float  # what a second of delay to the decodes running there is worth


def imposed_worth(state: RouterState, side: Side, now: float) -> float:
    """What a second of delay to the requests decoding on the side's worker while this one runs
    is worth: known for those this router placed, the standard class's worth for the others the
    worker reports. They are the running batch and the requests waiting there (queued ahead,
    they decode while this request is prefilled and decoded)."""
    tracked, tracked_worth = state.inflight(side.worker.worker_id, now)
    standard = state.config.latency_worth_usd_per_s.get("standard", 0.0)
    beside = min(side.worker.speed.max_running, side.decodes - 1 + side.waiting)
    return tracked_worth + max(0, beside - tracked) * standard


def prefill_figures(
    state: RouterState, request: RouteRequest, side: Side, now: float, disaggregated: bool
) -> AsPrefill:
    price_per_s = side.worker.price_per_hour / 3600.0
    # Evicting cached blocks that would have been reused: their re-prefill, at this worker's rate.
    evicted_s = (
        side.evicted_blocks
        * request.block_size
        * state.config.evicted_reuse_probability
        / side.worker.speed.prefill_tokens_per_s
    )
    return AsPrefill(
        price_per_s=price_per_s,
        prefill_s=side.prefill_gpu_s + side.cold_s + evicted_s,
        imposed_worth=imposed_worth(state, side, now) if disaggregated else 0.0,
    )


def decode_figures(state: RouterState, request: RouteRequest, side: Side, now: float) -> AsDecode:
    speed = side.worker.speed
    # Decode: one token per step of the decode worker's batch. Chunked prefill puts prompts into
    # the same steps (decodes first, prompts fill the token budget), so while prompts take a
    # share rho of the worker's compute, the decode steps stretch by 1 / (1 - rho); a backlog of
    # prompts queued when it starts adds its whole prefill time, up to a full chunk per step
    # (`predict_option`).
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
    return AsDecode(
        price_per_s=side.worker.price_per_hour / 3600.0,
        stretched_step_s=step / (1.0 - rho),
        chunk_s=chunk * speed.flops_per_token / speed.flops_per_s,
        decode_gpu_s=per_token * max(0, request.max_tokens - 1),
        per_step_s=own_context * speed.kv_bytes_per_token / speed.bytes_per_s * side.utilisation,
        imposed_worth=imposed_worth(state, side, now),
    )


def predict_option(
    state: RouterState,
    request: RouteRequest,
    prefill: Side,
    decode: Side,
    as_prefill: AsPrefill,
    as_decode: AsDecode,
    now: float,
) -> Option:
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
        # As this GPU type's predictions have turned out lately (calibration.py).
        probability = state.calibration.success_probability(decode.worker.gpu_type, completion, slack)
    # The latency this request imposes on the requests already running where it goes (what a
    # second of theirs is worth: `imposed_worth`): its prefill steps hold up their decodes, and
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
    return Option(
        mode="aggregated" if aggregated else "disaggregated",
        prefill=prefill,
        decode=decode,
        ttft_s=ttft,
        completion_s=completion,
        cost_usd=charged,
        probability=probability,
        score=score,
        marginal_usd=marginal,
        tpot_s=tpot,
    )


def cold_seconds(worker: WorkerView, request: RouteRequest) -> float:
    """Loading what the worker lacks for the request: the model's weights, the adapter."""
    seconds = 0.0 if worker.warm else worker.cold_load_s
    if request.adapter is not None and request.adapter not in worker.adapters:
        seconds += worker.adapter_load_s
    return seconds
