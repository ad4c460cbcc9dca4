"""A paged KV block manager with prefix caching.

A sequence holds blocks: shared ones, identified by their chained hash (services/mesh/block_hash.py)
and reference counted in the prefix cache, and private ones (a prompt's partial last block,
generated tokens, and full prompt blocks whose tokens are not computed yet). A full prompt block
joins the cache when its tokens are computed (`mark_computed`), which is when the "stored" event
goes out; a block computed while an equal one is already cached is dropped for the cached one.
When a sequence ends its cached blocks stay, unreferenced, in LRU order, and are evicted ("removed")
only when an allocation needs the space. Sequences grow block by block (`grow`); when the cache is
full the engine preempts one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from services.engines.base import KvBlockEvent


@dataclass(slots=True)
class _Holding:
    shared: list[int] = field(default_factory=list)  # hashes pinned in the cache, in block order
    private: int = 0  # blocks this sequence alone holds
    pending: dict[int, int] = field(default_factory=dict)  # block index -> hash, once computed

    @property
    def blocks(self) -> int:
        return len(self.shared) + self.private


class BlockManager:
    def __init__(self, total_blocks: int, block_size: int):
        if total_blocks < 1:
            raise ValueError("a KV cache needs at least one block")
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.total_blocks = total_blocks
        self.block_size = block_size
        self._free = total_blocks
        self._refs: dict[int, int] = {}
        self._unreferenced: OrderedDict[int, None] = OrderedDict()
        self._holdings: dict[str, _Holding] = {}
        self._events: list[KvBlockEvent] = []

    # ------------------------------------------------------------ queries

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in self._refs:
                break
            matched += 1
        return matched

    def cached_hashes(self) -> list[int]:
        return list(self._refs)

    def drain_events(self) -> list[KvBlockEvent]:
        events, self._events = self._events, []
        return events

    def held_by(self, seq_id: str) -> int:
        holding = self._holdings.get(seq_id)
        return 0 if holding is None else holding.blocks

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._holdings

    @property
    def used_blocks(self) -> int:
        """Blocks some sequence holds (cached ones included)."""
        return self.total_blocks - self._free - len(self._unreferenced)

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix cache, held or not."""
        return len(self._refs)

    @property
    def available_blocks(self) -> int:
        """Free blocks plus evictable (cached, unreferenced) ones."""
        return self._free + len(self._unreferenced)

    # ------------------------------------------------------------ changes

    def allocate(self, seq_id: str, block_hashes: list[int], tokens: int) -> int | None:
        """Blocks for a sequence's first `tokens` tokens, reusing the cached prefix of `block_hashes`.

        Returns how many leading blocks were found cached (their tokens need no computing), or
        None, changing nothing, when the space is not there.
        """
        if seq_id in self._holdings:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        matched = self.cached_prefix_blocks(block_hashes)
        needed = max(self.blocks_for(tokens), matched)
        new_blocks = needed - matched
        # Reusing a cached-but-unreferenced block takes it off the evictable list.
        reused_unreferenced = sum(1 for h in block_hashes[:matched] if self._refs[h] == 0)
        if new_blocks > self.available_blocks - reused_unreferenced:
            return None
        holding = _Holding()
        for block_hash in block_hashes[:matched]:
            self._pin(block_hash)
            holding.shared.append(block_hash)
        self._take(new_blocks)
        holding.private = new_blocks
        holding.pending = {i: block_hashes[i] for i in range(matched, min(len(block_hashes), needed))}
        self._holdings[seq_id] = holding
        return matched

    def grow(self, seq_id: str, tokens: int) -> bool:
        """Make the sequence's blocks hold `tokens` tokens; False, changing nothing, when full."""
        holding = self._holdings[seq_id]
        more = self.blocks_for(tokens) - holding.blocks
        if more <= 0:
            return True
        if more > self.available_blocks:
            return False
        self._take(more)
        holding.private += more
        return True

    def mark_computed(self, seq_id: str, tokens: int) -> None:
        """The sequence's first `tokens` tokens have their KV: full hashed blocks join the cache."""
        holding = self._holdings.get(seq_id)
        if holding is None or not holding.pending:
            return
        full = tokens // self.block_size
        stored: list[int] = []
        for index in sorted(i for i in holding.pending if i < full):
            block_hash = holding.pending.pop(index)
            holding.private -= 1
            holding.shared.append(block_hash)
            if block_hash in self._refs:
                # Computed while an equal block was cached: share that one, free ours.
                self._pin(block_hash)
                self._free += 1
            else:
                self._refs[block_hash] = 1
                stored.append(block_hash)
        if stored:
            self._events.append(KvBlockEvent("stored", tuple(stored)))

    def free(self, seq_id: str) -> None:
        holding = self._holdings.pop(seq_id, None)
        if holding is None:
            return
        # Deepest blocks first, so eviction takes a chain's tail before its shared head.
        for block_hash in reversed(holding.shared):
            self._refs[block_hash] -= 1
            if self._refs[block_hash] == 0:
                self._unreferenced[block_hash] = None
        self._free += holding.private

    def _pin(self, block_hash: int) -> None:
        if self._refs[block_hash] == 0:
            del self._unreferenced[block_hash]
        self._refs[block_hash] += 1

    def _take(self, blocks: int) -> None:
        evicted: list[int] = []
        while self._free < blocks:
            block_hash, _ = self._unreferenced.popitem(last=False)
            del self._refs[block_hash]
            evicted.append(block_hash)
            self._free += 1
        self._free -= blocks
        if evicted:
            self._events.append(KvBlockEvent("removed", tuple(evicted)))
