"""`MeshClient`: submit requests over NATS and receive their tokens, in order, exactly once.

credentials = load_credentials(".ripplemesh/credentials/tenant-demo.json")  # ripplemesh up wrote it
async with MeshClient("nats://127.0.0.1:4222", tenant="demo", credentials=credentials) as client:
    async for chunk in client.stream(prompt="Hello", max_tokens=32):
        print(chunk.text, end="")

The NATS URL may list several cluster nodes, comma-separated: the client reconnects to another
one when its node is lost, retries its publishes through leader elections, and has the token
events it missed meanwhile published again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import nats
from nats.aio.client import Client as NatsClient

from schemas.events import (
    CancelRequest,
    ChatMessage,
    PriorityClass,
    ReplayTokens,
    ResponseFormat,
    ServiceClass,
    StreamFailed,
    StreamFinished,
    SubmitRequest,
    TokenChunk,
    TokenEvent,
    TokenLogprob,
    ToolChoice,
    ToolSpec,
    Usage,
    WorkflowRef,
    encode_event,
    new_event_id,
)
from schemas.subjects import request_subject, tokens_subject
from services.ingress.tool_calls import ParsedCall, parse_tool_calls
from services.mesh.bus import TRANSIENT_ERRORS, nats_servers, publish_acked, reconnecting_options
from services.mesh.nats_auth import NatsCredentials
from services.mesh.token_stream import ReadBack, TokenStream
from services.mesh.tracing import inject_headers


class MeshError(Exception):
    """The mesh refused or failed the request; `code` and `http_status` say why."""

    def __init__(self, failure: StreamFailed):
        super().__init__(f"{failure.code}: {failure.message}")
        self.code = failure.code
        self.http_status = failure.http_status
        self.retry_after_s = failure.retry_after_s
        self.message = failure.message


class MeshUnavailable(Exception):
    """The mesh's NATS did not acknowledge the request (its stream without a leader, or no
    server reachable) within the client's retries. Whether it was stored is unknown, so the
    client also cancels it."""


@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    chunks: int
    # The tool calls read out of the text (when tools were offered), and the text outside them.
    tool_calls: list[ParsedCall] = field(default_factory=list)
    content: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


class MeshClient:
    def __init__(
        self,
        nats_url: str,
        tenant: str,
        *,
        model: str = "llama-3-8b",
        first_token_timeout_s: float = 60.0,
        idle_timeout_s: float = 30.0,
        nc: NatsClient | None = None,
        credentials: NatsCredentials | None = None,
    ):
        if credentials is not None and credentials.tenant not in (None, tenant):
            raise ValueError(f"credentials of tenant {credentials.tenant!r} cannot act for {tenant!r}")
        self.nats_url = nats_url
        self.credentials = credentials
        self.tenant = tenant
        self.model = model
        self.first_token_timeout_s = first_token_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._nc = nc
        self._owns_connection = nc is None

    async def connect(self) -> MeshClient:
        if self._nc is None:
            self._nc = await nats.connect(
                nats_servers(self.nats_url),
                **reconnecting_options(f"ripplemesh-client-{self.tenant}"),
                **(self.credentials.connect_options() if self.credentials else {}),
            )
        return self

    async def close(self) -> None:
        if self._nc is not None and self._owns_connection:
            await self._nc.drain()
        self._nc = None

    async def __aenter__(self) -> MeshClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def nc(self) -> NatsClient:
        if self._nc is None:
            raise RuntimeError("MeshClient is not connected")
        return self._nc

    async def events(
        self,
        *,
        prompt: str | None = None,
        messages: list[ChatMessage] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        priority: PriorityClass = "standard",
        deadline_ms: int | None = None,
        workflow: WorkflowRef | None = None,
        request_id: str | None = None,
        model: str | None = None,
        tools: list[ToolSpec] | None = None,
        tool_choice: ToolChoice | None = None,
        response_format: ResponseFormat | None = None,
        logprobs: int | None = None,
        priority_level: int = 0,
        service_class: ServiceClass = "interactive",
    ) -> AsyncIterator[TokenEvent]:
        """Submit one request and yield every token event, in order, ending with the final one.

        Closing the iterator early (or cancelling its task) cancels the request: the mesh stops
        generating for it."""
        request_id = request_id or uuid.uuid4().hex
        submission = SubmitRequest(
            event_id=new_event_id(),
            occurred_at=time.time(),
            request_id=request_id,
            model=model or self.model,
            prompt=prompt,
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            priority=priority,
            deadline_ms=deadline_ms,
            workflow=workflow,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            logprobs=logprobs,
            priority_level=priority_level,
            service_class=service_class,
        )
        stream = TokenStream(
            self.nc,
            tokens_subject(self.tenant, request_id),
            first_event_timeout_s=self.first_token_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            read_back=self._replay_from(request_id) if self._is_tenant_user else None,
        )
        async with stream:
            # The caller's trace context (if it traces) becomes the request's parent.
            headers = inject_headers({"Nats-Msg-Id": submission.event_id})
            try:
                await publish_acked(
                    self.nc.jetstream(), request_subject(self.tenant), encode_event(submission), headers
                )
            except TRANSIENT_ERRORS as exc:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.cancel(request_id), timeout=5.0)
                raise MeshUnavailable(f"request {request_id} not acknowledged by NATS: {exc!r}") from exc
            ended = False
            try:
                async for event in stream.events():
                    ended = not isinstance(event, TokenChunk)
                    yield event
            finally:
                if not ended:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self.cancel(request_id), timeout=5.0)

    async def cancel(self, request_id: str) -> None:
        """Cancel one of this tenant's requests: the mesh stops its work and frees its GPU."""
        cancel = CancelRequest(event_id=new_event_id(), occurred_at=time.time(), request_id=request_id)
        await self.nc.jetstream(timeout=5).publish(
            request_subject(self.tenant), encode_event(cancel), headers={"Nats-Msg-Id": cancel.event_id}
        )

    @property
    def _is_tenant_user(self) -> bool:
        # A tenant's NATS user has no JetStream API: it reads back through ingress instead.
        return self.credentials is not None and self.credentials.tenant is not None

    def _replay_from(self, request_id: str) -> ReadBack:
        async def replay(from_seq: int) -> list[TokenEvent]:
            request = ReplayTokens(
                event_id=new_event_id(), occurred_at=time.time(), request_id=request_id, from_seq=from_seq
            )
            await publish_acked(
                self.nc.jetstream(),
                request_subject(self.tenant),
                encode_event(request),
                {"Nats-Msg-Id": request.event_id},
            )
            return []  # ingress publishes them on the subscribed subject

        return replay

    async def stream(self, **request: object) -> AsyncIterator[TokenChunk]:
        """Yield token chunks; raise `MeshError` if the mesh rejects or fails the request."""
        async for event in self.events(**request):  # type: ignore[arg-type]
            if isinstance(event, TokenChunk):
                yield event
            elif isinstance(event, StreamFailed):
                raise MeshError(event)

    async def complete(self, **request: object) -> Completion:
        events = [event async for event in self.events(**request)]  # type: ignore[arg-type]
        return completion_of(
            events, tool_calls=bool(request.get("tools")) and request.get("tool_choice") != "none"
        )


def completion_of(events: Iterable[TokenEvent], *, tool_calls: bool = False) -> Completion:
    """A request's whole answer from its token stream's events in order (as streamed, or as
    read back from the TOKENS stream); MeshError for a failed stream, RuntimeError for one
    without its final event. `tool_calls`: read tool calls out of the text."""
    texts: list[str] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    chunks = 0
    for event in events:
        if isinstance(event, TokenChunk):
            texts.append(event.text)
            token_ids.extend(event.token_ids)
            logprobs.extend(event.logprobs or ())
            chunks += 1
        elif isinstance(event, StreamFailed):
            raise MeshError(event)
        elif isinstance(event, StreamFinished):
            text = "".join(texts)
            content: str | None = text
            calls: list[ParsedCall] = []
            if tool_calls:
                content, calls = parse_tool_calls(text, f"call_{event.request_id[:24]}_")
            return Completion(
                event.request_id,
                text,
                token_ids,
                event.finish_reason,
                event.usage,
                chunks,
                tool_calls=calls,
                content=content,
                logprobs=logprobs,
            )
    raise RuntimeError("the token stream ended without a final event")
