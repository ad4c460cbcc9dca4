"""Turning a client's request into an `InferenceRequest`: validate, tokenize, hash. Pure.

Both paths use it: the HTTP API and requests published to ``rmesh.req.<tenant>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.events import (
    ChatMessage,
    InferenceRequest,
    NamedToolChoice,
    OutputConstraint,
    PriorityClass,
    RefusalPart,
    RequestApi,
    ResponseFormat,
    ServiceClass,
    TextPart,
    ToolChoice,
    ToolSpec,
    WorkflowRef,
)
from services.engines.tokenizer import ChatTemplateError, tokenizer_for
from services.mesh.block_hash import chain_block_hashes
from services.mesh.config import AdapterConfig, MeshConfig, ModelConfig, TenantConfig


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
    priority: PriorityClass | None = None  # asked for; None: the tenant's class (`granted_priority`)
    priority_level: int = 0  # its range is admission's to check
    deadline_ms: int | None = None
    workflow: WorkflowRef | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    # Log-probabilities: None, none; k, each token's own and its k likeliest alternatives.
    logprobs: int | None = None
    # "batch": a Batch API line, run as the lowest work there is (see `prepare`).
    service_class: ServiceClass = "interactive"

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the output's tool calls are read out of its text (tools offered, not "none")."""
        return bool(self.tools) and self.tool_choice != "none"


# The parameters that need an engine feature (schemas.events.ENGINE_FEATURES), by feature.
FEATURE_PARAMS = {"logprobs": "logprobs", "tool_call": "tool_choice", "json": "response_format"}


def check_messages(messages: list[ChatMessage]) -> None:
    """What each role needs, and text only: a part of another kind is named in a 400."""
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if not isinstance(part, TextPart | RefusalPart):
                    kind = type(part).__struct_config__.tag
                    raise InvalidRequest(
                        f"{where}.content[{j}] is a part of type {kind}; the models here take text only",
                        param=f"{where}.content[{j}]",
                    )
        has_calls = bool(message.tool_calls) or message.function_call is not None
        if message.role != "assistant" and has_calls:
            raise InvalidRequest(
                f"only assistant messages carry tool calls ({where})", param=f"{where}.tool_calls"
            )
        if message.content is None and not has_calls:
            raise InvalidRequest(
                f"{where}.content is null; only an assistant message with tool_calls may omit it",
                param=f"{where}.content",
            )
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidRequest(
                f"{where} is a tool result without tool_call_id", param=f"{where}.tool_call_id"
            )
        if message.role == "function" and not message.name:
            raise InvalidRequest(f"{where} is a function result without name", param=f"{where}.name")


def output_constraint(request: ClientRequest) -> OutputConstraint | None:
    """What the output must be, from tool_choice and response_format; a 400 for a choice that
    names no offered tool or for both forced at once."""
    tools = [tool.function for tool in request.tools or ()]
    choice = request.tool_choice
    forced_tools = None
    if choice is not None and choice not in ("none", "auto") and not tools:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    if choice == "required":
        forced_tools = tools
    elif isinstance(choice, NamedToolChoice):
        named = [tool for tool in tools if tool.name == choice.function.name]
        if not named:
            raise InvalidRequest(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        forced_tools = named
    fmt = request.response_format
    wants_json = fmt is not None and fmt.type != "text"
    if forced_tools is not None and wants_json:
        raise InvalidRequest(
            "a JSON response_format cannot be combined with a forced tool_choice", param="response_format"
        )
    if forced_tools is not None:
        return OutputConstraint(kind="tool_call", tools=forced_tools)
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequest("response_format json_schema needs its json_schema", param="response_format")
        return OutputConstraint(kind="json", json_schema=fmt.json_schema.schema)
    if wants_json:
        return OutputConstraint(kind="json", json_schema={"type": "object"})
    return None


def check_features(
    logprobs: int | None, constraint: OutputConstraint | None, features: frozenset[str], model: str
) -> None:
    """A 400 naming the parameter that the workers serving `model` cannot honour."""
    needed = (["logprobs"] if logprobs is not None else []) + ([constraint.kind] if constraint else [])
    for feature in needed:
        if feature not in features:
            param = FEATURE_PARAMS[feature]
            raise InvalidRequest(
                f"{param} is not supported by the engine serving {model!r} "
                f"(it supports: {', '.join(sorted(features)) or 'plain generation only'})",
                param=param,
                code="unsupported_parameter",
            )


# Highest first.
PRIORITY_RANK: dict[PriorityClass, int] = {"critical": 2, "standard": 1, "sheddable": 0}


def granted_priority(asked: PriorityClass | None, tenant: TenantConfig | None) -> PriorityClass:
    """The class a request runs in: what it asked for, capped at its tenant's `max_priority`
    (its own class by default): a header cannot lift a tenant above what its config allows.
    Above it, the cap (`downgrade`) or a 403 (`reject`)."""
    if tenant is None:
        return asked or "standard"  # an unknown tenant: admission refuses it
    if asked is None:
        return tenant.priority
    cap = tenant.max_priority or tenant.priority
    if PRIORITY_RANK[asked] <= PRIORITY_RANK[cap]:
        return asked
    if tenant.above_max_priority == "reject":
        raise InvalidRequest(
            f"priority {asked!r} is above this tenant's allowed {cap!r}",
            param="x-ripple-priority",
            status=403,
            code="priority_not_allowed",
        )
    return cap


def served_model(name: str, config: MeshConfig) -> tuple[ModelConfig, AdapterConfig | None]:
    """The model (and adapter) a request's `model` names, or a 404 naming what is unknown."""
    resolved = config.model_and_adapter(name)
    if resolved is not None:
        return resolved
    base, colon, adapter_name = name.rpartition(":")
    known_base = config.model(base) if colon else None
    if known_base is not None:
        served = ", ".join(a.name for a in known_base.adapters) or "none"
        message = f"adapter {adapter_name!r} of model {base!r} is not served here; its adapters: {served}"
    else:
        known = ", ".join(
            [m.name for m in config.models]
            + [f"{m.name}:{a.name}" for m in config.models for a in m.adapters]
        )
        message = f"model {name!r} is not served here; available: {known}"
    raise InvalidRequest(message, param="model", status=404, code="model_not_found")


def prepare(
    request: ClientRequest, config: MeshConfig, now: float, features: frozenset[str] | None = None
) -> InferenceRequest:
    """`features`: what the model's live workers all honour (None: not known, not checked;
    the engine then refuses what it cannot do)."""
    model, adapter = served_model(request.model, config)
    priority = granted_priority(request.priority, config.tenants.get(request.tenant))
    priority_level = request.priority_level
    if request.service_class == "batch":
        # A batch line waits for spare capacity: the lowest class and level admission knows.
        priority, priority_level = "sheddable", config.admission.min_priority_level
    if request.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    if request.temperature < 0 or request.temperature > 2:
        raise InvalidRequest("temperature must be between 0 and 2", param="temperature")
    if request.deadline_ms is not None and request.deadline_ms < 1:
        raise InvalidRequest("the deadline must be a positive number of ms", param="x-ripple-deadline-ms")
    if (request.prompt is None) == (request.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
    if request.logprobs is not None and not 0 <= request.logprobs <= 20:
        raise InvalidRequest("top_logprobs must be between 0 and 20", param="top_logprobs")
    constraint = output_constraint(request)
    if features is not None:
        check_features(request.logprobs, constraint, features, model.name)
    tokenizer = tokenizer_for(model.path)
    if request.messages is not None:
        check_messages(request.messages)
        try:
            text = tokenizer.render_chat(request.messages, request.tools or ())
        except ChatTemplateError as exc:
            raise InvalidRequest(str(exc), param=exc.param) from None
    else:
        text = request.prompt or ""
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
        model=model.name,
        adapter=adapter.name if adapter is not None else None,
        api=request.api,
        prompt_tokens=tokens,
        block_size=config.block_size,
        block_hashes=chain_block_hashes(
            tokens, config.block_size, model=model.name, adapter=adapter.name if adapter else None
        ),
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        priority=priority,
        priority_level=priority_level,
        deadline_at=now + request.deadline_ms / 1000 if request.deadline_ms else None,
        workflow=request.workflow,
        submitted_at=now,
        logprobs=request.logprobs,
        constraint=constraint,
        service_class=request.service_class,
    )
