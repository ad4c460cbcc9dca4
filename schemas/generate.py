"""Generate the JSON Schema and AsyncAPI documents of the event contract.

Both documents are derived from the msgspec Structs in `schemas.events` and the subject
functions and stream/KV specs in `schemas.subjects`; they are committed so that subscribers
written in other languages can use them, and a test fails when they are stale.

    python -m schemas.generate          # (re)write the documents
    python -m schemas.generate --check  # exit 1 when a document is stale or missing

(``ripplemesh schemas generate`` runs the same thing.)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast, get_args

import msgspec

from schemas import events, subjects
from schemas.events import Event, PriorityClass
from schemas.subjects import (
    ADMISSION_CONSUMER,
    EVENT_KINDS,
    INGRESS_CONSUMER,
    LEDGER_CONSUMER,
    ROUTER_CONSUMER,
    STREAMS,
    WORKERS,
    ConsumerSpec,
    StreamSpec,
)

REGENERATE_COMMAND = "ripplemesh schemas generate"
SCHEMAS_DIR = Path(__file__).resolve().parent
EVENTS_SCHEMA_PATH = "jsonschema/events.json"
ASYNCAPI_PATH = "asyncapi.json"

# The version of the AsyncAPI document; bump it when the contract changes (a new event tag).
API_VERSION = "1.2.0"
CONTENT_TYPE = "application/json"
HEADERS_SCHEMA = "NatsHeaders"

JsonObject = dict[str, Any]

# ---------------------------------------------------------------- the contract's events


def event_types() -> tuple[type[Event], ...]:
    """Every top-level event type, in the order of the `AnyEvent` union."""
    return cast(tuple[type[Event], ...], get_args(events.AnyEvent))


def lifecycle_types() -> tuple[type[Event], ...]:
    return cast(tuple[type[Event], ...], get_args(events.LifecycleEvent))


def token_types() -> tuple[type[Event], ...]:
    return cast(tuple[type[Event], ...], get_args(events.TokenEvent))


def event_tag(cls: type[Event]) -> str:
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{cls.__name__} has no string tag")
    return tag


def _summary(cls: type[Event]) -> str:
    doc = cls.__doc__
    if doc and doc.strip():
        return doc.strip().splitlines()[0]
    return f"A `{event_tag(cls)}` event."


# ---------------------------------------------------------------- subjects, streams, consumers


def _param(name: str) -> str:
    return "{" + name + "}"


def _tokens_match(pattern: str, subject: str) -> bool:
    """NATS subject matching; a ``{param}`` token of `subject` is one concrete token."""
    pattern_tokens = pattern.split(".")
    subject_tokens = subject.split(".")
    for i, token in enumerate(pattern_tokens):
        if token == ">":
            return len(subject_tokens) > i
        if i >= len(subject_tokens):
            return False
        if token != "*" and token != subject_tokens[i]:
            return False
    return len(pattern_tokens) == len(subject_tokens)


def _overlaps(filter_subject: str, address: str) -> bool:
    """Whether a consumer's filter (which may itself hold ``{param}`` tokens) covers `address`."""
    return _tokens_match(filter_subject, address) or filter_subject == address


def stream_for(address: str) -> StreamSpec:
    """The one stream (from `STREAMS`) whose subjects capture a channel address."""
    found = [s for s in STREAMS if any(_tokens_match(p, address) for p in s.subjects)]
    if len(found) != 1:
        names = [s.name for s in found]
        raise RuntimeError(f"subject {address!r} is captured by {len(found)} streams: {names}")
    return found[0]


def _consumers() -> tuple[ConsumerSpec, ...]:
    return (
        INGRESS_CONSUMER,
        ADMISSION_CONSUMER,
        ROUTER_CONSUMER,
        LEDGER_CONSUMER,
        subjects.worker_consumer("prefill", _param("worker")),
        subjects.worker_consumer("decode", _param("worker")),
    )


def _consumer_doc(spec: ConsumerSpec) -> JsonObject:
    doc: JsonObject = {
        "durable": spec.durable,
        "stream": spec.stream,
        "filter_subject": spec.filter_subject,
        "ack_wait_s": spec.ack_wait_s,
        "max_deliver": spec.max_deliver,
        "max_ack_pending": spec.max_ack_pending,
    }
    if spec.inactive_threshold_s is not None:
        doc["inactive_threshold_s"] = spec.inactive_threshold_s
    return doc


@dataclass(frozen=True)
class Channel:
    id: str
    address: str
    title: str
    description: str
    messages: tuple[type[Event], ...]
    parameters: dict[str, JsonObject]
    publishers: str
    consumers: str
    # A KV bucket's channel instead of a stream's.
    kv_bucket: bool = False
    # Core NATS (not stored in a stream): fast, and lost if nobody listens.
    core: bool = False


_TENANT: JsonObject = {
    "description": "The tenant's name (letters, digits, '_' and '-'); NATS permissions confine "
    "a tenant to its own subjects."
}
_WORKER: JsonObject = {"description": "The worker's id, as in its `WorkerState.worker_id`."}


def channels() -> tuple[Channel, ...]:
    """Every subject family of the bus and the WORKERS KV bucket, with what flows on each."""
    unkinded = [event_tag(cls) for cls in lifecycle_types() if event_tag(cls) not in EVENT_KINDS]
    if unkinded:
        raise RuntimeError(f"lifecycle events without a kind in EVENT_KINDS: {unkinded}")
    kinds = [EVENT_KINDS[event_tag(cls)] for cls in lifecycle_types()]
    return (
        Channel(
            id="requests",
            address=subjects.request_subject(_param("tenant")),
            title="Submitted requests",
            description="What NATS clients submit for their tenant, and their cancellations; the "
            "tenant is the subject's.",
            messages=(events.SubmitRequest, events.CancelRequest, events.ReplayTokens),
            parameters={"tenant": _TENANT},
            publishers="Clients (the NATS API) publish a SubmitRequest on their tenant's subject, "
            "a CancelRequest to stop one of their requests, and a ReplayTokens to have the token "
            "events they missed published again.",
            consumers="Ingress (durable `ingress`) validates and tokenizes a submission into a "
            "RequestPrepared, or rejects it; it turns a cancellation into a RequestCancelled, "
            "and answers a ReplayTokens by publishing the stored token events again.",
        ),
        Channel(
            id="prepared",
            address=subjects.prepared_subject(_param("tenant")),
            title="Prepared requests",
            description="Validated, tokenized requests (from HTTP and NATS clients), for admission.",
            messages=(events.RequestPrepared,),
            parameters={"tenant": _TENANT},
            publishers="Ingress publishes each validated, tokenized request.",
            consumers="Admission (durable `admission`) applies the tenant's quotas and the "
            "fleet's capacity, then admits or rejects the request.",
        ),
        Channel(
            id="admitted",
            address=subjects.admitted_subject(cast(PriorityClass, _param("priority"))),
            title="Admitted requests",
            description="Admitted requests waiting for the router, by priority class.",
            messages=(events.RequestAdmitted,),
            parameters={
                "priority": {
                    "description": "The request's priority class.",
                    "enum": list(get_args(events.PriorityClass)),
                }
            },
            publishers="Admission publishes each admitted request under its priority class.",
            consumers="The router (durable `router`) places it on a prefill and a decode worker.",
        ),
        Channel(
            id="prefillWork",
            address=subjects.work_subject("prefill", _param("worker")),
            title="Prefill work",
            description="Prefill (or aggregated prefill and decode) work placed on one worker.",
            messages=(events.PrefillWork,),
            parameters={"worker": _WORKER},
            publishers="The router publishes the request placed on this prefill worker.",
            consumers="The prefill (or aggregated) worker it names (durable "
            "`worker-prefill-<worker>`) runs the prefill.",
        ),
        Channel(
            id="decodeWork",
            address=subjects.work_subject("decode", _param("worker")),
            title="Decode work",
            description="Decode work for one worker, with the handle of the prefilled KV cache.",
            messages=(events.DecodeWork,),
            parameters={"worker": _WORKER},
            publishers="The prefill worker publishes the request with its KV handle and first "
            "token once the prefill is done.",
            consumers="The decode worker it names (durable `worker-decode-<worker>`) pulls the "
            "KV cache and generates the tokens.",
        ),
        Channel(
            id="tokens",
            address=subjects.tokens_subject(_param("tenant"), _param("request_id")),
            title="Token streams",
            description="One request's token stream, ordered by `seq`: chunks, then exactly one "
            "StreamFinished or StreamFailed.",
            messages=token_types(),
            parameters={
                "tenant": _TENANT,
                "request_id": {"description": "The request's id, as in its `request_id`."},
            },
            publishers="Decode (or aggregated) workers publish token chunks and the final "
            "StreamFinished; the stage that rejects or fails a request publishes StreamFailed.",
            consumers="Clients (and ingress, for HTTP clients) subscribe to their request's "
            "subject and may read it back from the stream to resume.",
        ),
        Channel(
            id="lifecycle",
            address=subjects.event_subject(_param("kind")),
            title="Lifecycle and decision events",
            description="Every lifecycle and decision event, on the subject of its kind "
            "(see each message's `x-ripplemesh-subject`).",
            messages=lifecycle_types(),
            parameters={
                "kind": {
                    "description": "The event's kind (`EVENT_KINDS` by event tag).",
                    "enum": kinds,
                }
            },
            publishers="Ingress, admission and the router publish rejections; admission an "
            "AdmissionDecision for every request it admits or defers; the router routing "
            "decisions (RequestRouted, and a RouteDecision for every decision, with its "
            "predictions); prefill/decode workers completions and failures; the autoscaler its "
            "fleet view. Ingress publishes RequestCancelled (client gone or cancelled), the "
            "router RequestMigrated (a request re-placed off a lost or drained worker), workers "
            "WorkStopped (a request stopped early, with the GPU time it spent).",
            consumers="The ledger (durable `ledger`) prices each request and task from them; "
            "the stream is also the audit log. Router replicas read each other's RouteDecisions "
            "and the PrefillCompleted events (core subscriptions) for load and prediction error. "
            "Workers read RequestCancelled (core subscription) to stop the request at once.",
        ),
        Channel(
            id="deadLetters",
            address=subjects.dlq_subject(_param("stream")),
            title="Dead letters",
            description="Messages a consumer could not decode or process, with the reason.",
            messages=(events.DeadLetter,),
            parameters={
                "stream": {
                    "description": "The stream of the consumer that gave up on the message.",
                    "examples": [s.name for s in STREAMS if s.name != "DLQ"],
                }
            },
            publishers="Any service's consumer, when a message cannot be decoded, fails "
            "permanently or exhausts its deliveries.",
            consumers="Operators inspect (and replay) them; no service consumes them.",
        ),
        Channel(
            id="tenantThrottles",
            address=f"$KV.{subjects.TENANT_THROTTLES.bucket}.{_param('tenant')}",
            title="Tenant throttles",
            description="A control subject: a TenantThrottle put under a tenant makes admission "
            "refuse the tenant's new requests (429, Retry-After) until its `until`; deleting the "
            "entry lifts it.",
            messages=(events.TenantThrottle,),
            parameters={"tenant": _TENANT},
            publishers="Subscribers that close a loop (examples/budget_guard.py).",
            consumers="Admission, watching the bucket.",
            kv_bucket=True,
        ),
        Channel(
            id="workerStates",
            address=f"$KV.{WORKERS.bucket}.{_param('worker')}",
            title="Worker states",
            description=f"The {WORKERS.bucket} KV bucket: each worker's latest heartbeat, keyed "
            "by worker id.",
            messages=(events.WorkerState,),
            parameters={"worker": _WORKER},
            publishers="Every prefill/decode worker puts its WorkerState under its id at each heartbeat.",
            consumers="The router watches the bucket and the autoscaler reads it, for the "
            "fleet's capacity, load and cache contents.",
            kv_bucket=True,
        ),
        Channel(
            id="kvEvents",
            address=subjects.kv_subject(_param("worker")),
            title="Prefix-cache changes",
            description="Blocks a worker's engine stored in, or evicted from, its prefix cache, "
            "numbered per worker so a reader detects a gap.",
            messages=(events.KvEvents,),
            parameters={"worker": _WORKER},
            publishers="Every prefill/decode worker, as its engine's cache changes.",
            consumers="Routers, to keep their index of which worker caches which prefix.",
            core=True,
        ),
        Channel(
            id="kvDump",
            address=subjects.kv_dump_subject(_param("worker")),
            title="Prefix-cache dump",
            description="Request/reply: a worker answers with every block it caches and the "
            "batch number it is current to, for a reader that missed batches. The request's body "
            "is a KvDumpRequest (`max_blocks`): the answer then comes as `chunks` KvDump messages "
            "on the reply subject, each with at most that many blocks; an empty body gets one.",
            messages=(events.KvDump,),
            parameters={"worker": _WORKER},
            publishers="The worker, in reply to a request.",
            consumers="Routers, on start-up and on a gap in a worker's KvEvents.",
            core=True,
        ),
        Channel(
            id="workerControl",
            address=subjects.control_subject(_param("worker")),
            title="Worker control",
            description="Orders to one worker: drain (no new work, finish or hand off, exit), "
            "revoke (stop requests migrated elsewhere), ping (liveness probe). A request with a "
            "reply subject is answered with the worker's WorkerState.",
            messages=(events.WorkerControl,),
            parameters={"worker": _WORKER},
            publishers="Operators (`ripplemesh drain`), the autoscaler on scale-down, and routers "
            "(revoke after a migration; ping when a heartbeat is late).",
            consumers="The worker it names.",
            core=True,
        ),
        Channel(
            id="launcherControl",
            address=subjects.LAUNCHER_SUBJECT,
            title="Process supervisor control",
            description="Request/reply: `ripplemesh up --autoscale`'s supervisor starts workers of a "
            "pool, or drains and stops the ones named (ScaleOrder), and answers with what it runs "
            "(LauncherFleet).",
            messages=(events.ScaleOrder, events.LauncherFleet),
            parameters={},
            publishers="The autoscaler (ScaleOrder); the supervisor answers (LauncherFleet).",
            consumers="The supervisor of `ripplemesh up --autoscale`.",
            core=True,
        ),
    )


def subject_of(cls: type[Event], channel: Channel) -> str:
    """The subject (pattern) an event is published on."""
    tag = event_tag(cls)
    if channel.id == "lifecycle":
        return subjects.event_subject(EVENT_KINDS[tag])
    return channel.address


def event_subjects() -> dict[str, str]:
    """Every event tag's subject (pattern); fails when an event of the contract has none."""
    out: dict[str, str] = {}
    for channel in channels():
        for cls in channel.messages:
            tag = event_tag(cls)
            if tag in out:
                raise RuntimeError(f"event {tag!r} is on two channels")
            out[tag] = subject_of(cls, channel)
    missing = [event_tag(cls) for cls in event_types() if event_tag(cls) not in out]
    if missing:
        raise RuntimeError(f"events without a channel in schemas/generate.py: {missing}")
    return out


# ---------------------------------------------------------------- JSON Schema


def events_schema() -> JsonObject:
    """One JSON Schema (draft 2020-12) document of every event, a `oneOf` by `type` tag."""
    types = event_types()
    (union,), defs = msgspec.json.schema_components((events.AnyEvent,), ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "ripplemesh events",
        "description": "Every event ripplemesh services exchange over NATS JetStream, tagged by "
        "`type`. Generated from schemas/events.py: do not edit; run "
        f"`{REGENERATE_COMMAND}`.",
        "oneOf": [{"$ref": f"#/$defs/{cls.__name__}"} for cls in types],
        "discriminator": union["discriminator"],
        "$defs": defs,
        "x-ripplemesh-subjects": event_subjects(),
    }


# ---------------------------------------------------------------- AsyncAPI


def headers_schema() -> JsonObject:
    return {
        "type": "object",
        "description": "NATS message headers. Trace context travels only here, never in the payload.",
        "properties": {
            "Nats-Msg-Id": {
                "type": "string",
                "description": "The payload's `event_id`: JetStream drops a duplicate publish "
                "within the stream's duplicate window.",
            },
            "traceparent": {
                "type": "string",
                "description": "W3C Trace Context `traceparent` of the span that created the "
                "message (when traced).",
                "pattern": "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
            },
            "tracestate": {
                "type": "string",
                "description": "W3C Trace Context `tracestate`, when the trace has one.",
            },
        },
        "additionalProperties": {"type": "string"},
    }


def _message(cls: type[Event], channel: Channel) -> JsonObject:
    name = cls.__name__
    message: JsonObject = {
        "name": name,
        "title": name,
        "summary": _summary(cls),
        "contentType": CONTENT_TYPE,
        "headers": {"$ref": f"#/components/schemas/{HEADERS_SCHEMA}"},
        "payload": {"$ref": f"#/components/schemas/{name}"},
        "x-ripplemesh-tag": event_tag(cls),
        "x-ripplemesh-subject": subject_of(cls, channel),
    }
    return message


def _channel_doc(channel: Channel) -> JsonObject:
    doc: JsonObject = {
        "address": channel.address,
        "title": channel.title,
        "parameters": channel.parameters,
        "messages": {
            cls.__name__: {"$ref": f"#/components/messages/{cls.__name__}"} for cls in channel.messages
        },
    }
    if channel.core:
        doc["description"] = f"{channel.description} Core NATS: not stored in a stream."
        return doc
    if channel.kv_bucket:
        doc["description"] = f"{channel.description} {WORKERS.description}"
        doc["x-ripplemesh-kv-bucket"] = {
            "bucket": WORKERS.bucket,
            "description": WORKERS.description,
            "history": WORKERS.history,
            "ttl_s": WORKERS.ttl_s,
        }
        return doc
    stream = stream_for(channel.address)
    doc["description"] = f"{channel.description} Carried by stream {stream.name}: {stream.description}"
    doc["x-ripplemesh-stream"] = {
        "name": stream.name,
        "description": stream.description,
        "subjects": stream.subjects,
        "retention": stream.retention,
        "max_age_s": stream.max_age_s,
        "duplicate_window_s": stream.duplicate_window_s,
    }
    doc["x-ripplemesh-consumers"] = [
        _consumer_doc(spec)
        for spec in _consumers()
        if spec.stream == stream.name and _overlaps(spec.filter_subject, channel.address)
    ]
    return doc


def _operations(channel: Channel) -> dict[str, JsonObject]:
    refs = [{"$ref": f"#/channels/{channel.id}/messages/{cls.__name__}"} for cls in channel.messages]
    suffix = channel.id[0].upper() + channel.id[1:]
    return {
        f"publish{suffix}": {
            "action": "send",
            "channel": {"$ref": f"#/channels/{channel.id}"},
            "summary": channel.publishers,
            "messages": refs,
        },
        f"consume{suffix}": {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{channel.id}"},
            "summary": channel.consumers,
            "messages": refs,
        },
    }


def asyncapi() -> JsonObject:
    """An AsyncAPI 3.0.0 document of every channel, operation and message of the bus."""
    all_channels = channels()
    event_subjects()  # fails when an event of the contract has no channel
    _, schemas = msgspec.json.schema_components(event_types(), ref_template="#/components/schemas/{name}")
    if HEADERS_SCHEMA in schemas:
        raise RuntimeError(f"a Struct is named {HEADERS_SCHEMA}, the headers schema's name")
    schemas[HEADERS_SCHEMA] = headers_schema()
    messages: JsonObject = {}
    operations: JsonObject = {}
    for channel in all_channels:
        for cls in channel.messages:
            messages[cls.__name__] = _message(cls, channel)
        operations.update(_operations(channel))
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "ripplemesh event bus",
            "version": API_VERSION,
            "description": "The subjects, streams and events ripplemesh services exchange over "
            "NATS JetStream. Payloads are JSON, tagged by `type`; decoding is strict. "
            "Generated from schemas/events.py and schemas/subjects.py: do not edit; run "
            f"`{REGENERATE_COMMAND}`.",
        },
        "defaultContentType": CONTENT_TYPE,
        "channels": {channel.id: _channel_doc(channel) for channel in all_channels},
        "operations": operations,
        "components": {"schemas": schemas, "messages": messages},
    }


# ---------------------------------------------------------------- files


def _dump(doc: JsonObject) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render() -> dict[str, str]:
    """Every generated file's content, by path relative to the schemas/ package directory."""
    return {
        ASYNCAPI_PATH: _dump(asyncapi()),
        EVENTS_SCHEMA_PATH: _dump(events_schema()),
    }


def write(check: bool = False, root: Path = SCHEMAS_DIR) -> list[str]:
    """Write the generated files that changed and return their paths.

    With ``check=True`` nothing is written: the stale or missing paths are returned.
    """
    changed: list[str] = []
    for rel, content in sorted(render().items()):
        path = root / rel
        try:
            current: str | None = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            current = None
        if current == content:
            continue
        changed.append(rel)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m schemas.generate [--check]``: returns the exit status (1 when stale)."""
    parser = argparse.ArgumentParser(
        prog="python -m schemas.generate",
        description="Generate the JSON Schema and AsyncAPI documents of the event contract.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when a generated file is stale or missing",
    )
    args = parser.parse_args(argv)
    paths = write(check=args.check)
    if args.check:
        if paths:
            listed = ", ".join(f"schemas/{p}" for p in paths)
            print(
                f"stale generated schemas: {listed}; run `{REGENERATE_COMMAND}` "
                "(or `python -m schemas.generate`) and commit the result",
                file=sys.stderr,
            )
            return 1
        print("generated schemas are up to date")
        return 0
    for p in paths:
        print(f"wrote schemas/{p}")
    if not paths:
        print("generated schemas are up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
