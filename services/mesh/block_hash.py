"""Chained block hashes: the one prefix-identity scheme shared by engines, router and simulator.

A prompt's tokens are cut into fixed-size blocks; block i's hash covers the hash of block i-1 and
its own tokens, so equal hashes mean equal prefixes. The model (and adapter) seed the chain, so
two models never share a cache entry. Only full blocks are hashed: a partial block cannot be
reused by another request. The block size is part of every worker's state, because a mismatch
would silently turn every cache hit into a miss.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from functools import lru_cache

_HASH_BYTES = 8  # 64-bit hashes: fit a JSON integer and a numpy uint64


@lru_cache(maxsize=1024)
def chain_seed(model: str, adapter: str | None = None) -> int:
    digest = hashlib.blake2b(f"{model}\x00{adapter or ''}".encode(), digest_size=_HASH_BYTES)
    return int.from_bytes(digest.digest(), "little") >> 1


def chain_block_hashes(
    tokens: Sequence[int], block_size: int, *, model: str, adapter: str | None = None
) -> list[int]:
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    parent = chain_seed(model, adapter)
    hashes: list[int] = []
    full = len(tokens) // block_size * block_size
    data = array("q", tokens[:full]).tobytes()  # every full block's tokens, 8 bytes each
    width = block_size * 8
    blake2b = hashlib.blake2b
    for start in range(0, full * 8, width):
        digest = blake2b(
            parent.to_bytes(_HASH_BYTES, "little") + data[start : start + width], digest_size=_HASH_BYTES
        )
        # 63 bits, so the value is a non-negative signed 64-bit integer in every language.
        parent = int.from_bytes(digest.digest(), "little") >> 1
        hashes.append(parent)
    return hashes
