"""Test doubles for the routing policies' inputs, shared by the router and baseline tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.router.policy import RouterState, WorkerView


def state_of(*workers: WorkerView) -> RouterState:
    """A router state that has heard one heartbeat from each of `workers`."""
    state = RouterState()
    for worker in workers:
        state.observe(worker)
    return state


class FixedPrefix:
    """A PrefixView with fixed answers: worker -> leading blocks cached."""

    def __init__(self, blocks: Mapping[str, int] | None = None):
        self.blocks = dict(blocks or {})

    def overlap(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        return min(self.blocks.get(worker_id, 0), len(block_hashes))

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        return {w: n for w in self.blocks if (n := self.overlap(w, block_hashes))}
