"""Turning a client's request into an `InferenceRequest`: validate, tokenize, hash. Pure.

Both paths use it: the HTTP API and requests published to ``rmesh.req.<tenant>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.events import ChatMessage, InferenceRequest, PriorityClass, RequestApi, WorkflowRef
from services.engines.tokenizer import tokenizer_for
from services.mesh.block_hash import chain_block_hashes
from services.mesh.config import MeshConfig


class InvalidRequest(ValueError):
    """A client error; `param` names the offending field, `status` the HTTP status to answer."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str = "invalid_request",
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


@dataclass(frozen=True, slots=True)
class ClientRequest:
    request_id: str
    tenant: str
    model: str
    api: RequestApi
    # Exactly one of the two: a raw prompt, or chat messages rendered with the model's template.
    prompt: str | None
    messages: list[ChatMessage] | None
    max_tokens: int
    temperature: float = 0.0
    priority: PriorityClass = "standard"
    priority_level: int = 0  # its range is admission's to check
    deadline_ms: int | None = None
    workflow: WorkflowRef | None = None


def prepare(request: ClientRequest, config: MeshConfig, now: float) -> InferenceRequest:
    model = config.model(request.model)
    if model is None:
        known = ", ".join(m.name for m in config.models)
        raise InvalidRequest(
            f"model {request.model!r} is not served here; available: {known}",
            param="model",
            status=404,
            code="model_not_found",
        )
    if request.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    if request.temperature < 0 or request.temperature > 2:
        raise InvalidRequest("temperature must be between 0 and 2", param="temperature")
    if request.deadline_ms is not None and request.deadline_ms < 1:
        raise InvalidRequest("the deadline must be a positive number of ms", param="x-ripple-deadline-ms")
    if (request.prompt is None) == (request.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
    tokenizer = tokenizer_for(model.path)
    text = request.prompt if request.prompt is not None else tokenizer.render_chat(request.messages or [])
    tokens = tokenizer.encode(text)
    if not tokens:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if len(tokens) > config.max_prompt_tokens:
        raise InvalidRequest(
            f"the prompt has {len(tokens)} tokens; the limit is {config.max_prompt_tokens}",
            param="prompt",
            code="context_length_exceeded",
        )
    if len(tokens) + request.max_tokens > model.max_context_tokens:
        raise InvalidRequest(
            f"prompt ({len(tokens)} tokens) + max_tokens ({request.max_tokens}) exceeds the "
            f"model's context of {model.max_context_tokens} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return InferenceRequest(
        request_id=request.request_id,
        tenant=request.tenant,
        model=request.model,
        api=request.api,
        prompt_tokens=tokens,
        block_size=config.block_size,
        block_hashes=chain_block_hashes(tokens, config.block_size, model=request.model),
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        priority=request.priority,
        priority_level=request.priority_level,
        deadline_at=now + request.deadline_ms / 1000 if request.deadline_ms else None,
        workflow=request.workflow,
        submitted_at=now,
    )
