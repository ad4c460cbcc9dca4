"""A paged KV block manager with prefix caching.

A sequence holds blocks: shared ones, identified by their chained hash (services/mesh/block_hash.py)
and reference counted in the prefix cache, and private ones (a prompt's partial last block,
generated tokens, and full prompt blocks whose tokens are not computed yet). A full prompt block
joins the cache when its tokens are computed (`mark_computed`), which is when the "stored" event
goes out; a block computed while an equal one is already cached is dropped for the cached one.
When a sequence ends its cached blocks stay, unreferenced, in LRU order, and are evicted ("removed")
only when an allocation needs the space. Sequences grow block by block (`grow`); when the cache is
full the engine preempts one.

The fleet simulator drives a thousand of these, so the per-block work (pinning a matched prefix,
storing computed blocks, releasing, evicting) runs as bulk operations in C wherever the blocks
involved are distinct (always, for chained hashes), and block by block otherwise; and the LRU
order is a plain list of hashes in release order, where a block pinned again leaves its entry
behind as stale (counted per hash, skipped when reached, swept when they pile up): 8 bytes per
entry where an ordered dict takes about 90, so a cached block costs about half as much.
tests/engines/test_sim_blocks.py holds the state and events against a block-by-block model of
the rules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import compress, repeat, takewhile
from operator import add, is_not, not_, sub

from services.engines.base import KvBlockEvent

_is_count = partial(is_not, None)  # a hash's entry in `_refs` (None: not cached)


def _consume(calls: Iterable[object]) -> None:
    """Run a lazy `map` of calls to the end, in C."""
    deque(calls, maxlen=0)


class CacheEpoch:
    """A count of the changes to what any BlockManager caches (a block cached or evicted, its
    references going to or from none): while it stands still, every prefix match stands. The
    fleet simulator's prefix view reuses a match result within an instant while it does."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


EPOCH = CacheEpoch()


@dataclass(slots=True)
class _Holding:
    shared: list[int] = field(default_factory=list)  # hashes pinned in the cache, in block order
    private: int = 0  # blocks this sequence alone holds
    # Full prompt blocks held privately until their tokens are computed: `pending[i]` is block
    # `base + i`'s hash; blocks before `computed_to` have joined `shared`.
    pending: Sequence[int] = ()
    base: int = 0
    computed_to: int = 0
    distinct: bool = True  # no hash twice in `shared` (always so for chained hashes)

    @property
    def blocks(self) -> int:
        return len(self.shared) + self.private


class BlockManager:
    # Slack before the LRU list drops its consumed head and its stale entries (amortised O(1)).
    LRU_SLACK = 1024

    def __init__(self, total_blocks: int, block_size: int):
        if total_blocks < 1:
            raise ValueError("a KV cache needs at least one block")
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.total_blocks = total_blocks
        self.block_size = block_size
        self._free = total_blocks
        self._refs: dict[int, int] = {}  # cached block hash -> sequences holding it (0: evictable)
        # The evictable blocks in LRU order: `_lru[_lru_head:]`, by release, minus stale entries
        # (`_stale[h]`: how many of h's entries there no longer count, because h was released
        # again later or is held again now).
        self._lru: list[int] = []
        self._lru_head = 0
        self._stale: dict[int, int] = {}
        self._evictable = 0
        self._holdings: dict[str, _Holding] = {}
        self._events: list[KvBlockEvent] = []
        # Whether to keep "stored"/"removed" events for `drain_events` (an engine publishes them;
        # the fleet simulator reads the caches themselves and turns them off).
        self.record_events = True

    # ------------------------------------------------------------ queries

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        return len(list(takewhile(self._refs.__contains__, block_hashes)))

    def cached_hashes(self) -> list[int]:
        return list(self._refs)

    def evictable_hashes(self) -> list[int]:
        """The cached blocks no sequence holds, in eviction order (least recently released first)."""
        stale = dict(self._stale)
        order: list[int] = []
        for block_hash in self._lru[self._lru_head :]:
            entries = stale.get(block_hash)
            if entries:
                stale[block_hash] = entries - 1
            else:
                order.append(block_hash)
        return order

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
        return self.total_blocks - self._free - self._evictable

    @property
    def free_blocks(self) -> int:
        """Blocks neither held nor cached."""
        return self._free

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix cache, held or not."""
        return len(self._refs)

    @property
    def available_blocks(self) -> int:
        """Free blocks plus evictable (cached, unreferenced) ones."""
        return self._free + self._evictable

    # ------------------------------------------------------------ changes

    def allocate(self, seq_id: str, block_hashes: Sequence[int], tokens: int) -> int | None:
        """Blocks for a sequence's first `tokens` tokens, reusing the cached prefix of `block_hashes`.

        Returns how many leading blocks were found cached (their tokens need no computing), or
        None, changing nothing, when the space is not there.
        """
        if seq_id in self._holdings:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        refs = self._refs
        # The cached prefix's reference counts (its length: cached_prefix_blocks), in one pass.
        counts = list(takewhile(_is_count, map(refs.get, block_hashes)))
        matched = len(counts)
        needed = max(self.blocks_for(tokens), matched)
        new_blocks = needed - matched
        prefix = list(block_hashes[:matched])
        # Reusing a cached-but-unreferenced block takes it off the evictable list.
        reused_unreferenced = counts.count(0)
        if new_blocks > self.available_blocks - reused_unreferenced:
            return None
        distinct = len(set(prefix)) == matched
        if matched:
            EPOCH.value += 1
        if distinct:
            refs.update(zip(prefix, map(add, counts, repeat(1)), strict=True))
            if reused_unreferenced:
                revived = list(compress(prefix, map(not_, counts)))
                stale = self._stale
                entries = list(map(add, map(stale.get, revived, repeat(0)), repeat(1)))
                stale.update(zip(revived, entries, strict=True))
                self._evictable -= reused_unreferenced
                self._sweep()
        else:
            for block_hash in prefix:
                self._pin(block_hash)
        self._take(new_blocks)
        end = min(len(block_hashes), needed)
        self._holdings[seq_id] = _Holding(
            prefix, new_blocks, block_hashes[matched:end] if end > matched else (), matched, matched, distinct
        )
        return matched

    def grow(self, seq_id: str, tokens: int) -> bool:
        """Make the sequence's blocks hold `tokens` tokens; False, changing nothing, when full."""
        holding = self._holdings[seq_id]
        more = -(-tokens // self.block_size) - len(holding.shared) - holding.private
        if more <= 0:
            return True
        if more > self._free + self._evictable:
            return False
        self._take(more)
        holding.private += more
        return True

    def grow_each_by_one(self, seq_ids: Collection[str]) -> None:
        """`grow` for sequences whose next token starts a new block, all at once: one more block
        each, the evictions taken together (the caller knows that they fit)."""
        if len(seq_ids) > self._free + self._evictable:
            raise RuntimeError(f"{len(seq_ids)} blocks asked for, {self.available_blocks} available")
        holdings = self._holdings
        for seq_id in seq_ids:
            holdings[seq_id].private += 1
        self._take(len(seq_ids))

    def mark_computed(self, seq_id: str, tokens: int) -> None:
        """The sequence's first `tokens` tokens have their KV: full hashed blocks join the cache."""
        holding = self._holdings.get(seq_id)
        if holding is None:
            return
        start = holding.computed_to
        stop = min(tokens // self.block_size, holding.base + len(holding.pending))
        if stop <= start:
            return
        new = list(holding.pending[start - holding.base : stop - holding.base])
        EPOCH.value += 1
        holding.computed_to = stop
        holding.private -= stop - start
        holding.shared.extend(new)
        refs = self._refs
        fresh = dict.fromkeys(new, 1)
        if len(fresh) == len(new) and refs.keys().isdisjoint(fresh):
            refs.update(fresh)
            stored = new
        else:
            holding.distinct = False
            stored = []
            for block_hash in new:
                if block_hash in refs:
                    # Computed while an equal block was cached: share that one, free ours.
                    self._pin(block_hash)
                    self._free += 1
                else:
                    refs[block_hash] = 1
                    stored.append(block_hash)
        if stored and self.record_events:
            self._events.append(KvBlockEvent("stored", tuple(stored)))

    def free(self, seq_id: str) -> None:
        holding = self._holdings.pop(seq_id, None)
        if holding is None:
            return
        shared = holding.shared
        if shared:
            EPOCH.value += 1
            refs = self._refs
            # Deepest blocks first, so eviction takes a chain's tail before its shared head.
            deepest_first = shared[::-1]
            counts = list(map(refs.__getitem__, deepest_first))
            if counts.count(1) == len(counts):  # held by this sequence alone (so all distinct)
                refs.update(zip(deepest_first, repeat(0)))
                released = deepest_first
            elif holding.distinct:
                left = list(map(sub, counts, repeat(1)))
                refs.update(zip(deepest_first, left, strict=True))
                released = list(compress(deepest_first, map(not_, left)))
            else:
                released = []
                for block_hash in deepest_first:
                    refs[block_hash] -= 1
                    if refs[block_hash] == 0:
                        released.append(block_hash)
            self._lru.extend(released)
            self._evictable += len(released)
        self._free += holding.private

    def _pin(self, block_hash: int) -> None:
        count = self._refs[block_hash]
        self._refs[block_hash] = count + 1  # before a sweep, which reads who holds what
        if count == 0:
            self._stale[block_hash] = self._stale.get(block_hash, 0) + 1
            self._evictable -= 1
            self._sweep()

    def _take(self, blocks: int) -> None:
        short = blocks - self._free
        if short > 0:
            EPOCH.value += 1
            evicted = self._evict(short)
            _consume(map(self._refs.__delitem__, evicted))
            self._free += short
            if self.record_events:
                self._events.append(KvBlockEvent("removed", tuple(evicted)))
        self._free -= blocks

    def _evict(self, count: int) -> list[int]:
        """Take the `count` least recently released evictable blocks off the LRU list."""
        if count > self._evictable:
            raise RuntimeError(f"{count} blocks to evict, {self._evictable} evictable")
        lru, head, stale = self._lru, self._lru_head, self._stale
        evicted = lru[head : head + count]
        if not stale or stale.keys().isdisjoint(evicted):  # no stale entry among them
            head += count
        else:
            evicted = []
            while len(evicted) < count:
                block_hash = lru[head]
                head += 1
                entries = stale.get(block_hash)
                if entries is None:
                    evicted.append(block_hash)
                elif entries == 1:
                    del stale[block_hash]
                else:
                    stale[block_hash] = entries - 1
        self._evictable -= count
        if head > self.LRU_SLACK and 2 * head > len(lru):
            del lru[:head]
            head = 0
        self._lru_head = head
        return evicted

    def _sweep(self) -> None:
        """Drop the stale entries from the LRU list once they outnumber the live ones.

        A block's entries are one per release; each time it is pinned again its live entry goes
        stale. So an evictable block's live entry is its last one and every other is stale, and
        a held block's are all stale: what survives is each evictable block's last entry, in
        list order, and no stale entry is left. (Computed that way, in C, rather than entry by
        entry: an agent's long shared prompt revives hundreds of blocks per request.)"""
        lru, head = self._lru, self._lru_head
        if len(lru) - head - self._evictable <= self._evictable + self.LRU_SLACK:
            return
        # Each block once, at its last entry, in list order.
        last = list(dict.fromkeys(reversed(lru[head:] if head else lru)))
        last.reverse()
        # In place: the list stays the one object (the simulator freezes it out of the GC's scans).
        lru[:] = compress(last, map(not_, map(self._refs.__getitem__, last)))
        self._lru_head = 0
        self._stale.clear()
