"""The engine contract: one suite every engine kind must pass (sim, hf, vllm; see conftest.py).

It checks what the mesh relies on (services/engines/host.py and the prefill and decode workers):
prefill, streaming decode, prefix reuse and its KV events, KV hand-off between two instances,
concurrency, GPU-time accounting, the snapshot, bad input, and releasing KV.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import msgspec
import pytest

from schemas.events import InferenceRequest
from services.engines.base import DecodeStep, Engine, EngineError, KvBlockEvent, PrefillResult

if TYPE_CHECKING:  # the fixtures come from conftest.py; import it only for the types
    from tests.engines.conftest import EngineKit, EngineMaker

pytestmark = pytest.mark.timeout(600)  # a vllm engine pays for loading its model in the first test


# ------------------------------------------------------------------ helpers


async def decode_all(engine: Engine, request_id: str, first: int) -> tuple[list[int], list[DecodeStep]]:
    steps = [step async for step in engine.decode(request_id, first)]
    return [first, *(token for step in steps for token in step.token_ids)], steps


async def serve(
    engine: Engine, request: InferenceRequest
) -> tuple[PrefillResult, list[int], list[DecodeStep]]:
    """Aggregated serving: prefill, then decode on the same engine."""
    result = await engine.prefill(request)
    tokens, steps = await decode_all(engine, request.request_id, result.first_token_id)
    return result, tokens, steps


def assert_finished(request: InferenceRequest, tokens: list[int], steps: list[DecodeStep]) -> None:
    """Exactly max_tokens tokens ending with "length", or fewer ending at EOS with "stop"."""
    assert steps, "decode yielded nothing"
    finish = steps[-1].finish_reason
    assert all(step.finish_reason is None for step in steps[:-1])
    if finish == "stop":
        assert 1 <= len(tokens) <= request.max_tokens
    else:
        assert finish == "length"
        assert len(tokens) == request.max_tokens, (len(tokens), request.max_tokens)


def stored_in(events: Iterable[KvBlockEvent]) -> set[int]:
    return {h for event in events if event.kind == "stored" for h in event.block_hashes}


def replay(cache: set[int], events: Iterable[KvBlockEvent]) -> tuple[set[int], set[int]]:
    """Apply KV events to a router's view of the cache; returns (stored, removed) hashes."""
    stored: set[int] = set()
    removed: set[int] = set()
    for event in events:
        if event.kind == "stored":
            cache.update(event.block_hashes)
            stored.update(event.block_hashes)
        elif event.kind == "removed":
            cache.difference_update(event.block_hashes)
            removed.update(event.block_hashes)
        else:
            cache.clear()
    return stored, removed


async def eventually(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


# ------------------------------------------------------------------ the contract


async def test_prefill_returns_a_first_token_and_kv_covering_the_prompt(
    kit: EngineKit, new_engine: EngineMaker
) -> None:
    engine = await new_engine()
    prompt = kit.tokens(1, 3 * kit.block_size + 5)
    request = kit.request("c-prefill", prompt, max_tokens=4)
    result = await engine.prefill(request)
    assert isinstance(result.first_token_id, int) and result.first_token_id >= 0
    assert isinstance(engine.detokenize([result.first_token_id]), str)
    assert result.cached_tokens == 0
    assert result.gpu_seconds > 0
    assert result.kv.num_tokens == len(prompt)
    assert result.kv.block_hashes == request.block_hashes
    assert result.kv.kv_bytes > 0
    engine.release(request.request_id)


async def test_decode_streams_max_tokens_in_total(kit: EngineKit, new_engine: EngineMaker) -> None:
    engine = await new_engine()
    request = kit.request("c-decode", kit.tokens(2, 40), max_tokens=12)
    _, tokens, steps = await serve(engine, request)
    assert_finished(request, tokens, steps)
    assert all(isinstance(t, int) for t in tokens)
    # max_tokens=1: the prefill's token is the whole output.
    single = kit.request("c-decode-1", kit.tokens(3, 20), max_tokens=1)
    _, tokens, steps = await serve(engine, single)
    assert len(tokens) == 1 and steps[-1].finish_reason in ("length", "stop")


async def test_a_shared_prefix_is_reused_and_not_stored_again(
    kit: EngineKit, new_engine: EngineMaker
) -> None:
    engine = await new_engine()
    block = kit.block_size
    shared = kit.tokens(4, 6 * block)
    first = kit.request("c-prefix-1", [*shared, *kit.tokens(5, 7)], max_tokens=2)
    result, _, _ = await serve(engine, first)
    assert result.cached_tokens == 0
    seen: list[KvBlockEvent] = []

    def first_blocks_stored() -> bool:
        seen.extend(engine.drain_kv_events())
        return set(first.block_hashes) <= stored_in(seen)

    await eventually(first_blocks_stored)
    assert set(first.block_hashes) <= set(engine.cached_block_hashes())

    second = kit.request("c-prefix-2", [*shared, *kit.tokens(6, 9)], max_tokens=2)
    result, _, _ = await serve(engine, second)
    assert result.cached_tokens >= block, result.cached_tokens
    assert result.cached_tokens <= len(shared)
    await asyncio.sleep(0.05)  # engines that publish events from another thread or process
    again = stored_in(engine.drain_kv_events())
    assert not again & set(second.block_hashes[:6]), "shared blocks were announced as stored again"


async def test_kv_exported_to_a_second_instance_decodes_as_aggregated_serving(
    kit: EngineKit, new_engine: EngineMaker
) -> None:
    aggregated = await new_engine()
    producer = await new_engine(role="prefill")
    consumer = await new_engine(role="decode")
    prompt = kit.tokens(7, 5 * kit.block_size + 3)
    _, expected, _ = await serve(aggregated, kit.request("c-handoff-agg", prompt, max_tokens=10))

    request = kit.request("c-handoff", prompt, max_tokens=10)
    result = await producer.prefill(request)
    payload = await producer.export_kv(request.request_id)
    producer.release(request.request_id)
    kv = msgspec.structs.replace(result.kv, source_worker="producer")
    seconds = await consumer.import_kv(request, kv, payload)
    assert seconds >= 0
    tokens, steps = await decode_all(consumer, request.request_id, result.first_token_id)
    assert_finished(request, tokens, steps)
    assert tokens == expected


async def test_concurrent_requests_all_complete(kit: EngineKit, new_engine: EngineMaker) -> None:
    engine = await new_engine()
    requests = [
        kit.request(f"c-concurrent-{i}", kit.tokens(100 + i, 20 + 7 * i), max_tokens=4 + i) for i in range(8)
    ]
    served = await asyncio.wait_for(asyncio.gather(*(serve(engine, r) for r in requests)), timeout=300)
    for request, (_, tokens, steps) in zip(requests, served, strict=True):
        assert_finished(request, tokens, steps)
    snapshot = engine.snapshot()
    assert snapshot.running == 0 and snapshot.queue_depth == 0


async def test_an_interactive_request_goes_before_queued_batch_lines(
    kit: EngineKit, new_engine: EngineMaker
) -> None:
    """Waiting work is served interactive first (services/engines/scheduling.py): a request
    arriving while Batch API lines queue has its first token before the last of them, as it would
    not first come, first served. The lines' prompts overflow one step's token budget (the sim
    engine's 8192), so some are still waiting when it comes."""
    engine = await new_engine()
    prompt_len = kit.max_context_tokens * 5 // 8
    lines = [
        msgspec.structs.replace(
            kit.request(f"c-batch-{i}", kit.tokens(120 + i, prompt_len), max_tokens=2), service_class="batch"
        )
        for i in range(8)
    ]
    interactive = kit.request("c-interactive", kit.tokens(130, prompt_len), max_tokens=2)
    order: list[str] = []

    async def first_token(request: InferenceRequest) -> None:
        await engine.prefill(request)
        order.append(request.request_id)

    queued = [asyncio.create_task(first_token(line)) for line in lines]
    # Until the engine has taken lines from its queue (without letting a virtual clock run).
    for _ in range(100_000):
        await asyncio.sleep(0 if kit.kind == "sim" else 0.001)
        if engine.snapshot().queue_depth < len(lines):
            break
    waiting = engine.snapshot().queue_depth
    await asyncio.wait_for(asyncio.gather(first_token(interactive), *queued), timeout=300)
    if kit.kind == "vllm" and waiting == 0:
        pytest.skip("vLLM scheduled every line before the interactive request came")
    assert order.index(interactive.request_id) < order.index(lines[-1].request_id), order
    for request in (*lines, interactive):
        engine.release(request.request_id)


async def test_gpu_seconds_are_split_into_prefill_and_decode(kit: EngineKit, new_engine: EngineMaker) -> None:
    engine = await new_engine()
    request = kit.request("c-gpu", kit.tokens(8, 50), max_tokens=6)
    result, tokens, steps = await serve(engine, request)
    assert_finished(request, tokens, steps)
    prefill_s, decode_s = engine.gpu_seconds(request.request_id)
    assert prefill_s > 0 and decode_s > 0
    assert result.gpu_seconds > 0


async def test_snapshot_fields_are_sane(kit: EngineKit, new_engine: EngineMaker) -> None:
    engine = await new_engine()
    total = engine.info.kv_blocks_total
    assert total > 0 and engine.info.block_size == kit.block_size and engine.info.model == kit.model

    def sane() -> None:
        s = engine.snapshot()
        assert 0 <= s.kv_blocks_used <= total
        assert 0 <= s.kv_blocks_cached <= total
        assert s.queue_depth >= 0 and s.running >= 0 and s.tokens_per_s >= 0
        assert s.preemptions >= 0
        # What the router weighs beside the counts, where the engine reports it.
        if s.kv_blocks_free is not None:
            assert 0 <= s.kv_blocks_free <= total - s.kv_blocks_used
        if s.queued_tokens is not None:
            assert s.queued_tokens >= s.queue_depth  # a waiting request has a token to prefill
        if s.context_tokens is not None:
            assert s.context_tokens >= s.running  # a running one has its prompt's KV

    reports = engine.snapshot()
    sane()
    request = kit.request("c-snapshot", kit.tokens(9, 40), max_tokens=24)
    task = asyncio.create_task(serve(engine, request))
    await eventually(lambda: engine.snapshot().running >= 1 or task.done())
    sane()
    assert engine.snapshot().kv_blocks_used >= 1 or task.done()
    _, tokens, steps = await task
    assert_finished(request, tokens, steps)
    sane()
    await eventually(lambda: engine.snapshot().running == 0 and engine.snapshot().queue_depth == 0)
    idle = engine.snapshot()
    assert idle.tokens_per_s > 0
    if reports.kv_blocks_free is not None:
        # Idle, the request's blocks are cached or free; none is both.
        assert idle.kv_blocks_free is not None and idle.kv_blocks_used == 0
        assert idle.kv_blocks_free + idle.kv_blocks_cached <= total
        assert idle.queued_tokens == 0 and idle.context_tokens == 0


async def test_kv_events_and_the_dump_agree_through_eviction(kit: EngineKit, new_engine: EngineMaker) -> None:
    engine = await new_engine(kv_cache_tokens=16 * kit.block_size)
    if not kit.sized_cache or engine.info.kv_blocks_total > 16:
        pytest.skip(f"{kit.kind}: the engine factory gives no way to build a 16-block KV cache")
    view: set[int] = set()
    replay(view, engine.drain_kv_events())
    stored_ever: set[int] = set()
    removed_ever: set[int] = set()
    requests = [kit.request(f"c-evict-{i}", kit.tokens(200 + i, 4 * kit.block_size + 3)) for i in range(8)]
    for request in requests:
        await serve(engine, msgspec.structs.replace(request, max_tokens=3))
        await asyncio.sleep(0.02)
        stored, removed = replay(view, engine.drain_kv_events())
        stored_ever |= stored
        removed_ever |= removed
        dump = set(engine.cached_block_hashes())
        assert view == dump
        assert set(request.block_hashes) <= dump  # just stored
    assert removed_ever, "eight 4-block prompts in a 16-block cache must evict"
    assert removed_ever <= stored_ever
    assert not set(requests[0].block_hashes) & set(engine.cached_block_hashes())


async def test_bad_input_raises_engine_error_and_the_engine_keeps_serving(
    kit: EngineKit, new_engine: EngineMaker
) -> None:
    engine = await new_engine()
    consumer = await new_engine(role="decode")
    # A long request decoding the whole time: it must be untouched by the failures.
    busy = kit.request("c-busy", kit.tokens(10, 30), max_tokens=40)
    busy_task = asyncio.create_task(serve(engine, busy))

    with pytest.raises(EngineError):
        await engine.prefill(kit.request("c-bad-model", kit.tokens(11, 20), model="no-such-model"))
    with pytest.raises(EngineError):
        await engine.prefill(kit.request("c-bad-long", kit.tokens(12, 64), max_tokens=kit.max_context_tokens))
    with pytest.raises(EngineError):
        await engine.prefill(kit.request("c-bad-block", kit.tokens(13, 40), block_size=kit.block_size * 2))

    prompt = kit.tokens(14, 3 * kit.block_size + 2)
    request = kit.request("c-bad-kv", prompt)
    result = await engine.prefill(request)
    payload = await engine.export_kv(request.request_id)
    engine.release(request.request_id)
    kv = msgspec.structs.replace(result.kv, source_worker="producer")
    bad_imports = [
        (request, msgspec.structs.replace(kv, num_tokens=kv.num_tokens - 1)),
        (request, msgspec.structs.replace(kv, block_hashes=[h ^ 1 for h in kv.block_hashes])),
        (kit.request("c-bad-kv", prompt, block_size=kit.block_size * 2), kv),
    ]
    for bad_request, bad_kv in bad_imports:
        with pytest.raises(EngineError):
            await consumer.import_kv(bad_request, bad_kv, payload)
        consumer.release(bad_request.request_id)

    # Both engines go on serving, and the busy request finished normally.
    _, tokens, steps = await serve(engine, kit.request("c-after-bad", kit.tokens(15, 30), max_tokens=5))
    assert len(tokens) >= 1 and steps[-1].finish_reason in ("length", "stop")
    seconds = await consumer.import_kv(request, kv, payload)
    assert seconds >= 0
    tokens, steps = await decode_all(consumer, request.request_id, result.first_token_id)
    assert_finished(request, tokens, steps)
    _, tokens, steps = await asyncio.wait_for(busy_task, timeout=300)
    assert_finished(busy, tokens, steps)


async def test_release_frees_the_blocks(kit: EngineKit, new_engine: EngineMaker) -> None:
    engine = await new_engine()
    idle = engine.snapshot().kv_blocks_used
    request = kit.request("c-release", kit.tokens(16, 4 * kit.block_size + 9), max_tokens=8)
    await engine.prefill(request)
    assert engine.snapshot().kv_blocks_used > idle
    engine.release(request.request_id)
    await eventually(lambda: engine.snapshot().kv_blocks_used == idle)
    engine.release(request.request_id)  # twice is harmless
    engine.release("c-never-seen")
    # Its full blocks stay cached for the next request.
    again = kit.request("c-release-again", request.prompt_tokens, max_tokens=2)
    result, _, _ = await serve(engine, again)
    assert result.cached_tokens >= kit.block_size
