"""A worker's prefix-cache dump in chunks: how a worker cuts it and how a reader puts it together.

A dump of a large cache does not fit in one NATS message (1 MiB by default: about 50,000 block
hashes in JSON), so the reader asks for chunks of at most `max_blocks` blocks (`KvDumpRequest`)
and the worker answers with `chunks` KvDump messages on the reply subject, all as of the same
batch `seq`. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from schemas.events import KvDump, KvDumpRequest

# The JSON of one block hash in a dump: at most 19 digits (63 bits), a sign and a comma.
BYTES_PER_HASH = 21
# Room for the rest of a chunk (ids, model, headers).
ENVELOPE_BYTES = 4096

_request_decoder = msgspec.json.Decoder(KvDumpRequest)
_encoder = msgspec.json.Encoder()


class DumpError(ValueError):
    """Chunks that do not make one dump."""


def max_blocks_for(max_payload: int) -> int:
    """The most block hashes one message of `max_payload` bytes can carry."""
    return max(1, (max_payload - ENVELOPE_BYTES) // BYTES_PER_HASH)


def encode_request(max_blocks: int) -> bytes:
    return _encoder.encode(KvDumpRequest(max_blocks=max_blocks))


def decode_request(body: bytes) -> KvDumpRequest | None:
    """A dump request's body; None for an empty body (an older reader: one message).

    Raises msgspec.DecodeError or ValidationError for a body that is neither."""
    if not body.strip():
        return None
    return _request_decoder.decode(body)


def split(dump: KvDump, max_blocks: int) -> list[KvDump]:
    """`dump` as chunks of at most `max_blocks` blocks (one chunk, possibly empty, at least)."""
    hashes = dump.block_hashes
    count = max(1, -(-len(hashes) // max_blocks))
    if count == 1:
        return [dump]
    return [
        msgspec.structs.replace(
            dump,
            event_id=f"{dump.event_id}-{i}",
            block_hashes=hashes[i * max_blocks : (i + 1) * max_blocks],
            chunk=i,
            chunks=count,
        )
        for i in range(count)
    ]


class Assembler:
    """Collects a dump's chunks (in any order, duplicates ignored) until it is whole."""

    def __init__(self) -> None:
        self._first: KvDump | None = None
        self._parts: dict[int, list[int]] = {}

    @property
    def complete(self) -> bool:
        return self._first is not None and len(self._parts) == self._first.chunks

    def add(self, chunk: KvDump) -> None:
        """Raises DumpError when the chunk does not belong with the ones before it."""
        first = self._first
        if first is None:
            if chunk.chunk >= chunk.chunks:
                raise DumpError(f"chunk {chunk.chunk} of {chunk.chunks}")
            self._first = chunk
        elif (chunk.worker_id, chunk.model, chunk.block_size, chunk.seq, chunk.started_at, chunk.chunks) != (
            first.worker_id,
            first.model,
            first.block_size,
            first.seq,
            first.started_at,
            first.chunks,
        ):
            raise DumpError(
                f"chunk {chunk.chunk} of {chunk.chunks} (seq {chunk.seq}) does not belong with chunk "
                f"{first.chunk} of {first.chunks} (seq {first.seq})"
            )
        elif chunk.chunk >= first.chunks:
            raise DumpError(f"chunk {chunk.chunk} of {first.chunks}")
        self._parts.setdefault(chunk.chunk, chunk.block_hashes)

    def dump(self) -> KvDump:
        """The whole dump, once `complete`."""
        if self._first is None or not self.complete:
            raise DumpError("the dump is not complete")
        hashes: list[int] = []
        for i in range(self._first.chunks):
            hashes.extend(self._parts[i])
        return msgspec.structs.replace(self._first, block_hashes=hashes, chunk=0, chunks=1)


def assemble(chunks: Sequence[KvDump]) -> KvDump:
    assembler = Assembler()
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.dump()
