"""The ingress's OpenAPI document, generated from the request bodies it decodes.

The bodies are the msgspec Structs ingress decodes (services/ingress/openai_api.py), so the
document cannot drift from what the API accepts. Errors are OpenAI's shape.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from services.batch.records import COMPLETION_WINDOWS, ENDPOINTS, MAX_FILE_BYTES
from services.ingress.batch_api import CreateBatchBody
from services.ingress.openai_api import ChatCompletionBody, CompletionBody


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorDetail


_REF = "#/components/schemas/{name}"


def _ref(struct: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=struct.__name__)}


def _errors(*statuses: int) -> dict[str, Any]:
    described = {
        400: "The request is invalid; `error.param` names the field.",
        401: "Invalid or missing API key.",
        404: "Unknown model, or no such file or batch of the tenant's.",
        408: "The body was not received in time.",
        409: "The batch is finished: it cannot be cancelled.",
        413: "The body is too large.",
        429: "Over the tenant's quota, or the fleet is overloaded (Retry-After).",
        503: "The mesh cannot serve now (Retry-After).",
        504: "No response from the mesh in time.",
    }
    return {
        str(status): {
            "description": described[status],
            "content": {"application/json": {"schema": _ref(ErrorResponse)}},
        }
        for status in statuses
    }


def _generation(summary: str, body: type) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "parameters": [
                {"name": name, "in": "header", "required": False, "schema": schema}
                for name, schema in (
                    ("x-ripple-priority", {"type": "string", "enum": ["critical", "standard", "sheddable"]}),
                    ("x-ripple-deadline-ms", {"type": "integer", "minimum": 1}),
                    ("x-ripple-workflow-id", {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,128}$"}),
                    ("x-ripple-workflow-step", {"type": "integer", "minimum": 1}),
                    ("x-ripple-workflow-steps", {"type": "integer", "minimum": 1}),
                    ("x-request-id", {"type": "string", "maxLength": 128}),
                )
            ],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}},
            "responses": {
                "200": {
                    "description": "The completion: one JSON body, or server-sent events with `stream`.",
                    "content": {"application/json": {}, "text/event-stream": {}},
                },
                **_errors(400, 401, 404, 408, 413, 429, 503, 504),
            },
        }
    }


def _operation(summary: str, ok: str, *statuses: int, **extra: Any) -> dict[str, Any]:
    return {
        "summary": summary,
        "security": [{"bearer": []}],
        **extra,
        "responses": {"200": {"description": ok}, **_errors(401, *statuses)},
    }


def _path_id(name: str) -> list[dict[str, Any]]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]


def _batch_paths() -> dict[str, Any]:
    """The Batch API's routes (services/ingress/batch_api.py, docs/batch.md)."""
    upload = {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {
            "file": {
                "type": "string",
                "format": "binary",
                "description": f"JSONL, at most {MAX_FILE_BYTES} bytes",
            },
            "purpose": {"type": "string", "enum": ["batch"]},
        },
    }
    return {
        "/v1/files": {
            "post": _operation(
                "Upload a batch input file (multipart: file, purpose=batch)",
                "The file object.",
                400,
                413,
                503,
                requestBody={"required": True, "content": {"multipart/form-data": {"schema": upload}}},
            )
        },
        "/v1/files/{file_id}": {
            "get": _operation(
                "A file's metadata", "The file object.", 404, 503, parameters=_path_id("file_id")
            )
        },
        "/v1/files/{file_id}/content": {
            "get": _operation(
                "A file's bytes", "The file's content.", 404, 503, parameters=_path_id("file_id")
            )
        },
        "/v1/batches": {
            "post": _operation(
                f"Create a batch: endpoint one of {', '.join(ENDPOINTS)}, "
                f"completion_window {', '.join(COMPLETION_WINDOWS)}",
                "The batch object (status validating).",
                400,
                404,
                413,
                503,
                requestBody={
                    "required": True,
                    "content": {"application/json": {"schema": _ref(CreateBatchBody)}},
                },
            ),
            "get": _operation(
                "The tenant's batches, newest first",
                "A list of batch objects.",
                400,
                503,
                parameters=[
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
                    },
                    {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
                ],
            ),
        },
        "/v1/batches/{batch_id}": {
            "get": _operation("A batch", "The batch object.", 404, 503, parameters=_path_id("batch_id"))
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": _operation(
                "Cancel a validating or in-progress batch (cancelling, then cancelled)",
                "The batch object.",
                404,
                409,
                503,
                parameters=_path_id("batch_id"),
            )
        },
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        [ChatCompletionBody, CompletionBody, CreateBatchBody, ErrorResponse], ref_template=_REF
    )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ripplemesh ingress",
            "version": "1",
            "description": "The OpenAI-compatible API of a ripplemesh mesh.",
        },
        "paths": {
            "/v1/chat/completions": _generation("Create a chat completion", ChatCompletionBody),
            "/v1/completions": _generation("Create a text completion", CompletionBody),
            "/v1/models": {
                "get": {
                    "summary": "The models served, with their context length and live workers",
                    "security": [{"bearer": []}],
                    "responses": {"200": {"description": "The model list."}, **_errors(401)},
                }
            },
            **_batch_paths(),
            "/health": {
                "get": {
                    "summary": "200 when the mesh can serve (NATS connected, a live worker); else 503",
                    "responses": {
                        "200": {"description": "The mesh can serve."},
                        "503": {"description": "It cannot; `reason` says why."},
                    },
                }
            },
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
