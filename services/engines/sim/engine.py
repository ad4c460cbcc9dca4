"""The sim engine: continuous batching over the roofline model, with a paged prefix cache.

One module because the scheduler loop and its sequences are one state machine; the parts that
stand alone are already apart: the roofline model (perf.py), the paged cache (blocks.py) and
constrained outputs (synthetic.py).

One scheduler loop runs steps as a serving engine does (vLLM's, with chunked prefill and its
priority scheduling policy). Waiting work is taken a more urgent service class first (an
interactive request before a Batch API line; services/engines/scheduling.py), in order within a
class:
1. sequences whose decode was asked for join the running batch (up to `max_running`);
2. every running decode gets one token of the step's token budget, and the KV block that token
   needs when it crosses a block boundary. When no block is left, the most recently admitted
   running sequence of the least urgent class (of those not yet given their token this step) is
   preempted, recompute-style: its blocks are freed and it goes back to the head of its class
   in the waiting queue, to prefill its prompt and the tokens it has generated again (its
   cached prefix blocks usually still hit), after which its stream goes on where it stopped;
3. prompts being prefilled continue, chunked to the budget left;
4. waiting prompts are admitted in order while the budget, `max_running` and the KV cache allow:
   an admission takes the blocks for the whole prompt, reusing its cached prefix.
A step lasts as long as the performance model says, on the engine's clock: a RealClock in the
mesh (optionally sped up), a VirtualClock in the simulator, the same code either way. GPU time is
attributed to the sequences in the step by their share of its work (perf.step_shares).

A full prompt block is published as "stored" when the step that computes its last token ends
(or when imported KV arrives), not when it is allocated. Generated tokens are a deterministic
function of the prompt and position (greedy) or of the request too (temperature > 0), so an
imported KV decodes to the same tokens as aggregated serving, and a preempted sequence resumes
its stream seamlessly. A constrained request (a tool call, JSON) writes synthetic.py's output for
its seed instead, token by token, and stops after its last token; log-probabilities, for requests
that ask, are those of a model drawing uniformly from its words (a forced token's is 0).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Literal

from schemas.events import InferenceRequest, KvHandle, TokenAlternative, TokenLogprob
from services.engines.base import (
    Clock,
    DecodeStep,
    EngineError,
    EngineInfo,
    EngineSnapshot,
    KvBlockEvent,
    PrefillResult,
    RealClock,
    check_request,
)
from services.engines.scheduling import RankedQueue, scheduling_rank
from services.engines.sim.blocks import BlockManager
from services.engines.sim.perf import MBU, MFU, STEP_OVERHEAD_S, PerfModel
from services.engines.sim.profiles import gpu, model_shape
from services.engines.sim.synthetic import synthetic_output
from services.engines.tokenizer import SimpleTokenizer

# Finished requests' GPU time kept for `gpu_seconds` (prefill workers never ask for it).
FINISHED_KEPT = 10_000
_MASK64 = (1 << 64) - 1

State = Literal["waiting", "running", "importing", "idle", "ready", "done"]


@cache
def _tokenizer() -> SimpleTokenizer:
    """One word tokenizer for every engine in the process (it is read-only once built; a fleet
    simulation builds a thousand engines)."""
    return SimpleTokenizer()


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _Stream:
    """Tokens on their way to `decode()`'s consumer: a list and at most one waiter, lighter than
    an asyncio.Queue (one put per token per sequence is the engine's hottest path). A consumer
    that fell behind gets every token waiting in one step."""

    __slots__ = ("error", "finish", "logprobs", "tokens", "waiter")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per token, for requests that ask
        self.finish: str | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.error: EngineError | None = None

    def put(self, token: int, finish: str | None, logprob: TokenLogprob | None = None) -> None:
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        self.finish = finish
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: EngineError) -> None:
        self.error = error
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


@dataclass(eq=False, slots=True)
class _Sequence:
    request: InferenceRequest
    seed: int
    prompt_len: int
    rank: int = 0  # its scheduling rank (services/engines/scheduling.py): 0, the most urgent
    order: int = 0  # when it (last) joined the running batch
    # A resumed request's output so far (the tail of its prompt): its tokens continue from there.
    output_offset: int = 0
    # The whole output of a constrained request (a tool call, JSON), token by token.
    forced: list[int] | None = None
    state: State = "waiting"
    computed: int = 0  # tokens whose KV is computed
    generated: int = 0  # output tokens sampled so far (the first one included)
    cached_tokens: int = 0  # prompt tokens found cached at the first admission
    admitted_once: bool = False
    decoding: bool = False  # decode() asked for it: its tokens go to `steps`
    kv_import: bool = False
    prefill_gpu_s: float = 0.0
    decode_gpu_s: float = 0.0
    preemptions: int = 0
    first_token: asyncio.Future[int] | None = None
    admitted: asyncio.Future[None] | None = None  # imports: resolved once blocks are held
    steps: _Stream = field(default_factory=lambda: _Stream())

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Tokens known: the prompt and every sampled token (the last one's KV comes next step)."""
        return self.prompt_len + self.generated

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.computed

    @property
    def is_decode(self) -> bool:
        return self.decoding and self.remaining == 1

    @property
    def output_complete(self) -> bool:
        """A constrained output whose last token has been sampled: the model stops there."""
        return self.forced is not None and self.output_offset + self.generated >= len(self.forced)


def _rank_of(seq: _Sequence) -> int:
    return seq.rank


@dataclass
class SimStats:
    steps: int = 0
    busy_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens computed
    generated_tokens: int = 0  # tokens sampled, first tokens included
    preemptions: int = 0


class SimEngine:
    """A simulated GPU serving a model; see the module docstring.

    `shape` names a model shape, optionally with its precision ("llama-3-8b:fp8"), or `dtype`
    and `kv_dtype` set it; `mfu`, `mbu` and `step_overhead_s` default to perf.py's calibrated
    factors. `kv_capacity_tokens` defaults to what fits in `memory_fraction` of the GPUs'
    memory beside the weights. `max_batch_tokens` is the token budget of a step (chunked
    prefill), `max_running` the cap on sequences in the running batch. `adapters`: the LoRA
    adapters it serves, each with its load time (clock seconds), paid by the first request for
    it (those arriving meanwhile wait with it); it then stays loaded.
    """

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
        dtype: str | None = None,
        kv_dtype: str | None = None,
        mfu: float = MFU,
        mbu: float = MBU,
        step_overhead_s: float = STEP_OVERHEAD_S,
        memory_fraction: float = 0.9,
        adapters: Mapping[str, float] | None = None,
    ):
        model_profile = model_shape(shape)
        if dtype is not None or kv_dtype is not None:
            model_profile = model_profile.with_dtype(
                dtype or model_profile.dtype, kv_dtype or dtype or model_profile.kv_dtype
            )
        self.perf = PerfModel(gpu(gpu_type), model_profile, tensor_parallel, mfu, mbu, step_overhead_s)
        self.clock: Clock = clock or RealClock()
        capacity = kv_capacity_tokens or self.perf.kv_capacity_tokens(memory_fraction)
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be at least 1")
        self.blocks = BlockManager(capacity // block_size, block_size)
        self.info = EngineInfo(
            "sim",
            model,
            gpu_type,
            block_size,
            self.blocks.total_blocks,
            adapters=tuple(adapters or {}),
            adapter_load_s=max((adapters or {}).values(), default=0.0),
            time_scale=self.clock.time_scale if isinstance(self.clock, RealClock) else 1.0,
            # Synthetic, but the shape real engines give: see _token and synthetic.py.
            features=frozenset({"logprobs", "tool_call", "json"}),
        )
        self.tokenizer = _tokenizer()
        self._words = self.tokenizer.word_ids
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.max_context_tokens = max_context_tokens
        self.stats = SimStats()
        # To prefill (or import), and prefilled with decode asked for but not yet running: in
        # order within each scheduling rank, the more urgent rank first.
        self._waiting: RankedQueue[_Sequence] = RankedQueue()
        self._ready: RankedQueue[_Sequence] = RankedQueue()
        self._running: list[_Sequence] = []  # in admission order
        self._admissions = itertools.count()  # numbers the admissions (`_Sequence.order`)
        self._resident: dict[str, _Sequence] = {}
        self._finished: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self._tokens_per_s = 0.0
        self._adapter_load_s = dict(adapters or {})
        self._loaded_adapters: dict[str, None] = {}  # in load order
        self._adapter_loads: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None
        for loading in self._adapter_loads.values():
            loading.cancel()
        stopped = EngineError("engine stopped", code="capacity")
        for seq in list(self._resident.values()):
            for future in (seq.first_token, seq.admitted):
                if future is not None and not future.done():
                    future.set_exception(stopped)
            if seq.decoding:
                seq.steps.fail(stopped)

    # ------------------------------------------------------------ protocol

    def _check(self, request: InferenceRequest) -> None:
        check_request(request, self.info, self.max_context_tokens)
        prompt = len(request.prompt_tokens)
        if len(request.block_hashes) != prompt // self.info.block_size:
            raise EngineError(
                f"{len(request.block_hashes)} block hashes for a {prompt}-token prompt "
                f"in blocks of {self.info.block_size}"
            )
        total = prompt + request.max_tokens
        if self.blocks.blocks_for(total) > self.blocks.total_blocks:
            raise EngineError("request needs more KV blocks than this engine has", code="capacity")
        if request.request_id in self._resident:
            raise EngineError(f"request {request.request_id} is already on this engine")

    def _new_sequence(self, request: InferenceRequest) -> _Sequence:
        # Greedy output depends on the prompt only; sampled output on the request too. A resumed
        # request (migrated mid-stream) has its output so far at the end of its prompt: it is
        # seeded by the prompt proper and continues at that position, so the client gets the
        # tokens an uninterrupted run would have given.
        offset = request.resumption.output_tokens if request.resumption is not None else 0
        prompt = (
            request.prompt_tokens[: len(request.prompt_tokens) - offset] if offset else request.prompt_tokens
        )
        digest = hashlib.blake2b(digest_size=8)
        digest.update(request.model.encode())
        if request.adapter is not None:
            digest.update(request.adapter.encode())
        digest.update(array("q", prompt).tobytes())
        if request.temperature > 0:
            digest.update(request.request_id.encode())
        seed = int.from_bytes(digest.digest(), "little")
        seq = _Sequence(
            request=request,
            seed=seed,
            prompt_len=len(request.prompt_tokens),
            rank=scheduling_rank(request),
            output_offset=offset,
        )
        if request.constraint is not None:
            seq.forced = self.tokenizer.encode(synthetic_output(request.constraint, seed))
        self._resident[request.request_id] = seq
        return seq

    async def _load_adapter(self, adapter: str | None) -> None:
        """The request's adapter, loaded before its work (the load is not cancelled with a
        request waiting for it: others may wait too)."""
        if adapter is None or adapter in self._loaded_adapters:
            return
        loading = self._adapter_loads.get(adapter)
        if loading is None:
            loading = self._adapter_loads[adapter] = asyncio.ensure_future(
                self.clock.sleep(self._adapter_load_s[adapter])
            )
        await asyncio.shield(loading)
        self._loaded_adapters[adapter] = None
        self._adapter_loads.pop(adapter, None)

    async def prefill(self, request: InferenceRequest) -> PrefillResult:
        self._check(request)
        await self._load_adapter(request.adapter)
        seq = self._new_sequence(request)
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
            first_logprob=self._logprob(seq, seq.output_offset, first),
            cached_tokens=seq.cached_tokens,
            gpu_seconds=seq.prefill_gpu_s,
            kv=KvHandle(
                source_worker="",
                num_tokens=num_tokens,
                block_hashes=list(request.block_hashes),
                kv_bytes=num_tokens * self.perf.model.kv_bytes_per_token,
            ),
        )

    async def export_kv(self, request_id: str) -> bytes | None:
        # Simulated KV has no bytes: the decode side models the transfer from its size.
        if request_id not in self._resident:
            raise EngineError(f"request {request_id} has no KV on this engine")
        return None

    async def import_kv(self, request: InferenceRequest, kv: KvHandle, payload: bytes | None) -> float:
        self._check(request)
        prompt = len(request.prompt_tokens)
        if payload is not None:
            raise EngineError("the sim engine cannot import KV bytes from another kind of engine")
        await self._load_adapter(request.adapter)
        if kv.num_tokens != prompt:
            raise EngineError(f"KV covers {kv.num_tokens} tokens, the prompt has {prompt}")
        if kv.block_hashes != request.block_hashes:
            raise EngineError("KV block hashes do not match the request's prompt")
        seq = self._new_sequence(request)
        seq.kv_import = True
        seq.admitted = asyncio.get_running_loop().create_future()
        self._waiting.append(seq)
        self._wake.set()
        try:
            await seq.admitted
            # Blocks this worker already caches need not travel.
            seconds = self.perf.kv_transfer_seconds(
                (prompt - seq.cached_tokens) * self.perf.model.kv_bytes_per_token
            )
            await self.clock.sleep(seconds)
            if seq.state != "importing":
                raise EngineError(f"request {request.request_id} was released during its KV import")
        except BaseException:
            self.release(request.request_id)
            raise
        seq.computed = prompt
        seq.state = "idle"
        self.blocks.mark_computed(request.request_id, prompt)
        return seconds

    async def decode(self, request_id: str, first_token_id: int) -> AsyncIterator[DecodeStep]:
        seq = self._resident.get(request_id)
        if seq is None or seq.state != "idle":
            raise EngineError(f"request {request_id} has no prefilled KV on this engine")
        seq.generated = max(seq.generated, 1)  # the first token came from prefill
        try:
            if seq.output_complete:
                yield DecodeStep([], "stop")
                return
            if seq.generated >= seq.request.max_tokens:
                yield DecodeStep([], "length")
                return
            seq.decoding = True
            seq.state = "ready"
            self._ready.append(seq)
            self._wake.set()
            stream = seq.steps
            loop = asyncio.get_running_loop()
            while True:
                while not stream.tokens:
                    if stream.error is not None:
                        raise stream.error
                    stream.waiter = loop.create_future()
                    await stream.waiter
                tokens, stream.tokens = stream.tokens, []
                logprobs, stream.logprobs = stream.logprobs, []
                finish = stream.finish
                yield DecodeStep(tokens, finish, logprobs if seq.request.logprobs is not None else None)
                if finish is not None:
                    return
        finally:
            self.release(request_id)

    def release(self, request_id: str) -> None:
        seq = self._resident.pop(request_id, None)
        if seq is None:
            return
        if seq.state == "waiting":
            self._waiting.remove(seq)
        elif seq.state == "ready":
            self._ready.remove(seq)
        elif seq.state == "running":
            self._running.remove(seq)
        seq.state = "done"
        self._finished[request_id] = (seq.prefill_gpu_s, seq.decode_gpu_s)
        while len(self._finished) > FINISHED_KEPT:
            self._finished.popitem(last=False)
        self.blocks.free(request_id)
        self._wake.set()

    def gpu_seconds(self, request_id: str) -> tuple[float, float]:
        seq = self._resident.get(request_id)
        if seq is not None:
            return (seq.prefill_gpu_s, seq.decode_gpu_s)
        return self._finished.pop(request_id, (0.0, 0.0))

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            kv_blocks_used=self.blocks.used_blocks,
            kv_blocks_cached=self.blocks.cached_blocks,
            queue_depth=len(self._waiting),
            running=len(self._running) + len(self._ready),
            tokens_per_s=round(self._tokens_per_s, 3),
            preemptions=self.stats.preemptions,
            kv_blocks_free=self.blocks.free_blocks,
            queued_tokens=self._queued_tokens(),
            context_tokens=sum(seq.num_tokens for seq in self._running),
            adapters=tuple(self._loaded_adapters),
        )

    def _queued_tokens(self) -> int:
        """The prompt tokens yet to prefill: the rest of those in the batch (a decoding sequence
        has one token left to compute), and the uncached part of those waiting (an imported KV
        needs none)."""
        total = sum(seq.remaining for seq in self._running if seq.remaining > 1)
        size = self.info.block_size
        for seq in self._waiting:
            if not seq.kv_import:
                cached = self.blocks.cached_prefix_blocks(seq.request.block_hashes) * size
                total += max(1, seq.remaining - cached)
        return total

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def drain_kv_events(self) -> list[KvBlockEvent]:
        return self.blocks.drain_events()

    def cached_block_hashes(self) -> list[int]:
        return self.blocks.cached_hashes()

    # ------------------------------------------------------------ the scheduler

    async def _run(self) -> None:
        while True:
            batch = self._schedule()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._execute(batch)

    def _admit(self, seq: _Sequence) -> None:
        seq.state = "running"
        seq.order = next(self._admissions)
        self._running.append(seq)

    def _preempt(self, seq: _Sequence) -> None:
        """Recompute-style: free the sequence's KV; it prefills prompt + output again later."""
        self._running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.computed = 0
        seq.state = "waiting"
        seq.preemptions += 1
        self.stats.preemptions += 1
        self._waiting.appendleft(seq)

    def _victim(self, seq: _Sequence) -> _Sequence:
        """Whom to preempt for the block `seq`'s decode needs: the most recently admitted running
        sequence of the least urgent class, but for the decodes before `seq` in this step's
        order (they have their token in the step already). With one class, the newest."""
        key = (seq.rank, seq.order)
        victim = seq
        for other in reversed(self._running):  # the newest first
            if (
                other.decoding
                and other.prompt_len + other.generated - other.computed == 1
                and (other.rank, other.order) < key
            ):
                continue
            if other.rank > victim.rank or (other.rank == victim.rank and other.order > victim.order):
                victim = other
        return victim

    def _schedule(self) -> list[tuple[_Sequence, int]]:
        """This step's batch: (sequence, tokens to compute) pairs."""
        budget = self.max_batch_tokens
        batch: list[tuple[_Sequence, int]] = []
        preemptions = self.stats.preemptions
        # 1. Decodes asked for join the batch; they already hold their prompt's blocks.
        while self._ready and len(self._running) < self.max_running:
            self._admit(self._ready.popleft())
        # 2. Decodes, the more urgent class first and oldest first within it, each with the
        # block its token needs (a new one when the token starts a block).
        block_size = self.info.block_size
        running = self._running
        decodes = [s for s in running if s.decoding and s.prompt_len + s.generated - s.computed == 1]
        decodes.sort(key=_rank_of)
        for seq in decodes:
            if budget <= 0:
                break
            if seq.state != "running":
                continue  # preempted for the block of a decode before it
            if seq.computed % block_size == 0:
                while not self.blocks.grow(seq.request.request_id, seq.computed + 1):
                    victim = self._victim(seq)
                    self._preempt(victim)
                    if victim is seq:
                        break
                else:
                    batch.append((seq, 1))
                    budget -= 1
            else:
                batch.append((seq, 1))
                budget -= 1
        # 3. Prompts part-way through their prefill (or recompute) continue. (There is one at
        # most: of the prompts given budget in a step only the last can stop short. So the
        # order by class is the waiting queue's, step 4.)
        for seq in running:
            if budget <= 0:
                break
            if not seq.decoding or seq.prompt_len + seq.generated - seq.computed != 1:
                take = min(seq.prompt_len + seq.generated - seq.computed, budget)
                batch.append((seq, take))
                budget -= take
        # 4. New prompts, the more urgent class first and in order within it, while there is
        # room; none in a step that had to preempt (as vLLM does: the KV is short, admitting
        # more would only preempt again).
        while self._waiting and budget > 0 and preemptions == self.stats.preemptions:
            seq = self._waiting.head()
            if not seq.kv_import and len(self._running) >= self.max_running:
                break
            tokens = len(seq.request.prompt_tokens) if seq.kv_import else seq.num_tokens
            matched = self.blocks.allocate(seq.request_id, seq.request.block_hashes, tokens)
            if matched is None:
                break
            self._waiting.popleft()
            cached = min(matched * self.info.block_size, tokens if seq.kv_import else tokens - 1)
            if not seq.admitted_once:
                seq.cached_tokens = cached
                seq.admitted_once = True
            if seq.kv_import:
                seq.state = "importing"
                if seq.admitted is not None and not seq.admitted.done():
                    seq.admitted.set_result(None)
                continue
            seq.computed = cached
            self._admit(seq)
            take = min(seq.remaining, budget)
            batch.append((seq, take))
            budget -= take
        return batch

    async def _execute(self, batch: list[tuple[_Sequence, int]]) -> None:
        shares = self.perf.step_shares([(n, seq.computed) for seq, n in batch])
        step_time = sum(shares)
        await self.clock.sleep(step_time)
        stats = self.stats
        stats.steps += 1
        stats.busy_seconds += step_time
        emitted = 0
        any_done = False
        for (seq, n), share in zip(batch, shares, strict=True):
            if seq.state != "running":
                any_done = True
                continue  # released mid-step (cancelled)
            before = seq.computed
            computed = seq.computed = before + n
            first_token = seq.first_token
            if first_token is not None and not first_token.done():
                seq.prefill_gpu_s += share
            else:
                seq.decode_gpu_s += share
            if n > 1 or not seq.decoding:
                stats.prefill_tokens += n
            if before < seq.prompt_len:
                self.blocks.mark_computed(seq.request.request_id, computed)
            if computed < seq.prompt_len + seq.generated:
                continue  # a prefill chunk short of the prompt's end
            position = seq.output_offset + seq.generated
            forced = seq.forced
            if forced is not None and position < len(forced):
                token = forced[position]
            else:
                token = self._token(seq.seed, position)
            seq.generated += 1
            emitted += 1
            if not seq.decoding:
                # A prompt's prefill is done: its first token; it waits for decode() or release().
                seq.state = "idle"
                any_done = True
                if first_token is not None and not first_token.done():
                    first_token.set_result(token)
                continue
            logprob = self._logprob(seq, position, token) if seq.request.logprobs is not None else None
            finish = (
                "stop"
                if seq.output_complete
                else "length"
                if seq.generated >= seq.request.max_tokens
                else None
            )
            if finish is not None:
                seq.state = "done"
                any_done = True
            seq.steps.put(token, finish, logprob)
        if any_done:
            self._running = [s for s in self._running if s.state == "running"]
        stats.generated_tokens += emitted
        if step_time > 0:
            self._tokens_per_s = 0.9 * self._tokens_per_s + 0.1 * emitted / step_time

    def _word_index(self, seed: int, position: int) -> int:
        return _mix64(seed ^ (position * 0x9E3779B97F4A7C15 & _MASK64)) % len(self._words)

    def _token(self, seed: int, position: int) -> int:
        """The output token at `position` (0: the first) of a sequence with this seed."""
        return self._words[self._word_index(seed, position)]

    def _logprob(self, seq: _Sequence, position: int, token: int) -> TokenLogprob | None:
        """The sampled token's log-probability, with the request's k alternatives, the sampled
        one first. The sim model draws a free token uniformly from its words; a forced token (a
        constrained output) is certain, its alternatives ruled out (-9999, as vLLM reports a
        masked token)."""
        k = seq.request.logprobs
        if k is None:
            return None
        decode = self.tokenizer.decode
        if seq.forced is not None:
            chosen = 0.0
            others = [w for w in self._words[:k] if w != token][: max(0, k - 1)]
            other_logprob = -9999.0
        else:
            chosen = other_logprob = -math.log(len(self._words))
            index = self._word_index(seq.seed, position)
            others = [self._words[(index + 1 + j) % len(self._words)] for j in range(max(0, k - 1))]
        text = decode([token])
        top = [TokenAlternative(token_id=token, token=text, logprob=chosen)] if k else []
        top += [TokenAlternative(token_id=w, token=decode([w]), logprob=other_logprob) for w in others]
        return TokenLogprob(token_id=token, token=text, logprob=chosen, top=top)
