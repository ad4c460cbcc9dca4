"""Where a request taken from a lost or drained worker picks up its stream. Pure: no I/O.

The client has received the chunks of its token stream numbered without a gap from 0 (the
TOKENS stream holds them, as the client's reader does). The request is placed again with its
prompt followed by the tokens already delivered, `max_tokens` reduced by their number and its
next chunk numbered where the client's stream stopped (`Resumption`), so the client sees one
stream: no gap, no duplicate, the same length. Past the migration limit the stream fails with a
clear error instead, and so does a stream that cannot be continued faithfully: a constrained
output (a forced tool call, JSON) part-way written, as the grammar's state at the cut does not
travel with the tokens, and one longer than `max_migrated_output_tokens` where that is set.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from schemas.events import InferenceRequest, Resumption, StreamFailed, StreamFinished, TokenChunk, Usage
from services.mesh.block_hash import chain_block_hashes
from services.mesh.resumption import first_seq, output_before, prompt_proper

TokenEvent = TokenChunk | StreamFinished | StreamFailed


@dataclass(frozen=True, slots=True)
class Delivered:
    """What the client has: chunks up to `next_seq` (exclusive), their tokens, and whether the
    stream already ended (a final event is stored)."""

    next_seq: int
    token_ids: tuple[int, ...]
    final: bool


@dataclass(frozen=True, slots=True)
class AlreadyEnded:
    """The worker ended the stream before it went: nothing to do but drop its work."""


@dataclass(frozen=True, slots=True)
class FinishNow:
    """Every token was delivered but not the end of the stream: end it at `seq`."""

    seq: int
    usage: Usage


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The request was re-placed `migration - 1` times already, the limit: fail it at `seq`."""

    seq: int
    migration: int
    message: str


@dataclass(frozen=True, slots=True)
class Resume:
    """Place `request` (prompt + delivered tokens, what is left to generate) again."""

    request: InferenceRequest
    migration: int
    delivered_tokens: int
    remaining_tokens: int


Plan = AlreadyEnded | FinishNow | GiveUp | Resume


def delivered(request: InferenceRequest, events: Iterable[TokenEvent]) -> Delivered:
    """What the client has received of `request`'s stream, from the stream's stored events.

    Up to the request's own resume point (if it was placed again before) the tokens are the
    ones its prompt carries; past it, the stored chunks without a gap.
    """
    base_seq = first_seq(request)
    offset = output_before(request)
    tokens = list(request.prompt_tokens[len(request.prompt_tokens) - offset :]) if offset else []
    by_seq: dict[int, TokenEvent] = {}
    final = False
    for event in events:
        if event.seq < base_seq:
            continue
        by_seq.setdefault(event.seq, event)
        if not isinstance(event, TokenChunk):
            final = True
    seq = base_seq
    while True:
        chunk = by_seq.get(seq)
        if not isinstance(chunk, TokenChunk):
            break
        tokens.extend(chunk.token_ids)
        seq += 1
    return Delivered(next_seq=seq, token_ids=tuple(tokens), final=final)


def plan(
    request: InferenceRequest,
    got: Delivered,
    *,
    max_migrations: int,
    from_worker: str,
    reason: str,
    max_output_tokens: int | None = None,
) -> Plan:
    """What to do with `request`, whose worker `from_worker` is gone (`reason`)."""
    if got.final:
        return AlreadyEnded()
    migration = (request.resumption.migration if request.resumption is not None else 0) + 1
    prompt = prompt_proper(request)
    total = request.max_tokens + output_before(request)
    remaining = total - len(got.token_ids)
    if remaining <= 0:
        return FinishNow(
            seq=got.next_seq,
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(got.token_ids)),
        )
    lost = f"worker {from_worker} {reason} while serving request {request.request_id}"
    if request.constraint is not None and got.token_ids:
        return GiveUp(
            seq=got.next_seq,
            migration=migration,
            message=f"{lost}, a {request.constraint.kind} output {len(got.token_ids)} tokens in: a "
            "constrained output cannot be continued on another worker (the grammar's state does "
            "not travel with the tokens); send the request again",
        )
    if max_output_tokens is not None and len(got.token_ids) > max_output_tokens:
        return GiveUp(
            seq=got.next_seq,
            migration=migration,
            message=f"{lost}, {len(got.token_ids)} tokens in: past max_migrated_output_tokens "
            f"({max_output_tokens}) the stream is not moved; send the request again",
        )
    if migration > max_migrations:
        return GiveUp(
            seq=got.next_seq,
            migration=migration,
            message=f"{lost}, "
            f"which was already moved {migration - 1} time(s): the limit is {max_migrations} "
            f"migration(s) per request; {len(got.token_ids)} of {total} tokens were delivered",
        )
    return Resume(
        request=resumed_request(request, prompt, got),
        migration=migration,
        delivered_tokens=len(got.token_ids),
        remaining_tokens=remaining,
    )


def resumed_request(request: InferenceRequest, prompt: Sequence[int], got: Delivered) -> InferenceRequest:
    """`request` continued: its prompt then the delivered tokens, hashed in blocks as ingress
    hashes a prompt, with what is left to generate and its next chunk's number."""
    tokens = [*prompt, *got.token_ids]
    migration = (request.resumption.migration if request.resumption is not None else 0) + 1
    return msgspec.structs.replace(
        request,
        prompt_tokens=tokens,
        block_hashes=chain_block_hashes(
            tokens, request.block_size, model=request.model, adapter=request.adapter
        ),
        max_tokens=request.max_tokens + output_before(request) - len(got.token_ids),
        resumption=Resumption(migration=migration, next_seq=got.next_seq, output_tokens=len(got.token_ids)),
    )
