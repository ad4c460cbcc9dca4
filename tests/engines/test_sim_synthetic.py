"""The sim engine's constrained outputs: JSON valid against the schemas clients send (tool
definitions from agent frameworks, structured-output schemas), checked by the jsonschema library,
and tool calls the ingress parses back; then the engine writing them, with log-probabilities,
across a migration and a disaggregated hand-off."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jsonschema
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.events import InferenceRequest, OutputConstraint, Resumption, ToolFunction
from services.engines.base import EngineError, VirtualClock
from services.engines.sim.engine import SimEngine
from services.engines.sim.synthetic import synthetic_json, synthetic_output
from services.ingress.tool_calls import parse_tool_calls
from tests.engines.test_sim import BLOCK, MODEL, request

# Schemas as clients write them: OpenAI's function-calling examples, an SWE-agent style editor
# tool, a structured-output schema with $defs/anyOf, and strict-mode objects.
SCHEMAS: dict[str, dict[str, Any]] = {
    "weather": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City and country"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["location"],
        "additionalProperties": False,
    },
    "editor": {
        "type": "object",
        "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert"]},
            "path": {"type": "string", "minLength": 1},
            "view_range": {"type": "array", "items": {"type": "integer", "minimum": 1}, "maxItems": 2},
            "insert_line": {"type": "integer", "minimum": 0},
            "dry_run": {"type": "boolean"},
        },
        "required": ["command", "path"],
    },
    "calendar_event": {
        "$defs": {
            "person": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
                "required": ["name", "email"],
            }
        },
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "when": {"type": "string", "format": "date-time"},
            "attendees": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1},
            "priority": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5}, {"type": "null"}]},
            "score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        },
        "required": ["title", "when", "attendees", "priority", "score", "tags"],
        "additionalProperties": False,
    },
    "nullable_union": {"type": ["null", "integer"], "minimum": 10, "maximum": 12},
    "tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"const": 1},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["value", "children"],
            }
        },
        "$ref": "#/$defs/node",
    },
    "all_of": {
        "allOf": [
            {
                "type": "object",
                "properties": {"a": {"type": "integer", "multipleOf": 5, "minimum": 7}},
                "required": ["a"],
            },
            {"properties": {"b": {"type": "string"}}, "required": ["b"]},
        ]
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_synthetic_json_is_valid_against_the_schemas_clients_send(name: str) -> None:
    schema = SCHEMAS[name]
    values = [synthetic_json(schema, seed) for seed in range(200)]
    for value in values:
        jsonschema.validate(value, schema)
    # Deterministic per seed, and not one value for every seed.
    assert synthetic_json(schema, 7) == synthetic_json(schema, 7)
    if name not in ("tree",):
        assert len({json.dumps(v, sort_keys=True) for v in values}) > 1


# Schemas of plain types, nested objects and arrays, as a hypothesis strategy.
_leaf = st.one_of(
    st.just({"type": "string"}),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 20),
    ),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    st.builds(lambda lo: {"type": "string", "minLength": lo}, st.integers(0, 30)),
)
_schemas = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.builds(
            lambda items, lo: {"type": "array", "items": items, "minItems": lo}, inner, st.integers(0, 3)
        ),
        st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), inner, max_size=4).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props) or [""]), unique=True).map(
                lambda required: {
                    "type": "object",
                    "properties": props,
                    "required": [r for r in required if r in props],
                }
            )
        ),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(_schemas, st.integers(0, 2**63))
def test_synthetic_json_is_valid_for_generated_schemas(schema: dict[str, Any], seed: int) -> None:
    jsonschema.validate(synthetic_json(schema, seed), schema)


def test_a_synthetic_tool_call_names_one_of_the_tools_and_parses_back() -> None:
    tools = [
        ToolFunction(name="get_weather", parameters=SCHEMAS["weather"]),
        ToolFunction(name="str_replace_editor", parameters=SCHEMAS["editor"]),
        ToolFunction(name="no_arguments"),
    ]
    names = set()
    for seed in range(60):
        text = synthetic_output(OutputConstraint(kind="tool_call", tools=tools), seed)
        content, calls = parse_tool_calls(text, "call")
        assert content is None and len(calls) == 1
        (call,) = calls
        tool = next(t for t in tools if t.name == call.name)
        jsonschema.validate(json.loads(call.arguments), tool.parameters or {"type": "object"})
        names.add(call.name)
    assert names == {t.name for t in tools}
    with pytest.raises(ValueError):
        synthetic_output(OutputConstraint(kind="tool_call"), 1)
    # JSON mode with no schema: a JSON object.
    assert isinstance(json.loads(synthetic_output(OutputConstraint(kind="json"), 3)), dict)


# ------------------------------------------------------------------ the engine writing them

PROMPT = [300 + (i * 104729) % 400 for i in range(40)]
WEATHER = OutputConstraint(
    kind="tool_call", tools=[ToolFunction(name="get_weather", parameters=SCHEMAS["weather"])]
)


def constrained(
    rid: str,
    constraint: OutputConstraint | None,
    max_tokens: int = 200,
    logprobs: int | None = None,
    prompt: list[int] = PROMPT,
    resumption: Resumption | None = None,
) -> InferenceRequest:
    return msgspec.structs.replace(
        request(rid, prompt, max_tokens), constraint=constraint, logprobs=logprobs, resumption=resumption
    )


async def run(e: SimEngine, r: InferenceRequest) -> tuple[list[int], str | None, list[Any]]:
    result = await e.prefill(r)
    tokens, logprobs, finish = [result.first_token_id], [result.first_logprob], None
    async for step in e.decode(r.request_id, result.first_token_id):
        tokens += step.token_ids
        logprobs += step.logprobs or []
        finish = step.finish_reason
    return tokens, finish, logprobs


async def test_the_sim_engine_writes_the_constrained_output_and_stops_after_it() -> None:
    e = SimEngine(model=MODEL, block_size=BLOCK, clock=VirtualClock())
    assert {"logprobs", "tool_call", "json"} <= e.info.features
    await e.start()
    try:
        tokens, finish, _ = await run(e, constrained("t1", WEATHER))
        content, calls = parse_tool_calls(e.detokenize(tokens), "call")
        assert finish == "stop" and content is None and [c.name for c in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["weather"])

        schema = SCHEMAS["calendar_event"]
        tokens, finish, _ = await run(e, constrained("j1", OutputConstraint(kind="json", json_schema=schema)))
        assert finish == "stop"
        jsonschema.validate(json.loads(e.detokenize(tokens)), schema)

        # max_tokens before the end: cut short, as a real engine's would be.
        tokens, finish, _ = await run(e, constrained("t2", WEATHER, max_tokens=5))
        assert finish == "length" and len(tokens) == 5

        # An engine without a feature refuses it by name (the ingress never sends one there).
        bare = SimEngine(model=MODEL, block_size=BLOCK, clock=VirtualClock())
        bare.info = dataclasses.replace(bare.info, features=frozenset())
        with pytest.raises(EngineError, match="tool_call"):
            await bare.prefill(constrained("t3", WEATHER))
        with pytest.raises(EngineError, match="names no tools"):
            await e.prefill(constrained("t4", OutputConstraint(kind="tool_call")))
    finally:
        await e.stop()


async def test_a_one_token_output_stops_at_its_first_token() -> None:
    e = SimEngine(model=MODEL, block_size=BLOCK, clock=VirtualClock())
    await e.start()
    try:
        # JSON `1`: a one-token output, complete when prefill samples it.
        tokens, finish, _ = await run(
            e, constrained("one", OutputConstraint(kind="json", json_schema={"const": 1}))
        )
        assert e.detokenize(tokens) == "1" and finish == "stop"
    finally:
        await e.stop()


async def test_sim_logprobs_have_the_asked_alternatives_and_forced_tokens_are_certain() -> None:
    e = SimEngine(model=MODEL, block_size=BLOCK, clock=VirtualClock())
    await e.start()
    try:
        tokens, _, logprobs = await run(e, constrained("free", None, max_tokens=12, logprobs=3))
        assert len(logprobs) == len(tokens) == 12
        for token, entry in zip(tokens, logprobs, strict=True):
            assert entry.token_id == token and entry.token == e.detokenize([token])
            assert entry.top[0].token_id == token and len(entry.top) == 3
            assert entry.logprob < 0 and math.isclose(
                sum(math.exp(a.logprob) for a in entry.top), 3 * math.exp(entry.logprob)
            )
        tokens, _, logprobs = await run(e, constrained("forced", WEATHER, logprobs=2))
        assert all(entry.logprob == 0.0 for entry in logprobs) and len(logprobs) == len(tokens)
        assert all(alt.logprob == -9999.0 for entry in logprobs for alt in entry.top[1:])
        # Not asked for: none computed.
        _, _, logprobs = await run(e, constrained("none", None, max_tokens=4))
        assert logprobs == [None]
    finally:
        await e.stop()


async def test_a_constrained_output_continues_across_a_migration_and_a_hand_off() -> None:
    whole_engine = SimEngine(model=MODEL, block_size=BLOCK, clock=VirtualClock())
    await whole_engine.start()
    prefill_engine = SimEngine(model=MODEL, block_size=BLOCK, clock=VirtualClock())
    decode_engine = SimEngine(model=MODEL, block_size=BLOCK, clock=VirtualClock())
    await prefill_engine.start()
    await decode_engine.start()
    try:
        whole, _, _ = await run(whole_engine, constrained("w", WEATHER))
        # Resumed after 7 tokens on another worker: those tokens end its prompt.
        resumed_prompt = PROMPT + whole[:7]
        rest, finish, _ = await run(
            whole_engine,
            constrained(
                "w-resumed",
                WEATHER,
                max_tokens=200 - 7,
                prompt=resumed_prompt,
                resumption=Resumption(migration=1, next_seq=7, output_tokens=7),
            ),
        )
        assert whole[:7] + rest == whole and finish == "stop"
        # Prefill on one engine, decode on another from its KV.
        r = constrained("pd", WEATHER)
        first = await prefill_engine.prefill(r)
        kv = first.kv
        await decode_engine.import_kv(r, kv, None)
        tokens = [first.first_token_id]
        async for step in decode_engine.decode("pd", first.first_token_id):
            tokens += step.token_ids
        assert tokens == whole
    finally:
        for e in (whole_engine, prefill_engine, decode_engine):
            await e.stop()
