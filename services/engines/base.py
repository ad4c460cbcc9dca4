"""The one async protocol every engine (sim, hf, vllm) implements, and the clocks it runs on."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from schemas.events import InferenceRequest, KvHandle, TokenLogprob


class EngineError(Exception):
    """A request this engine cannot serve (too long, unknown model, bad KV); others go on.

    `code` says whose problem it is: "invalid" (the request's) or "capacity" (the engine's).
    """

    def __init__(self, message: str, *, code: Literal["invalid", "capacity"] = "invalid"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine: str
    model: str
    gpu_type: str
    block_size: int
    kv_blocks_total: int
    # The LoRA adapters it can serve (loaded on first use; `EngineSnapshot.adapters` says which
    # are loaded now), and the seconds of its modelled time loading one takes.
    adapters: tuple[str, ...] = ()
    adapter_load_s: float = 0.0
    # Wall seconds per second of the GPU work it models: 1 on real hardware; a sim engine run
    # faster (`RealClock(time_scale)`) less, so the router can predict in wall-clock time.
    time_scale: float = 1.0
    # What it honours beyond plain generation (schemas.events.ENGINE_FEATURES): "logprobs",
    # "tool_call" and "json" (an output constraint of that kind). Heartbeats announce them.
    features: frozenset[str] = frozenset()


def check_request(
    request: InferenceRequest, info: EngineInfo, max_context_tokens: int, vocab_size: int | None = None
) -> None:
    """What every engine refuses before taking a request (EngineError, code "invalid"): another
    model, an adapter it does not serve, another block size, an empty prompt, prompt +
    max_tokens past the context, and (when the engine knows its vocabulary) token ids outside
    it. Engines add their own checks."""
    if request.model != info.model:
        raise EngineError(f"model {request.model!r} is not loaded here ({info.model!r})")
    if request.adapter is not None and request.adapter not in info.adapters:
        served = ", ".join(info.adapters) or "none"
        raise EngineError(
            f"adapter {request.adapter!r} is not served by this {info.engine} engine of "
            f"{info.model!r} (its adapters: {served})"
        )
    if request.block_size != info.block_size:
        raise EngineError(
            f"block size mismatch: request hashed with {request.block_size}, engine uses {info.block_size}"
        )
    prompt = request.prompt_tokens
    if not prompt:
        raise EngineError("the prompt is empty")
    if len(prompt) + request.max_tokens > max_context_tokens:
        raise EngineError(
            f"prompt ({len(prompt)}) + max_tokens ({request.max_tokens}) "
            f"exceeds the model's context of {max_context_tokens} tokens"
        )
    if vocab_size and (min(prompt) < 0 or max(prompt) >= vocab_size):
        raise EngineError(f"prompt has token ids outside the model's vocabulary (0..{vocab_size - 1})")
    if request.logprobs is not None and "logprobs" not in info.features:
        raise EngineError(f"the {info.engine} engine does not compute log-probabilities")
    if request.constraint is not None and request.constraint.kind not in info.features:
        raise EngineError(f"the {info.engine} engine cannot force a {request.constraint.kind} output")
    constraint = request.constraint
    if constraint is not None and constraint.kind == "tool_call" and not constraint.tools:
        raise EngineError("a tool_call constraint names no tools to call")


@dataclass(frozen=True, slots=True)
class KvBlockEvent:
    """A change to the engine's prefix cache, by chained block hash (services/mesh/block_hash.py).

    "stored": blocks became reusable; "removed": blocks were evicted; "cleared": the whole cache
    was dropped (block_hashes empty). The host numbers and publishes them on rmesh.kv.<worker>.
    """

    kind: Literal["stored", "removed", "cleared"]
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    kv_blocks_used: int
    kv_blocks_cached: int
    queue_depth: int
    running: int
    tokens_per_s: float
    # Sequences evicted from the running batch for lack of KV blocks, since the engine started.
    preemptions: int = 0
    # What the router weighs beside the counts (None: the engine cannot tell): blocks neither
    # held nor cached (allocating past them evicts cached prefixes), the prompt tokens still to
    # prefill (the uncached part of those waiting), the KV tokens of the running batch.
    kv_blocks_free: int | None = None
    queued_tokens: int | None = None
    context_tokens: int | None = None
    # The LoRA adapters loaded now (of `EngineInfo.adapters`).
    adapters: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token_id: int
    cached_tokens: int
    gpu_seconds: float
    kv: KvHandle
    # The first token's log-probability, when the request asked for them.
    first_logprob: TokenLogprob | None = None


@dataclass(frozen=True, slots=True)
class DecodeStep:
    token_ids: list[int]
    finish_reason: str | None  # "length" or "stop" on the last step
    # One per token id, when the request asked for log-probabilities.
    logprobs: list[TokenLogprob] | None = None


class Engine(Protocol):
    info: EngineInfo

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def prefill(self, request: InferenceRequest) -> PrefillResult:
        """Compute the uncached part of the prompt; the sequence stays resident for decode.

        Waiting work is taken by the request's `service_class`, interactive before batch, in
        order within a class (services/engines/scheduling.py); the host hands the request over
        as the router placed it, class included (so does `import_kv`)."""
        ...

    async def export_kv(self, request_id: str) -> bytes | None:
        """The request's KV as bytes for another worker, or None when the engine moves KV itself
        (sim: only its size matters; vllm: its KV connector). Call before `release`."""
        ...

    async def import_kv(self, request: InferenceRequest, kv: KvHandle, payload: bytes | None) -> float:
        """Take a prefilled request's KV from another worker; returns the transfer seconds.

        Raises EngineError for KV that does not fit the request (wrong size, hashes, shape)."""
        ...

    def decode(self, request_id: str, first_token_id: int) -> AsyncIterator[DecodeStep]:
        """Join the running batch and stream tokens until the request finishes."""
        ...

    def release(self, request_id: str) -> None:
        """Drop a resident sequence; its full blocks stay in the prefix cache."""
        ...

    def gpu_seconds(self, request_id: str) -> tuple[float, float]:
        """GPU-seconds spent on a request so far: (prefill, decode)."""
        ...

    def snapshot(self) -> EngineSnapshot: ...

    def detokenize(self, token_ids: list[int]) -> str: ...

    def drain_kv_events(self) -> list[KvBlockEvent]:
        """Prefix-cache changes since the last call, in order."""
        ...

    def cached_block_hashes(self) -> list[int]:
        """Every block hash now in the prefix cache: the full dump a router resyncs from."""
        ...


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """Wall-clock time; `time_scale` < 1 runs simulated GPU work faster (0: no compute time)."""

    def __init__(self, time_scale: float = 1.0):
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.time_scale = time_scale

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds * self.time_scale)


class VirtualClock:
    """Simulated time for discrete-event runs, on an ordinary asyncio event loop.

    `sleep(s)` parks the caller in a heap keyed by (wake-up time, arrival order). One driver task
    per event loop, started by the first sleeper, lets the loop run until nothing else is ready
    (every task is blocked: on a clock, or on a queue, event or future that only other tasks can
    resolve), then advances each clock with sleepers to its earliest wake-up and wakes every
    sleeper due then, in arrival order; and again, until no one sleeps (the driver then exits;
    the next sleep starts another). So many engines and load generators sharing one clock
    interleave in time order, a step of GPU work costs no wall time, and a run depends only on
    the order of work, not on the host's speed: it is deterministic. Clocks on the same loop that
    are not shared are independent; each advances only its own time.

    "Nothing else is ready" is read from the loop's ready queue (`_ready`, present in CPython's
    asyncio loops; asyncio has no public call for it). On a loop without one (uvloop) the driver
    yields `settle_rounds` times instead, enough for wake-up chains up to that length. Tasks that
    wait on real I/O or real timers are invisible to it: virtual time does not wait for them, so
    a simulation should wait only on its clock and on its own tasks.
    """

    def __init__(self, start: float = 0.0, *, settle_rounds: int = 64):
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self.settle_rounds = settle_rounds

    def now(self) -> float:
        return self._now

    @property
    def sleepers(self) -> int:
        return sum(1 for _, _, future in self._sleepers if not future.done())

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._order), future))
        _VirtualTimeDriver.of(loop).watch(self)
        await future

    def _advance(self) -> bool:
        """Wake the sleepers due first; False when none is left."""
        sleepers = self._sleepers
        while sleepers and sleepers[0][2].done():  # cancelled while asleep
            heapq.heappop(sleepers)
        if not sleepers:
            return False
        when = sleepers[0][0]
        self._now = max(self._now, when)
        while sleepers and sleepers[0][0] <= when:
            _, _, future = heapq.heappop(sleepers)
            if not future.done():
                future.set_result(None)
        return True


class _VirtualTimeDriver:
    """Advances the VirtualClocks of one event loop whenever the loop has nothing else to run.

    One per loop while any of its clocks has sleepers, so that two drivers never keep each other
    "ready" forever; it removes itself when none is left."""

    _by_loop: ClassVar[dict[asyncio.AbstractEventLoop, _VirtualTimeDriver]] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.clocks: dict[VirtualClock, None] = {}  # insertion-ordered: deterministic
        self.task: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _VirtualTimeDriver:
        driver = cls._by_loop.get(loop)
        if driver is None:
            driver = cls._by_loop[loop] = cls(loop)
        return driver

    def watch(self, clock: VirtualClock) -> None:
        self.clocks[clock] = None
        if self.task is None or self.task.done():
            self.task = self.loop.create_task(self._drive(), name="virtual-time")

    async def _settle(self) -> None:
        """Yield to the loop until every other task is blocked (nothing but us is ready)."""
        ready = getattr(self.loop, "_ready", None)
        if ready is None:
            for _ in range(max((c.settle_rounds for c in self.clocks), default=64)):
                await asyncio.sleep(0)
            return
        while True:
            await asyncio.sleep(0)
            if not ready:
                return

    async def _drive(self) -> None:
        try:
            while True:
                await self._settle()
                idle = [clock for clock in self.clocks if not clock._advance()]
                for clock in idle:
                    del self.clocks[clock]
                if not self.clocks:
                    return
        finally:
            if not self.clocks and self._by_loop.get(self.loop) is self:
                del self._by_loop[self.loop]
