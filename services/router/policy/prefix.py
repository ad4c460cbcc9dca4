"""What is cached where: the prefix view the decision reads (`PrefixView`: the KV index's, or
the simulator's fleet's), a request's matched leading blocks per worker (`prefix_matches`), those
workers longest match first (`matched_by_depth`), and the prompt tokens a match saves
(`cached_tokens`). Reads the view; changes nothing."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import compress, repeat
from operator import eq
from typing import Protocol


class PrefixView(Protocol):
    """Which leading blocks of a request each worker's prefix cache holds. The router's KV index
    (kv_index.py, from the workers' KvEvents) and the simulator's fleet view both serve it."""

    def overlap(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` the worker's prefix cache holds."""
        ...

    def overlaps(self, block_hashes: Sequence[int]) -> Mapping[str, int]:
        """Every worker's matched leading blocks; workers matching nothing may be left out."""
        ...

    # A view may also have `matches(block_hashes)`: the same mapping, read lazily, with
    # `deepest()` giving (depth, worker ids) longest first in the mapping's order (`KvIndex`);
    # the decision then resolves only the workers it reads (`prefix_matches`, `matched_by_depth`).


class NoPrefix:
    """A PrefixView that knows no cache (callers without a KV index)."""

    def overlap(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        return 0

    def overlaps(self, block_hashes: Sequence[int]) -> Mapping[str, int]:
        return {}


def cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Whole matched blocks, but the last prompt token is always computed (the engines' rule)."""
    return max(0, min(matched_blocks * block_size, prompt_tokens - 1))


def matched_by_depth(matched: Mapping[str, int]) -> Iterable[tuple[int, Iterable[str]]]:
    """The matched workers by depth, longest first, each depth's in the mapping's order: from
    `deepest()` where the match has it (`kv_index.Matches`), else picked out in C per depth (a
    decision can match a thousand workers)."""
    deepest = getattr(matched, "deepest", None)
    if deepest is not None:
        groups: Iterable[tuple[int, Iterable[str]]] = deepest()
        return groups
    depths = matched.values()
    return (
        (depth, compress(matched, map(eq, repeat(depth), depths)))
        for depth in sorted(set(depths), reverse=True)
    )


def prefix_matches(prefix: PrefixView, block_hashes: Sequence[int]) -> Mapping[str, int]:
    """The prefix view's `overlaps`, or its `matches` where it has one (`KvIndex`: the same
    mapping, resolved into worker ids only for the workers the decision reads)."""
    if not block_hashes:
        return {}
    matches = getattr(prefix, "matches", None)
    if matches is not None:
        found: Mapping[str, int] = matches(block_hashes)
        return found
    return prefix.overlaps(block_hashes)
