"""Workloads that measure an engine through the Engine protocol only, on whatever clock it runs:
a VirtualClock for the sim engine, the real one for real engines. Used by the sim engine's
calibration test and by `ripplemesh bench engine`.

- `max_throughput`: every request queued at once, as NVIDIA's trtllm-bench "throughput" runs
  do; output tokens over the time from the first submit to the last token.
- `batch_rates`: `batch` requests together; prefill tokens/s (prompt tokens over the time until
  every first token is out) and decode tokens/s (tokens after the first, over the time from the
  last first token until the last token).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from schemas.events import InferenceRequest
from services.engines.base import Engine
from services.mesh.block_hash import chain_block_hashes

Now = Callable[[], float]


def make_request(
    engine: Engine,
    request_id: str,
    *,
    prompt_tokens: int,
    max_tokens: int,
    seed: int,
    token_range: tuple[int, int] = (300, 600),
) -> InferenceRequest:
    """A request with a prompt of its own (no prefix shared with other seeds)."""
    info = engine.info
    prompt = random.Random(seed).choices(range(*token_range), k=prompt_tokens)
    return InferenceRequest(
        request_id=request_id,
        tenant="bench",
        model=info.model,
        api="nats",
        prompt_tokens=prompt,
        block_size=info.block_size,
        block_hashes=chain_block_hashes(prompt, info.block_size, model=info.model),
        max_tokens=max_tokens,
        submitted_at=time.time(),
    )


async def _serve(
    engine: Engine, request: InferenceRequest, on_first: Callable[[], None] | None = None
) -> int:
    """Aggregated serving; returns the output tokens."""
    result = await engine.prefill(request)
    if on_first is not None:
        on_first()
    tokens = 1
    async for step in engine.decode(request.request_id, result.first_token_id):
        tokens += len(step.token_ids)
    return tokens


@dataclass(frozen=True, slots=True)
class Throughput:
    requests: int
    output_tokens: int
    seconds: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


async def max_throughput(
    engine: Engine,
    now: Now,
    *,
    requests: int,
    input_tokens: int,
    output_tokens: int,
    token_range: tuple[int, int] = (300, 600),
) -> Throughput:
    batch = [
        make_request(
            engine,
            f"throughput-{i}",
            prompt_tokens=input_tokens,
            max_tokens=output_tokens,
            seed=i,
            token_range=token_range,
        )
        for i in range(requests)
    ]
    started = now()
    produced = await asyncio.gather(*(_serve(engine, r) for r in batch))
    return Throughput(requests, sum(produced), now() - started)


@dataclass(frozen=True, slots=True)
class BatchRates:
    batch: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


class _Meter:
    """Decode tokens while the whole batch decodes: from the last first token to the first finish."""

    def __init__(self, batch: int, now: Now):
        self.batch, self.now = batch, now
        self.firsts = 0
        self.all_first_at: float | None = None
        self.first_done_at: float | None = None
        self.tokens = 0

    def first_token(self) -> None:
        self.firsts += 1
        if self.firsts == self.batch:
            self.all_first_at = self.now()

    def step(self, tokens: int, finished: bool) -> None:
        if self.first_done_at is not None:
            return
        if self.all_first_at is not None:
            self.tokens += tokens
        if finished:
            self.first_done_at = self.now()


async def batch_rates(
    engine: Engine,
    now: Now,
    *,
    batch: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int = 0,
    token_range: tuple[int, int] = (300, 600),
) -> BatchRates:
    if output_tokens < 2:
        raise ValueError("decode needs output_tokens >= 2")
    requests = [
        make_request(
            engine,
            f"batch{batch}-{seed}-{i}",
            prompt_tokens=prompt_tokens,
            max_tokens=output_tokens,
            seed=seed * 1_000_003 + i,
            token_range=token_range,
        )
        for i in range(batch)
    ]
    meter = _Meter(batch, now)

    async def one(request: InferenceRequest) -> None:
        result = await engine.prefill(request)
        meter.first_token()
        async for step in engine.decode(request.request_id, result.first_token_id):
            meter.step(len(step.token_ids), step.finish_reason is not None)

    started = now()
    await asyncio.gather(*(one(r) for r in requests))
    prefill_s = (meter.all_first_at or now()) - started
    decode_s = (meter.first_done_at or now()) - (meter.all_first_at or started)
    return BatchRates(
        batch,
        batch * prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
        meter.tokens / decode_s if decode_s > 0 else 0.0,
    )
