"""A block-level prefix cache of real KV, keyed by the request's chained block hashes.

The same semantics as the sim engine's `BlockManager` (services/engines/sim/blocks.py): a fixed
number of KV blocks; a sequence reserves blocks for its prompt and output, sharing the full prompt
blocks another sequence already holds (reference counted); when a sequence ends its hashed blocks
stay cached, unreferenced, in LRU order, and are evicted only when an allocation needs the space.

The difference: each hashed block carries a payload, the block's KV tensor, set only once it has
been computed (`store`). A block is reusable, and announced as "stored", from then on; a block
reserved by a sequence whose prefill has not finished yet is shared for accounting but not
matched for reuse. The hashes come from the request (services/mesh/block_hash.py); this module
only looks them up.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from services.engines.base import KvBlockEvent


@dataclass
class _Block:
    refs: int = 0
    kv: Any = None  # the block's KV once computed: [layers, 2, kv_heads, block_size, head_dim]


@dataclass
class _Holding:
    hashed: list[int] = field(default_factory=list)
    anonymous: int = 0


class KvBlockCache:
    def __init__(self, total_blocks: int, block_size: int):
        if total_blocks < 1:
            raise ValueError("a KV cache needs at least one block")
        self.total_blocks = total_blocks
        self.block_size = block_size
        self._free = total_blocks
        self._blocks: dict[int, _Block] = {}
        self._unreferenced: OrderedDict[int, None] = OrderedDict()
        self._holdings: dict[str, _Holding] = {}
        self._events: list[KvBlockEvent] = []

    # ------------------------------------------------------------ queries

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def cached_prefix(self, block_hashes: list[int]) -> list[Any]:
        """KV of the longest run of computed blocks at the start of `block_hashes`."""
        found: list[Any] = []
        for block_hash in block_hashes:
            block = self._blocks.get(block_hash)
            if block is None or block.kv is None:
                break
            found.append(block.kv)
        return found

    def cached_hashes(self) -> list[int]:
        return [h for h, block in self._blocks.items() if block.kv is not None]

    def drain_events(self) -> list[KvBlockEvent]:
        events, self._events = self._events, []
        return events

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self._free - len(self._unreferenced)

    @property
    def free_blocks(self) -> int:
        """Blocks neither held nor cached."""
        return self._free

    @property
    def cached_blocks(self) -> int:
        return sum(1 for block in self._blocks.values() if block.kv is not None)

    # ------------------------------------------------------------ changes

    def allocate(self, seq_id: str, block_hashes: list[int], total_tokens: int) -> list[Any] | None:
        """Reserve blocks for `total_tokens`, sharing the blocks of `block_hashes` already here.

        Returns the KV of the cached prefix (possibly empty), or None when the space is not there.
        """
        if seq_id in self._holdings:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        prefix = self.cached_prefix(block_hashes)
        needed = max(self.blocks_for(total_tokens), len(block_hashes))
        present = [h for h in block_hashes if h in self._blocks]
        # Reusing a cached-but-unreferenced block takes it off the evictable list.
        reused_unreferenced = sum(1 for h in present if self._blocks[h].refs == 0)
        new_blocks = needed - len(present)
        if new_blocks > self._free + len(self._unreferenced) - reused_unreferenced:
            return None
        for block_hash in present:
            self._pin(block_hash)
        self._take(new_blocks)
        for block_hash in block_hashes:
            if block_hash not in self._blocks:
                self._blocks[block_hash] = _Block(refs=1)
        self._holdings[seq_id] = _Holding(hashed=list(block_hashes), anonymous=needed - len(block_hashes))
        return prefix

    def store(self, computed: list[tuple[int, Any]]) -> None:
        """Give reserved blocks their computed KV; they become reusable ("stored")."""
        stored: list[int] = []
        for block_hash, kv in computed:
            block = self._blocks.get(block_hash)
            if block is not None and block.kv is None:
                block.kv = kv
                stored.append(block_hash)
        if stored:
            self._events.append(KvBlockEvent("stored", tuple(stored)))

    def free(self, seq_id: str) -> None:
        holding = self._holdings.pop(seq_id, None)
        if holding is None:
            return
        # Deepest blocks first, so eviction takes a chain's tail before its shared head.
        for block_hash in reversed(holding.hashed):
            block = self._blocks[block_hash]
            block.refs -= 1
            if block.refs > 0:
                continue
            if block.kv is None:
                # Never computed (the prefill failed or was cancelled): nothing to keep.
                del self._blocks[block_hash]
                self._free += 1
            else:
                self._unreferenced[block_hash] = None
        self._free += holding.anonymous

    def _pin(self, block_hash: int) -> None:
        block = self._blocks[block_hash]
        if block.refs == 0:
            del self._unreferenced[block_hash]
        block.refs += 1

    def _take(self, blocks: int) -> None:
        evicted: list[int] = []
        while self._free < blocks:
            block_hash, _ = self._unreferenced.popitem(last=False)
            del self._blocks[block_hash]
            evicted.append(block_hash)
            self._free += 1
        self._free -= blocks
        if evicted:
            self._events.append(KvBlockEvent("removed", tuple(evicted)))
