"""The one async protocol every engine (sim, hf, vllm) implements, and the clocks it runs on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

from schemas.events import InferenceRequest, KvHandle


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
    adapters: tuple[str, ...] = ()


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


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token_id: int
    cached_tokens: int
    gpu_seconds: float
    kv: KvHandle


@dataclass(frozen=True, slots=True)
class DecodeStep:
    token_ids: list[int]
    finish_reason: str | None  # "length" or "stop" on the last step


class Engine(Protocol):
    info: EngineInfo

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def prefill(self, request: InferenceRequest) -> PrefillResult:
        """Compute the uncached part of the prompt; the sequence stays resident for decode."""
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
