"""Ingress: the OpenAI-compatible HTTP API (`http_api`) and the NATS submit path (`nats_path`).

HTTP: authenticate (API key -> tenant), validate, tokenize and hash (`prepare`), publish a
`RequestPrepared`, then relay the request's token stream as SSE (or one JSON body).
NATS: consume `SubmitRequest`s from ``rmesh.req.<tenant>`` (the tenant is the subject's), prepare
them the same way; the client reads its tokens from ``rmesh.tokens.<tenant>.<request_id>``. A
client that missed token events (its NATS node was lost) publishes `ReplayTokens`: ingress
publishes the stored events again on that subject, the only one the tenant may read.

This module is the service: its lifecycle, routes and health, with the two paths on it.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from schemas.events import ClientEvent
from schemas.subjects import INGRESS_CONSUMER, WORKERS
from services.ingress.batch_api import BatchApi
from services.ingress.fleet import FleetView
from services.ingress.http_api import HttpApi
from services.ingress.http_helpers import error_response
from services.ingress.nats_path import NatsPath
from services.mesh.heartbeat_watch import HeartbeatWatch
from services.mesh.runtime import Runtime


class IngressService:
    name: ClassVar[str] = "ingress"

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.fleet = FleetView()
        self.http = HttpApi(lambda: self._rt, self.fleet)
        self.nats = NatsPath(lambda: self._rt, self.fleet)
        self.batch = BatchApi(lambda: self._rt, self.fleet, self.http._authenticate)

    # ------------------------------------------------------------ lifecycle

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        await runtime.consume(
            INGRESS_CONSUMER,
            ClientEvent,
            self.nats.on_client_event,
            max_inflight=256,
            direct=True,
            on_undecodable=self.nats.on_undecodable_submission,
        )
        runtime.spawn(self._watch_workers(), "workers-watch")

    async def _watch_workers(self) -> None:
        """The WORKERS bucket: who serves what, for /health, /v1/models and feature checks."""
        watch = HeartbeatWatch(await self._rt.bus.key_value(WORKERS))
        async for entry in watch.updates():
            self.fleet.observe(entry.key, entry.value, entry.operation)

    async def stop(self) -> None:
        return None

    def health(self) -> dict[str, Any]:
        return {"live_workers": len(self.fleet.live(time.time()))}

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/chat/completions", self.http.chat, methods=["POST"]),
            Route("/v1/completions", self.http.completions, methods=["POST"]),
            Route("/v1/models", self.http.models, methods=["GET"]),
            # The Batch API (batch_api.py; run by services/batch/).
            Route("/v1/files", self.batch.create_file, methods=["POST"]),
            Route("/v1/files/{file_id}", self.batch.get_file, methods=["GET"]),
            Route("/v1/files/{file_id}/content", self.batch.file_content, methods=["GET"]),
            Route("/v1/batches", self.batch.create_batch, methods=["POST"]),
            Route("/v1/batches", self.batch.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.batch.get_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.batch.cancel_batch, methods=["POST"]),
            Route("/health", self.http.health, methods=["GET"]),
            Route("/openapi.json", self.http.openapi, methods=["GET"]),
        ]

    def exception_handlers(self) -> dict[Any, Any]:
        """Starlette's own errors (an unknown path, a wrong method) in the OpenAI error shape."""

        async def http_error(request: Request, exc: Exception) -> Response:
            status = exc.status_code if isinstance(exc, HTTPException) else 500
            detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
            return error_response(status, f"{request.method} {request.url.path}: {detail}")

        return {HTTPException: http_error}

    @property
    def _rt(self) -> Runtime:
        if self.runtime is None:
            raise RuntimeError("ingress not started")
        return self.runtime
