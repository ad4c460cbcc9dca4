"""The sim engine: continuous batching over the roofline model, with a paged prefix cache.

One scheduler loop runs steps like a serving engine does: every running sequence decodes one
token, and waiting prompts fill the rest of the step's token budget (chunked prefill). A step
lasts as long as the performance model says, on the engine's clock. GPU time is attributed to
the requests in the step: its prefill part to the prompts by their tokens, its decode part and
overhead shared equally.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from schemas.events import InferenceRequest, KvHandle
from services.engines.base import (
    Clock,
    DecodeStep,
    EngineError,
    EngineInfo,
    EngineSnapshot,
    KvBlockEvent,
    PrefillResult,
    RealClock,
)
from services.engines.sim.blocks import BlockManager
from services.engines.sim.perf import PerfModel
from services.engines.sim.profiles import gpu, model_shape
from services.engines.tokenizer import SimpleTokenizer

BLOCK_WAIT_TIMEOUT_S = 30.0


@dataclass
class _Sequence:
    request: InferenceRequest
    to_compute: int  # prompt tokens not found in the prefix cache
    cached_tokens: int
    computed: int = 0
    generated: int = 0
    prefill_gpu_s: float = 0.0
    decode_gpu_s: float = 0.0
    first_token: asyncio.Future[int] | None = None
    steps: asyncio.Queue[DecodeStep] = field(default_factory=asyncio.Queue)
    rng: random.Random = field(default_factory=random.Random)

    @property
    def context(self) -> int:
        return len(self.request.prompt_tokens) + self.generated


class SimEngine:
    def __init__(
        self,
        *,
        model: str,
        shape: str = "llama-3-8b",
        gpu_type: str = "H100",
        block_size: int = 16,
        clock: Clock | None = None,
        tensor_parallel: int = 1,
        max_batch_tokens: int = 8192,
        max_running: int = 256,
        kv_capacity_tokens: int | None = None,
        max_context_tokens: int = 8192,
    ):
        self.perf = PerfModel(gpu(gpu_type), model_shape(shape), tensor_parallel)
        self.clock: Clock = clock or RealClock()
        capacity = kv_capacity_tokens or self.perf.kv_capacity_tokens()
        self.blocks = BlockManager(capacity // block_size, block_size)
        self.info = EngineInfo("sim", model, gpu_type, block_size, self.blocks.total_blocks)
        self.tokenizer = SimpleTokenizer()
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.max_context_tokens = max_context_tokens
        self._waiting: deque[_Sequence] = deque()
        self._resident: dict[str, _Sequence] = {}
        self._decoding: dict[str, _Sequence] = {}
        self._gpu_seconds: dict[str, tuple[float, float]] = {}
        self._wake = asyncio.Event()
        self._blocks_freed = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self._tokens_per_s = 0.0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None
        for seq in list(self._resident.values()):
            if seq.first_token is not None and not seq.first_token.done():
                seq.first_token.set_exception(EngineError("engine stopped", code="capacity"))

    # ------------------------------------------------------------ protocol

    def _check(self, request: InferenceRequest) -> None:
        if request.model != self.info.model:
            raise EngineError(f"model {request.model!r} is not loaded here ({self.info.model!r})")
        if request.block_size != self.info.block_size:
            raise EngineError(
                f"block size mismatch: request hashed with {request.block_size}, "
                f"engine uses {self.info.block_size}"
            )
        total = len(request.prompt_tokens) + request.max_tokens
        if total > self.max_context_tokens:
            raise EngineError(
                f"prompt ({len(request.prompt_tokens)}) + max_tokens ({request.max_tokens}) "
                f"exceeds the model's context of {self.max_context_tokens} tokens"
            )
        if self.blocks.blocks_for(total) > self.blocks.total_blocks:
            raise EngineError("request needs more KV blocks than this engine has")
        if request.request_id in self._resident:
            raise EngineError(f"request {request.request_id} is already on this engine")

    async def _reserve(self, request: InferenceRequest) -> int:
        """Reserve KV for prompt and output; waits (bounded) for blocks to free up."""
        total = len(request.prompt_tokens) + request.max_tokens
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BLOCK_WAIT_TIMEOUT_S
        while True:
            matched = self.blocks.allocate(request.request_id, request.block_hashes, total)
            if matched is not None:
                return matched
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise EngineError("timed out waiting for KV cache space", code="capacity")
            self._blocks_freed.clear()
            try:
                await asyncio.wait_for(self._blocks_freed.wait(), timeout=remaining)
            except TimeoutError:
                continue

    def _new_sequence(self, request: InferenceRequest, cached_tokens: int) -> _Sequence:
        seed = int.from_bytes(hashlib.blake2b(request.request_id.encode(), digest_size=8).digest())
        seq = _Sequence(
            request=request,
            to_compute=len(request.prompt_tokens) - cached_tokens,
            cached_tokens=cached_tokens,
            rng=random.Random(seed),
        )
        self._resident[request.request_id] = seq
        return seq

    async def prefill(self, request: InferenceRequest) -> PrefillResult:
        self._check(request)
        matched_blocks = await self._reserve(request)
        # At least one prompt token is always computed: it produces the first output token.
        cached = min(matched_blocks * self.info.block_size, len(request.prompt_tokens) - 1)
        seq = self._new_sequence(request, cached)
        seq.first_token = asyncio.get_running_loop().create_future()
        self._waiting.append(seq)
        self._wake.set()
        try:
            first = await seq.first_token
        except BaseException:
            self.release(request.request_id)
            raise
        num_tokens = len(request.prompt_tokens)
        return PrefillResult(
            first_token_id=first,
            cached_tokens=cached,
            gpu_seconds=seq.prefill_gpu_s,
            kv=KvHandle(
                source_worker="",
                num_tokens=num_tokens,
                block_hashes=list(request.block_hashes),
                kv_bytes=(num_tokens - cached) * self.perf.model.kv_bytes_per_token,
            ),
        )

    async def export_kv(self, request_id: str) -> bytes | None:
        # Simulated KV has no bytes: the decode side models the transfer from its size.
        return None

    async def import_kv(self, request: InferenceRequest, kv: KvHandle, payload: bytes | None) -> float:
        self._check(request)
        if kv.num_tokens != len(request.prompt_tokens):
            raise EngineError(
                f"KV covers {kv.num_tokens} tokens, the prompt has {len(request.prompt_tokens)}"
            )
        if kv.block_hashes != request.block_hashes:
            raise EngineError("KV block hashes do not match the request's prompt")
        matched_blocks = await self._reserve(request)
        # Blocks this worker already caches need not travel.
        local = min(matched_blocks * self.info.block_size, kv.num_tokens)
        transfer_bytes = (kv.num_tokens - local) * self.perf.model.kv_bytes_per_token
        seconds = self.perf.kv_transfer_seconds(transfer_bytes)
        seq = self._new_sequence(request, kv.num_tokens)
        seq.generated = 0
        await self.clock.sleep(seconds)
        return seconds

    async def decode(self, request_id: str, first_token_id: int) -> AsyncIterator[DecodeStep]:
        seq = self._resident.get(request_id)
        if seq is None:
            raise EngineError(f"request {request_id} has no KV on this engine")
        seq.generated = max(seq.generated, 1)  # the first token came from prefill
        try:
            if seq.generated >= seq.request.max_tokens:
                yield DecodeStep([], "length")
                return
            self._decoding[request_id] = seq
            self._wake.set()
            while True:
                step = await seq.steps.get()
                yield step
                if step.finish_reason is not None:
                    return
        finally:
            self._decoding.pop(request_id, None)
            self.release(request_id)

    def release(self, request_id: str) -> None:
        seq = self._resident.pop(request_id, None)
        if seq is None:
            return
        self._decoding.pop(request_id, None)
        if seq in self._waiting:
            self._waiting.remove(seq)
        self._gpu_seconds[request_id] = (seq.prefill_gpu_s, seq.decode_gpu_s)
        self.blocks.free(request_id)
        self._blocks_freed.set()

    def gpu_seconds(self, request_id: str) -> tuple[float, float]:
        seq = self._resident.get(request_id)
        if seq is not None:
            return (seq.prefill_gpu_s, seq.decode_gpu_s)
        return self._gpu_seconds.pop(request_id, (0.0, 0.0))

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            kv_blocks_used=self.blocks.used_blocks,
            kv_blocks_cached=self.blocks.cached_blocks,
            queue_depth=len(self._waiting),
            running=len(self._decoding),
            tokens_per_s=round(self._tokens_per_s, 3),
        )

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def drain_kv_events(self) -> list[KvBlockEvent]:
        return self.blocks.drain_events()

    def cached_block_hashes(self) -> list[int]:
        return self.blocks.cached_hashes()

    # ------------------------------------------------------------ the scheduler

    async def _run(self) -> None:
        while True:
            if not self._waiting and not self._decoding:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._step()

    async def _step(self) -> None:
        budget = self.max_batch_tokens
        decoding = list(self._decoding.values())[: self.max_running]
        budget -= len(decoding)
        chunks: list[tuple[_Sequence, int]] = []
        for seq in self._waiting:
            if budget <= 0:
                break
            take = min(seq.to_compute - seq.computed, budget)
            chunks.append((seq, take))
            budget -= take
        prefill_times = [self.perf.prefill_seconds(n, seq.cached_tokens + seq.computed) for seq, n in chunks]
        decode_time = self.perf.decode_seconds(len(decoding), sum(s.context for s in decoding))
        overhead = self.perf.step_overhead_s
        step_time = overhead + sum(prefill_times) + decode_time
        await self.clock.sleep(step_time)

        share = overhead / (len(chunks) + len(decoding))
        for (seq, n), seconds in zip(chunks, prefill_times, strict=True):
            if seq.request.request_id not in self._resident:
                continue  # released mid-step (cancelled)
            seq.computed += n
            seq.prefill_gpu_s += seconds + share
            if seq.computed >= seq.to_compute:
                self._waiting.remove(seq)
                if seq.first_token is not None and not seq.first_token.done():
                    seq.first_token.set_result(self._next_token(seq))
        per_sequence = decode_time / len(decoding) + share if decoding else 0.0
        for seq in decoding:
            if seq.request.request_id not in self._decoding:
                continue  # released mid-step (cancelled)
            seq.decode_gpu_s += per_sequence
            seq.generated += 1
            finished = seq.generated >= seq.request.max_tokens
            seq.steps.put_nowait(DecodeStep([self._next_token(seq)], "length" if finished else None))
            if finished:
                del self._decoding[seq.request.request_id]
        if step_time > 0:
            rate = len(decoding) / step_time
            self._tokens_per_s = 0.9 * self._tokens_per_s + 0.1 * rate

    def _next_token(self, seq: _Sequence) -> int:
        return seq.rng.choice(self.tokenizer.word_ids)
