"""Where the Batch API keeps what it must not lose: JetStream, which every service already
reaches, on the mesh's own replicas (``--nats-replicas``) and file storage.

- Object Store ``RMESH_FILES``: each file's bytes (uploaded input, written output and errors),
  under the file's id;
- KV ``BATCH_FILES``: each file's `FileRecord` (its tenant, size, name, purpose);
- KV ``BATCHES``: each batch's `BatchRecord`, changed only by compare-and-set (`modify`), so an
  ingress replica's cancel and the runner's progress never overwrite each other;
- KV ``BATCH_LINES``: one `LineResult` per finished line, key ``<batch_id>.<line>``, written
  with create-if-absent: a line is recorded once, and a resumed batch skips what is there;
- KV ``BATCH_SENT``: the request id each line was last submitted under, key
  ``<batch_id>.<line>``: a runner killed with lines in the mesh reads their answers back from
  the TOKENS stream when it is restarted instead of running them again.

Everything is kept 30 days (the buckets' TTL), well past the 24 h completion window.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from nats.js import api as jsapi
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    ObjectNotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from schemas.subjects import KvBucketSpec
from services.batch.records import BatchRecord, FileRecord, LineResult
from services.mesh.bus import Bus, kv_keys

RETENTION_S = 30 * 24 * 3600.0
FILES_OBJECTS = "RMESH_FILES"
FILES = KvBucketSpec(
    bucket="BATCH_FILES",
    ttl_s=RETENTION_S,
    description="Batch API files (FileRecord) by id; their bytes are objects in RMESH_FILES.",
)
BATCHES = KvBucketSpec(
    bucket="BATCHES",
    ttl_s=RETENTION_S,
    description="Batch API batches (BatchRecord) by id, changed by compare-and-set.",
)
BATCH_LINES = KvBucketSpec(
    bucket="BATCH_LINES",
    ttl_s=RETENTION_S,
    description="Each finished batch line's result (LineResult), key <batch_id>.<line>, written once.",
)
BATCH_SENT = KvBucketSpec(
    bucket="BATCH_SENT",
    ttl_s=RETENTION_S,
    description="The request id each batch line was last submitted under, key <batch_id>.<line>.",
)
CAS_ATTEMPTS = 16


class BatchStore:
    def __init__(self, bus: Bus):
        self.bus = bus
        self._objects: ObjectStore | None = None
        self._lock = asyncio.Lock()

    async def _kv(self, spec: KvBucketSpec) -> KeyValue:
        return await self.bus.key_value(spec)

    async def objects(self) -> ObjectStore:
        async with self._lock:
            if self._objects is None:
                try:
                    self._objects = await self.bus.js.object_store(FILES_OBJECTS)
                except BucketNotFoundError:
                    self._objects = await self.bus.js.create_object_store(
                        FILES_OBJECTS,
                        jsapi.ObjectStoreConfig(
                            description="Batch API files' bytes, by file id.",
                            ttl=RETENTION_S,
                            replicas=self.bus.replicas,
                        ),
                    )
            return self._objects

    # ------------------------------------------------------------ files

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        """The bytes first: a file whose record exists always has its content."""
        await (await self.objects()).put(record.id, content)
        await (await self._kv(FILES)).put(record.id, msgspec.json.encode(record))

    async def file(self, file_id: str, tenant: str | None = None) -> FileRecord | None:
        """The file, if it exists (and belongs to `tenant`, when given)."""
        if not _valid_key(file_id):
            return None
        try:
            entry = await (await self._kv(FILES)).get(file_id)
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        record = msgspec.json.decode(entry.value, type=FileRecord)
        return record if tenant is None or record.tenant == tenant else None

    async def content(self, file_id: str) -> bytes | None:
        try:
            result = await (await self.objects()).get(file_id)
        except ObjectNotFoundError:
            return None
        return result.data

    # ------------------------------------------------------------ batches

    async def create_batch(self, record: BatchRecord) -> None:
        await (await self._kv(BATCHES)).create(record.id, msgspec.json.encode(record))

    async def batch(self, batch_id: str, tenant: str | None = None) -> BatchRecord | None:
        found = await self._batch_entry(batch_id)
        if found is None:
            return None
        record = found[0]
        return record if tenant is None or record.tenant == tenant else None

    async def _batch_entry(self, batch_id: str) -> tuple[BatchRecord, int] | None:
        if not _valid_key(batch_id):
            return None
        try:
            entry = await (await self._kv(BATCHES)).get(batch_id)
        except KeyNotFoundError:
            return None
        if entry.value is None or entry.revision is None:
            return None
        return msgspec.json.decode(entry.value, type=BatchRecord), entry.revision

    async def batches(self, tenant: str | None = None) -> list[BatchRecord]:
        """Every batch (of `tenant`), newest first."""
        await self._kv(BATCHES)
        keys = await kv_keys(self.bus.js, BATCHES.bucket)
        found = await asyncio.gather(*(self._batch_entry(key) for key in keys))
        records = [f[0] for f in found if f is not None and (tenant is None or f[0].tenant == tenant)]
        records.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        return records

    async def modify(
        self, batch_id: str, change: Callable[[BatchRecord], BatchRecord | None]
    ) -> BatchRecord | None:
        """Apply `change` to the batch as stored, by compare-and-set (read again on a conflict).
        `change` returns the new record, or None to leave it; the record as it then stands is
        returned (None: no such batch)."""
        kv = await self._kv(BATCHES)
        for _ in range(CAS_ATTEMPTS):
            found = await self._batch_entry(batch_id)
            if found is None:
                return None
            record, revision = found
            changed = change(msgspec.structs.replace(record))
            if changed is None:
                return record
            try:
                await kv.update(batch_id, msgspec.json.encode(changed), last=revision)
            except KeyWrongLastSequenceError:
                continue
            return changed
        raise RuntimeError(f"batch {batch_id}: {CAS_ATTEMPTS} conflicting updates in a row")

    # ------------------------------------------------------------ lines

    async def record_line(self, batch_id: str, result: LineResult) -> bool:
        """Record a line's result once; False when it was recorded already."""
        try:
            await (await self._kv(BATCH_LINES)).create(
                f"{batch_id}.{result.line}", msgspec.json.encode(result)
            )
        except KeyWrongLastSequenceError:
            return False
        return True

    async def lines(self, batch_id: str) -> dict[int, LineResult]:
        """The batch's finished lines, by line number."""
        found = await self._by_line(BATCH_LINES, batch_id)
        return {line: msgspec.json.decode(value, type=LineResult) for line, value in found.items()}

    async def mark_sent(self, batch_id: str, line: int, request_id: str) -> None:
        """The request id a line is being submitted under, before it is."""
        await (await self._kv(BATCH_SENT)).put(f"{batch_id}.{line}", request_id.encode())

    async def sent(self, batch_id: str) -> dict[int, str]:
        """Each line's request id as last submitted (finished lines among them)."""
        return {line: value.decode() for line, value in (await self._by_line(BATCH_SENT, batch_id)).items()}

    async def _by_line(self, spec: KvBucketSpec, batch_id: str) -> dict[int, bytes]:
        """A bucket's values for one batch's lines, by line number."""
        kv = await self._kv(spec)
        prefix = f"{batch_id}."
        keys = await kv_keys(self.bus.js, spec.bucket, prefix)
        values: dict[int, bytes] = {}

        async def read(key: str) -> None:
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                return
            line = key.removeprefix(prefix)
            if entry.value and line.isdigit():
                values[int(line)] = entry.value

        for start in range(0, len(keys), 256):
            await asyncio.gather(*(read(key) for key in keys[start : start + 256]))
        return values


def _valid_key(key: str) -> bool:
    """Ids are KV keys: anything else (a client's guess with odd characters, non-ASCII letters
    and digits too, which NATS refuses) is simply unknown."""
    return 0 < len(key) <= 128 and all((c.isascii() and c.isalnum()) or c in "-_" for c in key)
