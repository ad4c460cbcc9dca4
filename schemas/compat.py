"""Check that the event contract stays compatible with the released one.

    python -m schemas.compat [--released schemas/released/asyncapi.json] [--current schemas/asyncapi.json]

prints one line per incompatible change and exits 1 when there is any (CI runs it: `.ci/run`).
The released contract is a file on purpose (schemas/released/README.md says why and how to
release a new one).

What "compatible" means here. An event has a writer and readers, and the two may be built on
different versions of the contract, in both directions:

- readers built on the *released* contract read what the mesh writes *now*: the outsiders'
  subscribers, written against the published asyncapi.json, on LIFECYCLE, TOKENS, the KV
  buckets... Removing a field breaks them (they require it, or lose its meaning), so does
  changing its type; a new field does not (the contract's Structs ignore unknown fields).
- readers built on the *current* contract read what was written under the *released* one:
  the messages a stream still keeps (LIFECYCLE keeps 7 days, a subscriber may start from
  "all"), those in flight during a rolling upgrade, and what outsiders write to the mesh
  (SubmitRequest, CancelRequest, ReplayTokens). A new required field breaks
  them (an old message lacks it), so does making an optional field required, narrowing an
  enum (an old message holds the value dropped), tightening a bound, or changing a type.

So a change is incompatible when either direction breaks, with one deliberate exception:
widening an enum (or a tagged union: a new variant) or loosening a bound is accepted. Strictly,
a released reader that decodes an enum as a closed Literal rejects the new value; but a new
value is how the contract grows (a new finish reason, role or kind) without a new tag for every
event that carries it, and a new tag forks every subscriber. The cost is on readers: a
subscriber treats an enum as open, i.e. expects a value it does not know yet (skips the event,
or lets it dead-letter, and upgrades). Narrowing stays incompatible because
it breaks the mesh's own readers on data already written, which no reader-side care can fix.

Making a required field optional (same type, with a default) is compatible: the contract's
Structs always encode every field (no ``omit_defaults``), so a released reader still gets it;
making it nullable (``X`` -> ``X | None``) is a type change and is reported.

Events are matched by tag (``x-ripplemesh-tag``): a new tag for a class is the old event
removed (and must come with a new released contract, see schemas/released/README.md). A new
event is compatible. Payloads are compared on their JSON Schema, with the ``$ref``s of each
document resolved in that document; a nested Struct's changes are reported once, under its
own name (``Usage.cached_tokens: ...``), whichever events carry it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JsonObject = dict[str, Any]

SCHEMAS_DIR = Path(__file__).resolve().parent
RELEASED_PATH = SCHEMAS_DIR / "released" / "asyncapi.json"
CURRENT_PATH = SCHEMAS_DIR / "asyncapi.json"

# Bounds a reader checks: raising a lower one or lowering an upper one narrows what it accepts.
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
# Constraints that cannot be ordered: any new or changed one is reported.
_EXACT = ("pattern", "multipleOf", "format", "contentEncoding")
_SCHEMA_KEYWORDS = frozenset(
    {
        "$ref",
        "anyOf",
        "oneOf",
        "allOf",
        "not",
        "enum",
        "const",
        "type",
        "properties",
        "items",
        "prefixItems",
        "additionalProperties",
        *_LOWER_BOUNDS,
        *_UPPER_BOUNDS,
        *_EXACT,
    }
)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


class _Document:
    """One document, resolving its local ``#/...`` references."""

    def __init__(self, root: JsonObject) -> None:
        self.root = root

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise ValueError(f"only local references are supported, not {ref!r}")
        node: Any = self.root
        for raw in ref[1:].split("/")[1:]:
            token = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                raise ValueError(f"unresolvable reference {ref!r}")
        return node


@dataclass(frozen=True)
class _Alt:
    """One alternative of a (flattened) schema: its kind, its node, a Struct's name."""

    kind: str  # any never null boolean integer number string array object struct enum other
    node: Any
    name: str | None = None


def _is_struct(node: Any) -> bool:
    return isinstance(node, dict) and isinstance(node.get("properties"), dict)


def _alternatives(doc: _Document, node: Any, refs: frozenset[str] = frozenset()) -> list[_Alt]:
    if node is True:
        return [_Alt("any", node)]
    if node is False:
        return [_Alt("never", node)]
    if not isinstance(node, dict):
        return [_Alt("other", node)]
    if "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str):
            return [_Alt("other", node)]
        target = doc.resolve(ref)
        if _is_struct(target):
            return [_Alt("struct", target, ref.rsplit("/", 1)[-1])]
        if ref in refs:  # a reference cycle that is not a Struct: compare as it is written
            return [_Alt("other", node)]
        return _alternatives(doc, target, refs | {ref})
    for union in ("anyOf", "oneOf"):
        if isinstance(node.get(union), list):
            return [alt for sub in node[union] for alt in _alternatives(doc, sub, refs)]
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
        return _alternatives(doc, node["allOf"][0], refs)
    if "const" in node:
        return [_Alt("enum", {**node, "enum": [node["const"]]})]
    if isinstance(node.get("enum"), list):
        return [_Alt("enum", node)]
    if _is_struct(node):
        title = node.get("title")
        return [_Alt("struct", node, title if isinstance(title, str) else None)]
    types = node.get("type")
    if isinstance(types, str):
        types = [types]
    if isinstance(types, list):
        return [_Alt(t if isinstance(t, str) else "other", node) for t in types]
    if not _SCHEMA_KEYWORDS & node.keys():
        return [_Alt("any", node)]
    return [_Alt("other", node)]


def _describe_alt(doc: _Document, alt: _Alt) -> str:
    node = alt.node
    if alt.kind == "struct":
        return alt.name or "object"
    if alt.kind == "enum":
        return " | ".join(_json(v) for v in node["enum"])
    if alt.kind == "array":
        if isinstance(node.get("prefixItems"), list):
            return "array[" + ", ".join(_describe(doc, s) for s in node["prefixItems"]) + "]"
        return "array[" + _describe(doc, node.get("items", True)) + "]"
    if alt.kind == "object" and "additionalProperties" in node:
        return "object[" + _describe(doc, node["additionalProperties"]) + "]"
    if alt.kind == "string" and isinstance(node.get("contentEncoding"), str):
        return f"string ({node['contentEncoding']})"
    if alt.kind == "other":
        return _json(node)
    return alt.kind


def _describe(doc: _Document, node: Any) -> str:
    alts = _alternatives(doc, node)
    alts.sort(key=lambda a: a.kind == "null")  # stable: null last, as `X | None` reads
    return " | ".join(_describe_alt(doc, a) for a in alts)


@dataclass
class _Comparison:
    released: _Document
    current: _Document
    lines: list[str] = field(default_factory=list)
    _structs_seen: set[tuple[str, str]] = field(default_factory=set)

    def report(self, line: str) -> None:
        if line not in self.lines:
            self.lines.append(line)

    def schema(self, path: str, old: Any, new: Any) -> None:
        old_alts = _alternatives(self.released, old)
        new_alts = _alternatives(self.current, new)
        old_kinds = {a.kind for a in old_alts}
        new_kinds = {a.kind for a in new_alts}
        if old_kinds != new_kinds:
            old_text, new_text = _describe(self.released, old), _describe(self.current, new)
            self.report(f"{path}: type {old_text} -> {new_text}")
            return
        for kind in sorted(old_kinds):
            olds = [a for a in old_alts if a.kind == kind]
            news = [a for a in new_alts if a.kind == kind]
            if kind == "enum":
                self._enum(path, olds, news)
            elif kind == "struct":
                self._variants(path, olds, news)
            elif kind == "other":
                if {_json(a.node) for a in olds} != {_json(a.node) for a in news}:
                    self.report(f"{path}: schema {_json(olds[0].node)} -> {_json(news[0].node)}")
            else:
                self._typed(path, kind, olds[0].node, news[0].node)

    def _enum(self, path: str, olds: list[_Alt], news: list[_Alt]) -> None:
        new_values = {_json(v) for a in news for v in a.node["enum"]}
        for alt in olds:
            for value in alt.node["enum"]:
                if _json(value) not in new_values:
                    self.report(f"{path}: enum lost value {_json(value)}")

    def _variants(self, path: str, olds: list[_Alt], news: list[_Alt]) -> None:
        if len(olds) == 1 and len(news) == 1:
            self.struct(path, olds[0], news[0])
            return
        by_name = {a.name: a for a in news}
        for alt in olds:
            match = by_name.get(alt.name)
            if match is None:
                self.report(f"{path}: union lost variant {alt.name or _json(alt.node)}")
            else:
                self.struct(path, alt, match)

    def struct(self, path: str, old: _Alt, new: _Alt) -> None:
        root = path
        if old.name is not None and new.name is not None:
            key = (old.name, new.name)
            if key in self._structs_seen:
                return
            self._structs_seen.add(key)
            root = old.name
        old_props: JsonObject = old.node["properties"]
        new_props: JsonObject = new.node["properties"]
        old_required = set(old.node.get("required", ()))
        new_required = set(new.node.get("required", ()))
        for name, old_schema in old_props.items():
            if name not in new_props:
                self.report(f"{root}: field {name} removed")
                continue
            if name not in old_required and name in new_required:
                self.report(f"{root}.{name}: optional field made required")
            self.schema(f"{root}.{name}", old_schema, new_props[name])
        for name in new_props:
            if name not in old_props and name in new_required:
                self.report(f"{root}.{name}: new required field")
        if (
            new.node.get("additionalProperties") is False
            and old.node.get("additionalProperties") is not False
        ):
            self.report(f"{root}: unknown fields now forbidden")

    def _typed(self, path: str, kind: str, old: Any, new: Any) -> None:
        if not isinstance(old, dict) or not isinstance(new, dict):
            return
        self._bounds(path, old, new)
        if kind == "array":
            old_prefix, new_prefix = old.get("prefixItems"), new.get("prefixItems")
            if isinstance(old_prefix, list) and isinstance(new_prefix, list):
                for i, (o, n) in enumerate(zip(old_prefix, new_prefix, strict=False)):
                    self.schema(f"{path}[{i}]", o, n)
                self.schema(f"{path}[]", old.get("items", True), new.get("items", True))
            elif old_prefix is None and new_prefix is None:
                self.schema(f"{path}[]", old.get("items", True), new.get("items", True))
            else:
                old_text, new_text = _describe(self.released, old), _describe(self.current, new)
                self.report(f"{path}: type {old_text} -> {new_text}")
        elif kind == "object":
            old_values = old.get("additionalProperties", True)
            new_values = new.get("additionalProperties", True)
            self.schema(f"{path}{{}}", old_values, new_values)

    def _bounds(self, path: str, old: JsonObject, new: JsonObject) -> None:
        for keyword in (*_LOWER_BOUNDS, *_UPPER_BOUNDS):
            if keyword not in new:
                continue
            if keyword not in old:
                self.report(f"{path}: new {keyword} {_json(new[keyword])}")
                continue
            o, n = old[keyword], new[keyword]
            tighter = n > o if keyword in _LOWER_BOUNDS else n < o
            if tighter:
                self.report(f"{path}: {keyword} {_json(o)} -> {_json(n)}")
        for keyword in _EXACT:
            if keyword not in new or old.get(keyword) == new[keyword]:
                continue
            if keyword not in old:
                self.report(f"{path}: new {keyword} {_json(new[keyword])}")
            else:
                self.report(f"{path}: {keyword} {_json(old[keyword])} -> {_json(new[keyword])}")


def _messages(doc: _Document) -> dict[str, tuple[str, JsonObject]]:
    """The document's events by tag: (message name, message)."""
    components = doc.root.get("components")
    messages = components.get("messages") if isinstance(components, dict) else None
    if not isinstance(messages, dict):
        raise ValueError("not an AsyncAPI document of the contract: no components.messages")
    out: dict[str, tuple[str, JsonObject]] = {}
    for name, message in messages.items():
        if isinstance(message, dict) and isinstance(message.get("$ref"), str):
            message = doc.resolve(message["$ref"])
        if not isinstance(message, dict):
            raise ValueError(f"message {name!r} is not an object")
        tag = message.get("x-ripplemesh-tag", name)
        out[str(tag)] = (name, message)
    return out


def _subject_pattern(subject: str) -> str:
    """A subject with its parameters' names dropped: renaming ``{worker}`` changes no subject."""
    return re.sub(r"\{[^}]*\}", "{}", subject)


def incompatibilities(released: JsonObject, current: JsonObject) -> list[str]:
    """Every incompatible change from the `released` AsyncAPI document to the `current` one.

    One line each, in the released document's order, e.g.
    ``DecodeCompleted.latency_s: type number -> string``, ``RequestFailed: field message removed``,
    ``WorkerState.role: enum lost value "prefill"``, ``event request.cancelled.v1 removed``,
    ``PrefillCompleted.foo: new required field``. See the module's docstring for the rules.
    """
    comparison = _Comparison(_Document(released), _Document(current))
    current_events = _messages(comparison.current)
    current_tags = {name: tag for tag, (name, _) in current_events.items()}
    for tag, (name, old) in _messages(comparison.released).items():
        if tag not in current_events:
            renamed = f" ({name} is now {current_tags[name]})" if name in current_tags else ""
            comparison.report(f"event {tag} removed{renamed}")
            continue
        new = current_events[tag][1]
        old_subject, new_subject = old.get("x-ripplemesh-subject"), new.get("x-ripplemesh-subject")
        if isinstance(old_subject, str) and (
            not isinstance(new_subject, str) or _subject_pattern(old_subject) != _subject_pattern(new_subject)
        ):
            comparison.report(f"event {tag}: subject {old_subject} -> {new_subject}")
        comparison.schema(name, old.get("payload", True), new.get("payload", True))
    return comparison.lines


def event_count(doc: JsonObject) -> int:
    return len(_messages(_Document(doc)))


def _load(path: Path) -> JsonObject:
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m schemas.compat``: 0 when compatible, 1 when not, 2 when a document is unreadable."""
    parser = argparse.ArgumentParser(
        prog="python -m schemas.compat",
        description="Check the event contract against the released one: print every incompatible "
        "change, exit 1 when there is any.",
    )
    parser.add_argument("--released", type=Path, default=RELEASED_PATH, help="the released contract")
    parser.add_argument("--current", type=Path, default=CURRENT_PATH, help="the contract to check")
    args = parser.parse_args(argv)
    try:
        released, current = _load(args.released), _load(args.current)
        lines = incompatibilities(released, current)
        count = event_count(released)
    except (OSError, ValueError) as exc:
        print(f"cannot compare the contracts: {exc}", file=sys.stderr)
        return 2
    if lines:
        for line in lines:
            print(line)
        print(
            f"{len(lines)} incompatible change(s) against the released contract ({args.released}): "
            "keep the change compatible, or give the event a new tag and release the new contract "
            "(schemas/released/README.md)",
            file=sys.stderr,
        )
        return 1
    print(f"compatible with the released contract ({count} events)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
