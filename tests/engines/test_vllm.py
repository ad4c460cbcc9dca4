"""The vLLM engine on a real model: needs the `vllm` extra, a CUDA GPU and a small local model.

Set RIPPLEMESH_VLLM_MODEL to a model directory (config.json, tokenizer, weights: e.g. Qwen2.5-0.5B
or SmolLM-135M). `services/engines/vllm/gpu_check.sh` runs this file in one go on a GPU machine.
Everywhere else the module is skipped, with the reason.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

SKIP_REASON = "vLLM engine tests need the vllm extra and a CUDA GPU"

# Ask torch through NVML whether there is a GPU, so this process does not initialise CUDA before
# vLLM starts its engine processes; and have vLLM spawn them rather than fork a pytest process.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

pytest.importorskip("vllm", reason=SKIP_REASON)
torch = pytest.importorskip("torch", reason=SKIP_REASON)
if not torch.cuda.is_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)
MODEL_PATH = os.environ.get("RIPPLEMESH_VLLM_MODEL", "")
if not MODEL_PATH:
    pytest.skip(
        "vLLM engine tests need RIPPLEMESH_VLLM_MODEL: a small local model directory",
        allow_module_level=True,
    )

import pytest_asyncio  # noqa: E402

from schemas.events import InferenceRequest, KvHandle  # noqa: E402
from services.engines.base import DecodeStep, EngineError  # noqa: E402
from services.engines.vllm import VllmEngine  # noqa: E402
from services.mesh.block_hash import chain_block_hashes  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # the first test pays for loading the model

MODEL = "vllm-test-model"
BLOCK = 16
MAX_CONTEXT = 2048
GPU_MEMORY = float(os.environ.get("RIPPLEMESH_VLLM_GPU_MEMORY", "0.35"))


def tokens(seed: int, n: int) -> list[int]:
    """Token ids every real vocabulary has (1000..19999), different for each seed."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def request(rid: str, prompt: list[int], max_tokens: int, *, model: str = MODEL) -> InferenceRequest:
    return InferenceRequest(
        request_id=rid,
        tenant="acme",
        model=model,
        api="nats",
        prompt_tokens=prompt,
        block_size=BLOCK,
        block_hashes=chain_block_hashes(prompt, BLOCK, model=model),
        max_tokens=max_tokens,
        temperature=0.0,
        submitted_at=time.time(),
    )


async def run(engine: VllmEngine, req: InferenceRequest) -> tuple[int, list[DecodeStep]]:
    result = await engine.prefill(req)
    steps = [step async for step in engine.decode(req.request_id, result.first_token_id)]
    return result.cached_tokens, steps


def vllm_engine(**extra: object) -> VllmEngine:
    return VllmEngine(
        model=MODEL,
        model_path=MODEL_PATH,
        block_size=BLOCK,
        max_context_tokens=MAX_CONTEXT,
        gpu_memory_utilization=GPU_MEMORY,
        ignore_eos=True,  # so a request streams exactly max_tokens tokens
        engine_kwargs={"enforce_eager": True},
        **extra,  # type: ignore[arg-type]
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine() -> AsyncIterator[VllmEngine]:
    engine = vllm_engine()
    await engine.start()
    yield engine
    await engine.stop()


async def test_vllm_prefill_then_decode_streams_max_tokens(engine: VllmEngine) -> None:
    assert engine.info.kv_blocks_total > 0
    req = request("vllm-stream", tokens(1, 3 * BLOCK + 5), max_tokens=12)
    result = await engine.prefill(req)
    assert result.kv.num_tokens == len(req.prompt_tokens)
    assert result.gpu_seconds > 0
    assert isinstance(engine.detokenize([result.first_token_id]), str)
    steps = [step async for step in engine.decode(req.request_id, result.first_token_id)]
    assert 1 + sum(len(step.token_ids) for step in steps) == 12
    assert steps[-1].finish_reason == "length"
    assert all(step.finish_reason is None for step in steps[:-1])
    prefill_s, decode_s = engine.gpu_seconds(req.request_id)
    assert prefill_s > 0 and decode_s > 0


async def test_vllm_prefix_reuse_reports_cached_tokens(engine: VllmEngine) -> None:
    shared = tokens(2, 6 * BLOCK)
    first, _ = await run(engine, request("vllm-prefix-1", [*shared, *tokens(3, 7)], max_tokens=2))
    second, _ = await run(engine, request("vllm-prefix-2", [*shared, *tokens(4, 9)], max_tokens=2))
    assert first == 0
    assert second >= 4 * BLOCK and second % BLOCK == 0, second


async def test_vllm_kv_events_arrive_for_stored_blocks(engine: VllmEngine) -> None:
    req = request("vllm-events", tokens(5, 4 * BLOCK + 3), max_tokens=2)
    await run(engine, req)
    stored: set[int] = set()
    deadline = time.monotonic() + 15
    while not set(req.block_hashes) <= stored and time.monotonic() < deadline:
        for event in engine.drain_kv_events():
            if event.kind == "stored":
                stored.update(event.block_hashes)
        await asyncio.sleep(0.05)
    assert set(req.block_hashes) <= stored, "vLLM's BlockStored events did not map to the prompt's blocks"
    assert set(req.block_hashes) <= set(engine.cached_block_hashes())
    assert engine.snapshot().kv_blocks_cached >= len(req.block_hashes)


async def test_vllm_abort_frees_the_request(engine: VllmEngine) -> None:
    req = request("vllm-abort", tokens(6, 2 * BLOCK), max_tokens=1500)
    result = await engine.prefill(req)
    stream = engine.decode(req.request_id, result.first_token_id)
    for _ in range(3):
        await anext(stream)
    await stream.aclose()  # the consumer goes away: the engine releases and aborts
    deadline = time.monotonic() + 15
    while engine.unfinished_in_vllm() not in (0, None) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert engine.unfinished_in_vllm() in (0, None)
    assert engine.snapshot().running == 0
    # The engine goes on serving.
    _, steps = await run(engine, request("vllm-after-abort", tokens(7, BLOCK + 1), max_tokens=3))
    assert steps[-1].finish_reason == "length"


async def test_vllm_bad_input_raises_engine_error(engine: VllmEngine, tmp_path: Path) -> None:
    too_long = request("vllm-too-long", tokens(8, engine.max_model_len), max_tokens=4)
    with pytest.raises(EngineError) as info:
        await engine.prefill(too_long)
    assert info.value.code == "invalid"
    with pytest.raises(EngineError) as info:
        await engine.prefill(request("vllm-other-model", tokens(9, 8), max_tokens=2, model="other"))
    assert info.value.code == "invalid"
    out_of_vocab = request("vllm-oov", [*tokens(10, 7), 10**9], max_tokens=2)
    with pytest.raises(EngineError) as info:
        await engine.prefill(out_of_vocab)
    assert info.value.code == "invalid"
    with pytest.raises(EngineError):
        await VllmEngine(model=MODEL, model_path=str(tmp_path / "no-such-model"), block_size=BLOCK).start()
    # Nothing leaked into vLLM.
    assert engine.unfinished_in_vllm() in (0, None)


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="disaggregated serving needs NIXL")
async def test_vllm_disaggregated_handoff_through_nixl(engine: VllmEngine) -> None:
    # `engine` holds its share of the GPU first, so the three engines fit side by side.
    common = {
        "model": MODEL,
        "model_path": MODEL_PATH,
        "block_size": BLOCK,
        "max_context_tokens": MAX_CONTEXT,
        "gpu_memory_utilization": 0.25,
        "ignore_eos": True,
        "engine_kwargs": {"enforce_eager": True},
    }
    prefill = VllmEngine(role="prefill", nixl_side_channel_port=5601, **common)
    decode = VllmEngine(role="decode", nixl_side_channel_port=5611, **common)
    await prefill.start()
    try:
        await decode.start()
        try:
            req = request("vllm-pd", tokens(11, 5 * BLOCK + 2), max_tokens=8)
            result = await prefill.prefill(req)
            payload = await prefill.export_kv(req.request_id)
            assert payload is not None
            prefill.release(req.request_id)
            handle = KvHandle(
                source_worker="prefill-0",
                num_tokens=result.kv.num_tokens,
                block_hashes=result.kv.block_hashes,
                kv_bytes=len(payload),
            )
            assert await decode.import_kv(req, handle, payload) > 0
            steps = [step async for step in decode.decode(req.request_id, result.first_token_id)]
            assert 1 + sum(len(step.token_ids) for step in steps) == 8
            assert steps[-1].finish_reason == "length"
            assert decode.gpu_seconds(req.request_id)[1] > 0
        finally:
            await decode.stop()
    finally:
        await prefill.stop()


async def test_vllm_serves_a_lora_adapter_beside_the_base_model(engine: VllmEngine, tmp_path: Path) -> None:
    """A PEFT adapter made here for the test model (random, nonzero weights) through vLLM's
    LoRARequest: its greedy output differs from the base model's, the base model's is unchanged,
    the heartbeat lists it warm, and an adapter not configured is refused."""
    import msgspec
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(MODEL_PATH)
    torch.manual_seed(3)
    config = peft.LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(base, config).save_pretrained(tmp_path / "lora")
    del base
    await engine.stop()  # one engine on the GPU at a time: the module's is started again below
    lora = vllm_engine(adapters={"test-lora": str(tmp_path / "lora")})
    await lora.start()
    try:
        prompt = tokens(11, 2 * BLOCK + 3)

        def with_adapter(rid: str, adapter: str | None) -> InferenceRequest:
            plain = request(rid, prompt, max_tokens=8)
            hashes = chain_block_hashes(prompt, BLOCK, model=MODEL, adapter=adapter)
            return msgspec.structs.replace(plain, adapter=adapter, block_hashes=hashes)

        def text(result: tuple[int, list[DecodeStep]]) -> list[int]:
            return [t for step in result[1] for t in step.token_ids]

        base_before = text(await run(lora, with_adapter("lora-base-1", None)))
        adapted = text(await run(lora, with_adapter("lora-1", "test-lora")))
        base_after = text(await run(lora, with_adapter("lora-base-2", None)))
        assert adapted != base_before and base_after == base_before
        assert lora.info.adapters == ("test-lora",) and lora.snapshot().adapters == ("test-lora",)
        with pytest.raises(EngineError, match="adapter 'other' is not served"):
            await lora.prefill(with_adapter("lora-unknown", "other"))
    finally:
        await lora.stop()
        await engine.start()
