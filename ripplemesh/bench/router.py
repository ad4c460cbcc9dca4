"""`ripplemesh bench router`: the router's KV index at fleet scale.

Builds the index the router keeps (`services/router/kv_index.py`) for `workers` workers caching
`blocks` blocks in all (worker, block) pairs, from a realistic population: a few hundred shared
system prompts with Zipf popularity, each worker holding some of them, and per-worker
conversations that extend a shared prompt (or start fresh) with blocks of their own, with a few
blocks evicted from the middle of chains (a worker can hold block i+1 without block i). Each
worker's blocks go in as the dump the router would fetch (`apply_dump`).

Then it times `overlaps()`, every worker's matched prefix for one request, for requests of 64 to
512 blocks: continuations of a worker's conversation, new questions on a shared system prompt (a
prefix many workers hold), and prompts nobody has seen. It prints p50/p99 microseconds in wall-clock
time (what a router sees, including whatever else the machine runs) and in this thread's CPU time,
and again with the index's group cache off (no reuse across requests); the whole decision as the
router makes it (`policy.place`: candidates pruned by the index's match, read through `matches`,
and the least-loaded heaps, then scored); `apply()` of event batches as workers publish them; the
index's memory (RSS growth of this process); and the target: decision latency p99 under 1 ms with
1,000 workers and 10 million indexed blocks (the whole `place`, wall clock). `placements_out`
(`--placements`): every decision the timed loop makes, one repr a line, to compare a change of
the policy against.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from schemas.events import KvCacheChange, KvDump, KvEvents
from services.router.kv_index import KvIndex
from services.router.policy import RouteRequest, RouterState, WorkerView, place
from services.router.speed import speed_for

TARGET_P99_US = 1000.0
BLOCK_SIZE = 16
MODEL = "llama-3-8b"
SYSTEM_PROMPTS = 256
SYSTEM_PROMPT_BLOCKS = (8, 128)
SHARED_PER_WORKER = (4, 12)
CONVERSATION_BLOCKS = (32, 512)
EVICTED_FRACTION = 0.03
REQUEST_BLOCKS = (64, 512)


@dataclass(frozen=True, slots=True)
class RouterBenchResult:
    workers: int
    indexed_blocks: int
    distinct_blocks: int
    build_s: float
    rss_mib: float
    p50_us: float
    p90_us: float
    p99_us: float
    max_us: float
    p99_by_kind_us: dict[str, float]
    p99_cpu_us: float
    p99_cold_us: float
    decision_p99_us: float
    decision_p99_cpu_us: float
    apply_batches_per_s: float


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _fresh(rng: random.Random, n: int) -> list[int]:
    """`n` new 63-bit block hashes (as services/mesh/block_hash.py makes them)."""
    bits = rng.getrandbits
    return [bits(63) for _ in range(n)]


def build_index(
    *, workers: int, blocks: int, seed: int = 7
) -> tuple[KvIndex, list[list[int]], list[list[list[int]]]]:
    """The index, the shared system prompts, and a few conversation chains per worker."""
    rng = random.Random(seed)
    index = KvIndex(BLOCK_SIZE)
    prompts = [_fresh(rng, rng.randint(*SYSTEM_PROMPT_BLOCKS)) for _ in range(SYSTEM_PROMPTS)]
    popularity = [1.0 / (rank + 1) ** 1.1 for rank in range(SYSTEM_PROMPTS)]
    per_worker = max(1, blocks // max(1, workers))
    sample_chains: list[list[list[int]]] = []
    for w in range(workers):
        held: set[int] = set()
        chains: list[list[int]] = []
        for prompt in rng.choices(prompts, popularity, k=rng.randint(*SHARED_PER_WORKER)):
            held.update(prompt[: rng.randint(1, len(prompt))])
        before_evictions = int(per_worker / (1 - EVICTED_FRACTION))
        while len(held) < before_evictions:
            base = rng.choices(prompts, popularity)[0] if rng.random() < 0.7 else []
            held.update(base)
            own = _fresh(rng, min(rng.randint(*CONVERSATION_BLOCKS), before_evictions - len(held)))
            held.update(own)
            if len(chains) < 4:
                chains.append(base + own)
        # Evicted from the middle of chains: the worker keeps later blocks of those chains.
        evicted = rng.sample(sorted(held), max(0, len(held) - per_worker))
        held.difference_update(evicted)
        unique = held
        index.apply_dump(
            KvDump(
                event_id=f"bench-dump-{w}",
                occurred_at=0.0,
                worker_id=f"worker-{w:04d}",
                model=MODEL,
                block_size=BLOCK_SIZE,
                seq=0,
                block_hashes=list(unique),
            )
        )
        sample_chains.append(chains)
    return index, prompts, sample_chains


def _requests(
    count: int, prompts: list[list[int]], chains: list[list[list[int]]], seed: int
) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed + 1)
    popularity = [1.0 / (rank + 1) ** 1.1 for rank in range(len(prompts))]
    with_chains = [c for c in chains if c]
    requests: list[tuple[str, list[int]]] = []
    for _ in range(count):
        length = rng.randint(*REQUEST_BLOCKS)
        roll = rng.random()
        if roll < 0.45 and with_chains:
            chain = rng.choice(rng.choice(with_chains))
            head = chain[: rng.randint(1, min(len(chain), length))]
            requests.append(("conversation", head + _fresh(rng, length - len(head))))
        elif roll < 0.80:
            prompt = rng.choices(prompts, popularity)[0][:length]
            requests.append(("shared prompt", prompt + _fresh(rng, length - len(prompt))))
        else:
            requests.append(("unseen", _fresh(rng, length)))
    return requests


def _time_apply(index: KvIndex, batches: int, seed: int) -> float:
    """Batches/s of `apply()`: 16 stored blocks and 4 removed per batch, across workers."""
    rng = random.Random(seed + 2)
    worker_ids = index.worker_ids
    seqs = dict.fromkeys(worker_ids, 0)
    prepared = []
    for _ in range(batches):
        worker_id = rng.choice(worker_ids)
        seqs[worker_id] += 1
        stored = _fresh(rng, 16)
        prepared.append(
            KvEvents(
                event_id=f"bench-{worker_id}-{seqs[worker_id]}",
                occurred_at=0.0,
                worker_id=worker_id,
                model=MODEL,
                block_size=BLOCK_SIZE,
                seq=seqs[worker_id],
                changes=[
                    KvCacheChange(kind="stored", block_hashes=stored),
                    KvCacheChange(kind="removed", block_hashes=stored[:4]),
                ],
            )
        )
    started = time.perf_counter()
    for batch in prepared:
        index.apply(batch)
    return batches / max(1e-9, time.perf_counter() - started)


def _time_overlaps(
    index: KvIndex, requests: list[tuple[str, list[int]]], clock: Callable[[], int]
) -> list[float]:
    """µs per `overlaps()` call, in request order, with the cyclic GC off."""
    timings: list[float] = []
    gc.disable()
    try:
        for _, hashes in requests:
            t0 = clock()
            index.overlaps(hashes)
            timings.append((clock() - t0) / 1000)
    finally:
        gc.enable()
    return timings


def _time_decisions(
    index: KvIndex,
    requests: list[tuple[str, list[int]]],
    clock: Callable[[], int] = time.perf_counter_ns,
    placements: list[str] | None = None,
) -> list[float]:
    """µs per decision as the router makes it: `policy.place` (the seven-axis policy, with its
    `matches` query on the index) over every worker: a prefill and a decode pool, half each, of
    H100s and H200s. Heartbeats (every worker's state anew) every 200 decisions, untimed.
    `placements`: each decision's outcome is appended to it (its repr), to hold a change to the
    policy to the same decisions."""
    state = RouterState()
    speeds = {gpu: speed_for(gpu, MODEL) for gpu in ("H100", "H200")}

    def heartbeat(tick: int) -> None:
        for i, worker_id in enumerate(index.worker_ids):
            gpu = "H200" if i % 4 >= 2 else "H100"
            speed = speeds[gpu]
            assert speed is not None
            state.observe(
                WorkerView(
                    worker_id=worker_id,
                    role="prefill" if i % 2 else "decode",
                    model=MODEL,
                    block_size=BLOCK_SIZE,
                    queue_depth=(i + tick) % 7,
                    running=(i + tick) % 5,
                    kv_blocks_total=20_000,
                    kv_blocks_used=(i * 37 + tick) % 20_000,
                    heartbeat_at=1e9,
                    gpu_type=gpu,
                    price_per_hour=3.8 if gpu == "H200" else 3.0,
                    speed=speed,
                    queued_tokens=((i + tick) % 7) * 900,
                )
            )

    timings: list[float] = []
    gc.disable()
    try:
        for n, (_, hashes) in enumerate(requests):
            if n % 200 == 0:
                heartbeat(n)
            request = RouteRequest(
                request_id=f"r{n}",
                tenant="bench",
                model=MODEL,
                block_size=BLOCK_SIZE,
                block_hashes=hashes,
                prompt_tokens=len(hashes) * BLOCK_SIZE,
                max_tokens=256,
                deadline_at=1e9 + 30.0 if n % 3 == 0 else None,
            )
            t0 = clock()
            decision = place(state, request, index, 1e9)
            timings.append((clock() - t0) / 1000)
            if placements is not None:
                placements.append(repr(decision))
    finally:
        gc.enable()
    timings.sort()
    return timings


def run_router_bench(
    *,
    workers: int = 1000,
    blocks: int = 10_000_000,
    requests: int = 5000,
    seed: int = 7,
    console: Console | None = None,
    placements_out: str | None = None,
) -> RouterBenchResult:
    console = console or Console()
    console.print(
        f"[bold]router KV index[/]: {workers:,} workers, {blocks:,} indexed blocks "
        f"(block size {BLOCK_SIZE}), {requests:,} requests of {REQUEST_BLOCKS[0]}-{REQUEST_BLOCKS[1]} blocks"
    )
    gc.collect()
    rss_before = _rss_bytes()
    started = time.perf_counter()
    index, prompts, chains = build_index(workers=workers, blocks=blocks, seed=seed)
    build_s = time.perf_counter() - started
    gc.collect()
    rss_mib = (_rss_bytes() - rss_before) / 2**20
    stats = index.stats()
    console.print(
        f"built in {build_s:.1f} s: {stats['blocks']:,} (worker, block) pairs, "
        f"{stats['distinct_blocks']:,} distinct blocks, {rss_mib:,.0f} MiB RSS "
        f"({rss_mib * 2**20 / max(1, stats['blocks']):.0f} bytes per pair; includes the bench's own "
        f"sample chains)"
    )

    timed = _requests(requests, prompts, chains, seed)
    for _, hashes in timed[:200]:  # warm up
        index.overlaps(hashes)
    wall = _time_overlaps(index, timed, time.perf_counter_ns)
    # CPU time of this thread: the same work without the time other processes take from it.
    cpu = sorted(_time_overlaps(index, timed, time.thread_time_ns))
    matched_workers = [len(index.overlaps(hashes)) for _, hashes in timed]
    # The same requests with the index's group cache off: every shared-prefix exit computed afresh.
    cache_size, index.group_cache_size = index.group_cache_size, 0
    index.clear_group_cache()
    cold = sorted(_time_overlaps(index, timed, time.perf_counter_ns))
    index.group_cache_size = cache_size
    placements: list[str] = []
    decisions = _time_decisions(index, timed[:2000], placements=placements)
    if placements_out is not None:
        with open(placements_out, "w") as out:
            out.writelines(f"{line}\n" for line in placements)
    decisions_cpu = _time_decisions(index, timed[:2000], time.thread_time_ns)
    apply_rate = _time_apply(index, 20_000, seed)

    by_kind: dict[str, list[float]] = {}
    mean_matched: dict[str, list[int]] = {}
    for (kind, _), elapsed_us, n in zip(timed, wall, matched_workers, strict=True):
        by_kind.setdefault(kind, []).append(elapsed_us)
        mean_matched.setdefault(kind, []).append(n)
    everything = sorted(wall)
    table = Table(title="overlaps(): every worker's matched prefix for one request (wall clock)")
    for column in ("requests", "n", "workers matched (mean)", "p50 µs", "p90 µs", "p99 µs", "max µs"):
        table.add_column(column, justify="right" if column != "requests" else "left")
    for kind, values in sorted(by_kind.items()):
        values.sort()
        table.add_row(
            kind,
            f"{len(values):,}",
            f"{sum(mean_matched[kind]) / len(mean_matched[kind]):.0f}",
            f"{_percentile(values, 0.50):.0f}",
            f"{_percentile(values, 0.90):.0f}",
            f"{_percentile(values, 0.99):.0f}",
            f"{values[-1]:.0f}",
        )
    p50, p90, p99 = (_percentile(everything, q) for q in (0.50, 0.90, 0.99))
    table.add_row(
        "[bold]all[/]",
        f"{len(everything):,}",
        f"{sum(matched_workers) / max(1, len(matched_workers)):.0f}",
        f"{p50:.0f}",
        f"{p90:.0f}",
        f"[bold]{p99:.0f}[/]",
        f"{everything[-1]:.0f}",
    )
    console.print(table)
    cpu_p99 = _percentile(cpu, 0.99)
    console.print(
        f"all, in this thread's CPU time: p50 {_percentile(cpu, 0.5):.0f} µs, "
        f"p90 {_percentile(cpu, 0.9):.0f} µs, p99 {cpu_p99:.0f} µs, max {cpu[-1]:.0f} µs"
    )
    console.print(
        f"all, with the group cache off (no reuse of worker-id groups across requests): "
        f"p50 {_percentile(cold, 0.5):.0f} µs, p99 {_percentile(cold, 0.99):.0f} µs, max {cold[-1]:.0f} µs"
    )
    console.print(
        f"whole decision (policy.place over {workers:,} workers, the index's match included): "
        f"p50 {_percentile(decisions, 0.5):.0f} µs, p99 {_percentile(decisions, 0.99):.0f} µs wall; "
        f"p50 {_percentile(decisions_cpu, 0.5):.0f} µs, p99 {_percentile(decisions_cpu, 0.99):.0f} µs "
        f"in this thread's CPU time (target: p99 under {TARGET_P99_US:.0f} µs)"
    )
    console.print(f"apply(): {apply_rate:,.0f} event batches/s (16 stored + 4 removed blocks each)")
    decision_p99 = _percentile(decisions, 0.99)
    verdict = "[green]meets[/]" if decision_p99 < TARGET_P99_US else "[red]misses[/]"
    console.print(
        f"target: decision latency p99 under {TARGET_P99_US:.0f} µs with 1,000 workers and 10,000,000 "
        f"indexed blocks: {verdict} it here (wall p99 {decision_p99:.0f} µs, CPU p99 "
        f"{_percentile(decisions_cpu, 0.99):.0f} µs, with {workers:,} workers and {stats['blocks']:,} blocks)"
    )
    if placements_out is not None:
        console.print(f"wrote the {len(placements):,} decisions to {placements_out}")
    return RouterBenchResult(
        workers=workers,
        indexed_blocks=stats["blocks"],
        distinct_blocks=stats["distinct_blocks"],
        build_s=build_s,
        rss_mib=rss_mib,
        p50_us=p50,
        p90_us=p90,
        p99_us=p99,
        max_us=everything[-1] if everything else 0.0,
        p99_by_kind_us={kind: _percentile(v, 0.99) for kind, v in by_kind.items()},
        p99_cpu_us=cpu_p99,
        p99_cold_us=_percentile(cold, 0.99),
        decision_p99_us=decision_p99,
        decision_p99_cpu_us=_percentile(decisions_cpu, 0.99),
        apply_batches_per_s=apply_rate,
    )
