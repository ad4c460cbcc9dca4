"""The ingress's OpenAI-compatible HTTP API: authenticate (API key -> tenant), validate,
tokenize and hash (`prepare`), publish a `RequestPrepared` per choice, then relay the token
streams as SSE (or one JSON body)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from schemas.events import (
    InferenceRequest,
    RequestPrepared,
    StreamFailed,
    StreamFinished,
    TokenChunk,
    new_event_id,
)
from schemas.subjects import event_subject, prepared_subject, tokens_subject
from services.ingress import latency
from services.ingress.cancel import ClientGone, cancelled, until_disconnect
from services.ingress.http_helpers import (
    client_request_id_of,
    error_response,
    field_of,
    ripple_headers,
    sse_event,
)
from services.ingress.openai_api import (
    ChatCompletionBody,
    CompletionBody,
    ResponseShape,
    choices_usage,
    error_body,
)
from services.ingress.openapi import openapi_document
from services.ingress.part import ServicePart
from services.ingress.prepare import ClientRequest, InvalidRequest, prepare
from services.ingress.relay import Choice, merged
from services.mesh.token_stream import StreamTimeout, TokenStream
from services.mesh.tracing import REQUEST_ID, LateSpan, extract_context

# The service's logger: its records are named as before the module was split out.
log = logging.getLogger("services.ingress.service")

HTTP_REQUESTS = Counter(
    "ripplemesh_ingress_http_requests_total",
    "HTTP API requests by route and status.",
    ["route", "status"],
)


class HttpApi(ServicePart):
    """The routes' handlers."""

    def _authenticate(self, request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        return self._rt.config.tenant_for_api_key(key) if key else None

    async def models(self, request: Request) -> Response:
        if self._authenticate(request) is None:
            return error_response(401, "invalid or missing API key", code="invalid_api_key")
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
                    "adapters": [a.name for a in m.adapters],
                }
            )
            data.extend(
                {
                    "id": f"{m.name}:{a.name}",
                    "object": "model",
                    "created": 0,
                    "owned_by": "ripplemesh",
                    "parent": m.name,
                    "max_model_len": m.max_context_tokens,
                }
                for a in m.adapters
            )
        return JSONResponse({"object": "list", "data": data})

    async def health(self, _: Request) -> Response:
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

    async def openapi(self, _: Request) -> Response:
        return JSONResponse(openapi_document())

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def completions(self, request: Request) -> Response:
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
        client_request_id = client_request_id_of(request)
        # A client's W3C trace context is continued (a malformed one is ignored: a fresh trace).
        # Built when the block ends (a LateSpan recorded on exit), without the SDK's per-span work.
        with LateSpan(
            f"POST {route}",
            context=extract_context(request.headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": route},
        ).activate(record=True) as span:
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
            return error_response(401, "invalid or missing API key", code="invalid_api_key")
        request_id = uuid.uuid4().hex
        span.set_attribute(REQUEST_ID, request_id)
        span.set_attribute("ripple.tenant", tenant)
        try:
            raw = await self._read_body(request)
            client_request, stream, include_usage, choices_asked = self._parse(
                raw, api, request, tenant, request_id
            )
            now = time.time()
            features = self.fleet.features(self._rt.config.base_model_name(client_request.model), now)
            prepared = prepare(client_request, self._rt.config, now, features)
        except InvalidRequest as exc:
            return error_response(exc.status, exc.message, param=exc.param, code=exc.code)
        except ClientDisconnect:
            return Response(status_code=499)
        context = span.get_span_context()
        trace_id = f"{context.trace_id:032x}" if context.is_valid else None
        # The GenAI conventions for the model call the client made.
        span.set_attribute("gen_ai.operation.name", "chat" if api == "chat" else "text_completion")
        span.set_attribute("gen_ai.request.model", prepared.model)
        span.set_attribute("gen_ai.request.max_tokens", prepared.max_tokens)
        span.set_attribute("gen_ai.request.temperature", prepared.temperature)
        prefix = "chatcmpl-" if api == "chat" else "cmpl-"
        span.set_attribute("gen_ai.response.id", prefix + client_request.request_id)
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
                first_at = time.time()
                for choice, first in zip(opened, firsts, strict=True):
                    choice.first, choice.first_at, choice.trace_id = first, first_at, trace_id
                    choice.saw(first)
                failed = next((f for f in firsts if isinstance(f, StreamFailed)), None)
                if failed is not None:
                    await self._close(choices)
                    return error_response(
                        failed.http_status,
                        failed.message,
                        code=failed.code,
                        retry_after_s=failed.retry_after_s,
                    )
                if len(choices) == 1 and not isinstance(firsts[0], StreamFailed):
                    latency.first_token(prepared, first_at, trace_id)
        except ClientGone:
            await self._close(choices)
            return Response(status_code=499)
        except StreamTimeout as exc:
            await self._close(choices)
            return error_response(504, f"no response from the mesh: {exc}", code="timeout")
        except Exception as exc:
            await self._close(choices)
            log.exception("request could not be submitted")
            return error_response(503, f"the mesh is unavailable: {exc!r}", code="unavailable")
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
            client_request.model,  # echoed as asked (an adapter named with its model, or alone)
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
            raise InvalidRequest(f"invalid request body: {exc}", param=field_of(exc)) from None
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
        refused = body.refused_parameter()
        if refused is not None:
            raise InvalidRequest(
                f"{refused} is not supported by ripplemesh's engines; leave it unset",
                param=refused,
                code="unsupported_parameter",
            )
        priority, priority_level, deadline_ms, workflow = ripple_headers(request)
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
                if isinstance(event, TokenChunk):
                    for chunk in choice.shape.chunks(event.text, event.logprobs):
                        yield sse_event(chunk)
                elif isinstance(event, StreamFinished):
                    for chunk in choice.shape.final_chunks(event.finish_reason):
                        yield sse_event(chunk)
                elif isinstance(event, StreamFailed):
                    log.warning(
                        "stream failed", extra={"request_id": event.request_id, "error": event.message}
                    )
                    yield sse_event(error_body(event.message, type_="server_error", code=event.code))
                    break
            usages = [c.usage for c in choices if c.usage is not None]
            if include_usage and len(usages) == len(choices):
                yield sse_event(choices[0].shape.usage_chunk(choices_usage(usages)))
            yield sse_event("[DONE]")
        except StreamTimeout as exc:
            log.warning("stream stalled", extra={"error": str(exc)})
            yield sse_event(error_body(f"the stream stalled: {exc}", type_="server_error", code="timeout"))
            yield sse_event("[DONE]")
        except Exception as exc:
            # Anything else mid-stream: the client gets an error event, not a cut connection.
            log.exception("stream broke")
            yield sse_event(error_body(f"the stream broke: {exc!r}", type_="server_error", code="internal"))
            yield sse_event("[DONE]")
        finally:
            await self._close(choices)

    async def _collect(self, choices: list[Choice]) -> Response:
        try:
            async for choice, event in merged(choices):
                if isinstance(event, TokenChunk):
                    choice.parts.append(event.text)
                    choice.logprobs.extend(event.logprobs or ())
                elif isinstance(event, StreamFailed):
                    return error_response(
                        event.http_status, event.message, code=event.code, retry_after_s=event.retry_after_s
                    )
                elif event is None:
                    return error_response(502, "the stream ended without a final event", code="internal")
            usages = [c.usage for c in choices if c.usage is not None]
            body = [c.shape.choice("".join(c.parts), c.logprobs, c.finish_reason) for c in choices]
            return JSONResponse(choices[0].shape.response(body, choices_usage(usages)))
        except StreamTimeout as exc:
            return error_response(504, f"the stream stalled: {exc}", code="timeout")
        finally:
            await self._close(choices)
