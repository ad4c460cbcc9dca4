"""A request on a simulated worker (`Seq`, SimEngine's `_Sequence`) and its states."""

from __future__ import annotations

from typing import Any

# Sequence states (SimEngine's `State`, as small ints).
WAITING, RUNNING, IMPORTING, IDLE, READY, DONE = range(6)


class Seq:
    """One request on one worker (SimEngine's `_Sequence`)."""

    __slots__ = (
        "a0",
        "a1",
        "a2",
        "admitted_at",
        "admitted_once",
        "base",
        "cached_tokens",
        "cancel",
        "computed",
        "dec",
        "decode_s",
        "decoding",
        "enqueued_at",
        "first_done",
        "generated",
        "hashes",
        "k0",
        "kfin",
        "kv_import",
        "max_tokens",
        "order",
        "owner",
        "preemptions",
        "prefill_s",
        "prompt_len",
        "rank",
        "rid",
        "state",
    )

    def __init__(
        self,
        rid: str,
        prompt_len: int,
        hashes: list[int],
        max_tokens: int,
        owner: Any,
        *,
        kv_import: bool,
        rank: int = 0,
    ):
        self.rid = rid
        self.prompt_len = prompt_len
        self.hashes = hashes
        self.max_tokens = max_tokens
        self.owner = owner
        self.kv_import = kv_import
        # Its scheduling rank (services/engines/scheduling.py, its service class's): 0 first.
        self.rank = rank
        self.state = WAITING
        self.computed = 0
        self.generated = 0
        self.cached_tokens = 0
        self.admitted_once = False
        self.decoding = False
        # Imported KV never had a first-token future here: all its GPU time is decode time.
        self.first_done = kv_import
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.preemptions = 0
        self.order = 0
        self.dec = False  # in the steady-decode group
        self.k0 = 0
        self.base = 0
        self.kfin = 0
        self.a0 = self.a1 = self.a2 = 0.0
        self.cancel = False
        self.enqueued_at = 0.0
        self.admitted_at = -1.0


def _order_of(seq: Seq) -> int:
    return seq.order


def _rank_of(seq: Seq) -> int:
    return seq.rank
