"""The hf engine with real torch: prefix reuse, KV hand-off between processes, batched decoding,
GPU-time accounting, log-probabilities and bad input. The model is a tiny random Llama (no download)."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import msgspec  # noqa: E402

from schemas.events import InferenceRequest, KvHandle, OutputConstraint, TokenLogprob  # noqa: E402
from services.engines.base import DecodeStep, EngineError, PrefillResult  # noqa: E402
from services.engines.hf.engine import HfEngine  # noqa: E402
from services.mesh.block_hash import chain_block_hashes  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
BLOCK = 16
VOCAB = 700  # prompt token ids drawn below this (the tiny model's vocabulary is the sim tokenizer's + EOS)


def make_request(
    request_id: str,
    tokens: list[int],
    *,
    max_tokens: int = 8,
    model: str = MODEL,
    block_size: int = BLOCK,
    temperature: float = 0.0,
    logprobs: int | None = None,
    constraint: OutputConstraint | None = None,
) -> InferenceRequest:
    return InferenceRequest(
        request_id=request_id,
        tenant="acme",
        model=model,
        api="nats",
        prompt_tokens=tokens,
        block_size=block_size,
        block_hashes=chain_block_hashes(tokens, block_size, model=model),
        max_tokens=max_tokens,
        temperature=temperature,
        submitted_at=time.time(),
        logprobs=logprobs,
        constraint=constraint,
    )


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


async def decode_all(engine: HfEngine, request_id: str, first: int) -> tuple[list[int], str | None]:
    tokens, finish = [first], None
    async for step in engine.decode(request_id, first):
        tokens += step.token_ids
        finish = step.finish_reason
    return tokens, finish


async def serve(engine: HfEngine, request: InferenceRequest) -> tuple[PrefillResult, list[int], str | None]:
    """Aggregated serving: prefill then decode on the same engine."""
    result = await engine.prefill(request)
    tokens, finish = await decode_all(engine, request.request_id, result.first_token_id)
    return result, tokens, finish


async def started(engine: HfEngine) -> HfEngine:
    await engine.start()
    return engine


@pytest.fixture
async def engine():
    running = await started(HfEngine(model=MODEL, block_size=BLOCK))
    yield running
    await running.stop()


@pytest.fixture
async def cpu_engine():
    """For wall-time checks: a tiny model on a GPU is bound by kernel launches, not by tokens."""
    running = await started(HfEngine(model=MODEL, block_size=BLOCK, device="cpu"))
    yield running
    await running.stop()


# ---------------------------------------------------------------- prefix cache


async def test_prefix_reuse_is_counted_correct_and_faster(cpu_engine: HfEngine) -> None:
    engine = cpu_engine
    rng = random.Random(7)
    await serve(engine, make_request("warm-up", random_tokens(rng, 40)))
    prefix = random_tokens(rng, 2048)
    first, _, _ = await serve(engine, make_request("first", [*prefix, *random_tokens(rng, 16)], max_tokens=1))
    assert first.cached_tokens == 0
    stored = {h for event in engine.drain_kv_events() if event.kind == "stored" for h in event.block_hashes}
    prefix_hashes = chain_block_hashes(prefix, BLOCK, model=MODEL)
    assert set(prefix_hashes) <= stored
    assert set(prefix_hashes) <= set(engine.cached_block_hashes())

    cold_s, cached_s = [], []
    for i in range(3):
        cold = make_request(f"cold-{i}", random_tokens(rng, 2048 + 16), max_tokens=1)
        t0 = time.perf_counter()
        result = await engine.prefill(cold)
        cold_s.append(time.perf_counter() - t0)
        engine.release(cold.request_id)
        assert result.cached_tokens == 0

        computed = engine.stats.prefill_tokens_computed
        warm = make_request(f"warm-{i}", [*prefix, *random_tokens(rng, 16)], max_tokens=1)
        t0 = time.perf_counter()
        result = await engine.prefill(warm)
        cached_s.append(time.perf_counter() - t0)
        engine.release(warm.request_id)
        assert result.cached_tokens == 2048
        assert engine.stats.prefill_tokens_computed - computed == 16  # only the new tokens

    cold_ms, cached_ms = statistics.median(cold_s) * 1000, statistics.median(cached_s) * 1000
    print(f"prefill of 2064 tokens: cold {cold_ms:.1f} ms, 2048 cached {cached_ms:.1f} ms")
    assert cached_ms < 0.6 * cold_ms

    # The reused KV is the real thing: same output as a fresh engine computing everything.
    prompt = [*prefix, *random_tokens(rng, 5)]
    reused, tokens, _ = await serve(engine, make_request("reuse", prompt, max_tokens=12))
    assert reused.cached_tokens == 2048
    fresh = await started(HfEngine(model=MODEL, block_size=BLOCK, device="cpu"))
    try:
        cold_result, cold_tokens, _ = await serve(fresh, make_request("reuse", prompt, max_tokens=12))
    finally:
        await fresh.stop()
    assert cold_result.cached_tokens == 0
    assert tokens == cold_tokens


async def test_fully_cached_prompt_still_computes_its_last_token(engine: HfEngine) -> None:
    prompt = random_tokens(random.Random(3), 64)  # exactly 4 blocks
    _, tokens, _ = await serve(engine, make_request("a", prompt))
    again, tokens_again, _ = await serve(engine, make_request("b", prompt))
    assert again.cached_tokens == 63
    assert tokens_again == tokens


async def test_lru_eviction_emits_removed_and_keeps_the_shared_head() -> None:
    # 8 blocks of 16 tokens in all.
    engine = await started(HfEngine(model=MODEL, block_size=BLOCK, kv_cache_tokens=8 * BLOCK))
    try:
        rng = random.Random(5)
        a, b = random_tokens(rng, 64), random_tokens(rng, 64)
        a_hashes, b_hashes = (chain_block_hashes(t, BLOCK, model=MODEL) for t in (a, b))
        await serve(engine, make_request("a", a, max_tokens=1))
        assert engine.snapshot().kv_blocks_used == 0 and engine.snapshot().kv_blocks_cached == 4
        await serve(engine, make_request("b", b, max_tokens=1))  # 5 blocks: evicts a's last one
        events = engine.drain_kv_events()
        assert [(e.kind, list(e.block_hashes)) for e in events] == [
            ("stored", a_hashes),
            ("removed", [a_hashes[-1]]),
            ("stored", b_hashes),
        ]
        assert sorted(engine.cached_block_hashes()) == sorted(a_hashes[:3] + b_hashes)
        result, _, _ = await serve(engine, make_request("a2", a, max_tokens=1))
        assert result.cached_tokens == 48
        with pytest.raises(EngineError, match="more KV blocks"):
            await engine.prefill(make_request("huge", random_tokens(rng, 130), max_tokens=1))
    finally:
        await engine.stop()


# ---------------------------------------------------------------- disaggregated serving

PREFILL_WORKER = textwrap.dedent(
    """
    import asyncio, json, sys
    import msgspec
    from schemas.events import InferenceRequest
    from services.engines.hf.engine import HfEngine
    from services.mesh.bus import Bus
    from services.mesh.nats_auth import load_credentials

    async def main(url, raw, credentials):
        request = msgspec.json.decode(raw, type=InferenceRequest)
        engine = HfEngine(model=request.model, block_size=request.block_size)
        await engine.start()
        result = await engine.prefill(request)
        payload = await engine.export_kv(request.request_id)
        engine.release(request.request_id)
        await engine.stop()
        bus = await Bus.connect(url, "hf-prefill-test", credentials=load_credentials(credentials))
        name = request.request_id + "-prefill-proc"
        await (await bus.kv_objects()).put(name, payload)
        await bus.close()
        print(json.dumps({"first_token_id": result.first_token_id, "object_name": name,
                          "num_tokens": result.kv.num_tokens, "kv_bytes": len(payload)}))

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
    """
)


async def test_kv_hand_off_between_processes_over_nats_object_store(
    bus, nats_server, nats_credentials
) -> None:
    rng = random.Random(11)
    request = make_request("disagg-1", random_tokens(rng, 300), max_tokens=24)

    # Prefill worker: another OS process, shipping the KV through the JetStream Object Store.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        PREFILL_WORKER,
        nats_server.url,
        msgspec.json.encode(request).decode(),
        str(nats_credentials["services"]),
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=150)
    assert process.returncode == 0, err.decode()[-3000:]
    handed = msgspec.json.decode(out.strip().splitlines()[-1])

    # Decode worker: this process.
    payload = (await (await bus.kv_objects()).get(handed["object_name"])).data
    kv = KvHandle(
        source_worker="prefill-proc",
        num_tokens=handed["num_tokens"],
        block_hashes=request.block_hashes,
        kv_bytes=handed["kv_bytes"],
        object_name=handed["object_name"],
    )
    decoder = await started(HfEngine(model=MODEL, block_size=BLOCK))
    aggregated = await started(HfEngine(model=MODEL, block_size=BLOCK))
    try:
        seconds = await decoder.import_kv(request, kv, payload)
        assert seconds >= 0
        # Imported full blocks join the decode worker's prefix cache.
        assert set(request.block_hashes) <= set(decoder.cached_block_hashes())
        disagg_tokens, disagg_finish = await decode_all(decoder, request.request_id, handed["first_token_id"])
        _, agg_tokens, agg_finish = await serve(aggregated, request)
    finally:
        await decoder.stop()
        await aggregated.stop()
    assert disagg_tokens == agg_tokens
    assert len(agg_tokens) == 24 and disagg_finish == agg_finish == "length"


async def test_sampled_decode_after_import_matches_aggregated() -> None:
    rng = random.Random(13)
    request = make_request("sampled", random_tokens(rng, 90), max_tokens=16, temperature=0.9)
    prefiller, decoder, aggregated = [
        await started(HfEngine(model=MODEL, block_size=BLOCK)) for _ in range(3)
    ]
    try:
        result = await prefiller.prefill(request)
        payload = await prefiller.export_kv(request.request_id)
        prefiller.release(request.request_id)
        assert payload is not None
        await decoder.import_kv(request, result.kv, payload)
        tokens, _ = await decode_all(decoder, request.request_id, result.first_token_id)
        _, agg_tokens, _ = await serve(aggregated, request)
        _, greedy_tokens, _ = await serve(
            aggregated, make_request("greedy", request.prompt_tokens, max_tokens=16)
        )
    finally:
        for e in (prefiller, decoder, aggregated):
            await e.stop()
    assert tokens == agg_tokens
    assert tokens != greedy_tokens  # it did sample


# ---------------------------------------------------------------- batching and accounting


async def test_concurrent_decodes_advance_together_in_one_forward_pass(engine: HfEngine) -> None:
    rng = random.Random(17)
    requests = [
        make_request(f"alone-{i}", random_tokens(rng, n), max_tokens=24)
        for i, n in enumerate((9, 40, 75, 130))
    ]
    alone = [(await serve(engine, r))[1:] for r in requests]

    steps, tokens = engine.stats.decode_steps, engine.stats.decode_tokens
    together = [msgspec.structs.replace(r, request_id=f"together-{i}") for i, r in enumerate(requests)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(serve(engine, r) for r in together))
    elapsed = time.perf_counter() - t0
    steps, tokens = engine.stats.decode_steps - steps, engine.stats.decode_tokens - tokens
    generated = sum(len(out) for _, out, _ in results)
    print(f"4 requests: {steps} batched steps for {tokens} decode tokens, {generated / elapsed:.0f} tokens/s")
    # One decode forward per token after the first (a sampled EOS takes a step but is not streamed).
    assert tokens == sum(len(out) - 1 + (finish == "stop") for _, out, finish in results)
    assert steps < tokens / 2
    assert engine.stats.max_batch == 4
    # Batching (left padding, per-row positions) does not change what each request generates.
    assert [r[1:] for r in results] == alone
    for r in together:
        prefill_s, decode_s = engine.gpu_seconds(r.request_id)
        assert prefill_s > 0 and decode_s > 0


async def test_gpu_seconds_split_into_prefill_and_decode(engine: HfEngine) -> None:
    request = make_request("gpu", random_tokens(random.Random(19), 200), max_tokens=6)
    result = await engine.prefill(request)
    assert result.gpu_seconds > 0
    assert engine.gpu_seconds("gpu") == (result.gpu_seconds, 0.0)
    tokens, finish = await decode_all(engine, "gpu", result.first_token_id)
    assert len(tokens) == 6 and finish == "length"
    prefill_s, decode_s = engine.gpu_seconds("gpu")
    assert prefill_s == result.gpu_seconds and decode_s > 0
    assert engine.gpu_seconds("gpu") == (0.0, 0.0)  # reported once released
    snap = engine.snapshot()
    assert snap.kv_blocks_used == 0 and snap.running == 0 and snap.tokens_per_s > 0


async def test_forward_passes_run_off_the_event_loop(cpu_engine: HfEngine) -> None:
    engine = cpu_engine
    rng = random.Random(23)
    await serve(engine, make_request("warm", random_tokens(rng, 20), max_tokens=1))
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    t0 = time.perf_counter()
    await engine.prefill(make_request("long", random_tokens(rng, 3500), max_tokens=1))
    elapsed = time.perf_counter() - t0
    done.set()
    await ticker
    engine.release("long")
    assert len(gaps) >= 10
    assert max(gaps) < elapsed / 3


async def test_eos_ends_with_stop(engine: HfEngine) -> None:
    prompt = random_tokens(random.Random(29), 50)
    _, tokens, finish = await serve(engine, make_request("free", prompt, max_tokens=20))
    assert finish == "length" and len(tokens) == 20
    k = next(i for i in range(1, 20) if tokens[i] not in tokens[:i])
    stopper = await started(HfEngine(model=MODEL, block_size=BLOCK, eos_token_ids={tokens[k]}))
    try:
        _, stopped, finish = await serve(stopper, make_request("stops", prompt, max_tokens=20))
    finally:
        await stopper.stop()
    assert finish == "stop"
    assert stopped == tokens[:k]  # the EOS token itself is not streamed


# ---------------------------------------------------------------- log-probabilities


async def serve_with_logprobs(
    engine: HfEngine, request: InferenceRequest
) -> tuple[PrefillResult, list[int], list[DecodeStep]]:
    """Aggregated serving, keeping the prefill result and every decode step."""
    result = await engine.prefill(request)
    tokens, steps = [result.first_token_id], []
    async for step in engine.decode(request.request_id, result.first_token_id):
        tokens += step.token_ids
        steps.append(step)
    return result, tokens, steps


def streamed_logprobs(result: PrefillResult, steps: list[DecodeStep]) -> list[TokenLogprob]:
    """The log-prob entries in stream order; each step has exactly one per token it streams."""
    assert result.first_logprob is not None
    entries = [result.first_logprob]
    for step in steps:
        if not step.token_ids:
            assert not step.logprobs  # a stop on EOS: nothing streamed, no entry
            continue
        assert step.logprobs is not None and len(step.logprobs) == len(step.token_ids)
        entries += step.logprobs
    return entries


def reference_logprobs(engine: HfEngine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the raw logits predicting each output token: one plain forward pass of the
    same model over prompt + output, no cache, no batching. Rows: [len(output), vocab]."""
    ids = torch.tensor([prompt + output], dtype=torch.long, device=engine.lm.device)
    with torch.inference_mode():
        logits = engine.lm.model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(output)].cpu()


def check_against_reference(
    engine: HfEngine, prompt: list[int], tokens: list[int], entries: list[TokenLogprob], k: int
) -> None:
    assert [e.token_id for e in entries] == tokens
    reference = reference_logprobs(engine, prompt, tokens)
    for position, (entry, row) in enumerate(zip(entries, reference, strict=True)):
        assert entry.token == engine.lm.tokenizer.decode([entry.token_id])
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4), position
        assert len(entry.top) == k
        values, ids = torch.topk(row, k)
        assert [a.token_id for a in entry.top] == ids.tolist()
        assert [a.logprob for a in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert [a.logprob for a in entry.top] == sorted((a.logprob for a in entry.top), reverse=True)
        assert all(a.token == engine.lm.tokenizer.decode([a.token_id]) for a in entry.top)


async def test_greedy_logprobs_are_the_models_and_the_max(engine: HfEngine) -> None:
    assert engine.info.features == frozenset({"logprobs"})
    rng = random.Random(43)
    prompt = random_tokens(rng, 40)
    plain = await serve(engine, make_request("plain", prompt, max_tokens=12))
    # The cached path too: a second request on the same prompt reuses its 2 full blocks.
    for request_id in ("lp", "lp-cached"):
        result, tokens, steps = await serve_with_logprobs(
            engine, make_request(request_id, prompt, max_tokens=12, logprobs=3)
        )
        assert tokens == plain[1]  # asking for log-probs does not change the output
        entries = streamed_logprobs(result, steps)
        assert len(entries) == 12
        for entry in entries:
            assert entry.top[0].token_id == entry.token_id
            assert entry.logprob == entry.top[0].logprob
            assert entry.logprob == max(a.logprob for a in entry.top)
            assert entry.logprob <= 0
        check_against_reference(engine, prompt, tokens, entries, 3)
    assert result.cached_tokens == 32


async def test_sampled_tokens_report_their_raw_logit_logprob(engine: HfEngine) -> None:
    rng = random.Random(47)
    prompt = random_tokens(rng, 25)
    temperature = 2.5
    # The seed is the request id's: the same id samples the same tokens, with or without log-probs.
    _, plain, _ = await serve(engine, make_request("t", prompt, max_tokens=24, temperature=temperature))
    _, greedy, _ = await serve(engine, make_request("t", prompt, max_tokens=24))
    result, tokens, steps = await serve_with_logprobs(
        engine, make_request("t", prompt, max_tokens=24, temperature=temperature, logprobs=2)
    )
    assert tokens == plain != greedy  # it sampled
    entries = streamed_logprobs(result, steps)
    check_against_reference(engine, prompt, tokens, entries, 2)
    # Not the tempered distribution's: log_softmax(logits / T) gives other values.
    full = torch.tensor([prompt + tokens], dtype=torch.long, device=engine.lm.device)
    with torch.inference_mode():
        logits = engine.lm.model(input_ids=full).logits[0].float().cpu()
    tempered = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 :]
    assert all(
        abs(entry.logprob - float(tempered[i, entry.token_id])) > 1e-2 for i, entry in enumerate(entries)
    )
    # Some sampled token was not the likeliest: its top[0] is another, with a higher log-prob.
    assert any(e.top[0].token_id != e.token_id and e.top[0].logprob > e.logprob for e in entries)


async def test_no_logprobs_unless_asked(engine: HfEngine) -> None:
    prompt = random_tokens(random.Random(53), 30)
    for temperature in (0.0, 0.8):
        result, tokens, steps = await serve_with_logprobs(
            engine, make_request(f"none-{temperature}", prompt, max_tokens=6, temperature=temperature)
        )
        assert len(tokens) == 6
        assert result.first_logprob is None
        assert all(step.logprobs is None for step in steps)


async def test_logprobs_zero_gives_the_token_alone(engine: HfEngine) -> None:
    prompt = random_tokens(random.Random(59), 20)
    result, tokens, steps = await serve_with_logprobs(
        engine, make_request("zero", prompt, max_tokens=5, logprobs=0)
    )
    entries = streamed_logprobs(result, steps)
    assert len(entries) == 5 and all(entry.top == [] for entry in entries)
    check_against_reference(engine, prompt, tokens, entries, 0)


async def test_batched_decode_mixes_requests_with_and_without_logprobs(engine: HfEngine) -> None:
    rng = random.Random(61)
    wanted: list[int | None] = [None, 3, 0, None, 20, 1]
    requests = [
        make_request(f"mix-{i}", random_tokens(rng, n), max_tokens=16, temperature=t, logprobs=k)
        for i, (n, t, k) in enumerate(
            zip((9, 40, 75, 23, 130, 51), (0, 0, 0.7, 0.7, 0, 1.2), wanted, strict=True)
        )
    ]
    alone = [await serve_with_logprobs(engine, r) for r in requests]
    steps_before = engine.stats.decode_steps
    # The same ids again (the seed is the id's), now all at once: one batch.
    together = await asyncio.gather(*(serve_with_logprobs(engine, r) for r in requests))
    assert engine.stats.max_batch == len(requests)
    assert engine.stats.decode_steps - steps_before < len(requests) * 15 / 2  # they did batch
    for request, k, (a_result, a_tokens, a_steps), (result, tokens, steps) in zip(
        requests, wanted, alone, together, strict=True
    ):
        assert tokens == a_tokens and len(tokens) == 16
        if k is None:
            assert result.first_logprob is None and all(step.logprobs is None for step in steps)
            continue
        entries, alone_entries = streamed_logprobs(result, steps), streamed_logprobs(a_result, a_steps)
        check_against_reference(engine, request.prompt_tokens, tokens, entries, k)
        for entry, single in zip(entries, alone_entries, strict=True):
            assert entry.token_id == single.token_id
            assert entry.logprob == pytest.approx(single.logprob, abs=1e-4)
            assert [a.token_id for a in entry.top] == [a.token_id for a in single.top]


async def test_eos_has_no_logprob_entry(engine: HfEngine) -> None:
    prompt = random_tokens(random.Random(67), 50)
    _, tokens, _ = await serve(engine, make_request("free", prompt, max_tokens=20))
    k = next(i for i in range(1, 20) if tokens[i] not in tokens[:i])
    stopper = await started(HfEngine(model=MODEL, block_size=BLOCK, eos_token_ids={tokens[k]}))
    try:
        result, stopped, steps = await serve_with_logprobs(
            stopper, make_request("stops", prompt, max_tokens=20, logprobs=2)
        )
    finally:
        await stopper.stop()
    assert stopped == tokens[:k]
    assert steps[-1].finish_reason == "stop" and steps[-1].token_ids == []
    entries = streamed_logprobs(result, steps)
    assert [e.token_id for e in entries] == stopped
    check_against_reference(engine, prompt, stopped, entries, 2)


async def test_constrained_output_is_refused(engine: HfEngine) -> None:
    rng = random.Random(71)
    for kind in ("json", "tool_call"):
        request = make_request(kind, random_tokens(rng, 20), constraint=OutputConstraint(kind=kind))
        with pytest.raises(EngineError, match=f"cannot force a {kind} output") as raised:
            await engine.prefill(request)
        assert raised.value.code == "invalid"
    assert engine.snapshot().kv_blocks_used == 0
    _, tokens, _ = await serve(engine, make_request("after", random_tokens(rng, 20), max_tokens=3))
    assert len(tokens) == 3


# ---------------------------------------------------------------- loading


async def test_loads_a_local_model_directory(tmp_path: Path) -> None:
    tiny = HfEngine(model=MODEL, block_size=BLOCK)
    tiny.lm.model.save_pretrained(tmp_path)  # no tokenizer files: the sim tokenizer serves
    loaded = await started(HfEngine(model="saved", model_path=str(tmp_path), block_size=BLOCK))
    await tiny.start()
    try:
        assert loaded.info.engine == "hf" and loaded.info.gpu_type == tiny.info.gpu_type
        prompt = random_tokens(random.Random(31), 33)
        _, from_dir, _ = await serve(loaded, make_request("d", prompt, model="saved"))
        _, from_seed, _ = await serve(tiny, make_request("s", prompt))
        assert from_dir == from_seed
        assert loaded.detokenize(from_dir) == tiny.detokenize(from_seed)
    finally:
        await loaded.stop()
        await tiny.stop()


def test_factory_builds_the_hf_engine() -> None:
    from services.engines.factory import ENGINES, make_engine
    from services.mesh.config import MeshConfig, ModelConfig

    config = MeshConfig(
        block_size=32,
        models=[ModelConfig(name="small", max_context_tokens=1024)],
        tenants={},
        gpu_prices_per_hour={},
    )
    built = make_engine({"engine": "hf"}, config)
    assert "hf" in ENGINES
    assert isinstance(built, HfEngine)
    assert (built.info.engine, built.info.model, built.info.block_size) == ("hf", "small", 32)
    assert built.max_context_tokens == 1024 and built.info.kv_blocks_total > 0
    with pytest.raises(EngineError, match="cannot load model"):
        make_engine({"engine": "hf", "model_path": "/nonexistent/model-dir"}, config)


# ---------------------------------------------------------------- bad input


async def test_bad_requests_fail_alone(engine: HfEngine) -> None:
    rng = random.Random(37)
    cases = {
        "context": make_request("too-long", random_tokens(rng, 4000), max_tokens=200),
        "not loaded here": make_request("other-model", random_tokens(rng, 10), model="llama-3-8b"),
        "block size": make_request("bs", random_tokens(rng, 40), block_size=8),
        "vocabulary": make_request("oov", [1, 2, 10**6]),
        "block hashes": msgspec.structs.replace(
            make_request("hashes", random_tokens(rng, 40)), block_hashes=[1, 2]
        ),
    }
    for message, request in cases.items():
        with pytest.raises(EngineError, match=message) as raised:
            await engine.prefill(request)
        assert raised.value.code == "invalid"
    with pytest.raises(EngineError, match="cannot load model"):
        HfEngine(model="missing", model_path="/nonexistent/model-dir")
    # The engine goes on serving, and nothing leaked.
    _, tokens, finish = await serve(engine, make_request("fine", random_tokens(rng, 30), max_tokens=5))
    assert len(tokens) == 5 and finish == "length"
    assert engine.snapshot().kv_blocks_used == 0


async def test_kv_that_does_not_fit_is_refused(engine: HfEngine) -> None:
    rng = random.Random(41)
    prompt = random_tokens(rng, 70)
    request = make_request("src", prompt, max_tokens=6)
    result = await engine.prefill(request)
    payload = await engine.export_kv("src")
    engine.release("src")
    assert payload is not None
    other = make_request("other", random_tokens(rng, 70), max_tokens=6)

    importer = await started(HfEngine(model=MODEL, block_size=BLOCK))
    bs8 = await started(HfEngine(model=MODEL, block_size=8))
    deeper = await started(HfEngine(model=MODEL, block_size=BLOCK, tiny_overrides={"num_hidden_layers": 3}))
    try:
        r8 = make_request("bs8", prompt, block_size=8)
        await bs8.prefill(r8)
        payload8 = await bs8.export_kv("bs8")
        assert payload8 is not None
        bad: list[tuple[HfEngine, InferenceRequest, KvHandle, bytes | None, str]] = [
            (importer, request, result.kv, payload[: len(payload) // 2], "corrupt"),
            (importer, request, result.kv, b"\x00" * 7, "not a KV file"),
            (importer, request, result.kv, b"garbage!" * 20, "corrupt"),
            (importer, request, result.kv, None, "needs the KV bytes"),
            (
                importer,
                request,
                msgspec.structs.replace(result.kv, num_tokens=69),
                payload,
                "covers 69 tokens",
            ),
            (
                importer,
                other,
                msgspec.structs.replace(result.kv, block_hashes=other.block_hashes),
                payload,
                "different prompt",
            ),
            (importer, make_request("src", prompt[:50]), result.kv, payload, "covers 70 tokens"),
            (importer, request, result.kv, payload8, "block size is 8"),
            (deeper, request, result.kv, payload, "different build"),
        ]
        for target, req, kv, data, message in bad:
            with pytest.raises(EngineError, match=message) as raised:
                await target.import_kv(req, kv, data)
            assert raised.value.code == "invalid"
            assert target.snapshot().kv_blocks_used == 0
        # The good bytes still import and decode, on the same engine that refused the bad ones.
        await importer.import_kv(request, result.kv, payload)
        tokens, finish = await decode_all(importer, "src", result.first_token_id)
        assert len(tokens) == 6 and finish == "length"
        with pytest.raises(EngineError, match="no KV"):
            await engine.export_kv("src")
        await importer.import_kv(request, result.kv, payload)
        with pytest.raises(EngineError, match="vocabulary"):
            await decode_all(importer, "src", 10**6)
        assert importer.snapshot().kv_blocks_used == 0
    finally:
        for e in (importer, bs8, deeper):
            await e.stop()


# ---------------------------------------------------------------- LoRA adapters


def _saved_adapter(path: Path, seed: int) -> Path:
    """A LoRA adapter for the tiny model, saved as PEFT saves one: random, nonzero weights
    (PEFT's default starts B at zero, an adapter that changes nothing)."""
    peft = pytest.importorskip("peft")
    from services.engines.hf.model import LoadedModel

    base = LoadedModel.tiny_llama(seed=0, device=torch.device("cpu"), max_context_tokens=4096).model
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    peft.get_peft_model(base, config).save_pretrained(path)
    return path


def _greedy_reference(adapter_dir: Path, prompt: list[int], n: int) -> list[int]:
    """The adapter's own greedy continuation: PEFT's model, whole-sequence forward passes."""
    import peft

    from services.engines.hf.model import LoadedModel

    base = LoadedModel.tiny_llama(seed=0, device=torch.device("cpu"), max_context_tokens=4096).model
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def _adapter_request(
    request_id: str, tokens: list[int], adapter: str | None, max_tokens: int = 12
) -> InferenceRequest:
    return msgspec.structs.replace(
        make_request(request_id, tokens, max_tokens=max_tokens),
        adapter=adapter,
        block_hashes=chain_block_hashes(tokens, BLOCK, model=MODEL, adapter=adapter),
    )


async def test_a_lora_adapter_is_loaded_with_peft_and_serves_beside_the_base_model(tmp_path: Path) -> None:
    adapter_dir = _saved_adapter(tmp_path / "terse", seed=5)
    engine = await started(
        HfEngine(model=MODEL, block_size=BLOCK, device="cpu", adapters={"terse": str(adapter_dir)})
    )
    try:
        assert engine.info.adapters == ("terse",) and engine.snapshot().adapters == ()
        prompt = random_tokens(random.Random(41), 37)
        _, base_before, _ = await serve(engine, _adapter_request("base-1", prompt, None))
        _, adapted, _ = await serve(engine, _adapter_request("lora-1", prompt, "terse"))
        # Loaded at its first request, and said so in the heartbeat's snapshot.
        assert engine.snapshot().adapters == ("terse",)
        assert adapted != base_before
        # What PEFT's own model generates from the same adapter, token for token.
        assert adapted == _greedy_reference(adapter_dir, prompt, len(adapted))
        # The base model is still the base model once an adapter is loaded.
        _, base_after, _ = await serve(engine, _adapter_request("base-2", prompt, None))
        assert base_after == base_before
        # Both in one decode batch: each row under its own adapter, the same tokens as alone.
        steps = engine.stats.decode_steps
        together = await asyncio.gather(
            serve(engine, _adapter_request("base-3", prompt, None)),
            serve(engine, _adapter_request("lora-2", prompt, "terse")),
        )
        assert [out for _, out, _ in together] == [base_before, adapted]
        assert engine.stats.max_batch >= 2 and engine.stats.decode_steps - steps < 2 * len(adapted)
        # The two share no prefix KV (the adapter is in the block hash): the second adapter
        # request reused the first's blocks, the base requests only theirs.
        assert together[1][0].cached_tokens > 0
        with pytest.raises(EngineError, match="adapter 'chatty' is not served"):
            await engine.prefill(_adapter_request("unknown", prompt, "chatty"))
    finally:
        await engine.stop()


def test_the_factory_gives_the_hf_engine_the_configured_adapters(tmp_path: Path) -> None:
    from services.engines.factory import make_engine
    from services.mesh.config import AdapterConfig, MeshConfig, ModelConfig

    adapter_dir = _saved_adapter(tmp_path / "terse", seed=5)
    config = MeshConfig(
        block_size=BLOCK,
        models=[
            ModelConfig(
                name=MODEL,
                adapters=[
                    AdapterConfig(name="terse", path=str(adapter_dir), load_s=0.5),
                    AdapterConfig(name="sim-only"),  # no weights to load: not served by hf
                ],
            )
        ],
        tenants={},
        gpu_prices_per_hour={},
    )
    built = make_engine({"engine": "hf", "device": "cpu"}, config)
    assert isinstance(built, HfEngine)
    assert built.info.adapters == ("terse",) and built.info.adapter_load_s == 0.5
