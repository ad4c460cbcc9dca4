"""The routing policies the simulator can run, by name, and the prefix view they read.

Every name resolves to a function of services/router: "ripplemesh" is `policy.place` (the
router service's own decision), the others services/router/baselines.py. Functions are looked up
on their module at each decision, never copied here, so the simulator always drives the code the
services import (tests/test_simulator.py patches a policy module and watches decisions change).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from services.router import baselines
from services.router import policy as router_policy
from services.router.policy import NoPlacement, Placement, RouterState
from services.simulator.worker import SimWorker


@dataclass(frozen=True, slots=True)
class RouteQuery:
    request_id: str
    model: str
    block_size: int
    block_hashes: list[int]
    prompt_tokens: int
    now: float


Router = Callable[[RouterState, RouteQuery], Placement | NoPlacement]


class FleetPrefixView:
    """`baselines.PrefixView` over the simulated workers' block managers.

    `overlap` is a binary search for the first leading block missing from the worker's cache. It
    relies on the cache being prefix-closed per chain (a block is cached only if the blocks before
    it are), which BlockManager keeps: a sequence pins and computes its blocks in order and
    releases them deepest first, so a block never outlives its parent in the LRU. The membership
    test reads the manager's hash table directly (`cached_prefix_blocks` walks the blocks one by
    one); tests/test_simulator.py holds the two equal on simulated caches.
    """

    def __init__(self, workers: Mapping[str, SimWorker]):
        self.workers = workers
        self.now = 0.0  # the simulator sets it before each decision

    def overlap(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        worker = self.workers.get(worker_id)
        n = len(block_hashes)
        if worker is None or n == 0:
            return 0
        worker.advance(self.now)  # apply its timed-ahead steps (their blocks may evict cached ones)
        cached = worker.blocks._refs
        if block_hashes[0] not in cached:
            return 0
        if block_hashes[n - 1] in cached:
            return n
        low, high = 1, n - 1  # block_hashes[low - 1] is cached, block_hashes[high] is not
        while low < high:
            middle = (low + high) // 2
            if block_hashes[middle] in cached:
                low = middle + 1
            else:
                high = middle
        return low


def _ripplemesh(state: RouterState, query: RouteQuery) -> Placement | NoPlacement:
    return router_policy.place(
        state, request_id=query.request_id, model=query.model, block_size=query.block_size, now=query.now
    )


def _least_loaded(state: RouterState, query: RouteQuery) -> Placement | NoPlacement:
    return baselines.least_loaded(
        state, request_id=query.request_id, model=query.model, block_size=query.block_size, now=query.now
    )


def make_router(name: str, prefix: baselines.PrefixView) -> Router:
    """A fresh router for one run (its own round-robin cursor)."""
    if name == "ripplemesh":
        return _ripplemesh
    if name == "least_loaded":
        return _least_loaded
    if name == "round_robin":
        cursor = baselines.RoundRobinState()

        def round_robin(state: RouterState, q: RouteQuery) -> Placement | NoPlacement:
            return baselines.round_robin(
                state,
                request_id=q.request_id,
                model=q.model,
                block_size=q.block_size,
                now=q.now,
                cursor=cursor,
            )

        return round_robin
    if name == "dynamo_kv":

        def dynamo_kv(state: RouterState, q: RouteQuery) -> Placement | NoPlacement:
            return baselines.dynamo_kv(
                state,
                request_id=q.request_id,
                model=q.model,
                block_size=q.block_size,
                now=q.now,
                block_hashes=q.block_hashes,
                prompt_tokens=q.prompt_tokens,
                prefix=prefix,
            )

        return dynamo_kv
    if name == "llmd_weighted":

        def llmd_weighted(state: RouterState, q: RouteQuery) -> Placement | NoPlacement:
            return baselines.llmd_weighted(
                state,
                request_id=q.request_id,
                model=q.model,
                block_size=q.block_size,
                now=q.now,
                block_hashes=q.block_hashes,
                prefix=prefix,
            )

        return llmd_weighted
    if name == "sglang_cache_aware":

        def sglang_cache_aware(state: RouterState, q: RouteQuery) -> Placement | NoPlacement:
            return baselines.sglang_cache_aware(
                state,
                request_id=q.request_id,
                model=q.model,
                block_size=q.block_size,
                now=q.now,
                block_hashes=q.block_hashes,
                prefix=prefix,
            )

        return sglang_cache_aware
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")


POLICY_NAMES: tuple[str, ...] = ("ripplemesh", *baselines.BASELINES)
