"""Which option wins: the candidates worth scoring (the workers caching the longest prefix of
the request, and the least loaded of each role and GPU type: `candidate_workers`), their options
predicted (`score_options`: each decode worker alone, and the best prefill workers handing off to
the decode workers soonest to have room), and the lowest score among them (`best_option`).

Candidates are pruned so that a decision costs O(k log n), not O(n). Exact ties break on a hash
of (request, worker) computed only for the tied (`tie_break`). The least-loaded rule (`load`,
`least_loaded_worker`) is also the baselines'."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping

from services.router.policy.predict import (
    AsDecode,
    Option,
    decode_figures,
    predict_option,
    predict_side,
    prefill_figures,
)
from services.router.policy.prefix import matched_by_depth
from services.router.policy.state import RouterState
from services.router.policy.types import LIVENESS_S, NoPlacement, Role, RouteRequest, WorkerView, no_workers


def load(worker: WorkerView, state: RouterState) -> float:
    """The least-loaded rule's key (also the baselines'): queued and running requests, those
    placed since the heartbeat, and the share of its KV in use."""
    kv = worker.kv_blocks_used / worker.kv_blocks_total if worker.kv_blocks_total else 1.0
    return worker.queue_depth + worker.running + state.placed_since_heartbeat.get(worker.worker_id, 0) + kv


def tie_break(request_id: str, worker_id: str) -> int:
    """An order among equals that depends on the request, not on the order workers were heard."""
    return int.from_bytes(hashlib.blake2b(f"{request_id}/{worker_id}".encode(), digest_size=4).digest())


def least_loaded_worker(
    workers: Iterable[WorkerView], state: RouterState, request_id: str
) -> WorkerView | None:
    """The least-loaded worker by `load`; ties broken by `tie_break`, hashed for the tied only."""
    keyed = [(load(w, state), w) for w in workers]
    if not keyed:
        return None
    low = min(k for k, _ in keyed)
    tied = [w for k, w in keyed if k == low]
    if len(tied) == 1:
        return tied[0]
    return min(tied, key=lambda w: tie_break(request_id, w.worker_id))


def candidate_workers(
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
        for _, worker_ids in matched_by_depth(matched):
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


def score_options(
    state: RouterState, request: RouteRequest, matched: Mapping[str, int], now: float
) -> tuple[list[Option], int] | NoPlacement:
    """Every option worth weighing for the request, predicted (`decide.options_for` keeps the
    last), and how many workers were considered; `NoPlacement` where no decode worker is live."""
    candidates = candidate_workers(state, request, matched, now)
    decoders = candidates["decode"]
    if not decoders:
        return no_workers(request.model)
    prefillers = candidates["prefill"]
    options: list[Option] = []
    decode_sides = []
    as_decodes: dict[int, AsDecode] = {}
    depth = matched.get
    for worker in decoders:
        side = predict_side(worker, state, request, depth(worker.worker_id, 0), now)
        decode_as = as_decodes[id(side)] = decode_figures(state, request, side, now)
        options.append(
            predict_option(
                state, request, side, side, prefill_figures(state, request, side, now, False), decode_as, now
            )
        )
        decode_sides.append(side)
    if prefillers:
        pairs = state.config.pair_candidates
        prefill_sides = sorted(
            (predict_side(w, state, request, depth(w.worker_id, 0), now) for w in prefillers),
            key=lambda s: (s.ready_s, s.prefill_gpu_s * s.worker.price_per_hour),
        )[:pairs]
        # Decode workers for a hand-off: the soonest to have room for the KV.
        handoff = sorted(decode_sides, key=lambda s: (s.kv_ready_s, s.worker.price_per_hour))[:pairs]
        for p in prefill_sides:
            prefill_as = prefill_figures(state, request, p, now, True)
            for d in handoff:
                options.append(predict_option(state, request, p, d, prefill_as, as_decodes[id(d)], now))
    return options, len(decoders) + len(prefillers)


def best_option(options: list[Option], request_id: str) -> Option:
    """The option with the lowest score; exact ties broken by `tie_break` over the pair."""
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
        key=lambda o: tie_break(request_id, f"{o.prefill.worker.worker_id}>{o.decode.worker.worker_id}"),
    )
