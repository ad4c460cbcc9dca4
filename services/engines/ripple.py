"""What a worker records of a request's effects on others: the ripple links.

A routing decision's effects show up on the worker it chose, and this module makes each one
point back at its cause with an OpenTelemetry span link (the attribute ``ripple.link`` says
which effect it is):

- ``reused_kv``: a prefill that found its prefix cached links to the prefill(s) that computed
  those blocks here, so a request's trace leads forward to the later requests its cache served;
- ``in_batch``: a utilisation sample (a ``worker.utilisation`` span, at most one per heartbeat)
  links to the requests in the batch since the last sample; the heartbeat names the sample
  (`WorkerState.utilisation_traceparent`), and the autoscaler's plan links to the samples it
  planned on, closing route -> cache hit -> batch -> utilisation -> scaling decision.

A span joining the batch also records the batch it joined (``ripple.batch.*``): how many
sequences, their tokens, and the share of their prompts that came from the cache.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import SpanContext

from services.engines.base import EngineSnapshot
from services.mesh.tracing import tracer

# Blocks whose first prefill here is remembered (LRU): about a large engine's KV capacity in
# 16-token blocks, a few MB of dict.
ORIGINS_KEPT = 65_536
# Links one span carries at most (a long shared prefix computed by many requests, a big batch).
MAX_LINKS = 16
# A worker whose batch did not change samples this often anyway, so a plan never reads a sample
# older than this.
IDLE_SAMPLE_EVERY_S = 10.0


def traceparent(context: SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


@dataclass(slots=True)
class _InBatch:
    span: SpanContext
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class BatchShape:
    sequences: int
    prompt_tokens: int
    cached_tokens: int

    def attributes(self) -> dict[str, int | float]:
        share = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {
            "ripple.batch.sequences": self.sequences,
            "ripple.batch.prompt_tokens": self.prompt_tokens,
            "ripple.batch.cache_hit_share": round(share, 4),
        }


class RippleRecorder:
    """One per worker: the blocks' origins, the batch, and the utilisation samples."""

    def __init__(self, worker_id: str, pool: str) -> None:
        self.worker_id = worker_id
        self.pool = pool
        self._origins: OrderedDict[int, SpanContext] = OrderedDict()
        self._batch: dict[str, _InBatch] = {}
        # Those that joined the batch since the last sample (most requests come and go between
        # two heartbeats): the next sample links to them, and to those still in it.
        self._since_sample: list[_InBatch] = []
        self._batch_changed = True
        self._sampled_at = 0.0
        self.sample_traceparent: str | None = None

    # ------------------------------------------------------------ the cache's origins

    def reused_from(
        self, block_hashes: Sequence[int], cached_tokens: int, block_size: int
    ) -> list[trace.Link]:
        """Links to the prefills that computed the cached blocks (the first `cached_tokens`)."""
        seen: dict[tuple[int, int], SpanContext] = {}
        for block in block_hashes[: cached_tokens // block_size]:
            origin = self._origins.get(block)
            if origin is not None:
                self._origins.move_to_end(block)
                seen.setdefault((origin.trace_id, origin.span_id), origin)
                if len(seen) >= MAX_LINKS:
                    break
        return [trace.Link(context, {"ripple.link": "reused_kv"}) for context in seen.values()]

    def computed(
        self, block_hashes: Sequence[int], cached_tokens: int, block_size: int, span: SpanContext
    ) -> None:
        """The blocks past the cached prefix were computed by this prefill (`span`)."""
        if not span.is_valid:
            return
        for block in block_hashes[cached_tokens // block_size :]:
            if block not in self._origins:
                self._origins[block] = span
        while len(self._origins) > ORIGINS_KEPT:
            self._origins.popitem(last=False)

    # ------------------------------------------------------------ the batch

    def shape(self) -> BatchShape:
        return BatchShape(
            sequences=len(self._batch),
            prompt_tokens=sum(b.prompt_tokens for b in self._batch.values()),
            cached_tokens=sum(b.cached_tokens for b in self._batch.values()),
        )

    @contextmanager
    def in_batch(self, request_id: str, span: SpanContext, prompt_tokens: int) -> Iterator[_InBatch]:
        """The request is in this worker's batch while the block runs; set `cached_tokens` on
        what it yields once known."""
        entry = _InBatch(span, prompt_tokens, 0)
        self._batch[request_id] = entry
        if len(self._since_sample) < MAX_LINKS:
            self._since_sample.append(entry)
        self._batch_changed = True
        try:
            yield entry
        finally:
            if self._batch.get(request_id) is entry:
                del self._batch[request_id]
                self._batch_changed = True

    # ------------------------------------------------------------ utilisation samples

    def sample(self, snapshot: EngineSnapshot, kv_blocks_total: int, now: float | None = None) -> str | None:
        """A ``worker.utilisation`` span when the batch changed since the last one (or the last
        is old): the engine's load, the batch's shape, links to the requests in it. Returns the
        latest sample's traceparent, for the heartbeat."""
        now = time.time() if now is None else now
        if not self._batch_changed and now - self._sampled_at < IDLE_SAMPLE_EVERY_S:
            return self.sample_traceparent
        measured = {id(b): b for b in [*self._since_sample, *self._batch.values()]}
        links = [trace.Link(b.span, {"ripple.link": "in_batch"}) for b in list(measured.values())[:MAX_LINKS]]
        span = tracer().start_span(
            "worker.utilisation",
            context=trace.set_span_in_context(trace.INVALID_SPAN),  # a root: its own trace
            links=links,
            attributes={
                "ripple.worker_id": self.worker_id,
                "ripple.pool": self.pool,
                "ripple.worker.running": snapshot.running,
                "ripple.worker.queue_depth": snapshot.queue_depth,
                "ripple.worker.kv_usage": round(snapshot.kv_blocks_used / kv_blocks_total, 4)
                if kv_blocks_total
                else 0.0,
                # The requests the sample measured: those in the batch now, and those that came
                # and went since the last sample.
                "ripple.sample.requests": len(measured),
                **self.shape().attributes(),
            },
        )
        span.end()
        context = span.get_span_context()
        self._batch_changed = False
        self._since_sample.clear()
        self._sampled_at = now
        self.sample_traceparent = traceparent(context) if context.is_valid else None
        return self.sample_traceparent
