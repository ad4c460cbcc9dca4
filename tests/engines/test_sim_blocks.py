"""The sim engine's BlockManager against a block-by-block model of its rules.

BlockManager does its per-block work in bulk (C-level dict and list operations) and keeps its LRU
order as a list with stale entries; the model below does every block one at a time with an
ordered dict. Random sequences of allocations, computed tokens, growth and releases, over shared
prefixes and over hash lists with repeats, must leave both in the same state with the same
events, whatever the manager's sweep slack.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import pytest

from services.engines.base import KvBlockEvent
from services.engines.sim.blocks import BlockManager


class BlockByBlock:
    """The rules, one block at a time: refcounted cached blocks, an LRU of unreferenced ones."""

    def __init__(self, total: int, size: int):
        self.total, self.size, self.free = total, size, total
        self.refs: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.holdings: dict[
            str, tuple[list[int], list[int], dict[int, int]]
        ] = {}  # shared, [private], pending
        self.events: list[KvBlockEvent] = []

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.size)

    def cached_prefix(self, hashes: list[int]) -> int:
        matched = 0
        while matched < len(hashes) and hashes[matched] in self.refs:
            matched += 1
        return matched

    def pin(self, h: int) -> None:
        if self.refs[h] == 0:
            del self.lru[h]
        self.refs[h] += 1

    def take(self, blocks: int) -> None:
        evicted = []
        while self.free < blocks:
            h, _ = self.lru.popitem(last=False)
            del self.refs[h]
            evicted.append(h)
            self.free += 1
        self.free -= blocks
        if evicted:
            self.events.append(KvBlockEvent("removed", tuple(evicted)))

    def allocate(self, sid: str, hashes: list[int], tokens: int) -> int | None:
        matched = self.cached_prefix(hashes)
        needed = max(self.blocks_for(tokens), matched)
        reused = sum(1 for h in hashes[:matched] if self.refs[h] == 0)
        if needed - matched > self.free + len(self.lru) - reused:
            return None
        for h in hashes[:matched]:
            self.pin(h)
        self.take(needed - matched)
        pending = {i: hashes[i] for i in range(matched, min(len(hashes), needed))}
        self.holdings[sid] = (list(hashes[:matched]), [needed - matched], pending)
        return matched

    def grow(self, sid: str, tokens: int) -> bool:
        shared, private, _ = self.holdings[sid]
        more = self.blocks_for(tokens) - len(shared) - private[0]
        if more <= 0:
            return True
        if more > self.free + len(self.lru):
            return False
        self.take(more)
        private[0] += more
        return True

    def mark_computed(self, sid: str, tokens: int) -> None:
        if sid not in self.holdings:
            return
        shared, private, pending = self.holdings[sid]
        stored = []
        for i in sorted(i for i in pending if i < tokens // self.size):
            h = pending.pop(i)
            private[0] -= 1
            shared.append(h)
            if h in self.refs:
                self.pin(h)
                self.free += 1
            else:
                self.refs[h] = 1
                stored.append(h)
        if stored:
            self.events.append(KvBlockEvent("stored", tuple(stored)))

    def release(self, sid: str) -> None:
        shared, private, _ = self.holdings.pop(sid)
        for h in reversed(shared):
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.lru[h] = None
        self.free += private[0]

    def state(self) -> dict[str, Any]:
        held = {sid: len(shared) + private[0] for sid, (shared, private, _) in self.holdings.items()}
        return {"free": self.free, "refs": self.refs, "lru": list(self.lru), "held": held}


def manager_state(m: BlockManager, sids: list[str]) -> dict[str, Any]:
    return {
        "free": m.free_blocks,
        "refs": dict(m._refs),
        "lru": m.evictable_hashes(),
        "held": {sid: m.held_by(sid) for sid in sids if m.holds(sid)},
    }


def _random_operations(rng: random.Random, count: int) -> list[tuple[str, int, int, bool, list[int], int]]:
    return [
        (
            rng.choice(["allocate", "allocate", "compute", "grow", "free"]),
            rng.randrange(8),  # which sequence
            rng.randint(0, 12),  # blocks of prompt
            rng.random() < 0.5,  # a shared prefix (else hashes drawn with repeats)
            [rng.randrange(26) for _ in range(12)],
            rng.randrange(40),  # tokens, relative
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize("batch", range(4))
def test_bulk_block_manager_equals_the_block_by_block_rules(batch: int) -> None:
    for trial in range(100):
        rng = random.Random(batch * 1000 + trial)
        long_run = trial % 10 == 0  # a big cache and many operations: stale entries pile up
        _replay(
            total=rng.randint(1, 600 if long_run else 48),
            size=rng.choice([1, 2, 4, 16]),
            slack=rng.choice([0, 1, 3, 1024]),
            operations=_random_operations(rng, 600 if long_run else 60),
        )


def _replay(
    *, total: int, size: int, slack: int, operations: list[tuple[str, int, int, bool, list[int], int]]
) -> None:
    manager = BlockManager(total, size)
    manager.LRU_SLACK = slack  # sweep and compact the LRU list early and often
    model = BlockByBlock(total, size)
    shared_chain = list(range(100, 112))
    lengths: dict[str, int] = {}
    for kind, which, blocks, shared, drawn, extra in operations:
        sid = f"s{which}"
        if kind == "allocate":
            if sid in lengths:
                continue
            hashes = shared_chain[:blocks] if shared else drawn[:blocks]
            tokens = max(1, blocks * size - size + 1 + extra % (2 * size))
            result = manager.allocate(sid, hashes, tokens)
            assert result == model.allocate(sid, hashes, tokens)
            if result is not None:
                lengths[sid] = tokens
        elif sid not in lengths:
            continue
        elif kind == "compute":
            computed = lengths[sid] if extra % 3 else extra % (lengths[sid] + 1)  # all, or part
            manager.mark_computed(sid, computed)
            model.mark_computed(sid, computed)
        elif kind == "grow":
            tokens = lengths[sid] + extra % (3 * size)
            grown = manager.grow(sid, tokens)
            assert grown == model.grow(sid, tokens)
            if grown:
                lengths[sid] = tokens
        else:
            manager.free(sid)
            model.release(sid)
            del lengths[sid]
        assert manager_state(manager, list(lengths)) == model.state()
        assert manager.drain_events() == model.events
        model.events = []
        assert manager.used_blocks == total - model.free - len(model.lru)
        assert manager.available_blocks == model.free + len(model.lru)
        assert manager.cached_prefix_blocks(shared_chain) == model.cached_prefix(shared_chain)


def test_growing_several_sequences_at_once_is_growing_each() -> None:
    """grow_each_by_one (the simulator's steady decodes crossing into new blocks) equals one
    grow per sequence, evictions included."""
    one, batched = BlockManager(7, 4), BlockManager(7, 4)
    for m in (one, batched):
        for i in range(3):
            m.allocate(f"old{i}", [10 * i + 1, 10 * i + 2], 8)
            m.mark_computed(f"old{i}", 8)
            m.free(f"old{i}")  # 6 cached, evictable; 1 free
        m.allocate("a", [1], 4)
        m.allocate("b", [21], 4)
        m.drain_events()
    one.grow("a", 5)
    one.grow("b", 5)
    batched.grow_each_by_one(["a", "b"])
    assert batched.held_by("a") == one.held_by("a") == 2
    assert batched.evictable_hashes() == one.evictable_hashes()
    assert batched.free_blocks == one.free_blocks
    removed = [h for e in one.drain_events() for h in e.block_hashes]
    assert removed == [2]  # the least recently released block went
    assert [h for e in batched.drain_events() for h in e.block_hashes] == removed
