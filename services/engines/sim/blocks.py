"""A paged KV block manager with prefix caching.

Full prompt blocks are identified by their chained hash and shared between sequences (reference
counted). When a sequence ends, its hashed blocks stay cached, unreferenced, in LRU order, and are
evicted only when a new allocation needs the space.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from services.engines.base import KvBlockEvent


@dataclass
class _Holding:
    hashed: list[int] = field(default_factory=list)
    anonymous: int = 0


class BlockManager:
    def __init__(self, total_blocks: int, block_size: int):
        if total_blocks < 1:
            raise ValueError("a KV cache needs at least one block")
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

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self._free - len(self._unreferenced)

    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    @property
    def available_blocks(self) -> int:
        return self._free + len(self._unreferenced)

    # ------------------------------------------------------------ changes

    def allocate(self, seq_id: str, block_hashes: list[int], total_tokens: int) -> int | None:
        """Reserve blocks for `total_tokens`, reusing the cached prefix of `block_hashes`.

        Returns the number of prefix blocks found cached, or None when the space is not there.
        """
        if seq_id in self._holdings:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        matched = self.cached_prefix_blocks(block_hashes)
        needed = max(self.blocks_for(total_tokens), len(block_hashes))
        # Reusing a cached-but-unreferenced block takes it off the evictable list.
        reused_unreferenced = sum(1 for h in block_hashes[:matched] if self._refs[h] == 0)
        new_blocks = needed - matched
        if new_blocks > self._free + len(self._unreferenced) - reused_unreferenced:
            return None
        holding = _Holding()
        stored: list[int] = []
        for block_hash in block_hashes[:matched]:
            self._pin(block_hash)
            holding.hashed.append(block_hash)
        self._take(new_blocks)
        for block_hash in block_hashes[matched:]:
            if block_hash in self._refs:
                # Cached beyond a gap in the chain (its parent was evicted): share it.
                self._pin(block_hash)
                self._free += 1
            else:
                # A fresh block's hash is known now; it is shareable once its tokens are computed.
                self._refs[block_hash] = 1
                stored.append(block_hash)
            holding.hashed.append(block_hash)
        if stored:
            self._events.append(KvBlockEvent("stored", tuple(stored)))
        holding.anonymous = needed - len(holding.hashed)
        self._holdings[seq_id] = holding
        return matched

    def free(self, seq_id: str) -> None:
        holding = self._holdings.pop(seq_id, None)
        if holding is None:
            return
        # Deepest blocks first, so eviction takes a chain's tail before its shared head.
        for block_hash in reversed(holding.hashed):
            self._refs[block_hash] -= 1
            if self._refs[block_hash] == 0:
                self._unreferenced[block_hash] = None
        self._free += holding.anonymous

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
