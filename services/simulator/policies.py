"""The routing policies the simulator can run, by name, and the prefix view they read.

Every name resolves to a function of services/router: "ripplemesh" is `policy.place` (the
router service's own decision), the others services/router/baselines.py. Functions are looked up
on their module at each decision, never copied here, so the simulator always drives the code the
services import (tests/test_simulator.py patches a policy module and watches decisions change).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.engines.sim.blocks import EPOCH
from services.router import baselines
from services.router import policy as router_policy
from services.router.policy import (
    NoPlacement,
    Placement,
    PrefixView,
    RouterConfig,
    RouteRequest,
    RouterState,
)
from services.simulator.options import convert, key_values
from services.simulator.worker import SimWorker

# (router state, the request as the router sees it, now) -> the decision.
Router = Callable[[RouterState, RouteRequest, float], Placement | NoPlacement]


class FleetPrefixView:
    """`policy.PrefixView` over the simulated workers' block managers.

    `overlap` is a binary search for the first leading block missing from the worker's cache. It
    relies on the cache being prefix-closed per chain (a block is cached only if the blocks before
    it are), which BlockManager keeps: a sequence pins and computes its blocks in order and
    releases them deepest first, so a block never outlives its parent in the LRU. The membership
    test reads the manager's hash table directly (`cached_prefix_blocks` walks the blocks one by
    one); tests/test_simulator.py holds the two equal on simulated caches.

    `overlaps` (the whole fleet's matches, once or more per routing decision) visits only the
    workers that may cache the prompt's first block, not the fleet: each worker reports the first
    blocks its cache stores (`stored_first_block`, from `SimWorker`), which makes an index of
    first block -> workers, a superset of those caching it now (an entry goes when it is found
    evicted, or in a sweep once the entries have doubled). With chained hashes a first block is
    never another position's block, so a worker caching any prefix of the prompt is in the index
    (tested against visiting every worker). A workload without prefix sharing
    (`shared_prefixes=False`: no two requests share a block) has nothing to find, and no index.

    A request's matches are asked twice at one instant (admission's prediction, then the
    placement): the last result is reused while the instant, the prompt, the fleet (`changed`)
    and every cache (`blocks.EPOCH`) are the same.
    """

    SWEEP_SLACK = 1024

    def __init__(self, workers: Mapping[str, SimWorker], *, shared_prefixes: bool = True):
        self.workers = workers
        self.now = 0.0  # the simulator sets it before each decision
        self.shared_prefixes = shared_prefixes
        self._holders: dict[int, list[str]] = {}  # first block hash -> workers that stored it
        self._entries = 0
        self._sweep_at = self.SWEEP_SLACK
        self._rank: dict[str, int] = {}  # worker -> its place in `workers` (the fleet's order)
        # The last `overlaps`: (its prompt, now, the cache epoch, the fleet's version) -> result.
        self._last: tuple[Sequence[int], float, int, int, dict[str, int]] | None = None
        self._fleet_version = 0

    def changed(self) -> None:
        """A worker joined or left `workers`."""
        self._fleet_version += 1

    def overlap(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        worker = self.workers.get(worker_id)
        n = len(block_hashes)
        if worker is None or n == 0:
            return 0
        return self._matched(worker, block_hashes, 0)

    def _matched(self, worker: SimWorker, block_hashes: Sequence[int], guess: int) -> int:
        cached = worker.blocks._refs
        matched = _cached_prefix(cached, block_hashes, guess)
        # The worker's steps timed ahead (`advance`) may evict cached blocks, but only
        # unreferenced ones: when the deepest matched block is held by a sequence, so are the
        # blocks before it (a sequence holds a prefix of its chain), and the match stands.
        if matched == 0 or cached[block_hashes[matched - 1]] > 0 or not worker.advance(self.now):
            return matched
        return _cached_prefix(cached, block_hashes, guess)

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Every serving worker's matched leading blocks (those matching none left out), in the
        fleet's order."""
        if not block_hashes or not self.shared_prefixes:
            return {}
        last = self._last
        if (
            last is not None
            and last[0] is block_hashes
            and last[1] == self.now
            and last[2] == EPOCH.value
            and last[3] == self._fleet_version
        ):
            return last[4]
        found = self._overlaps(block_hashes)
        self._last = (block_hashes, self.now, EPOCH.value, self._fleet_version, found)
        return found

    def _overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        first = block_hashes[0]
        holders = self._holders.get(first)
        if not holders:
            return {}
        workers = self.workers
        now = self.now
        found: dict[str, int] = {}
        caching: list[str] = []
        n = len(block_hashes)
        deepest = block_hashes[n - 1]
        guess = 0  # workers sharing a prefix mostly share its depth: each tries the last one first
        for worker_id in holders:
            worker = workers.get(worker_id)
            if worker is None:
                continue
            cached = worker.blocks._refs
            # `_matched`, inlined (this loop visits every worker caching a shared first block),
            # the last depth tried first: most workers here share the system prompt's depth, two
            # lookups (the cache is prefix-closed: its block guess - 1 cached, so is the first).
            if 0 < guess < n and block_hashes[guess - 1] in cached:
                caching.append(worker_id)
                if block_hashes[guess] not in cached:
                    matched = guess
                elif deepest in cached:
                    matched = n
                else:
                    matched = _cached_prefix(cached, block_hashes)
            elif first not in cached:
                continue
            else:
                caching.append(worker_id)
                matched = n if deepest in cached else _cached_prefix(cached, block_hashes)
            if not cached[block_hashes[matched - 1]] and worker.may_evict(now) and worker.advance(now):
                matched = _cached_prefix(cached, block_hashes, guess)
            if matched:
                found[worker_id] = guess = matched
        if len(caching) < len(holders):  # evicted (or the worker gone): it re-enters when stored again
            self._entries -= len(holders) - len(caching)
            if caching:
                self._holders[first] = caching
            else:
                del self._holders[first]
        return found

    def stored_first_block(self, worker: SimWorker, block_hash: int) -> None:
        """`worker`'s cache stored `block_hash` as the first block of a prompt."""
        if not self.shared_prefixes:
            return
        worker_id = worker.worker_id
        holders = self._holders.get(block_hash)
        if holders is None:
            self._holders[block_hash] = [worker_id]
        elif worker_id not in holders:
            # Kept in the fleet's order (a worker joins it last; the order of the others stays).
            rank = self._rank
            if worker_id not in rank:
                rank = self._rank = {w: i for i, w in enumerate(self.workers)}
            if any(w not in rank for w in holders):  # workers gone since
                holders[:] = [w for w in holders if w in rank]
            bisect.insort(holders, worker_id, key=rank.__getitem__)
        else:
            return
        self._entries += 1
        if self._entries > self._sweep_at:
            self._sweep()

    def _sweep(self) -> None:
        """Drop the entries of first blocks no longer cached (their workers evicted them)."""
        workers = self.workers
        kept: dict[int, list[str]] = {}
        entries = 0
        for block_hash, holders in self._holders.items():
            caching = [
                w
                for w in holders
                if (worker := workers.get(w)) is not None and block_hash in worker.blocks._refs
            ]
            if caching:
                kept[block_hash] = caching
                entries += len(caching)
        self._holders = kept
        self._entries = entries
        self._sweep_at = 2 * entries + self.SWEEP_SLACK


def _cached_prefix(cached: Mapping[int, int], block_hashes: Sequence[int], guess: int = 0) -> int:
    """How many leading blocks of the chain are in the cache (binary search: it is prefix-closed),
    `guess` tried first."""
    n = len(block_hashes)
    if n == 0 or block_hashes[0] not in cached:
        return 0
    if block_hashes[n - 1] in cached:
        return n
    if 0 < guess < n and block_hashes[guess - 1] in cached and block_hashes[guess] not in cached:
        return guess
    low, high = 1, n - 1  # block_hashes[low - 1] is cached, block_hashes[high] is not
    while low < high:
        middle = (low + high) // 2
        if block_hashes[middle] in cached:
            low = middle + 1
        else:
            high = middle
    return low


def make_router(name: str, prefix: PrefixView) -> Router:
    """A fresh router for one run (its own round-robin cursor). A baseline's placements are
    entered in the router state as ripplemesh's policy enters its own (the prompt tokens each
    leaves to prefill, the KV blocks it will hold), so that what reads the state (admission's
    predictions) is as well informed whichever policy routes."""
    decide = _router(name, prefix)
    if name == "ripplemesh":
        return decide

    def bookkept(state: RouterState, q: RouteRequest, now: float) -> Placement | NoPlacement:
        placement = decide(state, q, now)
        if isinstance(placement, Placement):
            cached = router_policy.cached_tokens(
                prefix.overlap(placement.prefill_worker, q.block_hashes), q.prompt_tokens, q.block_size
            )
            blocks = -(-(q.prompt_tokens + q.max_tokens) // q.block_size)
            state.add_work(placement.prefill_worker, q.prompt_tokens - cached, blocks, now)
            if placement.decode_worker != placement.prefill_worker:
                state.add_work(placement.decode_worker, 0, blocks, now)
        return placement

    return bookkept


# What each baseline reads of the RouteRequest beyond request_id, model and block_size.
_REQUEST_FIELDS: dict[str, tuple[str, ...]] = {
    "round_robin": (),
    "least_loaded": (),
    "dynamo_kv": ("block_hashes", "prompt_tokens"),
    "llmd_weighted": ("block_hashes",),
    "sglang_cache_aware": ("block_hashes",),
}


def _router(name: str, prefix: PrefixView) -> Router:
    if name == "ripplemesh":

        def ripplemesh(state: RouterState, q: RouteRequest, now: float) -> Placement | NoPlacement:
            return router_policy.place(state, q, prefix, now)

        return ripplemesh
    if name not in _REQUEST_FIELDS:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    return _baseline(name, prefix)


def _baseline(name: str, prefix: PrefixView) -> Router:
    """The one adapter from the simulator's Router shape to every baseline of
    services/router/baselines.py: the RouteRequest unpacked into the baseline's keywords, plus
    what one run keeps (a round-robin cursor of its own; the prefix view for the cache-aware
    rules). The function is looked up on its module at each decision."""
    fields = _REQUEST_FIELDS[name]
    kept: dict[str, object]
    if name == "round_robin":
        kept = {"cursor": baselines.RoundRobinState()}
    elif fields:
        kept = {"prefix": prefix}
    else:
        kept = {}

    def baseline(state: RouterState, q: RouteRequest, now: float) -> Placement | NoPlacement:
        rule: Callable[..., Placement | NoPlacement] = getattr(baselines, name)
        request = {field: getattr(q, field) for field in fields}
        return rule(
            state, request_id=q.request_id, model=q.model, block_size=q.block_size, now=now, **request, **kept
        )

    baseline.__name__ = name
    return baseline


POLICY_NAMES: tuple[str, ...] = ("ripplemesh", *baselines.BASELINES)


# RouterConfig's fields a run may set (`parse_router_config`): its numbers; the per-class
# mappings stay as they are, and whether admission controls the load follows the run's admission.
_CONFIG_FIELDS = {
    f.name: f.type
    for f in dataclasses.fields(RouterConfig)
    if "Mapping" not in str(f.type) and f.name != "admission_controls_load"
}


def parse_router_config(spec: str | None) -> RouterConfig:
    """A variant of ripplemesh's policy: `key=value,...` over RouterConfig's number fields
    (`none` turns off one that can be off), e.g. `dearest_task_factor=0.6,dearest_gate=-1`."""
    changes: dict[str, Any] = {}
    for key, value in key_values(spec or "", "router config").items():
        if key not in _CONFIG_FIELDS:
            raise ValueError(f"unknown router config {key!r}; known: {', '.join(_CONFIG_FIELDS)}")
        changes[key] = convert(key, value, _CONFIG_FIELDS[key], "router config")
    return dataclasses.replace(RouterConfig(), **changes)


def router_config_changes(config: RouterConfig) -> dict[str, Any]:
    """The fields `config` sets otherwise than the default: what a run's result records."""
    default = RouterConfig()
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(RouterConfig)
        if getattr(config, f.name) != getattr(default, f.name)
    }
