"""The router's global KV index: which worker caches which blocks, and how long a prefix of a request
each worker already holds. Pure: no I/O, no clock; `kv_sync.py` feeds it from the bus.

Structure
- ``_holders``: block hash -> bitmask of the worker slots that cache it (a Python int; one bit per
  worker slot, slots reused when workers go). A block one worker holds points to that slot's
  precomputed single-bit int, so the common case costs a dict entry and no new object.
- Each worker: its set of block hashes (for counts, "cleared", dumps and dropping it), the batch
  sequence number its blocks are exactly as of, and the batches held back while it resyncs.

Matching (`overlaps`) walks the request's chained block hashes (block i's hash covers block i-1, so
the list is a path) with the set of workers that matched every block so far, ANDing in each block's
holders until the set empties. A worker that holds block i+1 but not block i (an eviction in the
middle of a chain) leaves the set at i: its prefix stops at the first missing block. The cost is one
dict lookup and a few operations on a one-bit-per-worker int per block of the longest matched
prefix (once one worker is left, a set lookup per block), plus putting each matching worker in the
result: groups of workers that leave the match together, where a shared prefix ends, are turned
into ids once and cached by mask, so hot shared prefixes cost a C-level dict update per group.
The router reads the match through `matches` instead: the same walk, kept as its groups (a slot
mask and a depth each), so that a decision, which reads the deepest few workers and the depth of a
dozen others, does not turn a match of a thousand workers into a thousand dict entries.

Sequencing (per worker; `KvEvents.seq` counts batches from 1 with no gaps, `KvDump.seq` is the
batch a dump is exactly as of):
- applied: the next batch, applied.
- duplicate: a batch at or below the one the worker's blocks are as of: already reflected; ignored.
- gap: a batch past the next one (batches lost or reordered): held back, and the worker needs a
  dump. Its blocks stay queryable, exactly as of its last applied batch (`seq`), flagged
  `synced=False`; a late batch that fills the hole resumes it without a dump.
- stale: a batch for a worker that awaits a dump: held back (up to `max_pending`); when the dump
  comes, held batches after the dump's seq are applied on top of it. A dump older than the blocks
  the index holds is stale too, and ignored.
- ahead (not an outcome of `apply`: the router counts it under this name): a held batch more
  than `max_pending` past a dump's seq is dropped when the dump comes (`dropped_ahead` counts
  them): the worker cannot have sent that many batches since its dump, so the batch is bogus.
  Kept, one bogus far-future seq left a worker "not synced", and dumped again and again, until
  its real numbering caught up. (A batch far past a stale base is held:
  after a long outage the worker's next batches are far ahead of what the index last saw.)
- mismatch: a block size other than the mesh's or a model other than the worker's: the worker's
  blocks are dropped (they cannot be trusted) and it needs a dump. A dump with a mismatched block
  size leaves the worker out of the index (`excluded`) until a dump that matches.
- unknown: a batch from a worker the index does not track: it starts tracking it, holds the batch
  and the worker needs a dump (discovery).
- restarted: a batch (or dump) from a newer incarnation of the worker (a later `started_at`, the
  worker process's start): its numbering starts again at 1, so the blocks and held batches of the
  old incarnation go, the batch is held and the worker needs a dump.
- superseded: a batch (or dump) from an older incarnation than the one tracked (delivered late,
  after the restart was seen): ignored. Without these two, a restarted worker's batch 3 could be
  taken for its previous incarnation's batch 3. (Producers that send no `started_at` are not
  checked.)

So the index never answers from state it cannot vouch for: every tracked worker's blocks are exactly
its cache as of `seq(worker)`, and `synced(worker)` says whether later batches are known missing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import compress, repeat
from typing import Protocol

from schemas.events import KvEvents
from services.router.policy import PrefixView as PrefixView  # the protocol this index serves

__all__ = ["KvIndex", "Matches", "Outcome", "PrefixView"]

# Masks with more set bits than this have their worker ids cached (`KvIndex._groups`).
_FEW_BITS = 4
# Masks with more set bits than this are turned into worker ids by one C-level pass over the slots.
_DENSE_BITS = 64
_BIT_CHARS = bytes.maketrans(b"01", b"\x00\x01")


class Outcome(StrEnum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    GAP = "gap"
    STALE = "stale"
    MISMATCH = "mismatch"
    UNKNOWN = "unknown"
    RESTARTED = "restarted"
    SUPERSEDED = "superseded"


class DumpLike(Protocol):
    """A worker's full cache contents as of batch `seq` (`schemas.events.KvDump`)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def block_hashes(self) -> list[int]: ...
    @property
    def started_at(self) -> float | None: ...


@dataclass(slots=True)
class _Worker:
    worker_id: str
    slot: int
    bit: int
    blocks: set[int] = field(default_factory=set)
    # The batch `blocks` are exactly as of; None until a dump gives a base.
    seq: int | None = None
    synced: bool = False
    model: str | None = None
    # The last dump's block size was not the mesh's: not indexed until one that is.
    excluded: bool = False
    # The incarnation (process start) the blocks belong to; None until one is announced.
    started_at: float | None = None
    pending: dict[int, KvEvents] = field(default_factory=dict)


class Matches(Mapping[str, int]):
    """Every worker's matched prefix for one request (`KvIndex.matches`): a mapping worker id ->
    leading blocks matched, like `overlaps`, read without turning the whole match into ids."""

    __slots__ = ("_any", "_depths", "_dict", "_index", "_leaving", "_left")

    def __init__(self, index: KvIndex, leaving: list[int], depths: list[int], left: list[int]):
        self._index = index
        self._leaving = leaving
        self._depths = depths
        self._left = left
        # Every worker matching at least one block: the first group and those beyond it.
        self._any = leaving[0] | left[0] if leaving else 0
        self._dict: dict[str, int] | None = None

    def get(self, worker_id: str, default: int | None = None) -> int | None:  # type: ignore[override]
        worker = self._index._workers.get(worker_id)
        if worker is None or not self._any & worker.bit:
            return default
        # The masks beyond each group shrink group by group (to 0 after the last): the worker's
        # group is the first whose mask beyond lacks it.
        bit, left = worker.bit, self._left
        lo, hi = 0, len(left) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if left[mid] & bit:
                lo = mid + 1
            else:
                hi = mid
        return self._depths[lo]

    def __getitem__(self, worker_id: str) -> int:
        depth = self.get(worker_id)
        if depth is None:
            raise KeyError(worker_id)
        return depth

    def __contains__(self, worker_id: object) -> bool:
        return isinstance(worker_id, str) and self.get(worker_id) is not None

    def __bool__(self) -> bool:
        return bool(self._leaving)

    def _resolved(self) -> dict[str, int]:
        if self._dict is None:
            self._dict = self._index._resolve(self._leaving, self._depths)
        return self._dict

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._resolved())

    def deepest(self) -> Iterator[tuple[int, tuple[str, ...]]]:
        """(blocks matched, the workers that matched that many, in slot order), longest first:
        the order in which `overlaps` lists them, by group from the end."""
        group = self._index._group
        for mask, depth in zip(reversed(self._leaving), reversed(self._depths), strict=True):
            yield depth, group(mask)


class KvIndex:
    """Block hash -> workers, per-worker sequencing and resync. See the module docstring."""

    def __init__(self, block_size: int, *, max_pending: int = 1024, group_cache_size: int = 8192):
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self.max_pending = max_pending
        # Held batches dumps dropped as too far past their seq (see "ahead" above), ever.
        self.dropped_ahead = 0
        self._holders: dict[int, int] = {}
        self._workers: dict[str, _Worker] = {}
        self._slot_ids: list[str | None] = []
        self._slot_bits: list[int] = []
        self._free_slots: list[int] = []
        self._total_blocks = 0
        # Worker ids by slot mask, for groups of workers that leave a match together; cleared
        # whenever a slot changes hands.
        self.group_cache_size = group_cache_size
        self._groups: dict[int, tuple[str, ...]] = {}

    # ------------------------------------------------------------ queries

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    @property
    def total_blocks(self) -> int:
        """Indexed (worker, block) pairs."""
        return self._total_blocks

    @property
    def distinct_blocks(self) -> int:
        return len(self._holders)

    def block_count(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return 0 if worker is None else len(worker.blocks)

    def block_counts(self) -> dict[str, int]:
        return {worker_id: len(w.blocks) for worker_id, w in self._workers.items()}

    def seq(self, worker_id: str) -> int | None:
        """The batch the worker's indexed blocks are exactly as of (None: no base yet)."""
        worker = self._workers.get(worker_id)
        return None if worker is None else worker.seq

    def synced(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        return worker is not None and worker.synced

    def started_at(self, worker_id: str) -> float | None:
        """The incarnation of the worker the index's blocks belong to (None: not announced)."""
        worker = self._workers.get(worker_id)
        return None if worker is None else worker.started_at

    def excluded(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        return worker is not None and worker.excluded

    def needs_dump(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        return worker is not None and not worker.synced

    def pending(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return 0 if worker is None else len(worker.pending)

    def blocks_of(self, worker_id: str) -> frozenset[int]:
        worker = self._workers.get(worker_id)
        return frozenset() if worker is None else frozenset(worker.blocks)

    def stats(self) -> dict[str, int]:
        synced = sum(1 for w in self._workers.values() if w.synced)
        return {
            "workers": len(self._workers),
            "synced": synced,
            "resyncing": len(self._workers) - synced,
            "blocks": self._total_blocks,
            "distinct_blocks": len(self._holders),
        }

    def overlap(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` the worker caches (stops at the first miss)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0
        blocks = worker.blocks
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in blocks:
                break
            matched += 1
        return matched

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Every worker's matched prefix length in blocks; workers matching nothing are left out.
        In order of increasing length, and by worker slot among equal lengths."""
        leaving, depths, _ = self._walk(block_hashes)
        return self._resolve(leaving, depths)

    def matches(self, block_hashes: Sequence[int]) -> Matches:
        """`overlaps` as the walk left it, resolved into worker ids only as far as it is read: a
        worker's length costs a binary search over the groups, and `deepest()` gives the groups
        longest first. The router reads a few workers of a match that can hold a thousand.
        Valid until the index next changes."""
        leaving, depths, left = self._walk(block_hashes)
        return Matches(self, leaving, depths, left)

    def _walk(self, block_hashes: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """The match as groups of worker slots that leave it together, shortest first: per group
        its slot mask, its length in blocks, and the mask of the workers matching beyond it (the
        last group's is 0)."""
        leaving: list[int] = []
        depths: list[int] = []
        left: list[int] = []
        n = len(block_hashes)
        if not n:
            return leaving, depths, left
        holders = self._holders
        mask = holders.get(block_hashes[0], 0)
        if not mask:
            return leaving, depths, left
        i = 1
        while True:
            if not mask & (mask - 1):
                # One worker left: walk its own set (cheaper than a wide AND per block).
                worker_id = self._slot_ids[mask.bit_length() - 1]
                assert worker_id is not None
                blocks = self._workers[worker_id].blocks
                while i < n and block_hashes[i] in blocks:
                    i += 1
                leaving.append(mask)
                depths.append(i)
                left.append(0)
                return leaving, depths, left
            while i < n:
                narrowed = mask & holders.get(block_hashes[i], 0)
                if narrowed != mask:
                    break
                i += 1
            else:
                leaving.append(mask)
                depths.append(n)
                left.append(0)
                return leaving, depths, left
            leaving.append(mask ^ narrowed)
            depths.append(i)
            left.append(narrowed)
            if not narrowed:
                return leaving, depths, left
            mask = narrowed
            i += 1

    def _resolve(self, leaving: list[int], depths: list[int]) -> dict[str, int]:
        """The walk's groups as worker id -> depth, shortest first (by slot within a group)."""
        result: dict[str, int] = {}
        ids = self._slot_ids
        group = self._group
        for mask, depth in zip(leaving, depths, strict=True):
            if mask.bit_count() <= _FEW_BITS:
                # A few workers: bit by bit (no call per group; a wide match has a hundred).
                while mask:
                    low = mask & -mask
                    worker_id = ids[low.bit_length() - 1]
                    if worker_id is not None:
                        result[worker_id] = depth
                    mask ^= low
            else:
                result.update(zip(group(mask), repeat(depth)))
        return result

    def _group(self, mask: int) -> tuple[str, ...]:
        """The ids of the workers in `mask`, in slot order. Many workers leave the match together
        where a shared prefix ends; requests on the same hot prefix meet the same masks, so the
        ids of wide masks are kept (valid while slots stay put)."""
        if mask.bit_count() <= _FEW_BITS:
            return self._ids_of(mask)
        group = self._groups.get(mask)
        if group is None:
            group = self._ids_of(mask)
            if self.group_cache_size:
                if len(self._groups) >= self.group_cache_size:
                    self._groups.clear()
                self._groups[mask] = group
        return group

    def clear_group_cache(self) -> None:
        self._groups.clear()

    def _ids_of(self, mask: int) -> tuple[str, ...]:
        ids = self._slot_ids
        if mask.bit_count() > _DENSE_BITS:
            # One pass in C over every slot beats a Python step per set bit.
            selected = bin(mask)[:1:-1].encode("ascii").translate(_BIT_CHARS)
            return tuple(i for i in compress(ids, selected) if i is not None)
        found: list[str] = []
        while mask:
            low = mask & -mask
            worker_id = ids[low.bit_length() - 1]
            if worker_id is not None:
                found.append(worker_id)
            mask ^= low
        return tuple(found)

    # ------------------------------------------------------------ changes

    def apply(self, events: KvEvents) -> Outcome:
        """One batch of a worker's cache changes; see the module docstring for the outcomes."""
        worker = self._workers.get(events.worker_id)
        if worker is None:
            worker = self._add_worker(events.worker_id)
            worker.started_at = events.started_at
            if events.block_size != self.block_size:
                return Outcome.MISMATCH
            self._hold(worker, events)
            return Outcome.UNKNOWN
        incarnation = self._incarnation(worker, events.started_at)
        if incarnation is Outcome.SUPERSEDED:
            return incarnation
        if events.block_size != self.block_size or (
            worker.model is not None and events.model != worker.model
        ):
            self._reset(worker, model=worker.model)
            return Outcome.MISMATCH
        if incarnation is Outcome.RESTARTED:
            self._hold(worker, events)
            return incarnation
        if worker.seq is not None and events.seq <= worker.seq:
            return Outcome.DUPLICATE
        if worker.synced:
            assert worker.seq is not None
            if events.seq == worker.seq + 1:
                self._apply_changes(worker, events)
                worker.seq = events.seq
                return Outcome.APPLIED
            worker.synced = False
            self._hold(worker, events)
            return Outcome.GAP
        self._hold(worker, events)
        if worker.seq is None:
            return Outcome.STALE
        if not self._drain(worker):
            return Outcome.MISMATCH
        return Outcome.APPLIED if worker.seq >= events.seq else Outcome.STALE

    def apply_dump(self, dump: DumpLike) -> Outcome:
        """A worker's full contents as of `dump.seq`, then its held batches after that seq.

        applied; stale (older than the blocks held: ignored); mismatch (block size or model).
        """
        worker = self._workers.get(dump.worker_id)
        if worker is None:
            worker = self._add_worker(dump.worker_id)
            worker.started_at = dump.started_at
        if self._incarnation(worker, dump.started_at) is Outcome.SUPERSEDED:
            return Outcome.SUPERSEDED
        if dump.block_size != self.block_size:
            self._reset(worker, model=worker.model)
            worker.excluded = True
            return Outcome.MISMATCH
        if worker.seq is None and worker.model is not None and dump.model != worker.model:
            # The worker announced another model (its heartbeat) than its cache reports.
            self._reset(worker, model=worker.model)
            worker.excluded = True
            return Outcome.MISMATCH
        if worker.seq is not None and dump.seq < worker.seq:
            return Outcome.STALE
        target = set(dump.block_hashes)
        current = worker.blocks
        for block_hash in [h for h in current if h not in target]:
            self._remove(worker, block_hash)
        for block_hash in target:
            if block_hash not in current:
                self._add(worker, block_hash)
        worker.seq = dump.seq
        worker.model = dump.model
        worker.excluded = False
        beyond = dump.seq + self.max_pending
        for seq in [s for s in worker.pending if s <= dump.seq or s > beyond]:
            self.dropped_ahead += seq > beyond
            del worker.pending[seq]
        if not self._drain(worker):
            return Outcome.MISMATCH
        return Outcome.APPLIED

    def resync(self, worker_id: str, *, model: str | None = None, started_at: float | None = None) -> None:
        """Start (or restart) tracking a worker from nothing: its blocks dropped, a dump needed.

        For a worker seen for the first time, or a new incarnation of one (its process restarted,
        `started_at` its heartbeat's). Batches held for the same incarnation are kept.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            worker = self._add_worker(worker_id)
            worker.model = model
            worker.started_at = started_at
            return
        self._reset(worker, model=model)
        worker.excluded = False
        if started_at is None or started_at != worker.started_at:
            worker.pending.clear()
        if started_at is not None:
            worker.started_at = started_at

    def drop_worker(self, worker_id: str) -> bool:
        """Forget a worker (it died): its blocks leave the index and its slot is freed."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return False
        self._clear(worker)
        self._slot_ids[worker.slot] = None
        self._free_slots.append(worker.slot)
        self._groups.clear()
        return True

    # ------------------------------------------------------------ internals

    def _add_worker(self, worker_id: str) -> _Worker:
        if self._free_slots:
            slot = self._free_slots.pop()
            self._slot_ids[slot] = worker_id
        else:
            slot = len(self._slot_ids)
            self._slot_ids.append(worker_id)
            self._slot_bits.append(1 << slot)
        worker = _Worker(worker_id=worker_id, slot=slot, bit=self._slot_bits[slot])
        self._groups.clear()
        self._workers[worker_id] = worker
        return worker

    def _incarnation(self, worker: _Worker, started_at: float | None) -> Outcome | None:
        """SUPERSEDED for an older incarnation than the worker's, RESTARTED (after starting the
        worker over) for a newer one, None for the same one or when either is not announced."""
        if started_at is None:
            return None
        if worker.started_at is None:
            worker.started_at = started_at
            return None
        if started_at < worker.started_at:
            return Outcome.SUPERSEDED
        if started_at > worker.started_at:
            self._reset(worker, model=worker.model)
            worker.excluded = False
            worker.pending.clear()
            worker.started_at = started_at
            return Outcome.RESTARTED
        return None

    def _reset(self, worker: _Worker, *, model: str | None) -> None:
        self._clear(worker)
        worker.seq = None
        worker.synced = False
        worker.model = model

    def _hold(self, worker: _Worker, events: KvEvents) -> None:
        worker.pending[events.seq] = events
        if len(worker.pending) > self.max_pending:
            del worker.pending[min(worker.pending)]

    def _drain(self, worker: _Worker) -> bool:
        """Apply held batches that continue the worker's base; synced again if none remain.

        False when a held batch turned out to be for another model (the worker was reset)."""
        assert worker.seq is not None
        pending = worker.pending
        while pending:
            events = pending.pop(worker.seq + 1, None)
            if events is None:
                for seq in [s for s in pending if s <= worker.seq]:
                    del pending[seq]
                if not pending:
                    break
                worker.synced = False
                return True
            if events.model != worker.model:
                self._reset(worker, model=worker.model)
                pending.clear()
                return False
            self._apply_changes(worker, events)
            worker.seq = events.seq
        worker.synced = True
        return True

    def _apply_changes(self, worker: _Worker, events: KvEvents) -> None:
        for change in events.changes:
            if change.kind == "stored":
                blocks = worker.blocks
                for block_hash in change.block_hashes:
                    if block_hash not in blocks:
                        self._add(worker, block_hash)
            elif change.kind == "removed":
                for block_hash in change.block_hashes:
                    self._remove(worker, block_hash)
            else:
                self._clear(worker)

    def _add(self, worker: _Worker, block_hash: int) -> None:
        worker.blocks.add(block_hash)
        self._total_blocks += 1
        mask = self._holders.get(block_hash)
        self._holders[block_hash] = worker.bit if mask is None else mask | worker.bit

    def _remove(self, worker: _Worker, block_hash: int) -> None:
        blocks = worker.blocks
        if block_hash not in blocks:
            return
        blocks.remove(block_hash)
        self._total_blocks -= 1
        mask = self._holders[block_hash] & ~worker.bit
        if not mask:
            del self._holders[block_hash]
        elif not mask & (mask - 1):
            self._holders[block_hash] = self._slot_bits[mask.bit_length() - 1]  # the shared int
        else:
            self._holders[block_hash] = mask

    def _clear(self, worker: _Worker) -> None:
        holders, bit, bits = self._holders, worker.bit, self._slot_bits
        for block_hash in worker.blocks:
            mask = holders[block_hash] & ~bit
            if not mask:
                del holders[block_hash]
            elif not mask & (mask - 1):
                holders[block_hash] = bits[mask.bit_length() - 1]
            else:
                holders[block_hash] = mask
        self._total_blocks -= len(worker.blocks)
        worker.blocks = set()

    def check_invariants(self) -> None:
        """Raise AssertionError if the block map and the per-worker sets disagree (tests)."""
        rebuilt: dict[int, int] = {}
        for worker in self._workers.values():
            assert self._slot_ids[worker.slot] == worker.worker_id
            for block_hash in worker.blocks:
                rebuilt[block_hash] = rebuilt.get(block_hash, 0) | worker.bit
        assert rebuilt == self._holders
        assert self._total_blocks == sum(len(w.blocks) for w in self._workers.values())
