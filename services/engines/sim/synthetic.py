"""What a simulated model writes when its output is constrained: a JSON value valid against a
schema, or a call of one of the request's tools in the project's format
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, services/engines/tokenizer.py).

Pure and deterministic: the same constraint and seed give the same text, so a request migrated
mid-stream, or prefilled on one worker and decoded on another, continues the same output. The
schema subset is what tool definitions and structured-output clients use: `type` (one or a list),
`enum`, `const`, `properties`/`required`/`additionalProperties`, `items`/`prefixItems` with
`minItems`/`maxItems`, numeric bounds, string lengths, common `format`s, `anyOf`/`oneOf`/`allOf`
and local `$ref`s. A `pattern` is not honoured (the string is plain words); a real engine's
grammar-constrained decoding is the reference for those.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

from schemas.events import OutputConstraint, ToolFunction

_WORDS = (
    "alpha bravo cache delta engine fleet gateway harbor index journal kernel ledger mesh "
    "node orbit prefix queue router shard token update vector worker yield zone"
).split()
_FORMATS = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00Z",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "192.0.2.1",
    "hostname": "example.com",
}
_MAX_DEPTH = 6  # a recursive schema ($ref to itself) stops here with its smallest value


def synthetic_output(constraint: OutputConstraint, seed: int) -> str:
    """The whole output a sim model writes under `constraint`."""
    rng = random.Random(seed)
    if constraint.kind == "json":
        schema = constraint.json_schema if constraint.json_schema is not None else {"type": "object"}
        return json.dumps(_value(schema, schema, rng, 0))
    if not constraint.tools:
        raise ValueError("a tool_call constraint needs at least one tool")
    tool = rng.choice(constraint.tools)
    call = {"name": tool.name, "arguments": tool_arguments(tool, rng)}
    return "<tool_call>" + json.dumps(call) + "</tool_call>"


def synthetic_json(schema: dict[str, Any], seed: int) -> Any:
    """A JSON value valid against `schema` (within the subset the module docstring names)."""
    return _value(schema, schema, random.Random(seed), 0)


def tool_arguments(tool: ToolFunction, rng: random.Random) -> Any:
    schema = tool.parameters if tool.parameters else {"type": "object", "properties": {}}
    return _value(schema, schema, rng, 0)


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    while isinstance(ref, str) and ref.startswith("#/"):
        node: Any = root
        for part in ref[2:].split("/"):
            node = node.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(node, dict) else {}
        schema = {**node, **{k: v for k, v in schema.items() if k != "$ref"}}
        ref = node.get("$ref") if isinstance(node, dict) else None
    return schema


def _value(schema: Any, root: dict[str, Any], rng: random.Random, depth: int) -> Any:
    if schema is True or not isinstance(schema, dict):
        return _word(rng)
    schema = _resolve(schema, root)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            # The first option: the one a schema writer lists as the usual case.
            rest = {k: v for k, v in schema.items() if k != key}
            return _value({**rest, **_resolve(options[0], root)}, root, rng, depth)
    if isinstance(schema.get("allOf"), list):
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            part = _resolve(part, root) if isinstance(part, dict) else {}
            merged["properties"] = {**merged.get("properties", {}), **part.get("properties", {})}
            merged["required"] = [*merged.get("required", []), *part.get("required", [])]
            merged.update({k: v for k, v in part.items() if k not in ("properties", "required")})
        return _value(merged, root, rng, depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null") if kind else None
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        return _object(schema, root, rng, depth)
    if kind == "array":
        return _array(schema, root, rng, depth)
    if kind == "integer":
        return _integer(schema, rng)
    if kind == "number":
        return _number(schema, rng)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string(schema, rng)


def _object(schema: dict[str, Any], root: dict[str, Any], rng: random.Random, depth: int) -> dict[str, Any]:
    properties: dict[str, Any] = schema.get("properties") or {}
    required = [name for name in schema.get("required", []) if isinstance(name, str)]
    out: dict[str, Any] = {}
    for name, sub in properties.items():
        # Every required property, and about half the optional ones (none past the depth limit).
        if name in required or (depth < _MAX_DEPTH and rng.random() < 0.5):
            out[name] = _value(sub, root, rng, depth + 1)
    for name in required:
        if name not in out:  # required but not described: any value is valid
            out[name] = _word(rng)
    return out


def _array(schema: dict[str, Any], root: dict[str, Any], rng: random.Random, depth: int) -> list[Any]:
    given = schema.get("prefixItems")
    prefix: list[Any] = given if isinstance(given, list) else []
    low = int(schema.get("minItems", 0))
    high = int(schema.get("maxItems", max(low, len(prefix), 3)))
    if depth >= _MAX_DEPTH:
        count = low
    else:
        fewest = max(low, min(1, high))  # one item at least, where the schema allows one
        count = rng.randint(fewest, max(fewest, min(high, low + 3)))
    items = schema.get("items", {})
    out = [_value(prefix[i] if i < len(prefix) else items, root, rng, depth + 1) for i in range(count)]
    if schema.get("uniqueItems"):
        seen: dict[str, Any] = {}
        for value in out:
            seen.setdefault(json.dumps(value, sort_keys=True), value)
        if len(seen) >= low:
            out = list(seen.values())
    return out


def _bounds(schema: dict[str, Any], integer: bool) -> tuple[float, float]:
    low = float(schema.get("minimum", -math.inf))
    high = float(schema.get("maximum", math.inf))
    if "exclusiveMinimum" in schema:
        low = max(low, float(schema["exclusiveMinimum"]) + (1 if integer else 1e-6))
    if "exclusiveMaximum" in schema:
        high = min(high, float(schema["exclusiveMaximum"]) - (1 if integer else 1e-6))
    if math.isinf(low) and math.isinf(high):
        low, high = 0, 100
    elif math.isinf(low):
        low = high - 100
    elif math.isinf(high):
        high = low + 100
    return low, high


def _integer(schema: dict[str, Any], rng: random.Random) -> int:
    low, high = _bounds(schema, integer=True)
    value = rng.randint(math.ceil(low), max(math.ceil(low), math.floor(high)))
    step = schema.get("multipleOf")
    if isinstance(step, int) and step > 0:
        value = math.ceil(low / step) * step
    return value


def _number(schema: dict[str, Any], rng: random.Random) -> float:
    low, high = _bounds(schema, integer=False)
    step = schema.get("multipleOf")
    if isinstance(step, (int, float)) and step > 0:
        return float(math.ceil(low / step) * step)
    return round(rng.uniform(low, high), 3) if high > low else low


def _string(schema: dict[str, Any], rng: random.Random) -> str:
    fixed = _FORMATS.get(str(schema.get("format", "")))
    if fixed is not None:
        return fixed
    low = int(schema.get("minLength", 0))
    high = int(schema.get("maxLength", max(low, 40)))
    words = " ".join(_word(rng) for _ in range(rng.randint(1, 3)))
    while len(words) < low:
        words += " " + _word(rng)
    return words[:high] if len(words) > high else words


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)
