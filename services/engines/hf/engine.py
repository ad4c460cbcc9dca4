"""The hf engine: a real Hugging Face causal LM behind the Engine protocol.

Scheduling. One scheduler task (like the sim engine's) alternates, while there is work, between
one waiting prefill and one decode step for every decoding sequence (up to `max_running`). The
waiting prefill taken is the oldest of the most urgent service class (an interactive request
before a Batch API line: services/engines/scheduling.py). The
forward passes themselves run on one dedicated compute thread, so the event loop (heartbeats,
token streaming, NATS) stays responsive, and torch sees one caller at a time.

Batching. All sequences decoding at the same time advance together: one forward pass per step
over a left-padded batch (services/engines/hf/model.py, `DecodeBatch`), rebuilt only when a
sequence joins or leaves. A step's measured compute time is shared equally among its sequences.

Prefix cache. Full prompt blocks are kept, after a prefill, as real KV tensors keyed by the
request's chained block hashes (services/mesh/block_hash.py computes them at ingress; the engine
checks them against the prompt), reference counted while sequences hold them and LRU-evicted
(services/engines/hf/blocks.py). A prompt whose first blocks are cached computes only the rest;
at least its last token is always computed, as it yields the first output token.

Hand-off. `export_kv` serialises the prompt's KV (services/engines/hf/kv_io.py); `import_kv`
checks it against the request and installs it, so decode continues exactly as on the prefill
worker. Imported full blocks join this worker's prefix cache too.

EOS. A sampled EOS token ends the request with finish_reason "stop"; it is not streamed.

Log-probabilities. For a request with `logprobs` set (only those), the compute thread reports each
output token's log-probability, log_softmax of the model's raw logits (before temperature, as
vLLM does by default), with the k likeliest alternatives (model.py, `token_logprobs`): the first
token's in the PrefillResult, the others' in their DecodeSteps; an EOS that ends the request is
not streamed and has none. The engine cannot constrain its output (tool calls, JSON):
`check_request` refuses such requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from schemas.events import InferenceRequest, KvHandle, TokenLogprob
from services.engines.base import (
    DecodeStep,
    EngineError,
    EngineInfo,
    EngineSnapshot,
    KvBlockEvent,
    PrefillResult,
    check_request,
)
from services.engines.hf import kv_io
from services.engines.hf.blocks import KvBlockCache
from services.engines.hf.model import (
    DecodeBatch,
    LoadedModel,
    device_name,
    pick_device,
    sample,
    timed,
    token_logprobs,
)
from services.engines.scheduling import RankedQueue, scheduling_rank
from services.mesh.block_hash import chain_block_hashes

log = logging.getLogger(__name__)

BLOCK_WAIT_TIMEOUT_S = 30.0
RELEASED_GPU_SECONDS_KEPT = 10_000
CPU_KV_CACHE_BYTES = 1 << 30
GPU_KV_CACHE_FRACTION = 0.5

T = TypeVar("T")


@dataclass
class HfStats:
    """Counters for tests and benchmarks."""

    prefills: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_cached: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    max_batch: int = 0


@dataclass(eq=False)
class _Sequence:
    request: InferenceRequest
    cached_tokens: int
    prefix_blocks: list[torch.Tensor] = field(default_factory=list)  # cached prefix KV, block by block
    kv: torch.Tensor | None = None  # [layers, 2, kv_heads, length, head_dim] outside the decode batch
    length: int = 0  # tokens whose KV is computed
    last_token: int = -1
    generated: int = 0
    prefill_gpu_s: float = 0.0
    decode_gpu_s: float = 0.0
    retired: bool = False  # released, or finished decoding
    first_token: asyncio.Future[int] | None = None
    first_logprob: TokenLogprob | None = None  # set with first_token, when the request asks
    steps: asyncio.Queue[DecodeStep | EngineError] = field(default_factory=asyncio.Queue)
    seed: int = 0

    @property
    def adapter(self) -> str | None:
        return self.request.adapter

    @property
    def rank(self) -> int:
        return scheduling_rank(self.request)


def _seed(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") >> 2


class HfEngine:
    """The Engine protocol on a real model: `model_path` a local HF model directory, else a tiny
    random Llama (`seed`, `tiny_overrides` for its LlamaConfig). `kv_cache_tokens` sizes the block
    budget (default: half the free GPU memory, or 1 GiB of KV on CPU); `max_running` caps the
    decode batch; `eos_token_ids` replaces the model's own."""

    def __init__(
        self,
        *,
        model: str,
        model_path: str | None = None,
        block_size: int = 16,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        max_context_tokens: int = 4096,
        kv_cache_tokens: int | None = None,
        max_running: int = 64,
        tiny_overrides: dict[str, Any] | None = None,
        eos_token_ids: set[int] | None = None,
        adapters: dict[str, str] | None = None,
        adapter_load_s: float = 2.0,
    ):
        torch_device = pick_device(device)
        if model_path:
            self.lm = LoadedModel.from_path(
                model_path, device=torch_device, max_context_tokens=max_context_tokens, dtype=dtype
            )
        else:
            self.lm = LoadedModel.tiny_llama(
                seed=seed,
                device=torch_device,
                max_context_tokens=max_context_tokens,
                overrides=tiny_overrides,
            )
        if eos_token_ids is not None:
            self.lm.eos_token_ids = set(eos_token_ids)
        # LoRA adapters (name -> local PEFT directory), loaded with PEFT at their first request;
        # `adapter_load_s` is what the router is told a load costs until one is measured.
        self.lm.adapter_paths = dict(adapters or {})
        self.model_path = model_path
        shape = self.lm.kv_shape
        if kv_cache_tokens is None:
            if torch_device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(torch_device)
                budget = int(free * GPU_KV_CACHE_FRACTION)
            else:
                budget = CPU_KV_CACHE_BYTES
            kv_cache_tokens = budget // shape.bytes_per_token
        self.blocks = KvBlockCache(max(1, kv_cache_tokens // block_size), block_size)
        self.info = EngineInfo(
            "hf",
            model,
            device_name(torch_device),
            block_size,
            self.blocks.total_blocks,
            # Real log-probabilities; no constrained decoding (tool calls, JSON).
            features=frozenset({"logprobs"}),
            adapters=tuple(self.lm.adapter_paths),
            adapter_load_s=adapter_load_s if self.lm.adapter_paths else 0.0,
        )
        self.max_running = max_running
        self.stats = HfStats()
        self._batch = DecodeBatch(self.lm)
        self._executor: ThreadPoolExecutor | None = None
        self._waiting: RankedQueue[_Sequence] = RankedQueue()  # by class, then in order
        self._resident: dict[str, _Sequence] = {}
        self._decoding: dict[str, _Sequence] = {}
        # GPU time of released requests until asked for (bounded: a prefill worker never asks).
        self._gpu_seconds: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._wake = asyncio.Event()
        self._blocks_freed = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self._tokens_per_s = 0.0

    @property
    def max_context_tokens(self) -> int:
        return self.lm.max_context_tokens

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._loop is None:
            # One compute thread: forward passes leave the event loop, and run one at a time.
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
            self._loop = asyncio.create_task(self._run(), name="hf-engine")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None
        stopped = EngineError("engine stopped", code="capacity")
        for seq in list(self._resident.values()):
            if seq.first_token is not None and not seq.first_token.done():
                seq.first_token.set_exception(stopped)
        for seq in list(self._decoding.values()):
            seq.steps.put_nowait(stopped)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def _compute(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise EngineError("engine is not started", code="capacity")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ------------------------------------------------------------ protocol

    def _check(self, request: InferenceRequest) -> None:
        check_request(request, self.info, self.max_context_tokens, self.lm.vocab_size)
        prompt = request.prompt_tokens
        expected = chain_block_hashes(
            prompt, request.block_size, model=request.model, adapter=request.adapter
        )
        if request.block_hashes != expected:
            # Reusing KV under a wrong hash would silently corrupt output: refuse.
            raise EngineError("the request's block hashes do not match its prompt tokens")
        if self.blocks.blocks_for(len(prompt) + request.max_tokens) > self.blocks.total_blocks:
            raise EngineError("request needs more KV blocks than this engine has")
        if request.request_id in self._resident:
            raise EngineError(f"request {request.request_id} is already on this engine")

    async def _reserve(self, request: InferenceRequest) -> list[torch.Tensor]:
        """Reserve KV for prompt and output; the cached prefix's block KV. Waits (bounded) for space."""
        total = len(request.prompt_tokens) + request.max_tokens
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BLOCK_WAIT_TIMEOUT_S
        while True:
            prefix = self.blocks.allocate(request.request_id, request.block_hashes, total)
            if prefix is not None:
                return prefix
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise EngineError("timed out waiting for KV cache space", code="capacity")
            self._blocks_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._blocks_freed.wait(), timeout=remaining)

    def _new_sequence(self, request: InferenceRequest, cached_tokens: int) -> _Sequence:
        seq = _Sequence(request=request, cached_tokens=cached_tokens, seed=_seed(request.request_id))
        self._resident[request.request_id] = seq
        return seq

    def _kv_bytes(self, tokens: int) -> int:
        return tokens * self.lm.kv_shape.bytes_per_token

    async def prefill(self, request: InferenceRequest) -> PrefillResult:
        self._check(request)
        prefix_blocks = await self._reserve(request)
        num_tokens = len(request.prompt_tokens)
        # At least one prompt token is always computed: it produces the first output token.
        cached = min(len(prefix_blocks) * self.info.block_size, num_tokens - 1)
        seq = self._new_sequence(request, cached)
        seq.prefix_blocks = prefix_blocks if cached > 0 else []
        seq.first_token = asyncio.get_running_loop().create_future()
        self._waiting.append(seq)
        self._wake.set()
        try:
            first = await seq.first_token
        except BaseException:
            self.release(request.request_id)
            raise
        return PrefillResult(
            first_token_id=first,
            cached_tokens=cached,
            gpu_seconds=seq.prefill_gpu_s,
            first_logprob=seq.first_logprob,
            kv=KvHandle(
                source_worker="",
                num_tokens=num_tokens,
                block_hashes=list(request.block_hashes),
                kv_bytes=self._kv_bytes(num_tokens),
            ),
        )

    def _meta(self, tokens: list[int]) -> kv_io.KvMeta:
        shape = self.lm.kv_shape
        return kv_io.KvMeta(
            model=self.info.model,
            fingerprint=self.lm.fingerprint,
            block_size=self.info.block_size,
            tokens=tokens,
            layers=shape.layers,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
        )

    async def export_kv(self, request_id: str) -> bytes | None:
        seq = self._resident.get(request_id)
        if seq is None:
            raise EngineError(f"request {request_id} has no KV on this engine")
        kv = seq.kv
        if kv is None or seq.length < len(seq.request.prompt_tokens):
            raise EngineError(
                f"request {request_id} is not prefilled, or already decoding: nothing to export"
            )
        prompt = seq.request.prompt_tokens
        return await asyncio.to_thread(kv_io.dump, kv[:, :, :, : len(prompt)], self._meta(prompt))

    async def import_kv(self, request: InferenceRequest, kv: KvHandle, payload: bytes | None) -> float:
        started = time.perf_counter()
        self._check(request)
        prompt = request.prompt_tokens
        if kv.num_tokens != len(prompt):
            raise EngineError(f"KV covers {kv.num_tokens} tokens, the prompt has {len(prompt)}")
        if kv.block_hashes != request.block_hashes:
            raise EngineError("KV block hashes do not match the request's prompt")
        if payload is None:
            raise EngineError("the hf engine needs the KV bytes (no object in the KV handle)")
        tensor, blocks = await asyncio.to_thread(self._load_kv, payload, request)
        if request.request_id in self._resident:
            raise EngineError(f"request {request.request_id} is already on this engine")
        await self._reserve(request)
        seq = self._new_sequence(request, len(prompt))
        seq.kv, seq.length = tensor, len(prompt)
        self._store_blocks(seq, 0, blocks)
        return time.perf_counter() - started

    def _load_kv(self, payload: bytes, request: InferenceRequest) -> tuple[torch.Tensor, list[torch.Tensor]]:
        meta = self._meta(request.prompt_tokens)
        kv = kv_io.load(payload, meta, device=self.lm.device, dtype=self.lm.dtype)
        return kv, self._split_blocks(kv, 0, len(request.block_hashes))

    async def decode(self, request_id: str, first_token_id: int) -> AsyncIterator[DecodeStep]:
        seq = self._resident.get(request_id)
        if seq is None or seq.length < len(seq.request.prompt_tokens):
            raise EngineError(f"request {request_id} has no KV on this engine")
        if not 0 <= first_token_id < self.lm.vocab_size:
            self.release(request_id)
            raise EngineError(f"first token {first_token_id} is outside the model's vocabulary")
        seq.generated = max(seq.generated, 1)  # the first token came from prefill
        seq.last_token = first_token_id
        try:
            if first_token_id in self.lm.eos_token_ids:
                yield DecodeStep([], "stop")
                return
            if seq.generated >= seq.request.max_tokens:
                yield DecodeStep([], "length")
                return
            self._decoding[request_id] = seq
            self._wake.set()
            while True:
                step = await seq.steps.get()
                if isinstance(step, EngineError):
                    raise step
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
        # Its tensors go with the object; the compute thread may still be reading them now.
        seq.retired = True
        self._decoding.pop(request_id, None)
        if seq in self._waiting:
            self._waiting.remove(seq)
        self._gpu_seconds[request_id] = (seq.prefill_gpu_s, seq.decode_gpu_s)
        while len(self._gpu_seconds) > RELEASED_GPU_SECONDS_KEPT:
            self._gpu_seconds.popitem(last=False)
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
            kv_blocks_free=self.blocks.free_blocks,
            # A waiting sequence's cached prefix was found when it came.
            queued_tokens=sum(len(seq.request.prompt_tokens) - seq.cached_tokens for seq in self._waiting),
            context_tokens=sum(seq.length for seq in self._decoding.values()),
            adapters=tuple(self.lm.loaded_adapters),
        )

    def detokenize(self, token_ids: list[int]) -> str:
        return self.lm.tokenizer.decode(token_ids)

    def drain_kv_events(self) -> list[KvBlockEvent]:
        return self.blocks.drain_events()

    def cached_block_hashes(self) -> list[int]:
        return self.blocks.cached_hashes()

    # ------------------------------------------------------------ the scheduler

    async def _run(self) -> None:
        while True:
            if not self._waiting and not self._decoding:
                self._batch.clear()  # no step is in flight: the compute thread is idle
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                if self._waiting:
                    await self._prefill_one(self._waiting.popleft())
                if self._decoding:
                    await self._decode_step()
            except Exception as exc:
                # A bug, not a request's fault: fail what is in flight, keep serving the next ones.
                log.exception("hf engine step failed")
                self._fail_in_flight(EngineError(f"engine step failed: {exc}", code="capacity"))
                await self._compute(self._batch.clear)

    def _fail_in_flight(self, error: EngineError) -> None:
        while self._waiting:
            future = self._waiting.popleft().first_token
            if future is not None and not future.done():
                future.set_exception(error)
        for seq in self._decoding.values():
            seq.retired = True
            seq.steps.put_nowait(error)
        self._decoding.clear()

    def _split_blocks(self, kv: torch.Tensor, first: int, end: int) -> list[torch.Tensor]:
        """Copies of the KV of blocks first..end-1 (compact, so a cached block holds only itself)."""
        size = self.info.block_size
        return [kv[:, :, :, i * size : (i + 1) * size].clone() for i in range(first, end)]

    def _prefill_compute(
        self, seq: _Sequence
    ) -> tuple[int, TokenLogprob | None, torch.Tensor, list[torch.Tensor], float]:
        request = seq.request
        started = timed(self.lm.device)
        prefix = None
        if seq.prefix_blocks:
            prefix = torch.cat(seq.prefix_blocks, dim=3)[:, :, :, : seq.cached_tokens]
        logits, kv = self.lm.prefill(request.prompt_tokens, prefix, request.adapter)
        first = sample(logits, request.temperature, seq.seed + len(request.prompt_tokens))
        logprob = None
        if request.logprobs is not None:
            [logprob] = token_logprobs(logits[None], [first], [request.logprobs], self.lm.tokenizer)
        blocks = self._split_blocks(kv, len(seq.prefix_blocks), len(request.block_hashes))
        return first, logprob, kv, blocks, timed(self.lm.device) - started

    async def _prefill_one(self, seq: _Sequence) -> None:
        future = seq.first_token
        try:
            first, logprob, kv, blocks, seconds = await self._compute(self._prefill_compute, seq)
        except Exception as exc:
            if future is not None and not future.done():
                future.set_exception(EngineError(f"prefill failed: {exc}", code="capacity"))
            return
        matched = len(seq.prefix_blocks)
        seq.prefix_blocks = []
        if seq.retired:
            return
        prompt_tokens = len(seq.request.prompt_tokens)
        seq.kv, seq.length, seq.prefill_gpu_s = kv, prompt_tokens, seconds
        self._store_blocks(seq, matched, blocks)
        self.stats.prefills += 1
        self.stats.prefill_tokens_computed += prompt_tokens - seq.cached_tokens
        self.stats.prefill_tokens_cached += seq.cached_tokens
        if future is not None and not future.done():
            seq.first_logprob = logprob
            future.set_result(first)

    def _store_blocks(self, seq: _Sequence, first: int, blocks: list[torch.Tensor]) -> None:
        """Hand the prompt's computed full blocks, from block `first` on, to the prefix cache.

        Blocks another sequence stored meanwhile keep their KV (`store` skips them)."""
        hashes = seq.request.block_hashes[first:]
        self.blocks.store(list(zip(hashes, blocks, strict=True)))

    def _decode_compute(self, batch: list[_Sequence]) -> tuple[list[int], list[TokenLogprob | None], float]:
        started = timed(self.lm.device)
        logits = self._batch.step(batch)
        if all(seq.request.temperature <= 0 for seq in batch):
            tokens = [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
        else:
            # The token at position p of a request is drawn with seed + p, wherever it runs.
            tokens = [
                sample(logits[i], seq.request.temperature, seq.seed + seq.length)
                for i, seq in enumerate(batch)
            ]
        logprobs: list[TokenLogprob | None] = [None] * len(batch)
        wanting = [i for i, seq in enumerate(batch) if seq.request.logprobs is not None]
        if wanting:  # only the rows that asked: the others cost nothing
            rows = logits if len(wanting) == len(batch) else logits[wanting]
            computed = token_logprobs(
                rows,
                [tokens[i] for i in wanting],
                [batch[i].request.logprobs or 0 for i in wanting],
                self.lm.tokenizer,
            )
            for i, entry in zip(wanting, computed, strict=True):
                logprobs[i] = entry
        return tokens, logprobs, timed(self.lm.device) - started

    async def _decode_step(self) -> None:
        batch = list(self._decoding.values())[: self.max_running]
        try:
            tokens, logprobs, seconds = await self._compute(self._decode_compute, batch)
        except Exception as exc:
            log.exception("hf engine decode step failed")
            error = EngineError(f"decode step failed: {exc}", code="capacity")
            for seq in batch:
                if self._decoding.pop(seq.request.request_id, None) is not None:
                    seq.retired = True
                    seq.steps.put_nowait(error)
            await self._compute(self._batch.clear)
            return
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(batch)
        self.stats.max_batch = max(self.stats.max_batch, len(batch))
        share = seconds / len(batch)
        for seq, token, logprob in zip(batch, tokens, logprobs, strict=True):
            if seq.request.request_id not in self._decoding:
                continue  # released mid-step (cancelled)
            seq.decode_gpu_s += share
            seq.generated += 1
            seq.last_token = token
            entries = None if logprob is None else [logprob]
            if token in self.lm.eos_token_ids:
                step = DecodeStep([], "stop")  # the EOS is not streamed: no log-prob either
            elif seq.generated >= seq.request.max_tokens:
                step = DecodeStep([token], "length", entries)
            else:
                step = DecodeStep([token], None, entries)
            seq.steps.put_nowait(step)
            if step.finish_reason is not None:
                seq.retired = True
                del self._decoding[seq.request.request_id]
        if seconds > 0:
            rate = len(batch) / seconds
            self._tokens_per_s = 0.9 * self._tokens_per_s + 0.1 * rate
