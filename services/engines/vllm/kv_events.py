"""vLLM's KV cache events, read over ZMQ and translated to the project's chained block hashes.

What vLLM publishes (`vllm/distributed/kv_events.py`, enabled by `KVEventsConfig(
enable_kv_cache_events=True, publisher="zmq", endpoint=..., replay_endpoint=..., topic=...)`):
after each engine step, a `KVEventBatch` (ts, events[, data_parallel_rank]) msgpack-encoded and
sent on a PUB socket as three frames: topic, an 8-byte big-endian sequence number, the payload.
A ROUTER socket on the replay endpoint resends buffered batches from a given sequence number, then
an end marker (sequence -1, empty payload). Events are tagged structs:
- `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, ...)`: full blocks that became reusable, `token_ids` being
  the concatenated tokens of those blocks; the parent is None when the first block starts the
  sequence.
- `BlockRemoved(block_hashes, medium, group_idx)`: evicted blocks.
- `AllBlocksCleared()`: the prefix cache was reset.
Releases have encoded these structs both as arrays (`array_like=True`: the tag first, then the
fields in order) and as maps (tag under "type"); `decode_batch` reads both. Block hashes are
ints or bytes depending on `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`; both are used as opaque keys.

Why translate: vLLM's block hashes are not the project's. vLLM hashes (parent hash, tokens, extra
keys such as LoRA, multimodal inputs and cache salt) with its own function and seed; the router
and the KV index key everything by `services/mesh/block_hash.py`'s chain (seeded by the model,
blake2b). With the same block size a vLLM block and a project block cover the same tokens, so the
engine keeps the correspondence per request: before a request is submitted, `register` records,
for each of its full blocks, (parent project hash, block tokens) -> project hash, straight from
`InferenceRequest.prompt_tokens` and `InferenceRequest.block_hashes`; when the request finishes,
its generated tokens are registered too (their hashes from `chain_block_hashes`). A `BlockStored`
block is then mapped through its parent (vLLM hash -> project hash, learnt from earlier events)
and its tokens.

Limits, by design or for now:
- A stored block whose tokens were never registered here (its request came from elsewhere, or
  the table dropped it) is held for a while, then dropped: the project never hears of it. Under-
  reporting only costs routing quality, never correctness.
- Only full-attention blocks on the GPU are reported: events for another KV cache group
  (`group_idx` > 0: sliding-window or Mamba state of hybrid models), another medium (CPU
  offload) or a LoRA adapter are ignored.
- If batches are lost and the replay endpoint cannot resend them, the translator emits `cleared`
  and starts over (again under-reporting until blocks are stored anew).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from services.engines.base import KvBlockEvent
from services.mesh.block_hash import chain_block_hashes

log = logging.getLogger(__name__)

VllmHash = int | bytes


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[VllmHash, ...]
    parent: VllmHash | None
    token_ids: tuple[int, ...]
    block_size: int
    group_idx: int | None = None
    medium: str | None = None
    lora: bool = False


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[VllmHash, ...]
    group_idx: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


RawEvent = Stored | Removed | Cleared


# ---------------------------------------------------------------- decoding vLLM's msgpack


def _hashes(value: Any) -> tuple[VllmHash, ...]:
    return tuple(h if isinstance(h, int | bytes) else bytes(h) for h in (value or ()))


def _field(fields: Sequence[Any] | dict[str, Any], index: int, name: str) -> Any:
    if isinstance(fields, dict):
        return fields.get(name)
    return fields[index] if index < len(fields) else None


def decode_event(raw: Any) -> RawEvent | None:
    """One tagged vLLM KV event (array or map form); None for a kind this engine does not use."""
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list | tuple) and raw:
        tag, fields = raw[0], list(raw[1:])
    else:
        return None
    if tag == "BlockStored":
        return Stored(
            block_hashes=_hashes(_field(fields, 0, "block_hashes")),
            parent=_field(fields, 1, "parent_block_hash"),
            token_ids=tuple(_field(fields, 2, "token_ids") or ()),
            block_size=int(_field(fields, 3, "block_size") or 0),
            lora=_field(fields, 4, "lora_id") is not None or _field(fields, 6, "lora_name") is not None,
            medium=_field(fields, 5, "medium"),
            group_idx=_field(fields, 8, "group_idx"),
        )
    if tag == "BlockRemoved":
        return Removed(
            block_hashes=_hashes(_field(fields, 0, "block_hashes")),
            medium=_field(fields, 1, "medium"),
            group_idx=_field(fields, 2, "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> list[RawEvent]:
    """A `KVEventBatch` payload -> its events, in order. Raises msgspec.DecodeError or ValueError
    on a payload that is not one."""
    batch = msgspec.msgpack.decode(payload)
    if isinstance(batch, dict):
        events = batch.get("events")
    elif isinstance(batch, list | tuple) and len(batch) >= 2:
        events = batch[1]
    else:
        raise ValueError(f"not a KV event batch: {type(batch).__name__}")
    if not isinstance(events, list | tuple):
        raise ValueError("KV event batch without an event list")
    decoded = (decode_event(e) for e in events)
    return [e for e in decoded if e is not None]


# ---------------------------------------------------------------- translation to project hashes

_PENDING_TTL_S = 60.0


@dataclass(slots=True)
class _Pending:
    parent: VllmHash | None
    tokens: tuple[int, ...]
    since: float


class KvEventTranslator:
    """vLLM KV events -> `KvBlockEvent`s keyed by the project's chained block hashes."""

    def __init__(self, block_size: int, model: str, *, max_entries: int = 1 << 20):
        self.block_size = block_size
        self.model = model
        self.max_entries = max_entries
        # (parent project hash or None for the first block, block tokens) -> project hash
        self._by_content: OrderedDict[tuple[int | None, tuple[int, ...]], int] = OrderedDict()
        # vLLM hash -> project hash, for every block seen (kept after eviction to resolve parents)
        self._known: OrderedDict[VllmHash, int] = OrderedDict()
        # vLLM hash -> project hash, for blocks now in the prefix cache
        self._cached: dict[VllmHash, int] = {}
        self._refs: dict[int, int] = {}  # project hash -> cached vLLM blocks mapped to it
        self._pending: OrderedDict[VllmHash, _Pending] = OrderedDict()
        self._out: list[KvBlockEvent] = []
        self._dirty = False
        self._warned: set[str] = set()

    # ------------------------------------------------------------ correspondence

    def register(self, tokens: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Record the project hash of each full block of `tokens` (block i covers
        tokens[i*bs:(i+1)*bs] and its hash chains from block i-1's)."""
        bs = self.block_size
        parent: int | None = None
        for i, block_hash in enumerate(block_hashes):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            if len(block) < bs:
                break
            key = (parent, block)
            if key not in self._by_content:
                self._by_content[key] = block_hash
                self._dirty = True
            else:
                self._by_content.move_to_end(key)
            parent = block_hash
        while len(self._by_content) > self.max_entries:
            self._by_content.popitem(last=False)

    def register_sequence(self, tokens: Sequence[int]) -> None:
        """Register every full block of a whole sequence (prompt + generated tokens)."""
        self.register(tokens, chain_block_hashes(tokens, self.block_size, model=self.model))

    # ------------------------------------------------------------ events in

    def feed(self, events: Sequence[RawEvent]) -> None:
        for event in events:
            if isinstance(event, Stored):
                self._on_stored(event)
            elif isinstance(event, Removed):
                self._on_removed(event)
            else:
                self._on_cleared()

    def reset(self) -> None:
        """Events were lost: drop what this side believes is cached and start over."""
        self._on_cleared()

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def _on_stored(self, event: Stored) -> None:
        if event.group_idx not in (None, 0) or event.medium not in (None, "GPU") or event.lora:
            return
        bs = self.block_size
        if event.block_size != bs or len(event.token_ids) != bs * len(event.block_hashes):
            self._warn_once(
                "shape",
                "vLLM KV event with block size %s for %s hashes and %s tokens; the engine uses %s: "
                "such blocks are not reported",
                event.block_size,
                len(event.block_hashes),
                len(event.token_ids),
                bs,
            )
            return
        parent = event.parent
        now = time.monotonic()
        for i, vllm_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * bs : (i + 1) * bs]
            if not self._resolve(vllm_hash, parent, tokens):
                self._pending[vllm_hash] = _Pending(parent, tokens, now)
            parent = vllm_hash
        while len(self._pending) > self.max_entries:
            self._pending.popitem(last=False)

    def _resolve(self, vllm_hash: VllmHash, parent: VllmHash | None, tokens: tuple[int, ...]) -> bool:
        if parent is None:
            project_parent: int | None = None
        else:
            project_parent = self._known.get(parent)
            if project_parent is None:
                return False
        project_hash = self._by_content.get((project_parent, tokens))
        if project_hash is None:
            return False
        self._known[vllm_hash] = project_hash
        self._known.move_to_end(vllm_hash)
        while len(self._known) > self.max_entries:
            self._known.popitem(last=False)
        if self._pending:
            self._dirty = True  # a block held for want of this parent can now be resolved
        if vllm_hash not in self._cached:
            self._cached[vllm_hash] = project_hash
            refs = self._refs.get(project_hash, 0)
            self._refs[project_hash] = refs + 1
            if refs == 0:
                self._emit("stored", project_hash)
        return True

    def _on_removed(self, event: Removed) -> None:
        if event.group_idx not in (None, 0) or event.medium not in (None, "GPU"):
            return
        for vllm_hash in event.block_hashes:
            self._pending.pop(vllm_hash, None)
            project_hash = self._cached.pop(vllm_hash, None)
            if project_hash is None:
                continue
            refs = self._refs.get(project_hash, 0) - 1
            if refs > 0:
                self._refs[project_hash] = refs
            else:
                self._refs.pop(project_hash, None)
                self._emit("removed", project_hash)

    def _on_cleared(self) -> None:
        self._cached.clear()
        self._refs.clear()
        self._pending.clear()
        self._out.append(KvBlockEvent("cleared"))

    def _emit(self, kind: Literal["stored", "removed"], project_hash: int) -> None:
        last = self._out[-1] if self._out else None
        if last is not None and last.kind == kind:
            self._out[-1] = KvBlockEvent(kind, (*last.block_hashes, project_hash))
        else:
            self._out.append(KvBlockEvent(kind, (project_hash,)))

    # ------------------------------------------------------------ events out

    def _retry_pending(self) -> None:
        now = time.monotonic()
        progress = self._dirty
        while progress and self._pending:
            progress = False
            for vllm_hash, pending in list(self._pending.items()):
                if self._resolve(vllm_hash, pending.parent, pending.tokens):
                    del self._pending[vllm_hash]
                    progress = True
        self._dirty = False  # the resolutions above set it again; the loop already ran until none was left
        while self._pending:
            vllm_hash, pending = next(iter(self._pending.items()))
            if now - pending.since < _PENDING_TTL_S:
                break
            del self._pending[vllm_hash]

    def drain(self) -> list[KvBlockEvent]:
        self._retry_pending()
        out, self._out = self._out, []
        return out

    def cached(self) -> list[int]:
        return list(self._refs)

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (by project hash) the prefix cache holds."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._refs:
                break
            count += 1
        return count

    @property
    def cached_count(self) -> int:
        return len(self._refs)


# ---------------------------------------------------------------- the ZMQ subscriber

_END_SEQ = -1
_REPLAY_TIMEOUT_S = 2.0


class ZmqKvEventSubscriber:
    """Reads vLLM's KV event batches from its PUB socket, in sequence order.

    Connects before the engine binds (ZMQ allows it), so no batch is published before the
    subscription exists. On a gap in sequence numbers it asks the replay endpoint for the missing
    batches; if they cannot be had, it calls `on_gap` and goes on from the batch in hand.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        on_events: Callable[[list[RawEvent]], None],
        on_gap: Callable[[], None],
    ):
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.on_events = on_events
        self.on_gap = on_gap
        self.last_seq: int | None = None
        self._ctx: Any = None
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side; the publisher bounds its queue
        self._sub.setsockopt(zmq.RECONNECT_IVL, 10)  # join soon after vLLM binds (ms)
        self._sub.connect(self.endpoint)
        self._task = asyncio.create_task(self._run(), name="vllm-kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _run(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            try:
                if len(frames) != 3:
                    raise ValueError(f"expected 3 frames, got {len(frames)}")
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big")
                expected = 0 if self.last_seq is None else self.last_seq + 1
                if seq < expected:
                    continue  # already applied (delivered again after a replay)
                if seq > expected:
                    await self._replay(expected, seq)
                self.on_events(decode_batch(payload))
                self.last_seq = seq
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("unreadable vLLM KV event batch; resynchronising", exc_info=True)
                self.on_gap()

    async def _replay(self, start: int, upto: int) -> None:
        """Apply batches start..upto-1 from the replay endpoint, or report a gap."""
        got = await self._fetch_replay(start, upto) if self.replay_endpoint else None
        if got is None:
            log.warning("vLLM KV event batches %d..%d were lost; resynchronising", start, upto - 1)
            self.on_gap()
            return
        for seq, payload in got:
            self.on_events(decode_batch(payload))
            self.last_seq = seq

    async def _fetch_replay(self, start: int, upto: int) -> list[tuple[int, bytes]] | None:
        import zmq

        # A DEALER with an empty delimiter frame speaks to vLLM's ROUTER like a REQ socket, but can
        # take the several replies it sends for one request.
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), timeout=_REPLAY_TIMEOUT_S)
                if len(frames) != 3:
                    return None
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == _END_SEQ or not frames[2]:
                    break
                if start + len(got) == seq and seq < upto:
                    got.append((seq, frames[2]))
        except TimeoutError:
            return None
        finally:
            with contextlib.suppress(Exception):
                sock.close(linger=0)
        return got if len(got) == upto - start else None
