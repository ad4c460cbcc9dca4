"""The event contract: strict, frozen, versioned, and its generated documents up to date."""

from __future__ import annotations

import json
import re
from typing import Any, get_args

import msgspec
import pytest

from schemas import events, generate
from schemas.events import (
    CapacityWanted,
    ChatMessage,
    DeadLetter,
    DecodeCompleted,
    DecodeWork,
    Event,
    FleetObserved,
    InferenceRequest,
    KvHandle,
    LauncherFleet,
    ModelOutlook,
    PoolMembers,
    PoolPlan,
    PoolView,
    PrefillCompleted,
    PrefillWork,
    RequestAdmitted,
    RequestFailed,
    RequestPrepared,
    RequestRejected,
    RequestRouted,
    ScaleOrder,
    ScalingDecision,
    StreamFailed,
    StreamFinished,
    SubmitRequest,
    TenantThrottle,
    TokenChunk,
    Usage,
    WorkerState,
    WorkflowRef,
    decode_event,
    encode_event,
)
from schemas.subjects import EVENT_KINDS

REGENERATE = "ripplemesh schemas generate"
NOW = 1_700_000_000.25
TAG_RE = re.compile(r"^[a-z][a-z_]*(\.[a-z][a-z_]*)*\.v[1-9][0-9]*$")


def _id(n: int) -> str:
    return f"{n:032x}"


WORKFLOW = WorkflowRef(workflow_id="wf-1", step=2, steps=5)
USAGE = Usage(prompt_tokens=12, completion_tokens=7, cached_tokens=4)
REQUEST = InferenceRequest(
    request_id="req-1",
    tenant="acme",
    model="llama-3-8b",
    api="chat",
    prompt_tokens=[1, 2, 3, 4],
    block_size=16,
    block_hashes=[1234567890123, -42],
    max_tokens=64,
    temperature=0.7,
    priority="critical",
    deadline_at=NOW + 30.0,
    workflow=WORKFLOW,
    submitted_at=NOW,
)
KV = KvHandle(
    source_worker="prefill-0",
    num_tokens=4,
    block_hashes=[1234567890123],
    kv_bytes=131072,
    object_name="kv/req-1",
)
POOL = PoolView(
    pool="decode-h200",
    role="decode",
    gpu_type="H200",
    replicas=2,
    desired_replicas=3,
    queue_depth=9,
    running=14,
    kv_utilisation=0.81,
    reason="queue above target",
)
CHOSEN = events.RouteOption(
    mode="disaggregated",
    prefill_worker="prefill-0",
    decode_worker="decode-1",
    cached_tokens=48,
    ttft_s=0.12,
    cost_usd=0.0021,
    success_probability=0.97,
    expected_cost_per_success_usd=0.0022,
)

# One valid instance of every value Struct (not events).
CALL = events.ToolCall(
    id="call_1", function=events.FunctionCall(name="get_weather", arguments='{"city": "Oslo"}')
)
WEATHER = events.ToolFunction(
    name="get_weather",
    description="the weather in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
PLAN_POOL = PoolPlan(
    pool="decode-H100",
    model="llama-3-8b",
    role="decode",
    gpu_type="H100",
    serving=0,
    warming=0,
    draining=0,
    desired=1,
    add=1,
    utilisation=0.2,
    cost_per_hour=3.0,
    reason="scale up 0 -> 1; from zero: 1 held",
)
OUTLOOK = ModelOutlook(
    model="llama-3-8b",
    observed_rate=0.0,
    forecast_rate=0.0,
    horizon_s=65.0,
    mean_prompt=0.0,
    mean_output=0.0,
    hit_rate=0.0,
    prefill_load=0.0,
    decode_load=0.0,
    held=1,
)
MEMBERS = PoolMembers(pool="decode-H100", replicas=["decode-0", "decode-1"], stopping=["decode-1"])

VALUES: list[events.Struct] = [
    ChatMessage(role="user", content="hello"),
    CALL,
    CALL.function,
    events.ToolSpec(function=WEATHER),
    WEATHER,
    events.NamedToolChoice(function=events.NamedFunction(name="get_weather")),
    events.NamedFunction(name="get_weather"),
    events.ResponseFormat(type="json_schema", json_schema=events.JsonSchemaFormat(schema={"type": "object"})),
    events.JsonSchemaFormat(name="answer", schema={"type": "object"}, strict=True),
    events.OutputConstraint(kind="tool_call", tools=[WEATHER]),
    events.TokenLogprob(
        token_id=300,
        token=" the",
        logprob=-0.5,
        top=[events.TokenAlternative(token_id=300, token=" the", logprob=-0.5)],
    ),
    events.TokenAlternative(token_id=301, token=" of", logprob=-1.5),
    events.TextPart(text="hello"),
    events.RefusalPart(refusal="no"),
    events.ImagePart(image_url={"url": "https://example.com/a.png"}),
    events.AudioPart(input_audio={"data": "", "format": "wav"}),
    events.FilePart(file={"file_id": "file-1"}),
    WORKFLOW,
    USAGE,
    REQUEST,
    KV,
    POOL,
    PLAN_POOL,
    OUTLOOK,
    MEMBERS,
    events.KvCacheChange(kind="stored", block_hashes=[11, 12]),
    CHOSEN,
    events.KvDumpRequest(max_blocks=32768),
    events.Resumption(migration=1, next_seq=41, output_tokens=57),
    # The ledger's value in the WORKFLOW_SPEND KV bucket.
    events.WorkflowSpend(
        workflow_id="wf-1",
        tenant="acme",
        spend_usd=0.42,
        gpu_seconds=310.5,
        steps_completed=2,
        steps=5,
        status="failed",
        reason="deadline_missed",
        first_event_at=NOW - 60,
        last_event_at=NOW - 1,
        updated_at=NOW,
    ),
]

# One valid instance of every event of the contract.
SAMPLES: list[Event] = [
    SubmitRequest(
        event_id=_id(1),
        occurred_at=NOW,
        request_id="req-1",
        model="llama-3-8b",
        messages=[
            ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content="hi"),
            ChatMessage(
                role="user",
                content=[
                    events.TextPart(text="what is in "),
                    events.ImagePart(image_url={"url": "https://example.com/a.png"}),
                    events.AudioPart(input_audio={"data": "", "format": "wav"}),
                    events.FilePart(file={"file_id": "file-1"}),
                ],
            ),
            ChatMessage(role="assistant", content=[events.RefusalPart(refusal="no")], tool_calls=[CALL]),
            ChatMessage(role="tool", content="12 C", tool_call_id="call_1"),
        ],
        tools=[events.ToolSpec(function=WEATHER)],
        tool_choice="auto",
        logprobs=2,
        max_tokens=64,
        temperature=0.2,
        priority="sheddable",
        deadline_ms=30000,
        workflow=WORKFLOW,
    ),
    events.CancelRequest(event_id=_id(20), occurred_at=NOW, request_id="req-1"),
    events.ReplayTokens(event_id=_id(40), occurred_at=NOW, request_id="req-1", from_seq=7),
    RequestPrepared(event_id=_id(2), occurred_at=NOW, request=REQUEST),
    # A request re-placed mid-stream (a migration) is admitted again with its resumption.
    RequestAdmitted(
        event_id=_id(3),
        occurred_at=NOW,
        request=msgspec.structs.replace(
            REQUEST, resumption=events.Resumption(migration=1, next_seq=41, output_tokens=57)
        ),
        waited_s=0.05,
    ),
    PrefillWork(
        event_id=_id(4),
        occurred_at=NOW,
        request=REQUEST,
        prefill_worker="prefill-0",
        decode_worker="decode-1",
        prediction=CHOSEN,
    ),
    DecodeWork(
        event_id=_id(5),
        occurred_at=NOW,
        request=REQUEST,
        prefill_worker="prefill-0",
        decode_worker="decode-1",
        kv=KV,
        first_token_id=791,
        cached_tokens=0,
    ),
    RequestRejected(
        event_id=_id(6),
        occurred_at=NOW,
        request_id="req-2",
        tenant="acme",
        stage="admission",
        reason="quota",
        message="token rate exceeded",
        retry_after_s=1.5,
        workflow_id="wf-1",
        workflow_step=3,
        workflow_steps=5,
        deadline_at=NOW + 30.0,
    ),
    events.AdmissionDecision(
        event_id=_id(41),
        occurred_at=NOW,
        request_id="req-1",
        tenant="acme",
        admission="admission-7f3a",
        outcome="deferred",
        reason="saturated",
        priority="standard",
        priority_level=5,
        due_at=NOW + 20.0,
        saturation=1.12,
        predicted_ttft_s=2.4,
        workflow_id="wf-1",
        workflow_step=3,
        workflow_standing="continuation",
        workflow_spent_usd=0.04,
    ),
    RequestRouted(
        event_id=_id(7),
        occurred_at=NOW,
        request_id="req-1",
        tenant="acme",
        mode="disaggregated",
        prefill_worker="prefill-0",
        decode_worker="decode-1",
        candidates=4,
        predicted_load=0.4,
    ),
    events.RouteDecision(
        event_id=_id(19),
        occurred_at=NOW,
        request_id="req-1",
        tenant="acme",
        router="router-a1b2",
        policy="ripplemesh",
        outcome="placed",
        chosen=CHOSEN,
        runners_up=[
            events.RouteOption(
                mode="aggregated",
                prefill_worker="decode-2",
                decode_worker="decode-2",
                cached_tokens=0,
                ttft_s=9.5,
                cost_usd=0.003,
                success_probability=0.0,
                expected_cost_per_success_usd=None,
            )
        ],
        candidates=3,
        decision_s=0.0004,
        prompt_tokens=700,
        kv_blocks=48,
        workflow_id="wf-1",
        workflow_step=2,
        workflow_steps=5,
        workflow_spent_usd=0.31,
    ),
    PrefillCompleted(
        event_id=_id(8),
        occurred_at=NOW,
        request_id="req-1",
        tenant="acme",
        workflow_id="wf-1",
        worker_id="prefill-0",
        gpu_type="H100",
        gpu_seconds=0.12,
        prompt_tokens=4,
        cached_tokens=0,
        ttft_s=0.15,
    ),
    DecodeCompleted(
        event_id=_id(9),
        occurred_at=NOW,
        request_id="req-1",
        tenant="acme",
        worker_id="decode-1",
        gpu_type="H200",
        gpu_seconds=1.4,
        kv_transfer_bytes=131072,
        usage=USAGE,
        finish_reason="stop",
        latency_s=1.9,
        workflow_step=2,
        workflow_steps=5,
        deadline_at=NOW + 30.0,
    ),
    RequestFailed(
        event_id=_id(10),
        occurred_at=NOW,
        request_id="req-3",
        tenant="acme",
        stage="decode",
        worker_id="decode-1",
        message="engine crashed",
        workflow_id="wf-1",
        workflow_step=2,
        workflow_steps=5,
        deadline_at=NOW + 30.0,
    ),
    events.RequestCancelled(
        event_id=_id(21),
        occurred_at=NOW,
        request_id="req-1",
        tenant="acme",
        reason="client_disconnected",
        workflow_id="wf-1",
        workflow_step=2,
        workflow_steps=5,
        deadline_at=NOW + 30.0,
    ),
    events.RequestMigrated(
        event_id=_id(22),
        occurred_at=NOW,
        request_id="req-1",
        tenant="acme",
        migration=1,
        reason="worker_lost",
        from_worker="decode-1",
        from_phase="decode",
        resume_seq=41,
        delivered_tokens=57,
        remaining_tokens=7,
        workflow_id="wf-1",
        workflow_step=2,
        workflow_steps=5,
        deadline_at=NOW + 30.0,
    ),
    events.WorkStopped(
        event_id=_id(23),
        occurred_at=NOW,
        request_id="req-1",
        tenant="acme",
        workflow_id="wf-1",
        worker_id="decode-1",
        gpu_type="H200",
        gpu_seconds=0.8,
        tokens_generated=31,
        reason="cancelled",
    ),
    FleetObserved(event_id=_id(11), occurred_at=NOW, pools=[POOL]),
    ScalingDecision(
        event_id=_id(40),
        occurred_at=NOW,
        mode="act",
        trigger="held",
        pools=[PLAN_POOL],
        models=[OUTLOOK],
        cost_per_hour=3.0,
        budget_per_hour=40.0,
    ),
    CapacityWanted(event_id=_id(41), occurred_at=NOW, model="llama-3-8b", held=1, due_at=NOW + 30),
    ScaleOrder(event_id=_id(42), occurred_at=NOW, pool="decode-H100", add=1, decision_id=_id(40)),
    LauncherFleet(
        event_id=_id(43),
        occurred_at=NOW,
        pools=[MEMBERS],
    ),
    TenantThrottle(
        event_id=_id(44),
        occurred_at=NOW,
        tenant="acme",
        until=NOW + 3600,
        reason="daily budget $5 spent",
        source="budget-guard",
    ),
    TokenChunk(
        event_id=_id(12),
        occurred_at=NOW,
        request_id="req-1",
        seq=0,
        token_ids=[791, 12],
        text="Hi!",
    ),
    StreamFinished(
        event_id=_id(13),
        occurred_at=NOW,
        request_id="req-1",
        seq=1,
        finish_reason="length",
        usage=USAGE,
    ),
    StreamFailed(
        event_id=_id(14),
        occurred_at=NOW,
        request_id="req-2",
        seq=0,
        code="capacity",
        message="no capacity",
        http_status=503,
        retry_after_s=2.0,
    ),
    WorkerState(
        event_id=_id(15),
        occurred_at=NOW,
        worker_id="decode-1",
        role="decode",
        pool="decode-h200",
        model="llama-3-8b",
        engine="sim",
        gpu_type="H200",
        price_per_hour=3.8,
        block_size=16,
        kv_blocks_total=4096,
        kv_blocks_used=1024,
        kv_blocks_cached=512,
        queue_depth=3,
        running=8,
        tokens_per_s=2500.0,
        started_at=NOW - 3600,
        draining=True,
    ),
    events.WorkerControl(
        event_id=_id(24),
        occurred_at=NOW,
        worker_id="decode-1",
        action="drain",
        grace_s=30.0,
        reason="scale-down",
    ),
    events.KvEvents(
        event_id=_id(17),
        occurred_at=NOW,
        worker_id="decode-1",
        model="llama-3-8b",
        block_size=16,
        seq=7,
        changes=[
            events.KvCacheChange(kind="stored", block_hashes=[11, 12]),
            events.KvCacheChange(kind="removed", block_hashes=[3]),
        ],
        started_at=NOW - 3600,
    ),
    events.KvDump(
        event_id=_id(18),
        occurred_at=NOW,
        worker_id="decode-1",
        model="llama-3-8b",
        block_size=16,
        seq=7,
        block_hashes=[11, 12],
        started_at=NOW - 3600,
        chunk=1,
        chunks=2,
    ),
    DeadLetter(
        event_id=_id(16),
        occurred_at=NOW,
        stream="WORK",
        consumer="worker-decode-decode-1",
        subject="rmesh.work.decode.decode-1",
        reason="undecodable: Object missing required field `kv`",
        num_delivered=1,
        headers={"Nats-Msg-Id": _id(5), "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
        data=b'{"type": "work.decode.v1"}\x00\xff',
    ),
]


def _event_types() -> tuple[type[Event], ...]:
    return tuple(get_args(events.AnyEvent))


def _all_subclasses(cls: type[Any]) -> list[type[Any]]:
    out: list[type[Any]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def _contract_structs() -> list[type[events.Struct]]:
    """Every Struct the contract module defines (values and events, not the bases)."""
    return [
        obj
        for obj in vars(events).values()
        if isinstance(obj, type)
        and issubclass(obj, events.Struct)
        and obj not in (events.Struct, Event)
        and obj.__module__ == events.__name__
    ]


def _tag(cls: type[Event]) -> str:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str), cls
    return tag


def _valid_chunk() -> dict[str, Any]:
    raw: dict[str, Any] = msgspec.to_builtins(
        TokenChunk(event_id=_id(99), occurred_at=NOW, request_id="req-1", seq=3, token_ids=[1], text="a")
    )
    return raw


# ---------------------------------------------------------------- generated documents


def test_generated_schemas_are_up_to_date() -> None:
    stale = generate.write(check=True)
    assert stale == [], (
        f"generated schema files are stale or missing: {stale}; run `{REGENERATE}` "
        "(or `python -m schemas.generate`) and commit the result"
    )


def test_json_schema_names_every_event_tag() -> None:
    doc = json.loads(generate.render()[generate.EVENTS_SCHEMA_PATH])
    defs = doc["$defs"]
    refs = {ref["$ref"] for ref in doc["oneOf"]}
    for cls in _event_types():
        tag = _tag(cls)
        assert f"#/$defs/{cls.__name__}" in refs
        type_schema = defs[cls.__name__]["properties"]["type"]
        allowed = type_schema.get("enum", [type_schema.get("const")])
        assert allowed == [tag], (cls.__name__, type_schema)
        assert "type" in defs[cls.__name__]["required"]
        assert doc["discriminator"]["mapping"][tag] == f"#/$defs/{cls.__name__}"
        assert tag in doc["x-ripplemesh-subjects"]


def _resolve(doc: Any, ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"unresolvable $ref {ref}"
        node = node[part]
    return node


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        out = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        for value in node.values():
            out.extend(_refs(value))
        return out
    if isinstance(node, list):
        return [ref for item in node for ref in _refs(item)]
    return []


@pytest.mark.parametrize("path", [generate.EVENTS_SCHEMA_PATH, generate.ASYNCAPI_PATH])
def test_generated_refs_resolve(path: str) -> None:
    doc = json.loads(generate.render()[path])
    refs = _refs(doc)
    assert refs
    for ref in refs:
        _resolve(doc, ref)


def test_asyncapi_covers_every_event() -> None:
    doc = json.loads(generate.render()[generate.ASYNCAPI_PATH])
    assert doc["asyncapi"] == "3.0.0"
    messages = doc["components"]["messages"]
    for cls in _event_types():
        message = messages[cls.__name__]
        assert message["payload"] == {"$ref": f"#/components/schemas/{cls.__name__}"}
        assert message["x-ripplemesh-tag"] == _tag(cls)
    headers = _resolve(doc, messages["TokenChunk"]["headers"]["$ref"])
    assert {"traceparent", "tracestate", "Nats-Msg-Id"} <= set(headers["properties"])
    for channel_id, channel in doc["channels"].items():
        params = set(re.findall(r"\{(\w+)\}", channel["address"]))
        assert params == set(channel["parameters"]), channel_id
        carriers = {"x-ripplemesh-stream", "x-ripplemesh-kv-bucket"}
        assert carriers & set(channel) or "Core NATS" in channel["description"], channel_id
        actions = sorted(
            op["action"]
            for op in doc["operations"].values()
            if op["channel"]["$ref"] == f"#/channels/{channel_id}"
        )
        assert actions == ["receive", "send"], channel_id


# ---------------------------------------------------------------- the contract


def test_samples_cover_every_event() -> None:
    assert [type(e) for e in SAMPLES] == list(_event_types())


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_event_round_trips(event: Event) -> None:
    data = encode_event(event)
    assert json.loads(data)["type"] == _tag(type(event))
    decoded = decode_event(data)
    assert type(decoded) is type(event)
    assert decoded == event
    assert encode_event(decoded) == data


def test_decoding_ignores_unknown_fields() -> None:
    raw = _valid_chunk() | {"added_by_a_newer_producer": 1}
    assert isinstance(decode_event(json.dumps(raw).encode()), TokenChunk)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda d: d.update(type="tokens.chunk.v999"), id="unknown-tag"),
        pytest.param(lambda d: d.pop("type"), id="missing-tag"),
        pytest.param(lambda d: d.pop("text"), id="missing-field"),
        pytest.param(lambda d: d.pop("event_id"), id="missing-event-id"),
        pytest.param(lambda d: d.update(seq="3"), id="string-for-int"),
        pytest.param(lambda d: d.update(seq=1.5), id="float-for-int"),
        pytest.param(lambda d: d.update(seq=-1), id="negative-seq"),
        pytest.param(lambda d: d.update(occurred_at=-1.0), id="negative-time"),
        pytest.param(lambda d: d.update(request_id="not an id!"), id="bad-identifier"),
        pytest.param(lambda d: d.update(token_ids=["a"]), id="wrong-item-type"),
        pytest.param(lambda d: d.update(event_id=""), id="empty-event-id"),
    ],
)
def test_decoding_is_strict(mutate: Any) -> None:
    raw = _valid_chunk()
    mutate(raw)
    with pytest.raises(msgspec.ValidationError):
        decode_event(json.dumps(raw).encode())


def test_decoding_rejects_bad_nested_values() -> None:
    raw = msgspec.to_builtins(next(e for e in SAMPLES if isinstance(e, RequestPrepared)))
    raw["request"]["priority"] = "urgent"
    with pytest.raises(msgspec.ValidationError):
        decode_event(json.dumps(raw).encode())
    raw = msgspec.to_builtins(next(e for e in SAMPLES if isinstance(e, events.StreamFailed)))
    raw["http_status"] = 200
    with pytest.raises(msgspec.ValidationError):
        decode_event(json.dumps(raw).encode())


def test_values_cover_every_value_struct() -> None:
    values = {cls for cls in _contract_structs() if not issubclass(cls, Event)}
    assert {type(v) for v in VALUES} == values


@pytest.mark.parametrize("instance", [*VALUES, *SAMPLES], ids=lambda v: type(v).__name__)
def test_every_struct_is_frozen(instance: events.Struct) -> None:
    assert type(instance).__struct_config__.frozen
    field = type(instance).__struct_fields__[0]
    with pytest.raises(AttributeError):
        setattr(instance, field, getattr(instance, field))


def test_every_contract_struct_is_frozen() -> None:
    structs = _contract_structs()
    assert len(structs) == len(VALUES) + len(SAMPLES)
    for cls in structs:
        assert cls.__struct_config__.frozen, cls.__name__


@pytest.mark.parametrize("cls", _event_types(), ids=lambda c: c.__name__)
def test_every_event_has_id_and_time(cls: type[Event]) -> None:
    required = {f.name for f in msgspec.structs.fields(cls) if f.required}
    assert {"event_id", "occurred_at"} <= required


def test_event_tags_are_unique_and_versioned() -> None:
    subclasses = _all_subclasses(Event)
    assert set(subclasses) == set(_event_types()), "every Event subclass must be in AnyEvent"
    tags = [_tag(cls) for cls in subclasses]
    assert len(tags) == len(set(tags)), f"duplicate tags: {sorted(tags)}"
    for tag in tags:
        assert TAG_RE.match(tag), f"tag {tag!r} must end with a version suffix like '.v1'"


def test_event_kinds_match_lifecycle_events() -> None:
    lifecycle_tags = {_tag(cls) for cls in get_args(events.LifecycleEvent)}
    for tag in EVENT_KINDS:
        assert tag in lifecycle_tags, f"EVENT_KINDS tag {tag!r} is not a LifecycleEvent"
    for tag in lifecycle_tags:
        assert tag in EVENT_KINDS, f"LifecycleEvent {tag!r} has no kind in EVENT_KINDS"
    kinds = list(EVENT_KINDS.values())
    assert len(kinds) == len(set(kinds))
    for kind in kinds:
        assert re.fullmatch(r"[a-z_]+", kind), kind
