"""Ingress: the OpenAI-compatible HTTP API and the NATS submit path.

HTTP: authenticate (API key -> tenant), validate, tokenize and hash (`prepare`), publish a
`RequestPrepared`, then relay the request's token stream as SSE (or one JSON body).
NATS: consume `SubmitRequest`s from ``rmesh.req.<tenant>`` (the tenant is the subject's), prepare
them the same way; the client reads its tokens from ``rmesh.tokens.<tenant>.<request_id>``. A
client that missed token events (its NATS node was lost) publishes `ReplayTokens`: ingress
publishes the stored events again on that subject, the only one the tenant may read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

import msgspec
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Histogram
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from schemas.events import (
    CancelRequest,
    ClientEvent,
    Identifier,
    InferenceRequest,
    PriorityClass,
    ReplayTokens,
    RequestPrepared,
    StreamFailed,
    StreamFinished,
    SubmitRequest,
    TokenChunk,
    WorkflowRef,
    derived_event_id,
    new_event_id,
)
from schemas.subjects import (
    INGRESS_CONSUMER,
    WORKERS,
    event_subject,
    prepared_subject,
    tenant_of,
    tokens_subject,
)
from services.ingress.cancel import ClientGone, cancelled, until_disconnect
from services.ingress.fleet import FleetView
from services.ingress.openai_api import (
    ChatCompletionBody,
    CompletionBody,
    ResponseShape,
    choices_usage,
    error_body,
)
from services.ingress.openapi import openapi_document
from services.ingress.prepare import ClientRequest, InvalidRequest, prepare
from services.ingress.relay import Choice, merged
from services.mesh.consumer import Delivery
from services.mesh.heartbeat_watch import HeartbeatWatch
from services.mesh.rejection import publish_rejection
from services.mesh.runtime import Runtime
from services.mesh.token_stream import StreamTimeout, TokenStream, stored_messages
from services.mesh.tracing import REQUEST_ID, tracer

log = logging.getLogger(__name__)

HTTP_REQUESTS = Counter(
    "ripplemesh_ingress_http_requests_total",
    "HTTP API requests by route and status.",
    ["route", "status"],
)
TTFT = Histogram(
    "ripplemesh_ingress_ttft_seconds",
    "Time to first token seen by the ingress.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
NATS_SUBMISSIONS = Counter(
    "ripplemesh_ingress_nats_submissions_total",
    "Requests submitted over NATS, by outcome.",
    ["outcome"],
)
REPLAYED_EVENTS = Counter(
    "ripplemesh_ingress_replayed_token_events_total",
    "Token events published again for NATS clients that missed them (ReplayTokens).",
)

SUBMIT_TAG: str = SubmitRequest.__struct_config__.tag  # type: ignore[assignment]
PRIORITIES: tuple[PriorityClass, ...] = ("critical", "standard", "sheddable")


class _SubmissionIds(msgspec.Struct):
    """What can still be read of a submission that does not decode: enough to answer it."""

    type: str = ""
    request_id: Identifier | None = None
    event_id: Identifier | None = None


def _error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    retry_after_s: float | None = None,
) -> JSONResponse:
    type_ = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s else None
    return JSONResponse(
        error_body(message, type_=type_, param=param, code=code),
        status_code=status,
        headers=headers,
    )


def _client_request_id(request: Request) -> str | None:
    """The client's own `x-request-id`, echoed and recorded (printable ASCII, at most 128)."""
    raw = request.headers.get("x-request-id")
    if raw is None or not 0 < len(raw) <= 128 or not raw.isascii() or not raw.isprintable():
        return None
    return raw


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _ripple_headers(request: Request) -> tuple[PriorityClass, int, int | None, WorkflowRef | None]:
    """The optional `x-ripple-*` headers; a malformed one is a 400 naming it. The priority level's
    range is admission's to check (its config)."""
    headers = request.headers
    priority = headers.get("x-ripple-priority", "standard")
    if priority not in PRIORITIES:
        raise InvalidRequest(
            f"x-ripple-priority must be one of {', '.join(PRIORITIES)}", param="x-ripple-priority"
        )

    def integer(name: str) -> int | None:
        raw = headers.get(name)
        if raw is None:
            return None
        try:
            value = int(raw)
        except ValueError:
            raise InvalidRequest(f"{name} must be an integer", param=name) from None
        if value < 1 or value > 10**9:
            raise InvalidRequest(f"{name} must be between 1 and 1000000000", param=name)
        return value

    deadline_ms = integer("x-ripple-deadline-ms")
    raw_level = headers.get("x-ripple-priority-level", "0")
    try:
        priority_level = int(raw_level)
    except ValueError:
        raise InvalidRequest(
            "x-ripple-priority-level must be an integer", param="x-ripple-priority-level"
        ) from None
    workflow = None
    workflow_id = headers.get("x-ripple-workflow-id")
    step = integer("x-ripple-workflow-step")
    steps = integer("x-ripple-workflow-steps")
    if workflow_id is None and (step is not None or steps is not None):
        name = "x-ripple-workflow-step" if step is not None else "x-ripple-workflow-steps"
        raise InvalidRequest(f"{name} needs x-ripple-workflow-id", param=name)
    if workflow_id is not None:
        try:
            workflow = msgspec.convert(
                {"workflow_id": workflow_id, "step": step or 1, "steps": steps},
                WorkflowRef,
            )
        except msgspec.ValidationError:
            raise InvalidRequest(
                "x-ripple-workflow-id must be 1-128 characters of [A-Za-z0-9_-]",
                param="x-ripple-workflow-id",
            ) from None
    return priority, priority_level, deadline_ms, workflow  # type: ignore[return-value]


def _field_of(exc: msgspec.ValidationError) -> str | None:
    # msgspec says "... - at `$.messages[0].role`"; the field is what follows `$.`.
    text = str(exc)
    marker = "at `$."
    if marker in text:
        return text.split(marker, 1)[1].rstrip("`")
    return None


class _Sequenced(msgspec.Struct):
    """Just the sequence number of a token event."""

    seq: int


class IngressService:
    name: ClassVar[str] = "ingress"

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.fleet = FleetView()

    # ------------------------------------------------------------ lifecycle

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        await runtime.consume(
            INGRESS_CONSUMER,
            ClientEvent,
            self._on_client_event,
            max_inflight=256,
            direct=True,
            on_undecodable=self._on_undecodable_submission,
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
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/openapi.json", self._openapi, methods=["GET"]),
        ]

    def exception_handlers(self) -> dict[Any, Any]:
        """Starlette's own errors (an unknown path, a wrong method) in the OpenAI error shape."""

        async def http_error(request: Request, exc: Exception) -> Response:
            status = exc.status_code if isinstance(exc, HTTPException) else 500
            detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
            return _error(status, f"{request.method} {request.url.path}: {detail}")

        return {HTTPException: http_error}

    @property
    def _rt(self) -> Runtime:
        if self.runtime is None:
            raise RuntimeError("ingress not started")
        return self.runtime

    # ------------------------------------------------------------ HTTP

    def _authenticate(self, request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        return self._rt.config.tenant_for_api_key(key) if key else None

    async def _models(self, request: Request) -> Response:
        if self._authenticate(request) is None:
            return _error(401, "invalid or missing API key", code="invalid_api_key")
        now = time.time()
        data = []
        for m in self._rt.config.models:
            features = self.fleet.features(m.name, now)
            data.append(
                {
                    "id": m.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "ripplemesh",
                    "max_model_len": m.max_context_tokens,
                    "live_workers": len(self.fleet.live(now, m.name)),
                    "features": sorted(features) if features is not None else [],
                }
            )
        return JSONResponse({"object": "list", "data": data})

    async def _health(self, _: Request) -> Response:
        """200 when the mesh can serve: connected to NATS and a live worker for some model."""
        now = time.time()
        live = {m.name: len(self.fleet.live(now, m.name)) for m in self._rt.config.models}
        reason = None
        if not self._rt.bus.nc.is_connected:
            reason = "not connected to NATS"
        elif not any(live.values()):
            reason = "no live worker for any model"
        body: dict[str, Any] = {"status": "ok" if reason is None else "unavailable", "live_workers": live}
        if reason is not None:
            body["reason"] = reason
        return JSONResponse(body, status_code=200 if reason is None else 503)

    async def _openapi(self, _: Request) -> Response:
        return JSONResponse(openapi_document())

    async def _chat(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def _completions(self, request: Request) -> Response:
        return await self._serve(request, "completion")

    async def _read_body(self, request: Request) -> bytes:
        limit = self._rt.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise InvalidRequest(f"the request body exceeds {limit} bytes", status=413)
        body = bytearray()
        timeout_s = self._rt.config.body_read_timeout_s

        async def read() -> None:
            async for part in request.stream():
                body.extend(part)
                if len(body) > limit:
                    raise InvalidRequest(f"the request body exceeds {limit} bytes", status=413)

        try:
            # A client that dribbles its body must not hold a connection (and memory) forever.
            await asyncio.wait_for(read(), timeout_s)
        except TimeoutError:
            raise InvalidRequest(
                f"the request body was not received within {timeout_s:g} s", status=408, code="timeout"
            ) from None
        return bytes(body)

    async def _serve(self, request: Request, api: Literal["chat", "completion"]) -> Response:
        route = request.url.path
        client_request_id = _client_request_id(request)
        with tracer().start_as_current_span(
            f"POST {route}",
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": route},
        ) as span:
            if client_request_id is not None:
                span.set_attribute("ripple.client_request_id", client_request_id)
            response = await self._serve_traced(request, api, span)
            if client_request_id is not None:
                response.headers["x-request-id"] = client_request_id
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 500:
                span.set_status(Status(StatusCode.ERROR))
            HTTP_REQUESTS.labels(route, str(response.status_code)).inc()
            return response

    async def _serve_traced(
        self, request: Request, api: Literal["chat", "completion"], span: Any
    ) -> Response:
        tenant = self._authenticate(request)
        if tenant is None:
            return _error(401, "invalid or missing API key", code="invalid_api_key")
        request_id = uuid.uuid4().hex
        span.set_attribute(REQUEST_ID, request_id)
        span.set_attribute("ripple.tenant", tenant)
        try:
            raw = await self._read_body(request)
            client_request, stream, include_usage, choices_asked = self._parse(
                raw, api, request, tenant, request_id
            )
            now = time.time()
            features = self.fleet.features(client_request.model, now)
            prepared = prepare(client_request, self._rt.config, now, features)
        except InvalidRequest as exc:
            return _error(exc.status, exc.message, param=exc.param, code=exc.code)
        except ClientDisconnect:
            return Response(status_code=499)
        span.set_attribute("gen_ai.request.model", prepared.model)
        span.set_attribute("gen_ai.usage.input_tokens", len(prepared.prompt_tokens))
        if choices_asked > 1:
            span.set_attribute("gen_ai.request.choice.count", choices_asked)

        # Choice 0 is the request; each further one (n > 1) a sequence of its own, sent once the
        # first is prefilled, so the router places it where that prompt is now cached and its
        # prefill is a cache hit: the prompt is computed once for all n (the *share* move).
        preparations = [prepared] + [
            msgspec.structs.replace(prepared, request_id=f"{request_id}-{i}") for i in range(1, choices_asked)
        ]
        choices: list[Choice] = []
        try:
            for batch in (preparations[:1], preparations[1:]):
                if not batch:
                    continue
                opened = [
                    await self._open_choice(api, client_request, p, len(choices) + i)
                    for i, p in enumerate(batch)
                ]
                choices += opened
                for choice in opened:
                    await self._rt.bus.publish(
                        prepared_subject(tenant),
                        RequestPrepared(
                            event_id=new_event_id(), occurred_at=time.time(), request=choice.prepared
                        ),
                    )
                # Wait for the first events before answering, so a rejection gets its HTTP status.
                firsts = await until_disconnect(request, asyncio.gather(*(anext(c.events) for c in opened)))
                for choice, first in zip(opened, firsts, strict=True):
                    choice.first = first
                    choice.saw(first)
                failed = next((f for f in firsts if isinstance(f, StreamFailed)), None)
                if failed is not None:
                    await self._close(choices)
                    return _error(
                        failed.http_status,
                        failed.message,
                        code=failed.code,
                        retry_after_s=failed.retry_after_s,
                    )
                if len(choices) == 1:
                    TTFT.observe(time.time() - prepared.submitted_at)
        except ClientGone:
            await self._close(choices)
            return Response(status_code=499)
        except StreamTimeout as exc:
            await self._close(choices)
            return _error(504, f"no response from the mesh: {exc}", code="timeout")
        except Exception as exc:
            await self._close(choices)
            log.exception("request could not be submitted")
            return _error(503, f"the mesh is unavailable: {exc!r}", code="unavailable")
        if stream:
            return StreamingResponse(
                self._sse(choices, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Ripple-Request-Id": request_id},
            )
        try:
            return await until_disconnect(request, self._collect(choices))
        except ClientGone:
            return Response(status_code=499)

    async def _open_choice(
        self,
        api: Literal["chat", "completion"],
        client_request: ClientRequest,
        prepared: InferenceRequest,
        index: int,
    ) -> Choice:
        """A choice's token stream, subscribed before its request is published."""
        tokens = TokenStream(
            self._rt.bus.nc,
            tokens_subject(prepared.tenant, prepared.request_id),
            first_event_timeout_s=self._rt.config.first_token_timeout_s,
            idle_timeout_s=self._rt.config.stream_idle_timeout_s,
        )
        await tokens.open()
        shape = ResponseShape(
            api,
            client_request.request_id,
            prepared.model,
            index=index,
            tool_calls=client_request.parses_tool_calls,
            top_logprobs=prepared.logprobs,
        )
        return Choice(prepared, shape, tokens, tokens.events())

    async def _close(self, choices: list[Choice]) -> None:
        """The choices' streams closed; the work of any not finished (the client went away, a
        stream stalled, another choice failed) stopped."""
        for choice in choices:
            if not choice.ended:
                self._cancel(choice.prepared)
            await choice.tokens.close()

    def _cancel(self, prepared: InferenceRequest) -> None:
        """The client is gone (or its stream stalled): have the workers stop the request. In
        the background, as the caller may be a stream being cancelled itself."""
        event = cancelled(
            prepared.request_id,
            prepared.tenant,
            "client_disconnected",
            workflow=prepared.workflow,
            deadline_at=prepared.deadline_at,
        )
        self._rt.spawn(self._rt.bus.publish(event_subject("cancelled"), event), "cancel")

    def _parse(
        self,
        raw: bytes,
        api: Literal["chat", "completion"],
        request: Request,
        tenant: str,
        request_id: str,
    ) -> tuple[ClientRequest, bool, bool, int]:
        """The request, whether to stream, whether with a usage chunk, how many choices."""
        tools, tool_choice, response_format, logprobs = None, None, None, None
        try:
            if api == "chat":
                chat = msgspec.json.decode(raw, type=ChatCompletionBody)
                body: ChatCompletionBody | CompletionBody = chat
                prompt, messages = None, chat.messages
                tools, tool_choice, response_format = chat.tools, chat.tool_choice, chat.response_format
                if chat.top_logprobs is not None and not chat.logprobs:
                    raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
                logprobs = (chat.top_logprobs or 0) if chat.logprobs else None
                # `is not None`, not `or`: an explicit 0 is refused by prepare(), not replaced.
                max_tokens = next(
                    (n for n in (chat.max_completion_tokens, chat.max_tokens) if n is not None), 256
                )
                model, temperature, stream, options = (
                    chat.model,
                    chat.temperature,
                    chat.stream,
                    chat.stream_options,
                )
            else:
                completion = msgspec.json.decode(raw, type=CompletionBody)
                body = completion
                logprobs = completion.logprobs
                if isinstance(completion.prompt, list):
                    if len(completion.prompt) != 1:
                        raise InvalidRequest(
                            "prompt must be a string or a list of one string", param="prompt"
                        )
                    prompt = completion.prompt[0]
                else:
                    prompt = completion.prompt
                messages = None
                max_tokens = completion.max_tokens
                model, temperature = completion.model, completion.temperature
                stream, options = completion.stream, completion.stream_options
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"invalid request body: {exc}", param=_field_of(exc)) from None
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
        refused = body.refused_parameter()
        if refused is not None:
            raise InvalidRequest(
                f"{refused} is not supported by ripplemesh's engines; leave it unset",
                param=refused,
                code="unsupported_parameter",
            )
        priority, priority_level, deadline_ms, workflow = _ripple_headers(request)
        client_request = ClientRequest(
            request_id=request_id,
            tenant=tenant,
            model=model,
            api=api,
            prompt=prompt,
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            priority=priority,
            priority_level=priority_level,
            deadline_ms=deadline_ms,
            workflow=workflow,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            logprobs=logprobs,
        )
        return client_request, stream, bool(options and options.include_usage), body.n

    async def _sse(self, choices: list[Choice], include_usage: bool) -> AsyncIterator[bytes]:
        try:
            async for choice, event in merged(choices):
                choice.saw(event)
                if isinstance(event, TokenChunk):
                    for chunk in choice.shape.chunks(event.text, event.logprobs):
                        yield _sse(chunk)
                elif isinstance(event, StreamFinished):
                    for chunk in choice.shape.final_chunks(event.finish_reason):
                        yield _sse(chunk)
                elif isinstance(event, StreamFailed):
                    yield _sse(error_body(event.message, type_="server_error", code=event.code))
                    break
            usages = [c.usage for c in choices if c.usage is not None]
            if include_usage and len(usages) == len(choices):
                yield _sse(choices[0].shape.usage_chunk(choices_usage(usages)))
            yield _sse("[DONE]")
        except StreamTimeout as exc:
            yield _sse(error_body(f"the stream stalled: {exc}", type_="server_error", code="timeout"))
            yield _sse("[DONE]")
        finally:
            await self._close(choices)

    async def _collect(self, choices: list[Choice]) -> Response:
        try:
            async for choice, event in merged(choices):
                choice.saw(event)
                if isinstance(event, TokenChunk):
                    choice.parts.append(event.text)
                    choice.logprobs.extend(event.logprobs or ())
                elif isinstance(event, StreamFailed):
                    return _error(
                        event.http_status, event.message, code=event.code, retry_after_s=event.retry_after_s
                    )
                elif event is None:
                    return _error(502, "the stream ended without a final event", code="internal")
            usages = [c.usage for c in choices if c.usage is not None]
            body = [c.shape.choice("".join(c.parts), c.logprobs, c.finish_reason) for c in choices]
            return JSONResponse(choices[0].shape.response(body, choices_usage(usages)))
        except StreamTimeout as exc:
            return _error(504, f"the stream stalled: {exc}", code="timeout")
        finally:
            await self._close(choices)

    # ------------------------------------------------------------ NATS submissions

    async def _on_client_event(self, event: ClientEvent, delivery: Delivery) -> None:
        if isinstance(event, SubmitRequest):
            await self._on_submission(event, delivery)
        elif isinstance(event, ReplayTokens):
            await self._on_replay(event, delivery)
        elif isinstance(event, CancelRequest):
            await self._on_cancel(event, delivery)
        else:
            log.info("client event not handled here", extra={"type": type(event).__name__})

    async def _on_replay(self, replay: ReplayTokens, delivery: Delivery) -> None:
        """Publish again the request's stored token events from `from_seq` on, with their own
        message ids (the TOKENS stream drops them as duplicates; the client's subscription gets
        them). The tenant is the subject's, so a tenant replays only its own streams."""
        subject = tokens_subject(tenant_of(delivery.subject), replay.request_id)
        replayed = 0
        for msg in await stored_messages(self._rt.bus.nc, subject):
            try:
                seq = msgspec.json.decode(msg.data, type=_Sequenced).seq
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if seq >= replay.from_seq:
                msg_id = (msg.headers or {}).get("Nats-Msg-Id")
                await self._rt.bus.nc.publish(
                    subject, msg.data, headers={"Nats-Msg-Id": msg_id} if msg_id else None
                )
                replayed += 1
        REPLAYED_EVENTS.inc(replayed)

    async def _on_cancel(self, cancel: CancelRequest, delivery: Delivery) -> None:
        """A NATS client cancels one of its requests: the tenant is the subject's, and workers
        stop the request only if it is that tenant's."""
        tenant = tenant_of(delivery.subject)
        if tenant not in self._rt.config.tenants:
            log.warning("cancellation for an unknown tenant ignored", extra={"tenant": tenant})
            return
        await self._rt.bus.publish(
            event_subject("cancelled"),
            cancelled(cancel.request_id, tenant, "client_cancelled", source_event_id=cancel.event_id),
        )

    async def _on_submission(self, submission: SubmitRequest, delivery: Delivery) -> None:
        tenant = tenant_of(delivery.subject)
        try:
            if tenant not in self._rt.config.tenants:
                raise InvalidRequest(f"unknown tenant {tenant!r}", status=403, code="unknown_tenant")
            prepared = prepare(
                ClientRequest(
                    request_id=submission.request_id,
                    tenant=tenant,
                    model=submission.model,
                    api="nats",
                    prompt=submission.prompt,
                    messages=submission.messages,
                    max_tokens=submission.max_tokens,
                    temperature=submission.temperature,
                    priority=submission.priority,
                    priority_level=submission.priority_level,
                    deadline_ms=submission.deadline_ms,
                    workflow=submission.workflow,
                    tools=submission.tools,
                    tool_choice=submission.tool_choice,
                    response_format=submission.response_format,
                    logprobs=submission.logprobs,
                ),
                self._rt.config,
                submission.occurred_at or time.time(),
                self.fleet.features(submission.model, time.time()),
            )
        except InvalidRequest as exc:
            NATS_SUBMISSIONS.labels("invalid").inc()
            await self._reject_submission(submission, tenant, exc)
            return
        await self._rt.bus.publish(
            prepared_subject(tenant),
            RequestPrepared(
                event_id=derived_event_id(submission.event_id, "prepared"),
                occurred_at=time.time(),
                request=prepared,
            ),
        )
        NATS_SUBMISSIONS.labels("accepted").inc()

    async def _on_undecodable_submission(self, delivery: Delivery, data: bytes, reason: str) -> None:
        """A submission that breaks the schema (a priority not in the three classes, a negative
        max_tokens) is dead-lettered by the consumer; if its request id can still be read, its
        client is also told why on the request's token subject, instead of waiting in vain."""
        try:
            ids = msgspec.json.decode(data, type=_SubmissionIds)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # nobody to answer: the dead letter alone records it
        tenant = tenant_of(delivery.subject)
        if ids.type != SUBMIT_TAG or ids.request_id is None or tenant not in self._rt.config.tenants:
            return
        NATS_SUBMISSIONS.labels("invalid").inc()
        await publish_rejection(
            self._rt.bus,
            source_event_id=ids.event_id or f"{delivery.subject}:{delivery.stream_seq}",
            request_id=ids.request_id,
            tenant=tenant,
            stage="ingress",
            reason="invalid",
            message=f"invalid submission: {reason}",
            http_status=400,
        )

    async def _reject_submission(self, submission: SubmitRequest, tenant: str, exc: InvalidRequest) -> None:
        await publish_rejection(
            self._rt.bus,
            source_event_id=submission.event_id,
            request_id=submission.request_id,
            tenant=tenant,
            stage="ingress",
            reason="invalid",
            message=exc.message,
            http_status=exc.status,
        )
