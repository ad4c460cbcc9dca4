"""The baseline routing rules (services/router/baselines.py), each against the rule it cites."""

from __future__ import annotations

import random

import pytest

from services.router import baselines
from services.router import policy as router_policy
from services.router.policy import NoPlacement, Placement, RouterState, WorkerView
from tests.router_views import FixedPrefix, state_of

MODEL = "m"
BLOCK = 16


def view(
    worker_id: str,
    *,
    queue: int = 0,
    running: int = 0,
    used: int = 0,
    total: int = 1000,
    role: str = "decode",
    block_size: int = BLOCK,
    now: float = 10.0,
) -> WorkerView:
    return WorkerView(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        model=MODEL,
        block_size=block_size,
        queue_depth=queue,
        running=running,
        kv_blocks_total=total,
        kv_blocks_used=used,
        heartbeat_at=now,
    )


HASHES = list(range(10))  # a 10-block prompt
PROMPT = 10 * BLOCK


def decide(name: str, s: RouterState, prefix: FixedPrefix, request_id: str = "r1") -> Placement | NoPlacement:
    common = {"request_id": request_id, "model": MODEL, "block_size": BLOCK, "now": 10.0}
    if name == "dynamo_kv":
        return baselines.dynamo_kv(s, **common, block_hashes=HASHES, prompt_tokens=PROMPT, prefix=prefix)
    if name == "llmd_weighted":
        return baselines.llmd_weighted(s, **common, block_hashes=HASHES, prefix=prefix)
    if name == "sglang_cache_aware":
        return baselines.sglang_cache_aware(s, **common, block_hashes=HASHES, prefix=prefix)
    if name == "least_loaded":
        return baselines.least_loaded(s, **common)
    return baselines.round_robin(s, **common, cursor=baselines.RoundRobinState())


def chosen(decision: Placement | NoPlacement) -> str:
    assert isinstance(decision, Placement)
    return decision.decode_worker


def test_dynamo_picks_the_lowest_overlap_weighted_cost() -> None:
    # Dynamo's documented example: cached 2/5/8 blocks, so 8/5/2 blocks to prefill, and decode
    # blocks 10/5/9 (here: blocks in use, plus this 10-block request): worker 2 costs least.
    s = state_of(view("w1", used=10), view("w2", used=5), view("w3", used=9))
    assert chosen(decide("dynamo_kv", s, FixedPrefix({"w1": 2, "w2": 5, "w3": 8}))) == "w2"
    # The cache counts once per block, load once per block: a full hit beats a small load gap.
    s = state_of(view("w1", used=0), view("w2", used=8))
    assert chosen(decide("dynamo_kv", s, FixedPrefix({"w2": 10}))) == "w2"
    # A heavier weight on overlap favours the cache more.
    s = state_of(view("w1", used=0), view("w2", used=12))
    prefix = FixedPrefix({"w2": 10})
    assert chosen(decide("dynamo_kv", s, prefix)) == "w1"
    weighted = baselines.dynamo_kv(
        s,
        request_id="r1",
        model=MODEL,
        block_size=BLOCK,
        now=10.0,
        block_hashes=HASHES,
        prompt_tokens=PROMPT,
        prefix=prefix,
        overlap_score_weight=2.0,
    )
    assert chosen(weighted) == "w2"


def test_llmd_scores_queue_kv_and_prefix_two_two_three() -> None:
    # w1: empty queue, empty KV, no prefix: 2 + 2 + 0 = 4. w2: longest queue (0), KV half used
    # (1.0), full prefix (3): 4. w3: full prefix, queue in the middle: 2*0.5 + 2*1 + 3 = 6.
    s = state_of(view("w1", queue=0), view("w2", queue=4, used=500), view("w3", queue=2))
    assert chosen(decide("llmd_weighted", s, FixedPrefix({"w2": 10, "w3": 10}))) == "w3"
    # Without any prefix, queue and KV decide.
    s = state_of(view("w1", queue=3), view("w2", queue=1, used=900), view("w3", queue=1, used=100))
    assert chosen(decide("llmd_weighted", s, FixedPrefix({}))) == "w3"


def test_sglang_balances_when_imbalanced_and_follows_the_cache_otherwise() -> None:
    prefix = FixedPrefix({"w2": 9})
    # Balanced: the 90% match exceeds the 0.5 threshold.
    s = state_of(view("w1", running=4), view("w2", running=10))
    assert chosen(decide("sglang_cache_aware", s, prefix)) == "w2"
    # Imbalanced (40 - 4 > 32 and 40 > 4 x 1.1): the least loaded, whatever the cache.
    s = state_of(view("w1", running=4), view("w2", running=40))
    assert chosen(decide("sglang_cache_aware", s, prefix)) == "w1"
    # Balanced, low match: the worker with the smallest cache.
    s = state_of(view("w1", used=700), view("w2", used=300), view("w3", used=500))
    assert chosen(decide("sglang_cache_aware", s, FixedPrefix({"w1": 3}))) == "w2"


def test_round_robin_cycles_through_workers_in_turn() -> None:
    s = state_of(view("b"), view("a"), view("c"))
    cursor = baselines.RoundRobinState()
    picks = [
        chosen(
            baselines.round_robin(
                s, request_id=f"r{i}", model=MODEL, block_size=BLOCK, now=10.0, cursor=cursor
            )
        )
        for i in range(6)
    ]
    assert picks == ["b", "a", "c", "b", "a", "c"]


def test_least_loaded_is_the_router_policys_rule() -> None:
    rng = random.Random(2)
    for trial in range(200):
        workers = [
            view(f"w{i}", queue=rng.randint(0, 5), running=rng.randint(0, 5), used=rng.randint(0, 1000))
            for i in range(rng.randint(1, 8))
        ]
        s = state_of(*workers)
        s.placed_since_heartbeat.update({w.worker_id: rng.randint(0, 2) for w in workers})
        expected = router_policy._least_loaded(workers, s, f"r{trial}")
        assert expected is not None
        assert chosen(
            baselines.least_loaded(s, request_id=f"r{trial}", model=MODEL, block_size=BLOCK, now=10.0)
        ) == (expected.worker_id)


@pytest.mark.parametrize("name", baselines.BASELINES)
def test_placement_plumbing_matches_policy_place(name: str) -> None:
    # Disaggregated as soon as a prefill worker is live; every placement counted in the state.
    s = state_of(view("d1"), view("d2"), view("p1", role="prefill"))
    decision = decide(name, s, FixedPrefix({}))
    assert isinstance(decision, Placement)
    assert decision.mode == "disaggregated" and decision.prefill_worker == "p1"
    assert decision.candidates == 3
    assert s.placed_since_heartbeat["p1"] == 1
    assert s.placed_since_heartbeat[decision.decode_worker] == 1
    # A block-size mismatch is refused; no live decode worker is "no_workers".
    mismatch = decide(name, state_of(view("d1"), view("d2", block_size=32)), FixedPrefix({}))
    assert isinstance(mismatch, NoPlacement) and mismatch.reason == "invalid"
    stale = decide(name, state_of(view("d1", now=0.0)), FixedPrefix({}))
    assert isinstance(stale, NoPlacement) and stale.reason == "no_workers"
    assert isinstance(decide(name, state_of(view("p1", role="prefill")), FixedPrefix({})), NoPlacement)


def test_ties_break_as_policy_place_breaks_them() -> None:
    s = state_of(*(view(f"w{i}") for i in range(6)))
    for i in range(30):
        rid = f"tie-{i}"
        expected = min(s.workers.values(), key=lambda w: router_policy._tie_break(rid, w.worker_id))
        assert (
            chosen(decide("dynamo_kv", state_of(*s.workers.values()), FixedPrefix({}), rid))
            == expected.worker_id
        )
