"""Every event ripplemesh services exchange, as frozen msgspec Structs.

One module on purpose: it is the event contract, and a reader (or a reviewer of a change to it)
sees it whole here; `AnyEvent`, the union every decoder uses, and schemas/generate.py, which
documents every event it names, need all the events in one namespace.

Conventions (see docs/architecture.md):
- Each event is tagged by `type` (e.g. ``"request.prepared.v1"``); a breaking change is a new tag,
  so old and new producers can share a stream during a rollout.
- Each event carries `event_id` (sent as ``Nats-Msg-Id`` so JetStream drops duplicates and consumers
  are idempotent on it), `occurred_at` (seconds since the Unix epoch) and the ids it concerns.
- Trace context never travels in the payload, only in the NATS headers.
- Decoding is strict: unknown tags, missing fields or wrong types are errors, never guesses.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import msgspec

PriorityClass = Literal["critical", "standard", "sheddable"]
# What kind of work a request is, for the ledger's cost by class: a client's own request, or a
# line of a Batch API job (services/batch/), which runs only in the fleet's spare capacity.
ServiceClass = Literal["interactive", "batch"]
WorkerRole = Literal["prefill", "decode"]
ServingMode = Literal["aggregated", "disaggregated"]
RequestApi = Literal["chat", "completion", "nats"]

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Identifier = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]


def new_event_id() -> str:
    return uuid.uuid4().hex


def derived_event_id(source_event_id: str, stage: str) -> str:
    """A deterministic id for the event a handler emits in reaction to another event.

    A redelivered input then produces the same output id, and JetStream's duplicate window
    drops the second publish: handlers become idempotent without a lookup.
    """
    return uuid.uuid5(uuid.NAMESPACE_OID, f"{source_event_id}/{stage}").hex


class Struct(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every nested value in the contract.

    Unknown fields are ignored (a newer producer may add optional fields); wrong types, missing
    required fields and unknown tags are errors.
    """


class Event(Struct, frozen=True, tag_field="type"):
    """Base of every top-level event on the bus."""

    event_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    occurred_at: NonNegativeFloat


# ---------------------------------------------------------------- values


class TextPart(Struct, frozen=True, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImagePart(Struct, frozen=True, kw_only=True, tag_field="type", tag="image_url"):
    image_url: dict[str, str]


class AudioPart(Struct, frozen=True, kw_only=True, tag_field="type", tag="input_audio"):
    input_audio: dict[str, str]


class FilePart(Struct, frozen=True, kw_only=True, tag_field="type", tag="file"):
    file: dict[str, str]


class RefusalPart(Struct, frozen=True, kw_only=True, tag_field="type", tag="refusal"):
    """An assistant's earlier refusal, sent back in its history: text like any other."""

    refusal: str


# OpenAI's content parts. Only text reaches a model here; the others are named in a clear refusal.
ContentPart = TextPart | RefusalPart | ImagePart | AudioPart | FilePart


class FunctionCall(Struct, frozen=True, kw_only=True):
    name: str
    # A JSON object as text, as the OpenAI API carries it (what the model wrote).
    arguments: str


class ToolCall(Struct, frozen=True, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Struct, frozen=True, kw_only=True):
    """One turn of a chat, as OpenAI clients send it: content as text or as parts; an assistant
    turn that called tools (`tool_calls`, content often null); a tool's result (`tool_call_id`);
    the legacy `function` role and `function_call`. Ingress checks what each role needs."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None


class ToolFunction(Struct, frozen=True, kw_only=True):
    """A function the model may call: its name, what it does, its arguments' JSON Schema."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(Struct, frozen=True, kw_only=True):
    type: Literal["function"] = "function"
    function: ToolFunction


class NamedFunction(Struct, frozen=True, kw_only=True):
    name: str


class NamedToolChoice(Struct, frozen=True, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


# "none": answer in text; "auto": the model decides; "required": some tool call; named: that one.
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(Struct, frozen=True, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(Struct, frozen=True, kw_only=True):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class OutputConstraint(Struct, frozen=True, kw_only=True):
    """What a request's output must be, for an engine that constrains its decoding (its
    `features` say so): a call of one of `tools` (a tool choice of "required" or one named
    function), written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; or a JSON
    value, matching `json_schema` when one is given (a JSON object when not)."""

    kind: Literal["tool_call", "json"]
    tools: list[ToolFunction] = []
    json_schema: dict[str, Any] | None = None


class TokenAlternative(Struct, frozen=True, kw_only=True):
    token_id: int
    token: str
    logprob: float


class TokenLogprob(Struct, frozen=True, kw_only=True):
    """An output token's log-probability under the model, with the most likely alternatives at
    its position (as many as the request's `logprobs` asked for)."""

    token_id: int
    token: str
    logprob: float
    top: list[TokenAlternative] = []


class WorkflowRef(Struct, frozen=True, kw_only=True):
    """Which step of which multi-step task (an agent run) a request is."""

    workflow_id: Identifier
    step: PositiveInt
    steps: PositiveInt | None = None


class Usage(Struct, frozen=True, kw_only=True):
    prompt_tokens: NonNegativeInt
    completion_tokens: NonNegativeInt
    cached_tokens: NonNegativeInt = 0


class Resumption(Struct, frozen=True, kw_only=True):
    """Where a request re-placed mid-stream (a migration) picks up its stream.

    The request's `prompt_tokens` end with the `output_tokens` tokens its client has already
    received (so the prompt proper is the first ``len(prompt_tokens) - output_tokens``), its
    `max_tokens` is what is left to generate, and the first chunk it publishes is `next_seq`.
    """

    # How many times the request has been re-placed (1: the first time).
    migration: PositiveInt
    next_seq: NonNegativeInt
    output_tokens: NonNegativeInt


class InferenceRequest(Struct, frozen=True, kw_only=True):
    """A validated, tokenized request: what admission, router and workers act on."""

    request_id: Identifier
    tenant: Identifier
    model: str
    api: RequestApi
    prompt_tokens: list[int]
    block_size: PositiveInt
    block_hashes: list[int]
    max_tokens: PositiveInt
    temperature: NonNegativeFloat = 0.0
    priority: PriorityClass = "standard"
    # Within the class, higher first (Gateway API Inference Extension's objective `priority`);
    # admission checks its range (its config), so an out-of-range value gets a clear rejection.
    priority_level: int = 0
    deadline_at: float | None = None
    workflow: WorkflowRef | None = None
    submitted_at: NonNegativeFloat
    # Set when the request was re-placed mid-stream (its worker died or was drained).
    resumption: Resumption | None = None
    # Log-probabilities wanted with each output token: None, none; k, the token's own and the k
    # likeliest alternatives (OpenAI's top_logprobs). Only engines with the "logprobs" feature.
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    # What the output must be (a tool call, JSON); only engines with the matching feature.
    constraint: OutputConstraint | None = None
    # The LoRA adapter to serve it with, beside `model` (None: the model alone); it seeds the
    # block hashes with the model, so prefixes under two adapters share no KV.
    adapter: str | None = None
    # A Batch API line ("batch") or a client's own request; the ledger reports the two apart.
    service_class: ServiceClass = "interactive"


class KvHandle(Struct, frozen=True, kw_only=True):
    """Where a prefilled request's KV cache lives, for the decode worker to pull it."""

    source_worker: Identifier
    num_tokens: NonNegativeInt
    block_hashes: list[int]
    kv_bytes: NonNegativeInt
    # Set when the KV itself travelled through the JetStream Object Store (real engines).
    object_name: str | None = None


class RouteOption(Struct, frozen=True, kw_only=True):
    """One placement the router weighed, with what it predicted for it: the chosen one, or a
    runner-up. TTFT is counted from the routing decision to the first token."""

    mode: ServingMode
    prefill_worker: Identifier
    decode_worker: Identifier
    cached_tokens: NonNegativeInt
    ttft_s: NonNegativeFloat
    cost_usd: NonNegativeFloat
    success_probability: Probability
    # What a success is expected to cost: (the workflow's spend so far + this placement's cost)
    # / P(success); None when success is out of reach.
    expected_cost_per_success_usd: NonNegativeFloat | None = None
    # The objective the router ranks options by, lowest first: (the GPU time's marginal cost +
    # the latency's worth + the workflow's spend so far) / P(success); None when infinite or
    # from an older router.
    score: NonNegativeFloat | None = None
    # Predicted time from the decision to the last token.
    completion_s: NonNegativeFloat | None = None


class PoolView(Struct, frozen=True, kw_only=True):
    pool: str
    role: WorkerRole
    gpu_type: str
    replicas: NonNegativeInt
    desired_replicas: NonNegativeInt
    queue_depth: NonNegativeInt
    running: NonNegativeInt
    kv_utilisation: NonNegativeFloat
    reason: str


# ---------------------------------------------------------------- requests


class SubmitRequest(Event, frozen=True, kw_only=True, tag="request.submit.v1"):
    """What a client publishes to ``rmesh.req.<tenant>``; the tenant is the subject's."""

    request_id: Identifier
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: PositiveInt = 256
    temperature: NonNegativeFloat = 0.0
    priority: PriorityClass = "standard"
    priority_level: int = 0
    # Not constrained here: a non-positive or absurd deadline gets a clear rejection (ingress,
    # admission) rather than a dead letter.
    deadline_ms: int | None = None
    workflow: WorkflowRef | None = None
    # As in OpenAI's chat API; what the model's engine cannot honour is refused, not ignored.
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    # "batch": a Batch API line (the batch runner's); ingress runs it as the lowest work there is
    # (sheddable, at the lowest priority level) whatever it asked for.
    service_class: ServiceClass = "interactive"


class CancelRequest(Event, frozen=True, kw_only=True, tag="request.cancel.v1"):
    """What a client publishes to ``rmesh.req.<tenant>`` to stop one of its requests: the work
    is dropped and its GPU freed. The tenant is the subject's; another tenant's request is not
    touched."""

    request_id: Identifier


class ReplayTokens(Event, frozen=True, kw_only=True, tag="request.replay.v1"):
    """What a client publishes to ``rmesh.req.<tenant>`` when it missed some of a request's
    token events (a reconnect to another node): ingress publishes again, on the request's token
    subject, every stored event from `from_seq` on. A tenant's NATS user has no JetStream API
    of its own, so this is how it reads back its stream. The tenant is the subject's."""

    request_id: Identifier
    from_seq: NonNegativeInt = 0


class RequestPrepared(Event, frozen=True, kw_only=True, tag="request.prepared.v1"):
    request: InferenceRequest


class RequestAdmitted(Event, frozen=True, kw_only=True, tag="request.admitted.v1"):
    request: InferenceRequest
    waited_s: NonNegativeFloat = 0.0


class PrefillWork(Event, frozen=True, kw_only=True, tag="work.prefill.v1"):
    request: InferenceRequest
    prefill_worker: Identifier
    decode_worker: Identifier
    # What the router predicted for this placement (TTFT from `occurred_at`, the decision), so
    # the prefill span can show it next to what happened; None from older routers.
    prediction: RouteOption | None = None
    # The router's decision span (W3C traceparent), which the prefill span links to as
    # ``placed_by``; None from older routers or an unsampled trace.
    decision_traceparent: str | None = None


class DecodeWork(Event, frozen=True, kw_only=True, tag="work.decode.v1"):
    request: InferenceRequest
    prefill_worker: Identifier
    decode_worker: Identifier
    kv: KvHandle
    first_token_id: int
    cached_tokens: NonNegativeInt


# ---------------------------------------------------------------- lifecycle (rmesh.events.*)


class RequestRejected(Event, frozen=True, kw_only=True, tag="request.rejected.v1"):
    request_id: Identifier
    tenant: Identifier
    stage: Literal["ingress", "admission", "router"]
    reason: Literal["quota", "capacity", "deadline", "invalid", "no_workers"]
    message: str
    retry_after_s: NonNegativeFloat | None = None
    # The request's task, for the ledger (absent from older producers): a rejected workflow step
    # fails its workflow.
    workflow_id: Identifier | None = None
    workflow_step: PositiveInt | None = None
    workflow_steps: PositiveInt | None = None
    deadline_at: float | None = None
    # A Batch API line ("batch") or a client's own request, for the ledger's cost by service class.
    service_class: ServiceClass = "interactive"


class RequestRouted(Event, frozen=True, kw_only=True, tag="request.routed.v1"):
    request_id: Identifier
    tenant: Identifier
    mode: ServingMode
    prefill_worker: Identifier
    decode_worker: Identifier
    candidates: NonNegativeInt
    # The chosen worker's load as the router saw it, for the decision's audit trail.
    predicted_load: NonNegativeFloat


class RouteDecision(Event, frozen=True, kw_only=True, tag="router.decision.v1"):
    """Every routing decision, placed or not, with its predictions and the options passed over.

    Router replicas read each other's placements from these, to count the load the others put
    on a worker since its last heartbeat.
    """

    request_id: Identifier
    tenant: Identifier
    # The router replica that decided (replicas skip their own decisions).
    router: Identifier
    policy: str
    outcome: Literal["placed", "no_workers", "invalid", "infeasible", "saturated"]
    message: str | None = None
    chosen: RouteOption | None = None
    runners_up: list[RouteOption] = []
    candidates: NonNegativeInt = 0
    decision_s: NonNegativeFloat = 0.0
    # The load a placement adds (what other replicas count on its workers): the prompt, of which
    # `chosen.cached_tokens` need no prefill, and the KV blocks the request will hold.
    prompt_tokens: NonNegativeInt = 0
    kv_blocks: NonNegativeInt = 0
    workflow_id: Identifier | None = None
    workflow_step: PositiveInt | None = None
    workflow_steps: PositiveInt | None = None
    workflow_spent_usd: NonNegativeFloat = 0.0
    # The request's class: the other replicas count what a second of its latency is worth on
    # its workers until its predicted completion, as the placer does (None: an older router).
    priority: PriorityClass | None = None


class AdmissionDecision(Event, frozen=True, kw_only=True, tag="admission.decision.v1"):
    """Admission admitted or deferred a request (a rejection is a RequestRejected), with the
    reason and what it saw: the fleet's saturation and the router's predicted first token."""

    request_id: Identifier
    tenant: Identifier
    # The admission replica that decided.
    admission: Identifier
    outcome: Literal["admitted", "deferred"]
    # admitted: at once ("admitted") or after a wait ("after_deferral"); deferred: why ("saturated").
    reason: str
    priority: PriorityClass
    priority_level: int = 0
    waited_s: NonNegativeFloat = 0.0
    # Deferred: decided (admitted or rejected) by then.
    due_at: NonNegativeFloat | None = None
    saturation: NonNegativeFloat | None = None
    predicted_ttft_s: NonNegativeFloat | None = None
    # A later step of a running workflow goes ahead of new ones; what the ledger says it spent.
    workflow_id: Identifier | None = None
    workflow_step: PositiveInt | None = None
    workflow_standing: Literal["continuation", "new", "doomed"] = "new"
    workflow_spent_usd: NonNegativeFloat = 0.0


class PrefillCompleted(Event, frozen=True, kw_only=True, tag="request.prefill_completed.v1"):
    request_id: Identifier
    tenant: Identifier
    workflow_id: Identifier | None = None
    worker_id: Identifier
    gpu_type: str
    gpu_seconds: NonNegativeFloat
    prompt_tokens: NonNegativeInt
    cached_tokens: NonNegativeInt
    ttft_s: NonNegativeFloat
    # The model that served it (each model has its own pools), for the ledger's cost per
    # model; None from older producers.
    model: str | None = None


class DecodeCompleted(Event, frozen=True, kw_only=True, tag="request.decode_completed.v1"):
    request_id: Identifier
    tenant: Identifier
    workflow_id: Identifier | None = None
    worker_id: Identifier
    gpu_type: str
    gpu_seconds: NonNegativeFloat
    kv_transfer_bytes: NonNegativeInt
    usage: Usage
    finish_reason: Literal["stop", "length"]
    latency_s: NonNegativeFloat
    # The request's place in its workflow (`WorkflowRef.step` and `.steps`) and its deadline, for
    # the ledger's tasks; None from older producers. The completion time is `occurred_at`.
    workflow_step: PositiveInt | None = None
    workflow_steps: PositiveInt | None = None
    deadline_at: float | None = None
    # The request's class, for the ledger's cost by class; None from older producers.
    priority: PriorityClass | None = None
    # Interactive or a Batch API line, for the ledger's cost by service class.
    service_class: ServiceClass = "interactive"
    # The model that served it, for the ledger's cost per model; None from older producers.
    model: str | None = None


class RequestFailed(Event, frozen=True, kw_only=True, tag="request.failed.v1"):
    request_id: Identifier
    tenant: Identifier
    workflow_id: Identifier | None = None
    stage: str
    worker_id: str | None = None
    message: str
    # As in DecodeCompleted: which step of its workflow failed (None from older producers).
    workflow_step: PositiveInt | None = None
    workflow_steps: PositiveInt | None = None
    deadline_at: float | None = None
    # A Batch API line ("batch") or a client's own request, for the ledger's cost by service class.
    service_class: ServiceClass = "interactive"


class RequestCancelled(Event, frozen=True, kw_only=True, tag="request.cancelled.v1"):
    """The client went away (HTTP disconnect) or cancelled (`CancelRequest`): workers holding the
    request stop it and free its KV; the ledger closes it (not a success)."""

    request_id: Identifier
    tenant: Identifier
    reason: Literal["client_disconnected", "client_cancelled"]
    workflow_id: Identifier | None = None
    workflow_step: PositiveInt | None = None
    workflow_steps: PositiveInt | None = None
    deadline_at: float | None = None


class RequestMigrated(Event, frozen=True, kw_only=True, tag="request.migrated.v1"):
    """A request taken from a worker that died or was drained, and placed again: its stream
    resumes at `resume_seq` from its prompt plus the `delivered_tokens` already streamed."""

    request_id: Identifier
    tenant: Identifier
    migration: PositiveInt
    reason: Literal["worker_lost", "worker_drained"]
    from_worker: Identifier
    # The phase the lost worker held: a prefill (or aggregated) placement, or a decode.
    from_phase: WorkerRole
    resume_seq: NonNegativeInt
    delivered_tokens: NonNegativeInt
    remaining_tokens: NonNegativeInt
    workflow_id: Identifier | None = None
    workflow_step: PositiveInt | None = None
    workflow_steps: PositiveInt | None = None
    deadline_at: float | None = None


class WorkStopped(Event, frozen=True, kw_only=True, tag="request.work_stopped.v1"):
    """A worker stopped a request before its end and freed its KV: cancelled by its client,
    revoked (migrated elsewhere) or cut by a drain. `gpu_seconds` is the time it spent that no
    PrefillCompleted or DecodeCompleted reports, for the ledger to price."""

    request_id: Identifier
    tenant: Identifier
    workflow_id: Identifier | None = None
    worker_id: Identifier
    gpu_type: str
    gpu_seconds: NonNegativeFloat
    tokens_generated: NonNegativeInt
    reason: Literal["cancelled", "revoked", "drained"]


class FleetObserved(Event, frozen=True, kw_only=True, tag="fleet.observed.v1"):
    """The autoscaler's view of every pool and the size it would choose for each (superseded by
    `ScalingDecision`, which says why and what was done; kept so recorded streams decode)."""

    pools: list[PoolView]


class PoolPlan(Struct, frozen=True, kw_only=True):
    """One pool in a `ScalingDecision`: as it is, what the plan does to it, and why."""

    pool: str
    model: str
    role: WorkerRole
    gpu_type: str
    serving: NonNegativeInt
    warming: NonNegativeInt
    draining: NonNegativeInt
    desired: NonNegativeInt
    add: NonNegativeInt = 0
    remove: list[str] = []  # the replicas drained, then stopped
    # The predicted share of the pool's capacity at the SLO in use once the plan is done (-1:
    # a load with no replica to carry it).
    utilisation: float
    cost_per_hour: NonNegativeFloat
    reason: str


class ModelOutlook(Struct, frozen=True, kw_only=True):
    """What a `ScalingDecision` planned one model's pools for: the observed and forecast traffic."""

    model: str
    observed_rate: NonNegativeFloat  # requests per second in the last window
    forecast_rate: NonNegativeFloat  # at `horizon_s` ahead (a replica started now is ready then)
    horizon_s: NonNegativeFloat
    mean_prompt: NonNegativeFloat
    mean_output: NonNegativeFloat
    hit_rate: NonNegativeFloat
    prefill_load: NonNegativeFloat  # uncached prompt tokens per second planned for
    decode_load: NonNegativeFloat  # output tokens per second planned for
    ttft_p90_s: NonNegativeFloat | None = None
    itl_p90_s: NonNegativeFloat | None = None
    held: NonNegativeInt = 0


class ScalingDecision(Event, frozen=True, kw_only=True, tag="autoscaler.decision.v1"):
    """Every plan of the autoscaler: its inputs, each pool's decision with its reason, the
    predicted effect (utilisation, $/hour), and whether it was acted on (`mode`). A worker
    started by it names it (`WorkerState.scaling_decision`), and its spans link to this plan's."""

    mode: Literal["act", "observe"]
    trigger: Literal["interval", "held", "slo"]
    pools: list[PoolPlan]
    models: list[ModelOutlook]
    cost_per_hour: NonNegativeFloat
    budget_per_hour: NonNegativeFloat | None = None
    failed: list[str] = []  # actions the platform failed: "pool: error"


class CapacityWanted(Event, frozen=True, kw_only=True, tag="capacity.wanted.v1"):
    """Admission holds requests for a model that has no live worker (scaled to zero, or every
    worker lost): the autoscaler plans at once rather than at its next interval."""

    model: str
    held: NonNegativeInt
    due_at: NonNegativeFloat | None = None  # the earliest held request's decision is due then


class TenantThrottle(Event, frozen=True, kw_only=True, tag="tenant.throttle.v1"):
    """A control event: a tenant's new requests are refused (429, with Retry-After) until
    `until`. Put in the TENANT_THROTTLES bucket under the tenant by a subscriber (say, a budget
    guard); admission honours the latest entry, and a deleted or lapsed one lifts it."""

    tenant: Identifier
    until: NonNegativeFloat
    reason: str
    source: str  # who set it: the subscriber's name


class ScaleOrder(Event, frozen=True, kw_only=True, tag="autoscaler.scale.v1"):
    """The autoscaler to the process supervisor of `ripplemesh up --autoscale` (core NATS request
    on ``rmesh.control.launcher``): start `add` workers of `pool`, drain and stop `remove`. With
    `add` 0 and no `remove`, only asks what runs. Answered with `LauncherFleet`."""

    pool: str = ""
    add: NonNegativeInt = 0
    remove: list[str] = []
    decision_id: str = ""
    traceparent: str | None = None  # the plan's span: workers it starts link their spans to it


class PoolMembers(Struct, frozen=True, kw_only=True):
    pool: str
    replicas: list[str]  # started, ready or not
    stopping: list[str] = []  # draining, then gone
    # The limits `up --autoscale` was given for the pool (the `[autoscaler]` config's pools,
    # where it has them, come first), and what it serves.
    model: str | None = None
    min_replicas: NonNegativeInt | None = None
    max_replicas: NonNegativeInt | None = None
    startup_s: NonNegativeFloat | None = None


class LauncherFleet(Event, frozen=True, kw_only=True, tag="launcher.fleet.v1"):
    """What the supervisor of `ripplemesh up --autoscale` runs, per pool (the reply to a
    `ScaleOrder`); `error` when it could not do what was asked."""

    pools: list[PoolMembers]
    error: str | None = None


# ---------------------------------------------------------------- tokens (rmesh.tokens.<tenant>.<id>)


class TokenChunk(Event, frozen=True, kw_only=True, tag="tokens.chunk.v1"):
    request_id: Identifier
    seq: NonNegativeInt
    token_ids: list[int]
    text: str
    # One per token id, when the request asked for log-probabilities.
    logprobs: list[TokenLogprob] | None = None


class StreamFinished(Event, frozen=True, kw_only=True, tag="tokens.finished.v1"):
    request_id: Identifier
    seq: NonNegativeInt
    finish_reason: Literal["stop", "length"]
    usage: Usage


class StreamFailed(Event, frozen=True, kw_only=True, tag="tokens.failed.v1"):
    request_id: Identifier
    seq: NonNegativeInt
    code: Literal["quota", "capacity", "deadline", "invalid", "no_workers", "internal"]
    message: str
    http_status: Annotated[int, msgspec.Meta(ge=400, le=599)]
    retry_after_s: NonNegativeFloat | None = None


# ---------------------------------------------------------------- state and dead letters


class WorkflowSpend(Struct, frozen=True, kw_only=True):
    """A workflow's running spend, kept by the ledger in the WORKFLOW_SPEND KV bucket under the
    workflow's id, so that admission and the router can weigh its sunk cost.

    Spend is every GPU-second (prefill and decode, retried and migrated requests included) and
    KV transfer the workflow's requests reported so far, in US$. `status` is the task's:
    ``running`` until its final step completes in time (``succeeded``) or a step fails, misses
    its deadline or the workflow goes quiet past the ledger's task timeout (``failed``, with the
    `reason`).
    """

    workflow_id: Identifier
    tenant: Identifier
    spend_usd: NonNegativeFloat
    gpu_seconds: NonNegativeFloat
    # The highest step completed so far, and the workflow's number of steps when known.
    steps_completed: NonNegativeInt
    steps: PositiveInt | None = None
    status: Literal["running", "succeeded", "failed"]
    reason: Literal["step_failed", "deadline_missed", "abandoned"] | None = None
    first_event_at: NonNegativeFloat
    last_event_at: NonNegativeFloat
    updated_at: NonNegativeFloat


class WorkerState(Event, frozen=True, kw_only=True, tag="worker.state.v1"):
    """A worker's heartbeat: its latest state, kept in the WORKERS KV bucket under its id."""

    worker_id: Identifier
    role: WorkerRole
    pool: str
    model: str
    engine: str
    gpu_type: str
    price_per_hour: NonNegativeFloat
    block_size: PositiveInt
    kv_blocks_total: NonNegativeInt
    kv_blocks_used: NonNegativeInt
    kv_blocks_cached: NonNegativeInt
    queue_depth: NonNegativeInt
    running: NonNegativeInt
    tokens_per_s: NonNegativeFloat
    started_at: NonNegativeFloat
    draining: bool = False
    # For the router's memory-headroom and latency axes (None: the engine cannot tell, and the
    # router estimates from the counts): blocks neither held nor cached (allocating past them
    # evicts cached prefixes others may reuse), prompt tokens still to prefill (the uncached
    # part of those waiting), KV tokens of the running batch.
    kv_blocks_free: NonNegativeInt | None = None
    queued_tokens: NonNegativeInt | None = None
    context_tokens: NonNegativeInt | None = None
    # LoRA adapters loaded beside the model. (A worker announces itself once its model's
    # weights are loaded, so a heartbeat's model is warm.)
    adapters: list[str] = []
    # Seconds (of its modelled time) to load an adapter it lacks: the router weighs it.
    adapter_load_s: NonNegativeFloat = 0.0
    # Wall seconds per second of GPU work as its engine models it: 1 on real hardware, less for
    # a sim engine run faster (`--time-scale`). Its GPU seconds (and so their price) stay the
    # modelled ones.
    time_scale: NonNegativeFloat = 1.0
    # What its engine honours beyond plain generation (ENGINE_FEATURES): ingress refuses, with
    # a 400 naming the parameter, what no live worker of the model honours.
    features: list[str] = []
    # The `ScalingDecision` that started this worker (None: started by hand or at launch).
    scaling_decision: str | None = None
    # The worker's latest utilisation sample (a span linking the requests in its batch, W3C
    # traceparent): a plan made on this heartbeat links to it. None: tracing off.
    utilisation_traceparent: str | None = None


# What an engine may honour beyond plain generation, as announced in `WorkerState.features`:
# log-probabilities; an output forced to be a tool call; an output forced to be JSON.
ENGINE_FEATURES = ("logprobs", "tool_call", "json")


class WorkerControl(Event, frozen=True, kw_only=True, tag="worker.control.v1"):
    """An order to one worker, on core NATS ``rmesh.control.<worker>``; a request with a reply
    subject is answered with the worker's `WorkerState`.

    - ``drain``: take no new work (the heartbeat says draining at once), finish what is in
      flight within `grace_s`, hand the rest off (the router migrates it), then exit;
    - ``revoke``: stop `request_ids` now, they were placed elsewhere; with `work_event_ids`,
      only where a request runs for one of those work messages (the migrated one), not for the
      work that replaced it, which may have been placed back on this same worker;
    - ``ping``: only answer (a liveness probe).
    """

    worker_id: Identifier
    action: Literal["drain", "revoke", "ping"]
    grace_s: NonNegativeFloat | None = None
    request_ids: list[Identifier] = []
    work_event_ids: list[Identifier] = []
    reason: str = ""


class KvCacheChange(Struct, frozen=True, kw_only=True):
    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[int]


class KvEvents(Event, frozen=True, kw_only=True, tag="kv.events.v1"):
    """Prefix-cache changes of one worker, on core NATS ``rmesh.kv.<worker>``.

    `seq` numbers batches per worker, from 1, with no gaps: a reader that sees a gap (or starts
    late) asks the worker for a `KvDump` and applies later batches on top of it.
    """

    worker_id: Identifier
    model: str
    block_size: PositiveInt
    seq: PositiveInt
    changes: list[KvCacheChange]
    # The worker process's start (its WorkerState.started_at): a new value is a new incarnation,
    # whose batches count from 1 again. None from older producers.
    started_at: NonNegativeFloat | None = None


class KvDumpRequest(Struct, frozen=True, kw_only=True):
    """The body of a request on ``rmesh.kv.<worker>.dump``: the reader takes the dump in chunks of
    at most `max_blocks` blocks (one message each). An empty body asks for one message."""

    max_blocks: PositiveInt


class KvDump(Event, frozen=True, kw_only=True, tag="kv.dump.v1"):
    """Every block a worker caches, as of batch `seq` (0: before any batch); the reply to a
    request on ``rmesh.kv.<worker>.dump``, in `chunks` messages (chunk 0 first) that each carry
    a slice of the blocks, so that a large cache stays under the server's payload limit."""

    worker_id: Identifier
    model: str
    block_size: PositiveInt
    seq: NonNegativeInt
    block_hashes: list[int]
    started_at: NonNegativeFloat | None = None
    chunk: NonNegativeInt = 0
    chunks: PositiveInt = 1


class DeadLetter(Event, frozen=True, kw_only=True, tag="dlq.message.v1"):
    """A message a consumer could not decode or process, kept with the reason."""

    stream: str
    consumer: str
    subject: str
    reason: str
    num_delivered: NonNegativeInt
    headers: dict[str, str]
    data: bytes


# ---------------------------------------------------------------- unions, one per subject family

LifecycleEvent = (
    RequestRejected
    | AdmissionDecision
    | RequestRouted
    | RouteDecision
    | PrefillCompleted
    | DecodeCompleted
    | RequestFailed
    | RequestCancelled
    | RequestMigrated
    | WorkStopped
    | FleetObserved
    | ScalingDecision
    | CapacityWanted
)
TokenEvent = TokenChunk | StreamFinished | StreamFailed
WorkItem = PrefillWork | DecodeWork
# What clients publish on rmesh.req.<tenant>.
ClientEvent = SubmitRequest | CancelRequest | ReplayTokens
AnyEvent = (
    SubmitRequest
    | CancelRequest
    | ReplayTokens
    | RequestPrepared
    | RequestAdmitted
    | PrefillWork
    | DecodeWork
    | RequestRejected
    | AdmissionDecision
    | RequestRouted
    | RouteDecision
    | PrefillCompleted
    | DecodeCompleted
    | RequestFailed
    | RequestCancelled
    | RequestMigrated
    | WorkStopped
    | FleetObserved
    | ScalingDecision
    | CapacityWanted
    | ScaleOrder
    | LauncherFleet
    | TenantThrottle
    | TokenChunk
    | StreamFinished
    | StreamFailed
    | WorkerState
    | WorkerControl
    | KvEvents
    | KvDump
    | DeadLetter
)

_encoder = msgspec.json.Encoder()
_any_decoder: msgspec.json.Decoder[AnyEvent] = msgspec.json.Decoder(AnyEvent)


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes) -> AnyEvent:
    """Strictly decode any event of the contract; raises msgspec.ValidationError or DecodeError."""
    return _any_decoder.decode(data)
