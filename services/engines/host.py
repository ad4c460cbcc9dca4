"""An engine inside the mesh: what prefill and decode workers share.

Heartbeats (the worker's `WorkerState` in the WORKERS KV bucket), running a prefill or a decode
inside GenAI-convention spans, streaming token chunks with their sequence numbers, and reporting
GPU time in lifecycle events for the ledger.

A worker restarted under its id (its predecessor killed, so never deregistered) takes new work
at once and leaves the predecessor's unfinished work to the routers: see
`predecessors_work_left_for`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Gauge

from schemas.events import (
    InferenceRequest,
    KvCacheChange,
    KvDump,
    KvEvents,
    KvHandle,
    PrefillCompleted,
    RequestFailed,
    RouteOption,
    StreamFailed,
    StreamFinished,
    TokenChunk,
    Usage,
    WorkerState,
    derived_event_id,
    encode_event,
)
from schemas.subjects import (
    WORKERS,
    event_subject,
    kv_dump_subject,
    kv_subject,
    tokens_subject,
)
from services.engines.base import Engine, EngineError, PrefillResult
from services.engines.lifecycle import WorkerLifecycle
from services.engines.ripple import RippleRecorder
from services.mesh import kv_dump
from services.mesh.completion import decode_completed
from services.mesh.resumption import first_seq, output_before, prompt_proper
from services.mesh.runtime import Runtime
from services.mesh.tracing import REQUEST_ID, LateSpan, link_to

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# How long a restarted worker waits for the routers to take its predecessor's work over (they
# act within a second of the hand-back; none running, it then serves what is left itself).
# Longer than the routers look for a predecessor's work (PREDECESSOR_SCAN_FOR_S,
# services/router/liveness.py), so nothing is served here that a router may still migrate.
HAND_BACK_TIMEOUT_S = 20.0
KV_EVENTS_EVERY_S = 0.05

TOKENS_OUT = Counter("ripplemesh_worker_tokens_total", "Tokens generated.", ["worker", "pool"])
GPU_SECONDS = Counter(
    "ripplemesh_worker_gpu_seconds_total",
    "GPU-seconds spent, as the engine models them (a sim engine run faster counts modelled time).",
    ["worker", "pool", "phase"],
)
PROMPT_TOKENS = Counter(
    "ripplemesh_worker_prompt_tokens_total",
    "Prompt tokens prefilled here, by source: cached (the prefix cache) or computed.",
    ["worker", "pool", "source"],
)
KV_USED = Gauge("ripplemesh_worker_kv_blocks_used", "KV blocks in use.", ["worker", "pool"])
KV_USAGE = Gauge(
    "ripplemesh_worker_kv_usage_ratio", "KV blocks in use / KV blocks in all.", ["worker", "pool"]
)
RUNNING = Gauge("ripplemesh_worker_running", "Sequences in the running batch.", ["worker", "pool"])
QUEUE_DEPTH = Gauge("ripplemesh_worker_queue_depth", "Sequences waiting for the batch.", ["worker", "pool"])


class EngineHost:
    def __init__(
        self,
        runtime: Runtime,
        engine: Engine,
        *,
        worker_id: str,
        role: Literal["prefill", "decode"],
        pool: str,
        kv_events_every_s: float = KV_EVENTS_EVERY_S,
    ):
        self.runtime = runtime
        self.engine = engine
        self.worker_id = worker_id
        self.role = role
        self.pool = pool
        self.price_per_hour = runtime.config.gpu_prices_per_hour.get(engine.info.gpu_type, 0.0)
        self.started_at = time.time()
        self.draining = False
        # Started by an autoscaler's plan: the worker names it, and its spans link to it, so a
        # trace leads from a request served here to the scale-up that made room for it.
        extra = runtime.options.extra
        self.scaling_decision: str | None = extra.get("scaling_decision")
        self._plan_links = link_to(extra.get("scaling_traceparent"), {"ripple.link": "started_by_plan"})
        self._plan_attributes = (
            {"ripple.autoscaler.decision_id": self.scaling_decision} if self.scaling_decision else {}
        )
        # Batches of prefix-cache changes published so far on rmesh.kv.<worker>.
        self.kv_seq = 0
        # How often the cache changes not published yet go out (evictions, a decode's blocks); a
        # prefill's own blocks go out as soon as it ends (`prefill`).
        self.kv_events_every_s = kv_events_every_s
        self._kv_dump_sub: Subscription | None = None
        # Requests in flight; cancellation, revocation and drain (rmesh.control.<worker>).
        self.lifecycle = WorkerLifecycle(self)
        # The ripple links: whose cache a prefill reused, which requests a utilisation sample saw.
        self.ripple = RippleRecorder(worker_id, pool)
        self._labels = (worker_id, pool)

    async def start(self) -> None:
        await self.engine.start()
        info = self.engine.info
        self._kv_dump_sub = await self.runtime.bus.nc.subscribe(
            kv_dump_subject(self.worker_id), cb=self._on_kv_dump_request
        )
        await self.lifecycle.start()
        # On SIGTERM, say draining before the consumers stop, so no new work lands here.
        self.runtime.on_stopping(self.lifecycle.mark_draining)
        await self.heartbeat()
        self.runtime.spawn(self.runtime.every(HEARTBEAT_S, self.heartbeat, "heartbeat"), "heartbeat")
        self.runtime.spawn(
            self.runtime.every(self.kv_events_every_s, self.publish_kv_events, "kv-events"), "kv-events"
        )
        log.info("engine ready", extra={"engine": info.engine, "model": info.model, "gpu": info.gpu_type})

    async def stop(self) -> None:
        self.draining = True
        if self._kv_dump_sub is not None:
            with contextlib.suppress(Exception):
                await self._kv_dump_sub.unsubscribe()
        with contextlib.suppress(Exception):
            kv = await self.runtime.bus.key_value(WORKERS)
            await kv.delete(self.worker_id)
        await self.engine.stop()
        await self.lifecycle.close()

    def predecessors_work_left_for(self, sent_at: float) -> float:
        """For work sent at `sent_at`: how long to leave it to the routers (0: it is this
        process's to serve). Work sent before this process started is a predecessor's (killed,
        crashed): the routers take it over, seeing the predecessor lost or this worker's new
        `started_at` (services/router/liveness.py), and migrate its requests mid-stream from what
        their clients already received; served here too, a request would be streamed twice. It
        is put back (`Deferred`) until `HAND_BACK_TIMEOUT_S` after this start, longer than the
        routers scan for it, and served here only then (no router running). Meanwhile the worker
        serves new work: it is back as soon as it is connected."""
        if sent_at >= self.started_at:
            return 0.0
        return max(0.0, self.started_at + HAND_BACK_TIMEOUT_S - time.time())

    def health(self) -> dict[str, Any]:
        """What /healthz shows of a worker: its engine's load, now (not as of the heartbeat)."""
        snap = self.engine.snapshot()
        return {
            "worker_id": self.worker_id,
            "running": snap.running,
            "queue_depth": snap.queue_depth,
            "kv_blocks_used": snap.kv_blocks_used,
            **self.lifecycle.health(),
        }

    def state(self) -> WorkerState:
        info, snap = self.engine.info, self.engine.snapshot()
        KV_USED.labels(*self._labels).set(snap.kv_blocks_used)
        KV_USAGE.labels(*self._labels).set(
            snap.kv_blocks_used / info.kv_blocks_total if info.kv_blocks_total else 0.0
        )
        RUNNING.labels(*self._labels).set(snap.running)
        QUEUE_DEPTH.labels(*self._labels).set(snap.queue_depth)
        return WorkerState(
            event_id=f"{self.worker_id}-{time.monotonic_ns()}",
            occurred_at=time.time(),
            worker_id=self.worker_id,
            role=self.role,
            pool=self.pool,
            model=info.model,
            engine=info.engine,
            gpu_type=info.gpu_type,
            price_per_hour=self.price_per_hour,
            block_size=info.block_size,
            kv_blocks_total=info.kv_blocks_total,
            kv_blocks_used=snap.kv_blocks_used,
            kv_blocks_cached=snap.kv_blocks_cached,
            queue_depth=snap.queue_depth,
            running=snap.running,
            tokens_per_s=snap.tokens_per_s,
            started_at=self.started_at,
            draining=self.draining,
            kv_blocks_free=snap.kv_blocks_free,
            queued_tokens=snap.queued_tokens,
            context_tokens=snap.context_tokens,
            adapters=list(snap.adapters),
            adapter_load_s=info.adapter_load_s,
            features=sorted(info.features),
            time_scale=info.time_scale,
            scaling_decision=self.scaling_decision,
            utilisation_traceparent=self.ripple.sample(snap, info.kv_blocks_total),
        )

    async def heartbeat(self) -> None:
        kv = await self.runtime.bus.key_value(WORKERS)
        await kv.put(self.worker_id, encode_event(self.state()))

    # ------------------------------------------------------------ prefix-cache events

    def _next_kv_batch(self) -> KvEvents | None:
        """The engine's cache changes since the last batch, numbered; None when there are none.

        Synchronous, so a dump taken right after it is exactly as of its number.
        """
        changes = self.engine.drain_kv_events()
        if not changes:
            return None
        self.kv_seq += 1
        info = self.engine.info
        return KvEvents(
            event_id=f"{self.worker_id}-kv-{self.started_at:.6f}-{self.kv_seq}",
            occurred_at=time.time(),
            worker_id=self.worker_id,
            model=info.model,
            block_size=info.block_size,
            seq=self.kv_seq,
            changes=[KvCacheChange(kind=c.kind, block_hashes=list(c.block_hashes)) for c in changes],
            started_at=self.started_at,
        )

    async def publish_kv_events(self) -> None:
        batch = self._next_kv_batch()
        if batch is not None:
            await self.runtime.bus.nc.publish(kv_subject(self.worker_id), encode_event(batch))

    async def _on_kv_dump_request(self, msg: Msg) -> None:
        """Answer with the whole cache as of the latest batch, in chunks that fit in a message
        (as many blocks per chunk as the reader asked for, at most; one message if it did not)."""
        nc = self.runtime.bus.nc
        try:
            asked = kv_dump.decode_request(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("bad KV dump request: answering in one message", extra={"error": str(exc)})
            asked = None
        batch = self._next_kv_batch()
        info = self.engine.info
        dump = KvDump(
            event_id=f"{self.worker_id}-dump-{time.monotonic_ns()}",
            occurred_at=time.time(),
            worker_id=self.worker_id,
            model=info.model,
            block_size=info.block_size,
            seq=self.kv_seq,
            block_hashes=self.engine.cached_block_hashes(),
            started_at=self.started_at,
        )
        if batch is not None:
            await nc.publish(kv_subject(self.worker_id), encode_event(batch))
        if not msg.reply:
            return
        if asked is None:
            chunks = [dump]
        else:
            chunks = kv_dump.split(dump, min(asked.max_blocks, kv_dump.max_blocks_for(nc.max_payload)))
        try:
            for chunk in chunks:
                await nc.publish(msg.reply, encode_event(chunk))
        except Exception as exc:  # too large for an older reader's single message, or NATS down
            log.warning("KV dump not sent", extra={"blocks": len(dump.block_hashes), "error": repr(exc)})

    # ------------------------------------------------------------ KV hand-off

    async def export_kv(self, request_id: str, kv: KvHandle) -> KvHandle:
        """Ship the request's KV bytes (if the engine has any) through the Object Store."""
        payload = await self.engine.export_kv(request_id)
        if payload is None:
            return msgspec.structs.replace(kv, source_worker=self.worker_id)
        store = await self.runtime.bus.kv_objects()
        name = f"{request_id}-{self.worker_id}"
        await store.put(name, payload)
        # kv_bytes stays the engine's figure: a payload may be transfer parameters, not the KV.
        return msgspec.structs.replace(kv, source_worker=self.worker_id, object_name=name)

    async def import_kv(self, request: InferenceRequest, kv: KvHandle) -> float:
        payload = None
        if kv.object_name is not None:
            store = await self.runtime.bus.kv_objects()
            try:
                payload = (await store.get(kv.object_name)).data
            except Exception as exc:
                raise EngineError(f"KV object {kv.object_name!r} is not available: {exc}") from exc
        seconds = await self.engine.import_kv(request, kv, payload)
        if kv.object_name is not None:
            with contextlib.suppress(Exception):
                await (await self.runtime.bus.kv_objects()).delete(kv.object_name)
        return seconds

    # ------------------------------------------------------------ work

    async def prefill(
        self,
        request: InferenceRequest,
        source_event_id: str,
        hand_off: Callable[[PrefillResult], Awaitable[None]] | None = None,
        *,
        routed_at: float | None = None,
        prediction: RouteOption | None = None,
        placed_by: str | None = None,
    ) -> PrefillResult:
        """Run the prefill, stream the first token (seq 0), hand the KV off, report GPU time.

        The hand-off (to a decode worker) comes before the report, so the ledger's event never
        delays the second token. The span shows what happened next to what the router predicted
        (`prediction`, made at `routed_at`): cached tokens, and TTFT from the routing decision;
        it links to the decision (`placed_by`, its traceparent) and to the prefills whose cached
        blocks it reused, and records the batch it joined (services/engines/ripple.py).
        """
        # Filled in once the prefill says what it found cached: the span is built after that.
        links = [*self._plan_links, *link_to(placed_by, {"ripple.link": "placed_by"})]
        # Built once the first token is out (LateSpan): the token does not wait on the span.
        late = LateSpan(
            f"prefill {request.model}",
            kind=SpanKind.INTERNAL,
            attributes={
                REQUEST_ID: request.request_id,
                "gen_ai.operation.name": "prefill",
                "gen_ai.request.model": request.model,
                "gen_ai.usage.input_tokens": len(request.prompt_tokens),
                "ripple.worker_id": self.worker_id,
                "ripple.gpu_type": self.engine.info.gpu_type,
                **self._plan_attributes,
            },
            links=links,
        )
        try:
            with (
                late.activate() as span,
                self.ripple.in_batch(
                    request.request_id, span.get_span_context(), len(request.prompt_tokens)
                ) as entry,
            ):
                result = await self.engine.prefill(request)
                now = time.time()
                entry.cached_tokens = result.cached_tokens
                span.set_attributes(self.ripple.shape().attributes())
                block_size = request.block_size
                links.extend(self.ripple.reused_from(request.block_hashes, result.cached_tokens, block_size))
                self.ripple.computed(
                    request.block_hashes, result.cached_tokens, block_size, span.get_span_context()
                )
                span.set_attribute("ripple.cached_tokens", result.cached_tokens)
                span.set_attribute("ripple.gpu_seconds", result.gpu_seconds)
                if routed_at is not None:
                    span.set_attribute("ripple.ttft_s", max(0.0, now - routed_at))
                if prediction is not None:
                    span.set_attributes(
                        {
                            "ripple.predicted.cached_tokens": prediction.cached_tokens,
                            "ripple.predicted.ttft_s": prediction.ttft_s,
                        }
                    )
            seq = first_seq(request)  # 0, or where a migrated request's stream resumes
            await self.runtime.bus.publish_fast(
                tokens_subject(request.tenant, request.request_id),
                TokenChunk(
                    event_id=f"{request.request_id}-{seq}",
                    occurred_at=now,
                    request_id=request.request_id,
                    seq=seq,
                    token_ids=[result.first_token_id],
                    text=self.engine.detokenize([result.first_token_id]),
                    logprobs=[result.first_logprob] if result.first_logprob is not None else None,
                ),
            )
            # Let the connection's flusher send the first token now, before the hand-off's work
            # (which would otherwise hold it back to share one write): this is time to first token.
            await asyncio.sleep(0)
        finally:
            late.record()
        TOKENS_OUT.labels(*self._labels).inc()
        GPU_SECONDS.labels(*self._labels, "prefill").inc(result.gpu_seconds)
        PROMPT_TOKENS.labels(*self._labels, "cached").inc(result.cached_tokens)
        PROMPT_TOKENS.labels(*self._labels, "computed").inc(
            max(0, len(request.prompt_tokens) - result.cached_tokens)
        )
        if hand_off is not None:
            await hand_off(result)
            # This worker's part ends here: its first chunk must be stored before the work is
            # acked (`Bus.flush_fast`). In place, decode's own flush covers it.
            await self.runtime.bus.flush_fast(tokens_subject(request.tenant, request.request_id))
        # The prompt's blocks are cached now: tell the routers at once, not at the next tick, so
        # a request sharing the prefix that comes right after this one is placed knowing it.
        try:
            await self.publish_kv_events()
        except Exception as exc:  # never fails the request: a lost batch is a gap routers resync
            log.warning("KV events not published", extra={"worker": self.worker_id, "error": repr(exc)})
        await self.runtime.bus.publish(
            event_subject("prefill_completed"),
            PrefillCompleted(
                event_id=derived_event_id(source_event_id, "prefill_completed"),
                occurred_at=now,
                request_id=request.request_id,
                tenant=request.tenant,
                workflow_id=request.workflow.workflow_id if request.workflow else None,
                worker_id=self.worker_id,
                gpu_type=self.engine.info.gpu_type,
                gpu_seconds=result.gpu_seconds,
                prompt_tokens=len(request.prompt_tokens),
                cached_tokens=result.cached_tokens,
                ttft_s=max(0.0, now - request.submitted_at),
                model=request.model,
            ),
        )
        self.lifecycle.prefill_reported(request.request_id)
        return result

    async def decode(
        self,
        request: InferenceRequest,
        first_token_id: int,
        cached_tokens: int,
        kv_transfer_bytes: int,
        source_event_id: str,
    ) -> None:
        """Stream tokens from seq 1 (after a migration: the resume point's next) until the request
        finishes, then report usage (the whole request's, across migrations) and GPU time."""
        subject = tokens_subject(request.tenant, request.request_id)
        seq = first_seq(request) + 1
        generated = 1
        finish_reason: Literal["stop", "length"] = "length"
        # Built when the block ends (a LateSpan recorded on exit), without the SDK's per-span work.
        with (
            LateSpan(
                f"decode {request.model}",
                kind=SpanKind.INTERNAL,
                attributes={
                    REQUEST_ID: request.request_id,
                    "gen_ai.operation.name": "decode",
                    "gen_ai.request.model": request.model,
                    "gen_ai.request.max_tokens": request.max_tokens,
                    "ripple.worker_id": self.worker_id,
                    "ripple.gpu_type": self.engine.info.gpu_type,
                    **self._plan_attributes,
                },
                links=self._plan_links,
            ).activate(record=True) as span,
            self.ripple.in_batch(
                request.request_id, span.get_span_context(), len(request.prompt_tokens)
            ) as entry,
        ):
            entry.cached_tokens = cached_tokens
            span.set_attributes(self.ripple.shape().attributes())
            async for step in self.engine.decode(request.request_id, first_token_id):
                # One chunk per token, so a chunk's seq is its token's position in the output:
                # any two placements of the request (a migration, a worker thought lost that was
                # not) number the same token the same, and a reader's de-duplication by seq
                # never mixes them up.
                for i, token in enumerate(step.token_ids):
                    await self.runtime.bus.publish_fast(
                        subject,
                        TokenChunk(
                            event_id=f"{request.request_id}-{seq}",
                            occurred_at=time.time(),
                            request_id=request.request_id,
                            seq=seq,
                            token_ids=[token],
                            text=self.engine.detokenize([token]),
                            logprobs=[step.logprobs[i]] if step.logprobs is not None else None,
                        ),
                    )
                    seq += 1
                if step.token_ids:
                    generated += len(step.token_ids)
                    self.lifecycle.tokens_generated(request.request_id, generated)
                    TOKENS_OUT.labels(*self._labels).inc(len(step.token_ids))
                if step.finish_reason is not None:
                    finish_reason = "stop" if step.finish_reason == "stop" else "length"
            _, decode_gpu_s = self.engine.gpu_seconds(request.request_id)
            span.set_attribute("gen_ai.usage.output_tokens", generated)
            span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
            span.set_attribute("ripple.gpu_seconds", decode_gpu_s)
        usage = Usage(
            prompt_tokens=len(prompt_proper(request)),
            completion_tokens=output_before(request) + generated,
            cached_tokens=cached_tokens,
        )
        # Every chunk stored before the stream is marked finished and the work acked: after the
        # ack nothing would migrate the request, so a chunk only this process holds (its ack
        # lost with a NATS node) would be lost with it.
        await self.runtime.bus.flush_fast(subject)
        now = time.time()
        GPU_SECONDS.labels(*self._labels, "decode").inc(decode_gpu_s)
        await self.runtime.bus.publish(
            subject,
            StreamFinished(
                event_id=f"{request.request_id}-{seq}",
                occurred_at=now,
                request_id=request.request_id,
                seq=seq,
                finish_reason=finish_reason,
                usage=usage,
            ),
        )
        await self.runtime.bus.publish(
            event_subject("decode_completed"),
            decode_completed(
                request,
                source_event_id,
                now=now,
                worker_id=self.worker_id,
                gpu_type=self.engine.info.gpu_type,
                gpu_seconds=decode_gpu_s,
                kv_transfer_bytes=kv_transfer_bytes,
                usage=usage,
                finish_reason=finish_reason,
            ),
        )

    async def fail(
        self, request: InferenceRequest, seq: int, error: EngineError, source_event_id: str
    ) -> None:
        """An engine error for one request: tell its client and the ledger; others go on.

        `seq` counts from this placement's first chunk (0: the prefill's, 1: the decode's)."""
        seq += first_seq(request)
        now = time.time()
        log.warning(
            "request failed in engine",
            extra={"request_id": request.request_id, "error": str(error)},
        )
        await self.runtime.bus.publish(
            tokens_subject(request.tenant, request.request_id),
            StreamFailed(
                event_id=f"{request.request_id}-{seq}",
                occurred_at=now,
                request_id=request.request_id,
                seq=seq,
                code=error.code,
                message=str(error),
                http_status=400 if error.code == "invalid" else 503,
            ),
        )
        await self.runtime.bus.publish(
            event_subject("failed"),
            RequestFailed(
                event_id=derived_event_id(source_event_id, "failed"),
                occurred_at=now,
                request_id=request.request_id,
                tenant=request.tenant,
                workflow_id=request.workflow.workflow_id if request.workflow else None,
                stage=self.role,
                worker_id=self.worker_id,
                message=str(error),
                workflow_step=request.workflow.step if request.workflow else None,
                workflow_steps=request.workflow.steps if request.workflow else None,
                deadline_at=request.deadline_at,
                service_class=request.service_class,
            ),
        )
