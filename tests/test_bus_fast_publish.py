"""Fast publishes (token chunks) on a replicated stream: stored before a worker reports its work done.

A chunk is published without waiting for its ack; a chunk the stream did not store is published
again in the background. A worker that acks its work while such a chunk is still only in its own
memory loses it if it is killed then (a chaos drill's stalled stream). `Bus.flush_fast` is what
the worker calls before that ack; here, on a real 3-node cluster, it must leave every chunk of
the subject stored, without waiting for the background sweep.
"""

from __future__ import annotations

import time

import pytest

from schemas.events import TokenChunk
from services.mesh.bus import Bus
from services.mesh.embedded_nats import EmbeddedNats

pytestmark = pytest.mark.timeout(120)


def chunk(request_id: str, seq: int) -> TokenChunk:
    return TokenChunk(
        event_id=f"{request_id}-{seq}",
        occurred_at=time.time(),
        request_id=request_id,
        seq=seq,
        token_ids=[seq],
        text=f"t{seq}",
    )


async def test_chunks_the_stream_did_not_store_are_stored_once_flush_fast_returns(
    nats_cluster: EmbeddedNats,
) -> None:
    assert nats_cluster.auth is not None
    bus = await Bus.connect(nats_cluster.url, "tests", credentials=nats_cluster.auth.service, replicas=3)
    try:
        # No stream captures the subject yet: these publishes are not stored (as when a
        # stream's leader is lost), and nothing is waited for.
        for seq in range(3):
            await bus.publish_fast("flushcheck.r1", chunk("r1", seq))
        await bus.js.add_stream(name="FLUSHCHECK", subjects=["flushcheck.>"], num_replicas=3)

        await bus.flush_fast("flushcheck.r1")

        stored = await bus.js.stream_info("FLUSHCHECK", subjects_filter="flushcheck.>")
        assert stored.state.subjects == {"flushcheck.r1": 3}  # each chunk, once
        await bus.flush_fast("flushcheck.r1")  # again: nothing is stored twice
        again = await bus.js.stream_info("FLUSHCHECK", subjects_filter="flushcheck.>")
        assert again.state.subjects == {"flushcheck.r1": 3}
    finally:
        await bus.close()
