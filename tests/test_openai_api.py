"""The OpenAI API as agents and benchmark clients send it, through the real mesh (service
processes, NATS, the sim engine) with the official openai client, httpx and schemathesis."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from openai import OpenAI

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from schemas.events import ChatMessage, PrefillCompleted, ToolFunction, ToolSpec
from schemas.subjects import event_subject
from services.ingress.openapi import openapi_document
from services.mesh.bus import Bus
from tests.conftest import TEST_KEY, async_wait_until, openai_client, wait_for_workers

pytestmark = pytest.mark.timeout(180)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
AGENT_HISTORY: Any = [
    {"role": "system", "content": "You are a helpful agent."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "What is the weather "}, {"type": "text", "text": "in Oslo?"}],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees and rain"},
]


@pytest.fixture
def api(mesh: Mesh) -> OpenAI:
    wait_for_workers(mesh)
    return openai_client(mesh)


def test_an_agents_tool_history_and_content_parts_are_served(api: OpenAI) -> None:
    reply = api.chat.completions.create(model="llama-3-8b", messages=AGENT_HISTORY, max_tokens=8)
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 8


def test_an_image_part_is_refused_naming_the_part(api: OpenAI) -> None:
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(model="llama-3-8b", messages=messages, max_tokens=8)
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "messages[0].content[1]"
    assert "image_url" in error["message"] and error["type"] == "invalid_request_error"


def test_health_and_models_say_what_serves(mesh: Mesh, api: OpenAI) -> None:
    health = httpx.get(f"http://127.0.0.1:{mesh.http_port}/health", timeout=5).json()
    assert health["status"] == "ok" and health["live_workers"]["llama-3-8b"] >= 1
    (model,) = httpx.get(
        f"http://127.0.0.1:{mesh.http_port}/v1/models", headers={"Authorization": f"Bearer {TEST_KEY}"}
    ).json()["data"]
    assert model["id"] == "llama-3-8b" and model["max_model_len"] == 4096
    assert set(model["features"]) == {"logprobs", "tool_call", "json"}  # what the sim engine declares
    assert [m.id for m in api.models.list()] == ["llama-3-8b"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_required_tool_choice_returns_a_well_formed_call(api: OpenAI, stream: bool) -> None:
    messages: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
    if not stream:
        reply = api.chat.completions.create(
            model="llama-3-8b", messages=messages, tools=TOOLS, tool_choice="required", max_tokens=200
        )
        choice = reply.choices[0]
        finish, calls = (
            choice.finish_reason,
            [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []],
        )
        assert choice.message.content is None
    else:
        parts: dict[int, dict[str, str]] = {}
        finish, content = None, ""
        for chunk in api.chat.completions.create(
            model="llama-3-8b",
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=200,
            stream=True,
        ):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                part = parts.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                part["id"] += call.id or ""
                part["name"] += (call.function.name or "") if call.function else ""
                part["arguments"] += (call.function.arguments or "") if call.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert content == ""  # the call's text is not shown as content
        calls = [(p["id"], p["name"], p["arguments"]) for p in parts.values()]
    assert finish == "tool_calls"
    (call_id, name, arguments) = calls[0]
    assert call_id.startswith("call_") and name in ("get_weather", "get_time")
    schema = WEATHER_PARAMETERS if name == "get_weather" else TOOLS[1]["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)


def test_a_named_tool_choice_calls_that_function(api: OpenAI) -> None:
    reply = api.chat.completions.create(
        model="llama-3-8b",
        messages=AGENT_HISTORY,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


def test_a_json_schema_response_format_returns_matching_json(api: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string"},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["answer", "confidence"],
    }
    reply = api.chat.completions.create(
        model="llama-3-8b",
        messages=[{"role": "user", "content": "Answer as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        max_tokens=200,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), schema)
    as_object = api.chat.completions.create(
        model="llama-3-8b",
        messages=[{"role": "user", "content": "Answer as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=200,
    )
    assert isinstance(json.loads(as_object.choices[0].message.content or ""), dict)


def test_chat_logprobs_come_with_each_token_and_its_alternatives(api: OpenAI) -> None:
    reply = api.chat.completions.create(
        model="llama-3-8b",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content
    assert len(entries) == 6 and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    plain = api.chat.completions.create(
        model="llama-3-8b", messages=[{"role": "user", "content": "Say something."}], max_tokens=6
    )
    assert plain.choices[0].logprobs is None


def test_streamed_and_legacy_completion_logprobs(api: OpenAI) -> None:
    stream = api.chat.completions.create(
        model="llama-3-8b",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=5,
        logprobs=True,
        stream=True,
    )
    streamed = [
        entry
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content or []
    ]
    assert len(streamed) == 5
    completion = api.completions.create(model="llama-3-8b", prompt="Once upon", max_tokens=4, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 4
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    assert logprobs.top_logprobs is not None and all(len(top) == 2 for top in logprobs.top_logprobs)


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"top_p": 0.5}, "top_p"), ({"stop": ["\n"]}, "stop"), ({"presence_penalty": 1.0}, "presence_penalty")],
    ids=["top_p", "stop", "presence_penalty"],
)
def test_sampling_parameters_no_engine_honours_are_refused(
    api: OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(
            model="llama-3-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra
        )
    body = raised.value.body
    assert isinstance(body, dict) and body["param"] == param and body["code"] == "unsupported_parameter"


def test_a_clients_request_id_is_echoed(mesh: Mesh, api: OpenAI) -> None:
    response = httpx.post(
        f"http://127.0.0.1:{mesh.http_port}/v1/chat/completions",
        headers={"Authorization": f"Bearer {TEST_KEY}", "x-request-id": "bench-7f3a-0001"},
        json={"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == "bench-7f3a-0001"
    refused = httpx.post(
        f"http://127.0.0.1:{mesh.http_port}/v1/chat/completions",
        headers={"Authorization": f"Bearer {TEST_KEY}", "x-request-id": "bench-7f3a-0002"},
        json={"model": "llama-3-8b", "messages": []},
        timeout=30,
    )
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bench-7f3a-0002"


def test_unknown_paths_and_methods_answer_in_the_openai_error_shape(mesh: Mesh) -> None:
    base = f"http://127.0.0.1:{mesh.http_port}"
    for response, status in [
        (httpx.get(f"{base}/v1/embeddings", timeout=5), 404),
        (httpx.get(f"{base}/v1/chat/completions", timeout=5), 405),
    ]:
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}


async def test_nats_clients_get_tool_calls_and_logprobs_too(mesh: Mesh) -> None:
    wait_for_workers(mesh)
    tools = [ToolSpec(function=ToolFunction(name="get_weather", parameters=WEATHER_PARAMETERS))]
    async with MeshClient(mesh.url, "acme", credentials=mesh.credentials("acme")) as client:
        result = await client.complete(
            messages=_as_messages(AGENT_HISTORY),
            tools=tools,
            tool_choice="required",
            logprobs=1,
            max_tokens=200,
        )
    assert result.finish_reason == "stop" and result.content is None
    (call,) = result.tool_calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert len(result.logprobs) == result.usage.completion_tokens


async def test_n_choices_share_one_prefill(mesh: Mesh, bus: Bus) -> None:
    """n > 1: n sequences, the first prefilled and the others placed on its cached prompt, so
    the prompt is computed once; sampled, the choices differ; the usage counts the prompt once."""
    wait_for_workers(mesh)
    prefills: dict[str, PrefillCompleted] = {}

    async def on_prefill(msg: Any) -> None:
        event = msgspec.json.decode(msg.data, type=PrefillCompleted)
        prefills[event.request_id] = event

    subscription = await bus.nc.subscribe(event_subject("prefill_completed"), cb=on_prefill)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key=TEST_KEY, max_retries=0
    )
    prompt = "Write three different openings for a story about caches. " * 8
    try:
        reply = await client.chat.completions.create(
            model="llama-3-8b", messages=[{"role": "user", "content": prompt}], n=3, max_tokens=8
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        texts = [c.message.content for c in reply.choices]
        assert len(set(texts)) == 3 and all(texts)
        assert reply.usage is not None and reply.usage.completion_tokens == 24
        request_id = reply.id.removeprefix("chatcmpl-")
        ids = [request_id, f"{request_id}-1", f"{request_id}-2"]
        await async_wait_until(lambda: all(i in prefills for i in ids))
        prompt_tokens = reply.usage.prompt_tokens
        for later in ids[1:]:
            assert prefills[later].worker_id == prefills[request_id].worker_id
            assert prefills[later].cached_tokens >= prompt_tokens - 16, prefills[later]

        # Streamed: each chunk names its choice, each choice finishes, one usage chunk at the end.
        finishes: dict[int, str] = {}
        usage = None
        async for chunk in await client.completions.create(
            model="llama-3-8b",
            prompt=prompt,
            n=2,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        ):
            for choice in chunk.choices:
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
            usage = chunk.usage or usage
        assert finishes == {0: "length", 1: "length"}
        assert usage is not None and usage.completion_tokens == 10

        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="llama-3-8b", messages=[{"role": "user", "content": "hi"}], n=17, max_tokens=2
            )
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "n"
    finally:
        await subscription.unsubscribe()
        await client.close()


def _as_messages(history: list[dict[str, Any]]) -> list[ChatMessage]:
    return msgspec.convert(history, list[ChatMessage])


# ---------------------------------------------------------------- the API fuzzed from its document

SCHEMA = schemathesis.openapi.from_dict(openapi_document())


@SCHEMA.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_documented_api_never_fails_on_what_clients_send(case: Any, mesh: Mesh) -> None:
    """Schemathesis sends what the OpenAPI document allows (and breaks it): no 5xx, and every
    4xx in the OpenAI error shape clients parse."""
    response = case.call(
        base_url=f"http://127.0.0.1:{mesh.http_port}",
        headers={"Authorization": f"Bearer {TEST_KEY}"},
        timeout=60,
    )
    assert response.status_code < 500, response.text
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error), response.text


def test_no_service_behind_the_ingress_died_of_it(mesh: Mesh) -> None:
    assert [c.name for c in mesh.children if c.process is None or c.process.poll() is not None] == []


async def test_a_header_cannot_lift_a_tenant_above_its_class(mesh: Mesh, bus: Bus) -> None:
    """`x-ripple-priority: critical` from a tenant allowed only its own class: a 403 naming the
    header where its config says reject, its own class where it says downgrade."""
    from schemas.events import AdmissionDecision, decode_event
    from tests.conftest import LOWLY_KEY, PLAIN_KEY

    url = f"http://127.0.0.1:{mesh.http_port}/v1"
    lowly = OpenAI(base_url=url, api_key=LOWLY_KEY, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        lowly.chat.completions.create(
            model="llama-3-8b",
            messages=[{"role": "user", "content": "me first"}],
            max_tokens=3,
            extra_headers={"x-ripple-priority": "critical"},
        )
    assert refused.value.status_code == 403 and "x-ripple-priority" in str(refused.value.body)
    # Its own class, or none asked, it is served.
    done = lowly.chat.completions.create(
        model="llama-3-8b",
        messages=[{"role": "user", "content": "in my place"}],
        max_tokens=3,
        extra_headers={"x-ripple-priority": "sheddable"},
    )
    assert done.choices[0].finish_reason == "length"

    decisions: list[AdmissionDecision] = []

    async def on_decision(msg) -> None:  # type: ignore[no-untyped-def]
        event = decode_event(msg.data)
        if isinstance(event, AdmissionDecision) and event.tenant == "plain":
            decisions.append(event)

    subscription = await bus.nc.subscribe(event_subject("admission"), cb=on_decision)
    try:
        async with openai.AsyncOpenAI(base_url=url, api_key=PLAIN_KEY, max_retries=0) as plain:
            await plain.chat.completions.create(
                model="llama-3-8b",
                messages=[{"role": "user", "content": "lift me"}],
                max_tokens=3,
                extra_headers={"x-ripple-priority": "critical"},
            )
        await async_wait_until(lambda: decisions or None, timeout_s=10)
    finally:
        await subscription.unsubscribe()
    assert [d.priority for d in decisions] == ["standard"]  # downgraded to its own class
