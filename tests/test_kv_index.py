"""The router's KV index against a brute-force reference, under random event sequences.

Reference: per worker, the set of block hashes its cache holds after each batch; a request's
overlap with a worker is the leading run of the request's hashes in that set. Whatever the
delivery (lost, duplicated, reordered batches; late, stale and repeated dumps; workers dropped,
restarted, or sending a wrong block size or model), the index must hold, for every worker it
tracks, exactly the worker's cache as of the batch `index.seq(worker)` it reports, and answer
every prefix query from that; once every batch is delivered and at most one dump, it must be
current. A restarted worker numbers its batches from 1 again: batches and dumps of an earlier
incarnation, delivered late, must never be taken for the new one's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.events import KvCacheChange, KvDump, KvEvents
from services.router.kv_index import KvIndex, Outcome, PrefixView

BLOCK_SIZE = 16
MODEL = "llama-3-8b"
UNIVERSE = 24  # small, so workers share blocks and requests match


def brute_overlap(blocks: frozenset[int] | set[int], request: list[int]) -> int:
    matched = 0
    for block_hash in request:
        if block_hash not in blocks:
            break
        matched += 1
    return matched


def answers(index: KvIndex, request: list[int]) -> dict[str, int]:
    """`overlaps`, once `matches` (what the router reads) is seen to say the same: each worker's
    length, and the workers by length, longest first, in the order `overlaps` lists them."""
    found = index.overlaps(request)
    assert list(found.values()) == sorted(found.values())  # shortest first
    matches = index.matches(request)
    assert bool(matches) == bool(found)
    for worker_id in index.worker_ids:
        assert matches.get(worker_id) == found.get(worker_id)
        assert (worker_id in matches) == (worker_id in found)
    assert matches.get("nobody", 0) == 0 and "nobody" not in matches
    groups = [(depth, list(ids)) for depth, ids in matches.deepest()]
    lengths = sorted(set(found.values()), reverse=True)
    assert groups == [(n, [w for w, d in found.items() if d == n]) for n in lengths]
    assert dict(matches) == found and len(matches) == len(found)
    return found


def events(
    worker: str,
    seq: int,
    *changes: tuple[str, list[int]],
    model: str = MODEL,
    bs: int = BLOCK_SIZE,
    started_at: float | None = None,
) -> KvEvents:
    return KvEvents(
        event_id=f"{worker}-{seq}",
        occurred_at=1.0,
        worker_id=worker,
        model=model,
        block_size=bs,
        seq=seq,
        changes=[KvCacheChange(kind=kind, block_hashes=hashes) for kind, hashes in changes],  # type: ignore[arg-type]
        started_at=started_at,
    )


def dump(
    worker: str,
    seq: int,
    hashes: set[int] | frozenset[int],
    *,
    model: str = MODEL,
    bs: int = BLOCK_SIZE,
    started_at: float | None = None,
) -> KvDump:
    return KvDump(
        event_id=f"{worker}-dump-{seq}",
        occurred_at=1.0,
        worker_id=worker,
        model=model,
        block_size=bs,
        seq=seq,
        block_hashes=sorted(hashes),
        started_at=started_at,
    )


# ---------------------------------------------------------------- examples


def test_prefix_stops_at_the_first_block_a_worker_lacks() -> None:
    index = KvIndex(BLOCK_SIZE)
    index.apply_dump(dump("a", 0, {1, 2, 3, 4}))
    index.apply_dump(dump("b", 0, {1, 3, 4}))  # block 2 evicted, 3 and 4 kept
    index.apply_dump(dump("c", 0, {9}))
    assert index.overlaps([1, 2, 3, 4, 5]) == {"a": 4, "b": 1}
    assert index.overlap("b", [1, 2, 3, 4]) == 1
    assert index.overlap("c", [1, 2]) == 0
    assert index.overlaps([2, 3]) == {"a": 2}
    assert index.overlaps([]) == {}
    assert index.overlaps([7]) == {}
    view: PrefixView = index
    assert view.overlap("a", [1, 2]) == 2


def test_in_order_batches_apply_and_faults_are_detected() -> None:
    index = KvIndex(BLOCK_SIZE)
    assert index.apply(events("w", 1, ("stored", [1, 2]))) is Outcome.UNKNOWN
    assert index.needs_dump("w") and index.block_count("w") == 0
    assert index.apply(events("w", 2, ("stored", [3]))) is Outcome.STALE
    # The dump is as of batch 1; batch 2 arrived first and is applied on top of it.
    assert index.apply_dump(dump("w", 1, {1, 2})) is Outcome.APPLIED
    assert index.blocks_of("w") == {1, 2, 3} and index.seq("w") == 2 and index.synced("w")
    assert index.apply(events("w", 2, ("stored", [3]))) is Outcome.DUPLICATE
    assert index.apply(events("w", 3, ("removed", [1]))) is Outcome.APPLIED
    assert index.overlaps([1, 2]) == {}
    # Batch 4 lost: 5 is a gap; the blocks stay as of 3, flagged.
    assert index.apply(events("w", 5, ("stored", [5]))) is Outcome.GAP
    assert index.needs_dump("w") and index.seq("w") == 3 and index.blocks_of("w") == {2, 3}
    # Batch 4 arrives late (reordered): the hole fills, no dump needed.
    assert index.apply(events("w", 4, ("cleared", []), ("stored", [7]))) is Outcome.APPLIED
    assert index.synced("w") and index.seq("w") == 5 and index.blocks_of("w") == {5, 7}
    # A dump older than what the index holds is ignored.
    assert index.apply_dump(dump("w", 4, {7})) is Outcome.STALE
    assert index.blocks_of("w") == {5, 7}
    index.check_invariants()


def test_mismatched_block_size_or_model_is_never_indexed() -> None:
    index = KvIndex(BLOCK_SIZE)
    index.apply_dump(dump("w", 0, {1, 2}))
    assert index.apply(events("w", 1, ("stored", [3]), bs=32)) is Outcome.MISMATCH
    assert index.blocks_of("w") == set() and index.needs_dump("w")
    assert index.apply_dump(dump("w", 1, {1, 2, 3}, bs=32)) is Outcome.MISMATCH
    assert index.excluded("w") and index.overlaps([1]) == {}
    assert index.apply_dump(dump("w", 1, {1, 2, 3})) is Outcome.APPLIED
    assert not index.excluded("w") and index.overlaps([1, 2, 3]) == {"w": 3}
    assert index.apply(events("w", 2, ("stored", [4]), model="other")) is Outcome.MISMATCH
    assert index.blocks_of("w") == set() and index.needs_dump("w")
    # A worker announced (heartbeat) with one model whose cache reports another.
    index.resync("v", model=MODEL)
    assert index.apply_dump(dump("v", 3, {5}, model="other")) is Outcome.MISMATCH
    assert index.blocks_of("v") == set() and index.excluded("v")
    # Wrong block size from an unknown worker: tracked (so it gets a dump), nothing held.
    assert index.apply(events("x", 1, ("stored", [1]), bs=8)) is Outcome.MISMATCH
    assert index.needs_dump("x") and index.pending("x") == 0
    index.check_invariants()


def test_a_restarted_worker_is_never_mixed_with_its_previous_incarnation() -> None:
    index = KvIndex(BLOCK_SIZE)
    index.apply_dump(dump("w", 0, set(), started_at=100.0))
    assert index.apply(events("w", 1, ("stored", [1, 2]), started_at=100.0)) is Outcome.APPLIED
    assert index.apply(events("w", 2, ("stored", [3]), started_at=100.0)) is Outcome.APPLIED
    # The process restarts (empty cache) before the router sees its heartbeat: its batch 1 is not
    # a duplicate of the old batch 1 but a new incarnation, so the old blocks go.
    assert index.apply(events("w", 1, ("stored", [7]), started_at=200.0)) is Outcome.RESTARTED
    assert index.blocks_of("w") == set() and index.needs_dump("w") and index.started_at("w") == 200.0
    # A late batch and a late dump of the old incarnation change nothing.
    assert index.apply(events("w", 3, ("stored", [4]), started_at=100.0)) is Outcome.SUPERSEDED
    assert index.apply_dump(dump("w", 3, {1, 2, 3, 4}, started_at=100.0)) is Outcome.SUPERSEDED
    assert index.apply_dump(dump("w", 0, set(), started_at=200.0)) is Outcome.APPLIED
    assert index.blocks_of("w") == {7} and index.seq("w") == 1 and index.synced("w")
    # A dump of a newer incarnation replaces everything, held batches of the older one included.
    assert index.apply(events("w", 3, ("stored", [8]), started_at=200.0)) is Outcome.GAP
    assert index.apply_dump(dump("w", 0, {9}, started_at=300.0)) is Outcome.APPLIED
    assert index.blocks_of("w") == {9} and index.synced("w") and index.pending("w") == 0
    index.check_invariants()


def test_drop_and_slot_reuse_keep_the_map_consistent() -> None:
    index = KvIndex(BLOCK_SIZE, group_cache_size=16)
    rng = random.Random(3)
    live: dict[str, set[int]] = {}
    shared = [1, 2, 3, 4, 5, 6]  # most workers hold a prefix of it: wide masks, cached groups
    for step in range(600):
        if live and rng.random() < 0.3:
            gone = rng.choice(sorted(live))
            assert index.drop_worker(gone)
            del live[gone]
        else:
            name = f"w{step}"
            blocks = set(shared[: rng.randrange(len(shared) + 1)])
            blocks |= {rng.randrange(50) for _ in range(rng.randrange(12))}
            index.apply_dump(dump(name, 0, blocks))
            live[name] = blocks
        for request in ([*shared, 7, 8], [rng.randrange(50) for _ in range(rng.randrange(1, 8))]):
            expected = {w: n for w, b in live.items() if (n := brute_overlap(b, request))}
            assert answers(index, request) == expected
    index.check_invariants()
    assert index.block_counts() == {w: len(b) for w, b in live.items()}
    for _ in range(200):
        request = [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
        expected = {w: n for w, b in live.items() if (n := brute_overlap(b, request))}
        assert answers(index, request) == expected
    assert not index.drop_worker("nobody")


def test_a_wide_fleet_matches_the_brute_force_with_and_without_the_group_cache() -> None:
    rng = random.Random(11)
    chain = list(range(100, 140))
    holdings: dict[str, set[int]] = {}
    for w in range(300):
        blocks = set(chain[: rng.randrange(len(chain) + 1)])
        blocks -= {h for h in blocks if rng.random() < 0.03}  # evicted mid-chain
        blocks |= {rng.randrange(60) for _ in range(rng.randrange(20))}
        holdings[f"w{w:03d}"] = blocks
    cached, uncached = KvIndex(BLOCK_SIZE), KvIndex(BLOCK_SIZE, group_cache_size=0)
    for index in (cached, uncached):
        for name, blocks in holdings.items():
            index.apply_dump(dump(name, 0, blocks))
    requests = [[*chain[: rng.randrange(1, len(chain) + 1)], rng.randrange(60)] for _ in range(100)]
    requests += [[rng.randrange(60) for _ in range(rng.randrange(1, 6))] for _ in range(100)]
    for request in requests * 2:  # twice: the second time from the cache
        expected = {w: n for w, b in holdings.items() if (n := brute_overlap(b, request))}
        assert answers(cached, request) == expected
        assert answers(uncached, request) == expected
    # A worker leaving changes the slots: cached groups must not name it any more.
    gone = "w007"
    cached.drop_worker(gone)
    del holdings[gone]
    for request in requests:
        expected = {w: n for w, b in holdings.items() if (n := brute_overlap(b, request))}
        assert answers(cached, request) == expected


# ---------------------------------------------------------------- property: random deliveries


@dataclass
class SimWorker:
    name: str
    started_at: float = 1.0  # the incarnation
    truth: list[frozenset[int]] = field(default_factory=lambda: [frozenset()])
    batches: list[KvEvents] = field(default_factory=list)
    inflight: list[KvEvents] = field(default_factory=list)
    dumps: list[KvDump] = field(default_factory=list)
    tainted: bool = False  # a bogus batch (another model) may be held for it

    @property
    def seq(self) -> int:
        return len(self.batches)

    def publish(self, rng: random.Random) -> None:
        blocks = set(self.truth[-1])
        changes: list[tuple[str, list[int]]] = []
        for _ in range(rng.randint(1, 3)):
            roll = rng.random()
            if roll < 0.55:
                hashes = [rng.randrange(UNIVERSE) for _ in range(rng.randint(1, 5))]
                blocks.update(hashes)
                changes.append(("stored", hashes))
            elif roll < 0.93:
                pool = sorted(blocks) or [rng.randrange(UNIVERSE)]
                hashes = [rng.choice(pool) for _ in range(rng.randint(1, 3))]
                if rng.random() < 0.2:
                    hashes.append(rng.randrange(UNIVERSE))  # removing what is not cached: a no-op
                blocks.difference_update(hashes)
                changes.append(("removed", hashes))
            else:
                blocks.clear()
                changes.append(("cleared", []))
        batch = events(self.name, self.seq + 1, *changes, started_at=self.started_at)
        self.batches.append(batch)
        self.truth.append(frozenset(blocks))
        self.inflight.append(batch)

    def take_dump(self) -> KvDump:
        return dump(self.name, self.seq, self.truth[-1], started_at=self.started_at)


OPS = (
    ["publish"] * 6
    + ["deliver"] * 6
    + ["deliver_any", "lose", "duplicate", "take_dump", "take_dump", "deliver_dump", "deliver_dump"]
    + ["die", "restart", "bogus", "late", "far_ahead"]
)


def check(index: KvIndex, incarnations: dict[tuple[str, float], SimWorker], rng: random.Random) -> None:
    """Every tracked worker's blocks are exactly its cache, in the incarnation and as of the batch
    the index reports; prefix queries answer from that."""
    index.check_invariants()
    truth: dict[str, frozenset[int]] = {}
    for name in index.worker_ids:
        started_at = index.started_at(name)
        assert started_at is not None
        sim = incarnations[(name, started_at)]
        seq = index.seq(name)
        if seq is None:
            assert index.blocks_of(name) == set()
        else:
            assert seq <= sim.seq
            assert index.blocks_of(name) == sim.truth[seq], (name, seq)
        assert index.block_count(name) == len(index.blocks_of(name))
        truth[name] = sim.truth[seq] if seq is not None else frozenset()
    for _ in range(4):
        request = [rng.randrange(UNIVERSE) for _ in range(rng.randint(1, 8))]
        expected = {}
        for name in index.worker_ids:
            reference = truth[name]
            matched = brute_overlap(reference, request)
            assert index.overlap(name, request) == matched
            if matched:
                expected[name] = matched
        assert answers(index, request) == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Hypothesis draws every choice (`st.randoms(use_true_random=False)`), so a failure shrinks to a
# short sequence of operations (with the far-ahead drop removed from `apply_dump`: 6 steps on one
# worker).
@given(rng=st.randoms(use_true_random=False), steps=st.integers(1, 120), n_workers=st.integers(1, 4))
def test_index_matches_the_reference_under_random_delivery(
    rng: random.Random, steps: int, n_workers: int
) -> None:
    index = KvIndex(BLOCK_SIZE, max_pending=rng.choice([4, 1024]))
    workers = {f"w{i}": SimWorker(f"w{i}") for i in range(n_workers)}
    incarnations = {(sim.name, sim.started_at): sim for sim in workers.values()}
    # Batches and dumps of earlier incarnations, still on their way.
    late: list[KvEvents | KvDump] = []
    for _ in range(steps):
        sim = workers[rng.choice(sorted(workers))]
        op = rng.choice(OPS)
        if op == "publish":
            sim.publish(rng)
        elif op == "deliver" and sim.inflight:
            index.apply(sim.inflight.pop(0))
        elif op == "deliver_any" and sim.inflight:
            index.apply(sim.inflight.pop(rng.randrange(len(sim.inflight))))
        elif op == "lose" and sim.inflight:
            sim.inflight.pop(rng.randrange(len(sim.inflight)))
        elif op == "duplicate" and sim.batches:
            outcome = index.apply(rng.choice(sim.batches))
            assert outcome is not Outcome.MISMATCH or sim.tainted
        elif op == "take_dump":
            sim.dumps.append(sim.take_dump())
        elif op == "deliver_dump" and sim.dumps:
            before = index.seq(sim.name)
            same_incarnation = index.started_at(sim.name) == sim.started_at
            d = sim.dumps.pop(rng.randrange(len(sim.dumps)))
            outcome = index.apply_dump(d)
            if before is not None and same_incarnation and d.seq < before:
                assert outcome is Outcome.STALE
            else:
                # A held bogus batch for another model resets the worker when the dump reveals it.
                assert outcome is Outcome.APPLIED or (outcome is Outcome.MISMATCH and sim.tainted)
        elif op == "die":
            index.drop_worker(sim.name)
        elif op == "restart":
            # A new incarnation, its batches numbered from 1 again. The router sees its new
            # heartbeat (and starts it from nothing) or, first, one of its batches or dumps.
            late.extend([*sim.inflight, *sim.dumps])
            new = workers[sim.name] = SimWorker(sim.name, started_at=sim.started_at + 1.0)
            incarnations[(new.name, new.started_at)] = new
            if rng.random() < 0.5:
                index.resync(sim.name, model=MODEL, started_at=new.started_at)
        elif op == "late" and late:
            message = late.pop(rng.randrange(len(late)))
            tracked = index.started_at(message.worker_id)
            if isinstance(message, KvDump):
                outcome = index.apply_dump(message)
            else:
                outcome = index.apply(message)
            if tracked is not None and message.started_at is not None and message.started_at < tracked:
                assert outcome is Outcome.SUPERSEDED
        elif op == "bogus":
            if rng.random() < 0.5:
                bogus = events(
                    sim.name, sim.seq + 1, ("stored", [1]), bs=BLOCK_SIZE * 2, started_at=sim.started_at
                )
                assert index.apply(bogus) is Outcome.MISMATCH
            else:
                # Another model: refused at once if the index knows the worker's model, else held.
                bogus = events(
                    sim.name, sim.seq + 1, ("stored", [1]), model="other-model", started_at=sim.started_at
                )
                outcome = index.apply(bogus)
                assert outcome is not Outcome.APPLIED
                sim.tainted = sim.tainted or outcome is not Outcome.MISMATCH
        elif op == "far_ahead":
            # A batch numbered far past anything the worker will send (a broken producer): never
            # applied, and it must not keep the worker out of sync once a dump has come.
            far = events(sim.name, sim.seq + 10**9, ("stored", [1]), started_at=sim.started_at)
            assert index.apply(far) is not Outcome.APPLIED
        check(index, incarnations, rng)

    # Liveness: a last batch (so a lost tail shows as a gap) and every batch still in flight
    # delivered in order, then at most one dump, and the index is current.
    for sim in workers.values():
        if sim.name not in index:
            continue
        sim.publish(rng)
        while sim.inflight:
            index.apply(sim.inflight.pop(0))
        if index.needs_dump(sim.name):
            outcome = index.apply_dump(sim.take_dump())
            if outcome is Outcome.MISMATCH and sim.tainted:
                outcome = index.apply_dump(sim.take_dump())
            assert outcome is Outcome.APPLIED
        assert index.synced(sim.name) and not index.needs_dump(sim.name)
        assert index.seq(sim.name) == sim.seq and index.started_at(sim.name) == sim.started_at
        assert index.blocks_of(sim.name) == sim.truth[-1]
    check(index, incarnations, rng)


def test_a_dump_drops_held_batches_too_far_past_it_and_leaves_the_worker_synced() -> None:
    index = KvIndex(BLOCK_SIZE, max_pending=8)
    # A bogus far-future batch: a gap, held; the dump it calls for drops it.
    assert index.apply_dump(dump("w", 1, [10])) is Outcome.APPLIED
    assert index.apply(events("w", 10**9, ("stored", [11]))) is Outcome.GAP
    assert index.needs_dump("w") and index.pending("w") == 1
    assert index.apply_dump(dump("w", 2, [10, 12])) is Outcome.APPLIED
    assert index.synced("w") and index.pending("w") == 0 and index.dropped_ahead == 1
    # No base yet (discovery): the same, and a real batch after the dump is applied on it.
    assert index.apply(events("v", 10**9, ("stored", [11]))) is Outcome.UNKNOWN
    assert index.apply(events("v", 3, ("stored", [12]))) is Outcome.STALE
    assert index.apply_dump(dump("v", 2, [10])) is Outcome.APPLIED
    assert index.synced("v") and index.seq("v") == 3 and index.blocks_of("v") == {10, 12}
    assert index.dropped_ahead == 2 and index.pending("v") == 0
    # After a long outage the worker's batches are far past the index's stale base: held, and
    # applied on the dump that follows.
    assert index.apply(events("v", 1000, ("stored", [14]))) is Outcome.GAP
    assert index.apply_dump(dump("v", 999, [10, 12, 13])) is Outcome.APPLIED
    assert index.synced("v") and index.seq("v") == 1000 and index.blocks_of("v") == {10, 12, 13, 14}


@settings(max_examples=100, deadline=None)
@given(rng=st.randoms(use_true_random=False), batches=st.integers(0, 60))
def test_faultless_delivery_never_needs_a_dump(rng: random.Random, batches: int) -> None:
    index = KvIndex(BLOCK_SIZE)
    sim = SimWorker("w")
    index.apply_dump(sim.take_dump())
    for _ in range(batches):
        sim.publish(rng)
        assert index.apply(sim.inflight.pop(0)) is Outcome.APPLIED
        assert index.blocks_of("w") == sim.truth[-1]
    assert index.synced("w") and index.seq("w") == batches


@settings(max_examples=100, deadline=None)
@given(
    chains=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12), min_size=1, max_size=6),
    request=st.lists(st.integers(0, 40), max_size=14),
)
def test_overlaps_equal_the_brute_force_for_any_holdings(chains: list[list[int]], request: list[int]) -> None:
    index = KvIndex(BLOCK_SIZE)
    for i, blocks in enumerate(chains):
        index.apply_dump(dump(f"w{i}", 0, set(blocks)))
    expected = {f"w{i}": n for i, blocks in enumerate(chains) if (n := brute_overlap(set(blocks), request))}
    assert answers(index, request) == expected
