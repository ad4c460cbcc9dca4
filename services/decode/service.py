"""Decode worker: continuous batching of decodes, streaming token chunks in order.

It takes two kinds of work: `DecodeWork` (a prompt prefilled elsewhere, whose KV it imports)
and, for aggregated serving, `PrefillWork` addressed to itself (prefill and decode here)."""

from __future__ import annotations

from typing import Any, ClassVar

from starlette.routing import BaseRoute

from schemas.events import DecodeWork, PrefillWork
from schemas.subjects import worker_consumer
from services.engines.base import EngineError
from services.engines.factory import make_engine
from services.engines.host import EngineHost
from services.mesh.consumer import Delivery
from services.mesh.runtime import Runtime


class DecodeService:
    name: ClassVar[str] = "decode"

    def __init__(self) -> None:
        self.host: EngineHost | None = None

    async def start(self, runtime: Runtime) -> None:
        settings = runtime.options.extra
        worker_id = settings["worker_id"]
        engine = make_engine({**settings, "role": "decode"}, runtime.config)
        self.host = EngineHost(
            runtime,
            engine,
            worker_id=worker_id,
            role="decode",
            pool=settings.get("pool") or f"decode-{engine.info.gpu_type}",
        )
        await self.host.start()
        await runtime.consume(
            worker_consumer("decode", worker_id),
            DecodeWork,
            self.host.lifecycle.guarded(self._on_decode),
            max_inflight=256,
            direct=True,
        )
        await runtime.consume(
            worker_consumer("prefill", worker_id),
            PrefillWork,
            self.host.lifecycle.guarded(self._on_aggregated),
            max_inflight=256,
            direct=True,
        )

    async def stop(self) -> None:
        if self.host is not None:
            await self.host.stop()

    def routes(self) -> list[BaseRoute]:
        return []

    def health(self) -> dict[str, Any]:
        return self.host.health() if self.host else {}

    async def _on_decode(self, work: DecodeWork, delivery: Delivery) -> None:
        host = self.host
        assert host is not None
        try:
            await host.import_kv(work.request, work.kv)
            await host.decode(
                work.request,
                work.first_token_id,
                work.cached_tokens,
                work.kv.kv_bytes,
                work.event_id,
            )
        except EngineError as exc:
            host.engine.release(work.request.request_id)
            await host.fail(work.request, 1, exc, work.event_id)

    async def _on_aggregated(self, work: PrefillWork, delivery: Delivery) -> None:
        host = self.host
        assert host is not None
        try:
            result = await host.prefill(
                work.request,
                work.event_id,
                routed_at=work.occurred_at,
                prediction=work.prediction,
                placed_by=work.decision_traceparent,
            )
        except EngineError as exc:
            await host.fail(work.request, 0, exc, work.event_id)
            return
        try:
            await host.decode(work.request, result.first_token_id, result.cached_tokens, 0, work.event_id)
        except EngineError as exc:
            host.engine.release(work.request.request_id)
            await host.fail(work.request, 1, exc, work.event_id)
