"""Baseline routing rules, for honest comparison with ripplemesh's own router. Pure functions.

Each has the shape of services/router/policy.place: router state in, a Placement (or a
NoPlacement) out, the clock passed in, no I/O; each counts its placement in the state as place()
does, so that a burst between two heartbeats does not herd. What a rule needs beyond place()'s
arguments comes as keywords: the request's chained block hashes and prompt length, and a
`PrefixView` (which leading blocks each worker's cache holds). The simulator implements
PrefixView from its sim engines' block managers; the router's KV index (kv_index.py), built from
the workers' KvEvents, implements the same protocol.

Where a rule reads load, it reads the router's WorkerView (queue, running batch, KV blocks, as of
the worker's last heartbeat) plus the requests this router placed there since that heartbeat,
which stands in for the fresher, router-local accounting the original systems keep.

With prefill workers live, each rule picks a prefill worker and a decode worker from their own
roles (disaggregated, as place() does); otherwise one worker serves both (aggregated).

- round_robin: the next live worker in turn (Dynamo's and SGLang's `round_robin` router modes).
- least_loaded: the router's own least-loaded rule (services/router/policy/choose.py: `load` and its
  tie-break), reused, not copied.
- dynamo_kv: NVIDIA Dynamo's KV router.
- llmd_weighted: llm-d's default scheduling profile (the Gateway API Inference Extension's scorers).
- sglang_cache_aware: SGLang router's cache-aware policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.router import policy
from services.router.policy import NoPlacement, Placement, PrefixView, RouterState, WorkerView, no_workers

__all__ = [
    "BASELINES",
    "PrefixView",
    "RoundRobinState",
    "dynamo_kv",
    "least_loaded",
    "llmd_weighted",
    "round_robin",
    "sglang_cache_aware",
]


@dataclass(slots=True)
class RoundRobinState:
    """The round-robin cursors (state a round-robin router keeps between decisions)."""

    next_decode: int = 0
    next_prefill: int = 0


Decision = Placement | NoPlacement
# (candidates of one role) -> the chosen worker and the load to report for it.
Picker = Callable[[list[WorkerView]], tuple[WorkerView, float]]


def _count(state: RouterState, worker_id: str) -> None:
    state.count(worker_id, 0, 0)


def _placed(state: RouterState, worker: WorkerView) -> int:
    return state.placed_since_heartbeat.get(worker.worker_id, 0)


def _place(
    state: RouterState,
    *,
    model: str,
    block_size: int,
    now: float,
    pick_decode: Picker,
    pick_prefill: Picker,
) -> Decision:
    """Candidates, the block-size check and the placement's bookkeeping, as policy.place does.
    The live workers by role come from the state's index (`RouterState.live`: no scan of the
    fleet per request); the pickers read those lists, they do not change them."""
    live, decoders, prefillers = state.live(model, now)
    counts = state._size_counts.get(model)
    if not counts or len(counts) > 1 or block_size not in counts:  # a worker of another size exists
        mismatched = sorted(w.worker_id for w in live if w.block_size != block_size)
        if mismatched:
            return NoPlacement(
                "invalid",
                f"block size mismatch: the request was hashed with {block_size}-token blocks but "
                f"worker(s) {', '.join(mismatched)} use another size; refusing to route",
            )
    if not decoders:
        return no_workers(model)
    decode, decode_load = pick_decode(decoders)
    _count(state, decode.worker_id)
    if not prefillers:
        return Placement("aggregated", decode.worker_id, decode.worker_id, len(live), max(0.0, decode_load))
    prefill, _ = pick_prefill(prefillers)
    _count(state, prefill.worker_id)
    return Placement("disaggregated", prefill.worker_id, decode.worker_id, len(live), max(0.0, decode_load))


def _best(
    workers: list[WorkerView], request_id: str, key: Callable[[WorkerView], float], *, highest: bool = False
) -> WorkerView:
    """The worker with the lowest (or highest) key; ties broken as policy.place breaks them (the
    tie-break hash is computed only for the tied workers: the same choice, fewer hashes)."""
    keyed = [(key(w), w) for w in workers]
    target = max(k for k, _ in keyed) if highest else min(k for k, _ in keyed)
    tied = [w for k, w in keyed if k == target]
    if len(tied) == 1:
        return tied[0]
    return min(tied, key=lambda w: policy._tie_break(request_id, w.worker_id))


# ------------------------------------------------------------------ round robin


def round_robin(
    state: RouterState, *, request_id: str, model: str, block_size: int, now: float, cursor: RoundRobinState
) -> Decision:
    """Each role's live workers in turn (in the order the router came to know them).

    Source: Dynamo's `--router-mode round-robin` ("cycles through available workers",
    docs/architecture/kv_cache_routing.md, "Basic Routing") and SGLang router's `round_robin`
    policy (sgl-router/src/policies/round_robin.rs)."""

    def pick(role: str) -> Picker:
        def choose(workers: list[WorkerView]) -> tuple[WorkerView, float]:
            if role == "decode":
                index, cursor.next_decode = cursor.next_decode, cursor.next_decode + 1
            else:
                index, cursor.next_prefill = cursor.next_prefill, cursor.next_prefill + 1
            chosen = workers[index % len(workers)]
            return chosen, policy.load(chosen, state)

        return choose

    return _place(
        state,
        model=model,
        block_size=block_size,
        now=now,
        pick_decode=pick("decode"),
        pick_prefill=pick("prefill"),
    )


# ------------------------------------------------------------------ least loaded


def least_loaded(state: RouterState, *, request_id: str, model: str, block_size: int, now: float) -> Decision:
    """The least-loaded live worker of each role: services/router/policy/choose.py's rule (its `load`:
    queue + running + placed since the heartbeat + KV fraction, and its tie-break), which is
    what policy.place decides today. Kept here under its own name so that the baseline stays
    least-loaded when place() grows into ripplemesh's full router."""

    def pick(workers: list[WorkerView]) -> tuple[WorkerView, float]:
        chosen = policy._least_loaded(workers, state, request_id)
        assert chosen is not None  # callers pass a non-empty list
        return chosen, policy.load(chosen, state)

    return _place(state, model=model, block_size=block_size, now=now, pick_decode=pick, pick_prefill=pick)


# ------------------------------------------------------------------ NVIDIA Dynamo


def dynamo_kv(
    state: RouterState,
    *,
    request_id: str,
    model: str,
    block_size: int,
    now: float,
    block_hashes: Sequence[int],
    prompt_tokens: int,
    prefix: PrefixView,
    overlap_score_weight: float = 1.0,
) -> Decision:
    """Dynamo's KV router: the lowest `overlap_score_weight * prefill_blocks + decode_blocks`.

    Source: NVIDIA Dynamo, docs/architecture/kv_cache_routing.md ("Cost Calculation": "cost =
    overlap_score_weight * prefill_blocks + decode_blocks", lower is better, default weight 1.0,
    router temperature 0: the lowest cost wins) and docs/components/router/README.md ("Potential
    prefill blocks = (input tokens - overlap blocks x block size) / block size"; decode blocks:
    the worker's active blocks plus the new request's). Active blocks here: the worker's KV
    blocks in use at its last heartbeat plus, for each request placed since, this request's
    size (Dynamo's router predicts them locally the same way)."""
    request_blocks = -(-prompt_tokens // block_size)

    def pick(workers: list[WorkerView]) -> tuple[WorkerView, float]:
        def cost(w: WorkerView) -> float:
            overlap = prefix.overlap(w.worker_id, block_hashes)
            prefill_blocks = max(0.0, (prompt_tokens - overlap * block_size) / block_size)
            decode_blocks = w.kv_blocks_used + (_placed(state, w) + 1) * request_blocks
            return overlap_score_weight * prefill_blocks + decode_blocks

        chosen = _best(workers, request_id, cost)
        return chosen, policy.load(chosen, state)

    return _place(state, model=model, block_size=block_size, now=now, pick_decode=pick, pick_prefill=pick)


# ------------------------------------------------------------------ llm-d


LLMD_QUEUE_WEIGHT = 2.0
LLMD_KV_UTILISATION_WEIGHT = 2.0
LLMD_PREFIX_WEIGHT = 3.0


def llmd_weighted(
    state: RouterState,
    *,
    request_id: str,
    model: str,
    block_size: int,
    now: float,
    block_hashes: Sequence[int],
    prefix: PrefixView,
) -> Decision:
    """llm-d's default scheduling profile: the highest 2 x queue + 2 x KV-utilisation + 3 x prefix.

    Source: the Gateway API Inference Extension's InferencePool chart, `default-plugins.yaml`
    (config/charts/inferencepool/templates/epp-config.yaml; llm-d's inference-scheduling guide
    deploys it: queue-scorer weight 2, kv-cache-utilization-scorer weight 2, prefix-cache-scorer
    weight 3, max-score picker). The scorers, in gateway-api-inference-extension
    pkg/epp/scheduling/framework/plugins: queue-scorer (max - queue) / (max - min) over the
    candidates, 1 when all are equal (queue.go); kv-cache-utilization-scorer 1 - KV usage
    (kvcache_utilization.go); prefix-cache-scorer matched blocks / the request's blocks
    (multi/prefix/plugin.go). Queue here: waiting requests plus those placed since the heartbeat."""
    total = len(block_hashes)

    def pick(workers: list[WorkerView]) -> tuple[WorkerView, float]:
        queues = {w.worker_id: w.queue_depth + _placed(state, w) for w in workers}
        low, high = min(queues.values()), max(queues.values())

        def score(w: WorkerView) -> float:
            queue = 1.0 if high == low else (high - queues[w.worker_id]) / (high - low)
            kv = 1.0 - (w.kv_blocks_used / w.kv_blocks_total if w.kv_blocks_total else 1.0)
            cached = prefix.overlap(w.worker_id, block_hashes) / total if total else 0.0
            return LLMD_QUEUE_WEIGHT * queue + LLMD_KV_UTILISATION_WEIGHT * kv + LLMD_PREFIX_WEIGHT * cached

        chosen = _best(workers, request_id, score, highest=True)
        return chosen, policy.load(chosen, state)

    return _place(state, model=model, block_size=block_size, now=now, pick_decode=pick, pick_prefill=pick)


# ------------------------------------------------------------------ SGLang


SGLANG_CACHE_THRESHOLD = 0.5
SGLANG_BALANCE_ABS_THRESHOLD = 32
SGLANG_BALANCE_REL_THRESHOLD = 1.1


def sglang_cache_aware(
    state: RouterState,
    *,
    request_id: str,
    model: str,
    block_size: int,
    now: float,
    block_hashes: Sequence[int],
    prefix: PrefixView,
    cache_threshold: float = SGLANG_CACHE_THRESHOLD,
    balance_abs_threshold: float = SGLANG_BALANCE_ABS_THRESHOLD,
    balance_rel_threshold: float = SGLANG_BALANCE_REL_THRESHOLD,
) -> Decision:
    """SGLang router's cache-aware policy.

    Source: sgl-project/sglang, sgl-router/src/policies/cache_aware.rs: the load is imbalanced
    when max - min > balance_abs_threshold AND max > min x balance_rel_threshold; then the
    shortest queue (least load) wins. Otherwise the worker with the longest prefix match wins if
    its match rate (matched / request) exceeds cache_threshold, else the worker with the
    smallest tree (the most free cache). Defaults: CacheAwareConfig::default() in
    sgl-router/src/policies/mod.rs (0.5, 32, 1.1). Load here: queue + running + placed since the
    heartbeat (SGLang counts its in-flight requests per worker); match: the worker's real cache
    (PrefixView), where SGLang keeps an approximate tree of the text it routed; tree size: the
    worker's KV blocks in use."""
    total = len(block_hashes)

    def pick(workers: list[WorkerView]) -> tuple[WorkerView, float]:
        loads = {w.worker_id: float(w.queue_depth + w.running + _placed(state, w)) for w in workers}
        low, high = min(loads.values()), max(loads.values())
        if high - low > balance_abs_threshold and high > low * balance_rel_threshold:
            chosen = _best(workers, request_id, lambda w: loads[w.worker_id])
            return chosen, loads[chosen.worker_id]
        overlaps = {w.worker_id: prefix.overlap(w.worker_id, block_hashes) for w in workers}
        best = _best(
            workers, request_id, lambda w: overlaps[w.worker_id] - loads[w.worker_id] * 1e-9, highest=True
        )
        if total and overlaps[best.worker_id] / total > cache_threshold:
            return best, loads[best.worker_id]
        chosen = _best(workers, request_id, lambda w: float(w.kv_blocks_used))
        return chosen, loads[chosen.worker_id]

    return _place(state, model=model, block_size=block_size, now=now, pick_decode=pick, pick_prefill=pick)


BASELINES: tuple[str, ...] = (
    "round_robin",
    "least_loaded",
    "dynamo_kv",
    "llmd_weighted",
    "sglang_cache_aware",
)
