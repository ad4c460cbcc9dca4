"""The Batch API's HTTP routes on ingress, as OpenAI's clients call them: ``/v1/files`` (upload a
JSONL of requests, read a file and its content) and ``/v1/batches`` (create, read, list,
cancel). They only store and read (`services/batch/store.py`, on JetStream); the batch runner
(`services/batch/service.py`) validates and runs the lines. Every id is the tenant's own: an id
of another tenant's is as unknown as one that never existed (a 404 in OpenAI's error shape)."""

from __future__ import annotations

import email.parser
import email.policy
import time
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from services.batch.records import (
    ACTIVE,
    COMPLETION_WINDOWS,
    ENDPOINTS,
    MAX_FILE_BYTES,
    BatchRecord,
    FileRecord,
    new_id,
)
from services.batch.store import BatchStore
from services.ingress.fleet import FleetView
from services.ingress.http_helpers import error_response
from services.ingress.part import ServicePart
from services.mesh.bus import TRANSIENT_ERRORS
from services.mesh.runtime import Runtime


class CreateBatchBody(msgspec.Struct, kw_only=True):
    """The body of `POST /v1/batches` (OpenAI's)."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


class _Refused(Exception):
    def __init__(self, response: Response):
        self.response = response


def _multipart(content_type: str, body: bytes) -> tuple[dict[str, str], tuple[str, bytes] | None]:
    """A multipart/form-data body's text fields, and its file (name, bytes) if any, read with the
    standard library's MIME parser."""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise ValueError("not a multipart body")
    fields: dict[str, str] = {}
    upload: tuple[str, bytes] | None = None
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        filename = part.get_filename()
        if filename is not None:
            upload = (filename, data)
        elif isinstance(name, str):
            fields[name] = data.decode(errors="replace")
    return fields, upload


class BatchApi(ServicePart):
    def __init__(
        self, runtime: Callable[[], Runtime], fleet: FleetView, authenticate: Callable[[Request], str | None]
    ) -> None:
        super().__init__(runtime, fleet)
        self._authenticate = authenticate
        self._store: BatchStore | None = None

    @property
    def store(self) -> BatchStore:
        if self._store is None:
            self._store = BatchStore(self._rt.bus)
        return self._store

    def _tenant(self, request: Request) -> str:
        tenant = self._authenticate(request)
        if tenant is None:
            raise _Refused(error_response(401, "invalid or missing API key", code="invalid_api_key"))
        return tenant

    async def _body(self, request: Request, limit: int) -> bytes:
        body = bytearray()
        try:
            async for part in request.stream():
                body.extend(part)
                if len(body) > limit:
                    raise _Refused(error_response(413, f"the body exceeds {limit} bytes"))
        except ClientDisconnect:
            raise _Refused(Response(status_code=499)) from None
        return bytes(body)

    async def _guarded(self, request: Request, handler: Callable[[Request], Any]) -> Response:
        try:
            response: Response = await handler(request)
            return response
        except _Refused as refused:
            return refused.response
        except TRANSIENT_ERRORS as exc:
            # JetStream unreachable for now (a node lost, a leader being elected): try again.
            return error_response(
                503, f"the batch store is unavailable: {exc!r}", code="unavailable", retry_after_s=1
            )

    # ------------------------------------------------------------ files

    async def create_file(self, request: Request) -> Response:
        return await self._guarded(request, self._create_file)

    async def _create_file(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = await self._body(request, MAX_FILE_BYTES + 64 * 1024)
        try:
            fields, upload = _multipart(request.headers.get("content-type", ""), body)
        except ValueError:
            return error_response(400, "expected a multipart/form-data body with a file and a purpose")
        purpose = fields.get("purpose")
        if purpose != "batch":
            return error_response(
                400, f"purpose must be 'batch', not {purpose!r}", param="purpose", code="invalid_purpose"
            )
        if upload is None:
            return error_response(400, "no file in the form", param="file")
        filename, content = upload
        if not content.strip():
            return error_response(400, "the file is empty", param="file")
        if len(content) > MAX_FILE_BYTES:
            return error_response(413, f"the file exceeds {MAX_FILE_BYTES} bytes", param="file")
        record = FileRecord(
            id=new_id("file-"),
            tenant=tenant,
            bytes=len(content),
            created_at=int(time.time()),
            filename=filename or "upload.jsonl",
            purpose="batch",
        )
        await self.store.put_file(record, content)
        return JSONResponse(record.as_openai())

    async def get_file(self, request: Request) -> Response:
        return await self._guarded(request, self._get_file)

    async def _get_file(self, request: Request) -> Response:
        record = await self._own_file(request)
        return JSONResponse(record.as_openai())

    async def file_content(self, request: Request) -> Response:
        return await self._guarded(request, self._file_content)

    async def _file_content(self, request: Request) -> Response:
        record = await self._own_file(request)
        content = await self.store.content(record.id)
        if content is None:
            raise _Refused(_no_such("File", record.id))
        return Response(content, media_type="application/octet-stream")

    async def _own_file(self, request: Request) -> FileRecord:
        tenant = self._tenant(request)
        file_id = request.path_params["file_id"]
        record = await self.store.file(file_id, tenant)
        if record is None:
            raise _Refused(_no_such("File", file_id))
        return record

    # ------------------------------------------------------------ batches

    async def create_batch(self, request: Request) -> Response:
        return await self._guarded(request, self._create_batch)

    async def _create_batch(self, request: Request) -> Response:
        tenant = self._tenant(request)
        raw = await self._body(request, self._rt.config.max_body_bytes)
        try:
            asked = msgspec.json.decode(raw, type=CreateBatchBody)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error_response(400, f"invalid request body: {exc}")
        if asked.endpoint not in ENDPOINTS:
            return error_response(
                400,
                f"endpoint must be one of {', '.join(ENDPOINTS)}, not {asked.endpoint!r}",
                param="endpoint",
            )
        window = COMPLETION_WINDOWS.get(asked.completion_window)
        if window is None:
            return error_response(
                400,
                f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}",
                param="completion_window",
            )
        source = await self.store.file(asked.input_file_id, tenant)
        if source is None:
            return _no_such("File", asked.input_file_id, param="input_file_id")
        if source.purpose != "batch":
            return error_response(
                400, f"file {source.id} has purpose {source.purpose!r}, not 'batch'", param="input_file_id"
            )
        now = int(time.time())
        record = BatchRecord(
            id=new_id("batch_"),
            tenant=tenant,
            endpoint=asked.endpoint,
            input_file_id=source.id,
            completion_window=asked.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + int(window),
            metadata=asked.metadata,
        )
        await self.store.create_batch(record)
        return JSONResponse(record.as_openai())

    async def get_batch(self, request: Request) -> Response:
        return await self._guarded(request, self._get_batch)

    async def _get_batch(self, request: Request) -> Response:
        tenant = self._tenant(request)
        batch_id = request.path_params["batch_id"]
        record = await self.store.batch(batch_id, tenant)
        if record is None:
            return _no_such("Batch", batch_id)
        return JSONResponse(record.as_openai())

    async def list_batches(self, request: Request) -> Response:
        return await self._guarded(request, self._list_batches)

    async def _list_batches(self, request: Request) -> Response:
        tenant = self._tenant(request)
        raw_limit = request.query_params.get("limit", "20")
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
            return error_response(400, "limit must be between 1 and 100", param="limit")
        limit = int(raw_limit)
        records = await self.store.batches(tenant)
        after = request.query_params.get("after")
        if after is not None:
            ids = [r.id for r in records]
            records = records[ids.index(after) + 1 :] if after in ids else []
        page = records[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": [r.as_openai() for r in page],
                "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None,
                "has_more": len(records) > limit,
            }
        )

    async def cancel_batch(self, request: Request) -> Response:
        return await self._guarded(request, self._cancel_batch)

    async def _cancel_batch(self, request: Request) -> Response:
        tenant = self._tenant(request)
        batch_id = request.path_params["batch_id"]
        if await self.store.batch(batch_id, tenant) is None:
            return _no_such("Batch", batch_id)
        now = int(time.time())

        def cancel(record: BatchRecord) -> BatchRecord | None:
            if record.status not in ("validating", "in_progress"):
                return None
            return msgspec.structs.replace(record, status="cancelling", cancelling_at=now)

        record = await self.store.modify(batch_id, cancel)
        if record is None:
            return _no_such("Batch", batch_id)
        if record.status not in ACTIVE and record.status != "cancelled":
            return error_response(
                409,
                f"batch {batch_id} is {record.status}: it cannot be cancelled",
                code="batch_not_cancellable",
            )
        return JSONResponse(record.as_openai())


def _no_such(kind: str, object_id: str, *, param: str | None = None) -> JSONResponse:
    return error_response(404, f"No such {kind} object: {object_id}", param=param, code="not_found")
