"""The vLLM engine: `base.Engine` over vLLM's v1 `AsyncLLM`, for real models on CUDA GPUs.

One module because it is one class over one AsyncLLM: the three roles share its table of
sequences and their output streams. What stands apart is already apart: vLLM's import (loader.py), its KV
events (kv_events.py) and GPU-time accounting (accounting.py).

One AsyncLLM per engine, built with `AsyncLLM.from_engine_args(AsyncEngineArgs(...))`: prefix
caching on, the mesh's block size (so a vLLM block and a project block cover the same tokens),
stats on (the engine reads vLLM's per-request timestamps and scheduler stats), KV cache events
published on a private ZMQ socket. Requests go in as token ids (a `TokensPrompt` dict) with
`SamplingParams(max_tokens, temperature, output_kind=DELTA)`; every streamed `RequestOutput`
carries the new tokens since the previous one.

Scheduling order: vLLM's `scheduling_policy="priority"`, each request submitted with its service
class's rank as its `priority` (services/engines/scheduling.py: an interactive request, 0, before
a Batch API line, 1; first come first served within a class). vLLM's scheduler then takes its
waiting requests by (priority, arrival) and, short of KV blocks, preempts the running request of
the least urgent class that arrived last, as the sim engine does.

Roles (`role=`):
- "aggregated": prefill and decode here, no KV connector. `prefill()` starts the generation and
  returns at the first token; `decode()` goes on reading the same stream.
- "prefill": the prefill worker of a disaggregated pair. `prefill()` asks vLLM for one token with
  `kv_transfer_params={"do_remote_decode": True, ...}`: vLLM's KV connector (NixlConnector by
  default) keeps the prompt's blocks for the decode worker to pull and returns, on the final
  output, the parameters that locate them (engine id, block ids, host, port, ...). `export_kv`
  returns those parameters as JSON bytes: the host carries them through the Object Store to the
  decode worker (`KvHandle` has no field for them), so the KV itself never touches NATS.
- "decode": the decode worker of a disaggregated pair. `import_kv` submits the request with the
  received parameters; vLLM pulls the prompt's KV from the prefill worker, recomputes the last
  prompt token and samples a first token again. That first token stands for the one the prefill
  worker already streamed, so it is dropped; with temperature > 0 both sides sample with the same
  per-request seed, so they draw the same token unless their logits differ. A decode engine also
  serves aggregated work (prefill() then decode()), as the decode service sends it both.
  Both disaggregated roles configure `KVTransferConfig(kv_connector, kv_role="kv_both")`. With
  NIXL, each engine on a host needs its own `VLLM_NIXL_SIDE_CHANNEL_PORT`
  (`nixl_side_channel_port=`), and the prefill worker frees unread blocks after its lease
  (`kv_lease_duration`, 30 s by default in current vLLM).

Prefix-cache events: see `kv_events.py` (vLLM's hashes are mapped to the project's chained
hashes per request). GPU-seconds and load: see `accounting.py` (vLLM reports no per-request GPU
time; it is shared out by processor sharing between the requests running at each moment).

Tracing: the current W3C trace context (the host's prefill/decode span) is injected into a dict
and passed as `trace_headers`; vLLM exports its own `llm_request` span under it when it is given
an OTLP endpoint (`otlp_traces_endpoint` in `engine_kwargs`).

Text: `detokenize` returns the text vLLM's incremental detokenizer produced for the tokens just
streamed (right across multi-byte characters and leading spaces) and decodes with the model's
tokenizer otherwise.

Start-up: `start()` builds the AsyncLLM on the event loop thread, as vLLM's own server does; it
blocks the loop while the model loads (the worker serves nothing before then anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from opentelemetry import propagate

from schemas.events import InferenceRequest, KvHandle
from services.engines.base import (
    DecodeStep,
    EngineError,
    EngineInfo,
    EngineSnapshot,
    KvBlockEvent,
    PrefillResult,
    check_request,
)
from services.engines.scheduling import scheduling_rank
from services.engines.vllm.accounting import (
    SchedulerView,
    SequenceLoad,
    ShareClock,
    Throughput,
    batch_load,
)
from services.engines.vllm.kv_events import KvEventTranslator, ZmqKvEventSubscriber
from services.engines.vllm.loader import VllmApi, load_vllm

if TYPE_CHECKING:
    from services.mesh.config import MeshConfig

log = logging.getLogger(__name__)

Role = Literal["aggregated", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("aggregated", "prefill", "decode")

TRANSFER_FORMAT = "ripplemesh.vllm.kv-transfer.v1"
# What the prefill side asks of the connector (vLLM's P/D proxy sends the same keys).
REMOTE_DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# What NixlConnector's prefill side returns and its decode side needs.
NIXL_REQUIRED = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
KV_EVENTS_TOPIC = "rmesh-kv"
# Adapters vLLM holds on the GPU at once (its `max_loras`; each costs GPU memory for its slots):
# at most this many, fewer when fewer are configured. engine_kwargs may set it.
MAX_LORAS_ON_GPU = 4
_END = object()  # the generation stream ended
_KEEP_GPU_SECONDS = 10_000
_SNAPSHOT_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineSnapshot))


class _Delta(NamedTuple):
    tokens: list[int]
    finish: str | None  # "stop" or "length" on the last output
    text: str


@dataclass(eq=False)
class _Sequence:
    request: InferenceRequest
    # local: generated here end to end; remote_decode: prefill for another worker;
    # imported: KV pulled from another worker, decoded here
    kind: Literal["local", "remote_decode", "imported"]
    submitted_at: float
    outputs: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    pump: asyncio.Task[None] | None = None
    metrics: Any = None  # vLLM's RequestStateStats for the request, updated in place
    first_out_at: float | None = None
    last_out_at: float | None = None
    ended_at: float | None = None
    engine_tokens: list[int] = field(default_factory=list)  # every token vLLM produced here
    carry: list[int] = field(default_factory=list)  # produced but not yet handed to decode()
    finished: bool = False
    finish_reason: str | None = None
    cached_tokens: int = 0
    failure: EngineError | None = None  # why vLLM ended it, when it did not finish normally
    kv_transfer_params: dict[str, Any] | None = None
    regenerated_first: int | None = None


class VllmEngine:
    """`base.Engine` on vLLM. Needs the `vllm` extra and a CUDA GPU; constructing it without vLLM
    raises ImportError naming the extra."""

    def __init__(
        self,
        *,
        model: str,
        model_path: str | None = None,
        gpu_type: str = "H100",
        block_size: int = 16,
        max_context_tokens: int | None = None,
        role: Role = "aggregated",
        tensor_parallel: int = 1,
        gpu_memory_utilization: float = 0.9,
        kv_connector: str = "NixlConnector",
        kv_connector_extra_config: Mapping[str, Any] | None = None,
        nixl_side_channel_port: int | None = None,
        ignore_eos: bool = False,
        engine_kwargs: Mapping[str, Any] | None = None,
        adapters: Mapping[str, str] | None = None,
        adapter_load_s: float = 2.0,
    ):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self._api: VllmApi = load_vllm()
        self.model_path = model_path or model
        self.role: Role = role
        self.max_context_tokens = max_context_tokens
        self.tensor_parallel = tensor_parallel
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_connector = kv_connector
        self.kv_connector_extra_config = dict(kv_connector_extra_config or {})
        self.nixl_side_channel_port = nixl_side_channel_port
        self.ignore_eos = ignore_eos
        self.engine_kwargs = dict(engine_kwargs or {})
        # LoRA adapters (name -> local PEFT directory or hub id): vLLM loads one at its first
        # request (LoRARequest) and keeps up to `max_loras` on the GPU.
        self.adapters = dict(adapters or {})
        self._lora_ids = lora_ids(self.adapters)
        self._loras_used: OrderedDict[str, None] = OrderedDict()
        # kv_blocks_total is known once vLLM has profiled the GPU (start()).
        self.info = EngineInfo(
            "vllm",
            model,
            gpu_type,
            block_size,
            0,
            adapters=tuple(self.adapters),
            adapter_load_s=adapter_load_s if self.adapters else 0.0,
        )
        self.max_model_len = max_context_tokens or 0
        self._llm: Any = None
        self._tokenizer: Any = None
        self._vocab_size = 0
        self._kv_bytes_per_token = 0
        self._seqs: dict[str, _Sequence] = {}
        self._gpu_seconds: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._background: set[asyncio.Task[Any]] = set()
        now = time.monotonic()
        self._share = ShareClock(now)
        self._sched = SchedulerView(self._share)
        self._throughput = Throughput()
        self._own_running = 0  # requests submitted and not finished or released
        self._kv = KvEventTranslator(block_size, model)
        self._kv_sub: ZmqKvEventSubscriber | None = None
        self._ipc_dir: str | None = None
        self._pending_text: tuple[tuple[int, ...], str] | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._llm is not None:
            return
        self._ipc_dir = tempfile.mkdtemp(prefix="rmesh-vllm-")
        events_endpoint = f"ipc://{self._ipc_dir}/kv-events"
        replay_endpoint = f"ipc://{self._ipc_dir}/kv-replay"
        self._kv_sub = ZmqKvEventSubscriber(
            events_endpoint, replay_endpoint, KV_EVENTS_TOPIC, self._kv.feed, self._kv.reset
        )
        await self._kv_sub.start()
        if self.nixl_side_channel_port is not None:
            # Read by vLLM's engine-core process, which inherits this environment.
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.nixl_side_channel_port)
        try:
            args = self._engine_args(events_endpoint, replay_endpoint)
            factory = self._stat_logger_factory()
            llm = self._api.AsyncLLM.from_engine_args(args, stat_loggers=[factory] if factory else None)
        except Exception as exc:
            await self._close_kv_events()
            raise self._load_error(exc) from exc
        self._llm = llm
        try:
            tokenizer = llm.get_tokenizer()  # a coroutine in older releases
            self._tokenizer = await tokenizer if inspect.isawaitable(tokenizer) else tokenizer
        except Exception:
            log.warning("vLLM gave no tokenizer; detokenize returns vLLM's streamed text only")
        vllm_config = llm.vllm_config
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self._vocab_size = int(vllm_config.model_config.get_vocab_size())
        blocks = int(vllm_config.cache_config.num_gpu_blocks or 0)
        self.info = dataclasses.replace(self.info, kv_blocks_total=blocks)
        self._kv.max_entries = max(self._kv.max_entries, 4 * blocks)
        self._kv_bytes_per_token = kv_bytes_per_token(vllm_config)
        log.info(
            "vLLM engine ready",
            extra={
                "vllm": self._api.version,
                "model": self.info.model,
                "role": self.role,
                "kv_blocks": blocks,
                "max_model_len": self.max_model_len,
            },
        )

    async def stop(self) -> None:
        for request_id in list(self._seqs):
            self._drop(request_id, EngineError("engine stopped", code="capacity"))
        if self._background:
            await asyncio.wait(list(self._background), timeout=5.0)
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                llm.shutdown()
            except Exception:
                log.warning("vLLM shutdown failed", exc_info=True)
        await self._close_kv_events()

    async def _close_kv_events(self) -> None:
        if self._kv_sub is not None:
            await self._kv_sub.stop()
            self._kv_sub = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def _engine_args(self, events_endpoint: str, replay_endpoint: str) -> Any:
        api = self._api
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "served_model_name": self.info.model,
            "block_size": self.info.block_size,
            "enable_prefix_caching": True,
            "tensor_parallel_size": self.tensor_parallel,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "disable_log_stats": False,  # per-request timestamps and scheduler stats
            # Waiting requests by (priority, arrival): interactive before batch (the `priority`
            # each request is generated with, `scheduling_rank`).
            "scheduling_policy": "priority",
            "kv_events_config": api.KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=events_endpoint,
                replay_endpoint=replay_endpoint,
                topic=KV_EVENTS_TOPIC,
            ),
        }
        if self.max_context_tokens:
            kwargs["max_model_len"] = self.max_context_tokens
        if self.adapters:
            kwargs["enable_lora"] = True
            kwargs["max_loras"] = min(len(self.adapters), MAX_LORAS_ON_GPU)
        if self.role != "aggregated":
            kwargs["kv_transfer_config"] = api.KVTransferConfig(
                kv_connector=self.kv_connector,
                kv_role="kv_both",
                kv_connector_extra_config=dict(self.kv_connector_extra_config),
            )
        kwargs.update(self.engine_kwargs)
        return api.AsyncEngineArgs(**kwargs)

    def _stat_logger_factory(self) -> Callable[..., Any] | None:
        """A vLLM stat logger that hands each step's SchedulerStats to this engine."""
        base = self._api.StatLoggerBase
        if base is None:
            return None
        view = self._sched

        class SchedulerStatsLogger(base):  # type: ignore[misc, valid-type]
            def __init__(self, vllm_config: Any = None, engine_index: int = 0):
                self.engine_index = engine_index

            def record(
                self, scheduler_stats: Any, iteration_stats: Any = None, *args: Any, **kw: Any
            ) -> None:
                view.record(time.monotonic(), scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

            def log(self) -> None:
                pass

            def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
                pass

        def factory(vllm_config: Any, engine_index: int = 0, *args: Any, **kwargs: Any) -> Any:
            return SchedulerStatsLogger(vllm_config, engine_index)

        return factory

    def _load_error(self, exc: Exception) -> EngineError:
        if isinstance(exc, (OSError, ValueError, *self._api.client_errors)):
            return EngineError(f"vLLM cannot load model {self.model_path!r}: {exc}", code="invalid")
        return EngineError(f"vLLM failed to start with {self.model_path!r}: {exc!r}", code="capacity")

    def _require_started(self) -> Any:
        if self._llm is None:
            raise EngineError("the vLLM engine is not started", code="capacity")
        return self._llm

    # ------------------------------------------------------------ protocol

    def _check(self, request: InferenceRequest) -> None:
        """Reject what vLLM would reject, before anything is submitted."""
        check_request(request, self.info, self.max_model_len, self._vocab_size)
        if request.request_id in self._seqs:
            raise EngineError(f"request {request.request_id} is already on this engine")

    async def prefill(self, request: InferenceRequest) -> PrefillResult:
        self._require_started()
        self._check(request)
        remote = self.role == "prefill"
        params = self._sampling_params(
            request,
            max_tokens=1 if remote else request.max_tokens,
            kv_transfer_params=dict(REMOTE_DECODE_PARAMS) if remote else None,
        )
        seq = self._submit(request, "remote_decode" if remote else "local", params)
        try:
            delta = await self._first_tokens(seq)
        except BaseException:
            self.release(request.request_id)
            raise
        seq.carry = delta.tokens[1:]
        self._offer_text(delta.tokens[:1], delta.text if len(delta.tokens) == 1 else None)
        prefill_s, _ = self._phase_seconds(seq)
        num_tokens = len(request.prompt_tokens)
        cached = min(seq.cached_tokens, num_tokens)
        return PrefillResult(
            first_token_id=delta.tokens[0],
            cached_tokens=cached,
            gpu_seconds=prefill_s,
            kv=KvHandle(
                source_worker="",
                num_tokens=num_tokens,
                block_hashes=list(request.block_hashes),
                kv_bytes=(num_tokens - cached) * self._kv_bytes_per_token,
            ),
        )

    async def export_kv(self, request_id: str) -> bytes | None:
        if self.role != "prefill":
            raise EngineError(
                f"this vLLM engine (role {self.role!r}) hands no KV to other workers; "
                "a disaggregated prefill worker needs role 'prefill'",
                code="capacity",
            )
        seq = self._seqs.get(request_id)
        if seq is None or seq.kv_transfer_params is None:
            raise EngineError(
                f"vLLM returned no KV transfer parameters for {request_id}: "
                f"is {self.kv_connector} configured and working?",
                code="capacity",
            )
        envelope = {
            "format": TRANSFER_FORMAT,
            "connector": self.kv_connector,
            "request_id": request_id,
            "num_tokens": len(seq.request.prompt_tokens),
            "kv_transfer_params": seq.kv_transfer_params,
        }
        try:
            return json.dumps(envelope, separators=(",", ":"), default=_jsonable).encode()
        except (TypeError, ValueError) as exc:
            raise EngineError(f"KV transfer parameters are not serialisable: {exc}", code="capacity") from exc

    async def import_kv(self, request: InferenceRequest, kv: KvHandle, payload: bytes | None) -> float:
        self._require_started()
        self._check(request)
        if self.role != "decode":
            raise EngineError(
                f"this vLLM engine (role {self.role!r}) cannot take KV from another worker; "
                "a disaggregated decode worker needs role 'decode'",
                code="capacity",
            )
        if kv.num_tokens != len(request.prompt_tokens):
            raise EngineError(
                f"KV covers {kv.num_tokens} tokens, the prompt has {len(request.prompt_tokens)}"
            )
        if kv.block_hashes != request.block_hashes:
            raise EngineError("KV block hashes do not match the request's prompt")
        transfer = self._transfer_params(request, payload)
        params = self._sampling_params(request, max_tokens=request.max_tokens, kv_transfer_params=transfer)
        started = time.monotonic()
        seq = self._submit(request, "imported", params)
        try:
            # The first output comes once the KV has arrived and the last prompt token was recomputed.
            delta = await self._first_tokens(seq)
        except BaseException:
            self.release(request.request_id)
            raise
        seq.regenerated_first = delta.tokens[0]
        seq.carry = delta.tokens[1:]
        return time.monotonic() - started

    async def decode(self, request_id: str, first_token_id: int) -> AsyncIterator[DecodeStep]:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise EngineError(f"request {request_id} has no KV on this engine")
        if seq.kind == "remote_decode":
            raise EngineError(f"request {request_id} was prefilled here for another worker to decode")
        try:
            if seq.regenerated_first is not None and seq.regenerated_first != first_token_id:
                log.info(
                    "decode worker's first token differs from the prefill worker's",
                    extra={
                        "request_id": request_id,
                        "prefill": first_token_id,
                        "decode": seq.regenerated_first,
                    },
                )
            carry, seq.carry = seq.carry, []
            if seq.finished:
                yield DecodeStep(carry, seq.finish_reason)
                return
            if carry:
                yield DecodeStep(carry, None)
            while True:
                delta = await self._next(seq)
                if not delta.tokens and delta.finish is None:
                    continue
                self._offer_text(delta.tokens, delta.text)
                yield DecodeStep(delta.tokens, delta.finish)
                if delta.finish is not None:
                    return
        finally:
            self.release(request_id)

    def release(self, request_id: str) -> None:
        self._drop(request_id, EngineError(f"request {request_id} was released", code="invalid"))

    def gpu_seconds(self, request_id: str) -> tuple[float, float]:
        seq = self._seqs.get(request_id)
        if seq is not None:
            return self._phase_seconds(seq)
        return self._gpu_seconds.pop(request_id, (0.0, 0.0))

    def snapshot(self) -> EngineSnapshot:
        view, own = self._sched, self._own_running
        if view.seen and own > 0:
            # Every request in this AsyncLLM came through this engine: clamp stats that went stale
            # when the last step ran.
            running = min(view.running, own)
            queue = min(view.waiting, own - running)
            used = round(view.kv_usage * self.info.kv_blocks_total)
        else:
            running, queue, used = own, 0, 0
        fields: dict[str, Any] = {
            "kv_blocks_used": used,
            "kv_blocks_cached": self._kv.cached_count,
            "queue_depth": queue,
            "running": running,
            "tokens_per_s": round(self._throughput.rate(time.monotonic()), 3),
        }
        if "preemptions" in _SNAPSHOT_FIELDS:
            fields["preemptions"] = view.preemptions
        # vLLM keeps the `max_loras` adapters used last on the GPU: those are the warm ones.
        fields["adapters"] = tuple(self._loras_used)
        fields["queued_tokens"], fields["context_tokens"] = batch_load(
            self._sequence_loads(), queue_depth=queue, running=running
        )
        return EngineSnapshot(**fields)

    def _lora_request(self, adapter: str | None) -> Any:
        if adapter is None:
            return None
        self._loras_used[adapter] = None
        self._loras_used.move_to_end(adapter)
        while len(self._loras_used) > min(len(self.adapters), MAX_LORAS_ON_GPU):
            self._loras_used.popitem(last=False)
        return self._api.LoRARequest(adapter, self._lora_ids[adapter], self.adapters[adapter])

    def _sequence_loads(self) -> Iterator[SequenceLoad]:
        size = self.info.block_size
        for seq in self._seqs.values():
            if seq.finished:
                continue
            request = seq.request
            out = seq.first_out_at is not None
            needs_prefill = seq.kind != "imported"
            cached = 0
            if not out and needs_prefill:
                cached = self._kv.cached_prefix_blocks(request.block_hashes) * size
            yield SequenceLoad(len(request.prompt_tokens), len(seq.engine_tokens), out, needs_prefill, cached)

    def detokenize(self, token_ids: list[int]) -> str:
        offered, self._pending_text = self._pending_text, None
        if offered is not None and offered[0] == tuple(token_ids):
            return offered[1]
        if self._tokenizer is None or not token_ids:
            return ""
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def drain_kv_events(self) -> list[KvBlockEvent]:
        return self._kv.drain()

    def cached_block_hashes(self) -> list[int]:
        return self._kv.cached()

    def unfinished_in_vllm(self) -> int | None:
        """Requests vLLM's frontend still tracks (a diagnostic, from a non-public attribute)."""
        processor = getattr(self._llm, "output_processor", None)
        count = getattr(processor, "get_num_unfinished_requests", None)
        return int(count()) if callable(count) else None

    # ------------------------------------------------------------ requests in vLLM

    def _sampling_params(
        self, request: InferenceRequest, *, max_tokens: int, kv_transfer_params: dict[str, Any] | None
    ) -> Any:
        api = self._api
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": request.temperature,
            "output_kind": api.RequestOutputKind.DELTA,
            "ignore_eos": self.ignore_eos,
        }
        if kv_transfer_params is not None:
            kwargs["extra_args"] = {"kv_transfer_params": kv_transfer_params}
            if request.temperature > 0:
                # Prefill and decode workers both sample the first token: same seed, same draw.
                kwargs["seed"] = request_seed(request.request_id)
        return api.SamplingParams(**kwargs)

    def _transfer_params(self, request: InferenceRequest, payload: bytes | None) -> dict[str, Any]:
        if payload is None:
            raise EngineError("no KV transfer parameters came with the KV handle")
        try:
            envelope = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise EngineError(f"KV transfer parameters are not JSON: {exc}") from exc
        if not isinstance(envelope, dict) or envelope.get("format") != TRANSFER_FORMAT:
            raise EngineError("KV payload is not a vLLM KV transfer envelope")
        if envelope.get("request_id") != request.request_id:
            raise EngineError(f"KV transfer parameters are for {envelope.get('request_id')!r}")
        if envelope.get("connector") != self.kv_connector:
            raise EngineError(
                f"KV was prepared for {envelope.get('connector')!r}, this engine runs {self.kv_connector!r}"
            )
        if envelope.get("num_tokens") != len(request.prompt_tokens):
            raise EngineError("KV transfer parameters cover a different prompt length")
        params = envelope.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise EngineError("KV transfer parameters do not describe a remote prefill")
        if self.kv_connector == "NixlConnector":
            missing = [key for key in NIXL_REQUIRED if params.get(key) is None]
            if missing:
                raise EngineError(f"KV transfer parameters lack {', '.join(missing)}")
        return params

    def _submit(
        self, request: InferenceRequest, kind: Literal["local", "remote_decode", "imported"], params: Any
    ) -> _Sequence:
        llm = self._require_started()
        now = time.monotonic()
        seq = _Sequence(request=request, kind=kind, submitted_at=now)
        self._running_changed(now, +1)
        self._seqs[request.request_id] = seq
        # The per-request correspondence that maps vLLM's stored blocks to the project's hashes.
        self._kv.register(request.prompt_tokens, request.block_hashes)
        headers: dict[str, str] = {}
        propagate.inject(headers)  # the caller's span: the host's prefill or decode span
        prompt = {"prompt_token_ids": list(request.prompt_tokens)}  # a vllm TokensPrompt
        seq.pump = asyncio.create_task(
            self._pump(llm, seq, prompt, params, headers or None), name=f"vllm-{request.request_id}"
        )
        return seq

    async def _pump(self, llm: Any, seq: _Sequence, prompt: dict[str, Any], params: Any, trace: Any) -> None:
        """Read the request's stream into its queue, so nothing waits on the reader (decode may
        start later than the first token, or never). Cancelling this task makes vLLM abort."""
        try:
            lora = self._lora_request(seq.request.adapter)
            async for output in llm.generate(
                prompt,
                params,
                seq.request.request_id,
                lora_request=lora,
                trace_headers=trace,
                priority=scheduling_rank(seq.request),
            ):
                seq.outputs.put_nowait(output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            seq.outputs.put_nowait(exc)
        else:
            seq.outputs.put_nowait(_END)

    async def _first_tokens(self, seq: _Sequence) -> _Delta:
        while True:
            delta = await self._next(seq)
            if delta.tokens:
                return delta
            if delta.finish is not None:
                raise EngineError("vLLM finished the request without a token", code="capacity")

    async def _next(self, seq: _Sequence) -> _Delta:
        if seq.finished and seq.outputs.empty():
            if seq.failure is not None:
                raise seq.failure
            return _Delta([], seq.finish_reason, "")
        item = await seq.outputs.get()
        if isinstance(item, EngineError):
            raise item
        if isinstance(item, BaseException):
            raise self._request_error(item) from item
        if item is _END:
            if seq.finished:
                return await self._next(seq)
            raise EngineError("vLLM ended the request's stream before it finished", code="capacity")
        return self._absorb(seq, item)

    def _absorb(self, seq: _Sequence, output: Any) -> _Delta:
        """Take one streamed RequestOutput (DELTA: only what is new since the previous one)."""
        now = time.monotonic()
        completion = output.outputs[0] if output.outputs else None
        tokens = [int(t) for t in completion.token_ids] if completion is not None else []
        text = (completion.text or "") if completion is not None else ""
        metrics = getattr(output, "metrics", None)
        if metrics is not None:
            seq.metrics = metrics
        cached = getattr(output, "num_cached_tokens", None)
        if cached:
            seq.cached_tokens = int(cached)
        if tokens:
            if seq.first_out_at is None:
                seq.first_out_at = now
            seq.last_out_at = now
            seq.engine_tokens.extend(tokens)
            self._throughput.add(now, len(tokens))
        if not output.finished:
            return _Delta(tokens, None, text)
        params = getattr(output, "kv_transfer_params", None)
        if isinstance(params, dict):
            seq.kv_transfer_params = params
        reason = getattr(completion, "finish_reason", None)
        if reason not in ("stop", "length"):
            seq.failure = EngineError(
                f"vLLM ended the request: {reason or 'no reason given'}", code="capacity"
            )
        self._finished(seq, now)
        if seq.failure is not None:
            raise seq.failure
        seq.finish_reason = reason
        return _Delta(tokens, reason, text)

    def _finished(self, seq: _Sequence, now: float) -> None:
        if seq.finished:
            return
        seq.finished = True
        seq.ended_at = now
        self._running_changed(now, -1)
        # Generated tokens fill blocks vLLM caches too: register them so those events map.
        bs = self.info.block_size
        sequence = [*seq.request.prompt_tokens, *seq.engine_tokens]
        if len(sequence) // bs > len(seq.request.block_hashes):
            self._kv.register_sequence(sequence)

    def _request_error(self, exc: BaseException) -> EngineError:
        if isinstance(exc, EngineError):
            return exc
        api = self._api
        if isinstance(exc, api.EngineDeadError):
            return EngineError(f"the vLLM engine died: {exc}", code="capacity")
        cause: BaseException = exc
        if isinstance(exc, api.EngineGenerateError) and exc.__cause__ is not None:
            cause = exc.__cause__
        if isinstance(cause, api.client_errors):
            return EngineError(f"vLLM rejected the request: {cause}", code="invalid")
        return EngineError(f"vLLM failed the request: {cause!r}", code="capacity")

    def _drop(self, request_id: str, reason: EngineError) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        now = time.monotonic()
        if not seq.finished:
            # Still generating (cancelled, failed or stopped): stop it in vLLM. Whoever waits on
            # its outputs gets `reason`.
            seq.ended_at = now
            self._running_changed(now, -1)
            seq.outputs.put_nowait(reason)
            self._spawn(self._abort(request_id, seq.pump))
        # A finished prefill for a remote decode is not aborted: the connector keeps its blocks
        # until the decode worker has read them.
        self._gpu_seconds[request_id] = self._phase_seconds(seq)
        while len(self._gpu_seconds) > _KEEP_GPU_SECONDS:
            self._gpu_seconds.popitem(last=False)

    async def _abort(self, request_id: str, pump: asyncio.Task[None] | None) -> None:
        if pump is not None and not pump.done():
            pump.cancel()  # vLLM's generate() aborts the request when it is cancelled
            await asyncio.gather(pump, return_exceptions=True)
        llm = self._llm
        if llm is not None and request_id not in self._seqs:
            # Also abort by id: covers a cancel that landed before vLLM registered the request.
            # (Not when the id is back on this engine: that would abort the retry.)
            with contextlib.suppress(Exception):
                await llm.abort(request_id)

    def _spawn(self, coro: Any) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            coro.close()
            log.warning("release outside the event loop: the request is not aborted in vLLM")
            return
        task = loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------ GPU time and text

    def _running_changed(self, now: float, delta: int) -> None:
        if not self._sched.seen:
            # No scheduler stats from vLLM: share GPU time by this engine's own count.
            self._share.step(now, self._own_running)
        self._own_running = max(0, self._own_running + delta)

    def _engine_ts(self, seq: _Sequence, name: str) -> float | None:
        """A RequestStateStats timestamp, when it is set and on this host's monotonic clock."""
        value = getattr(seq.metrics, name, 0.0) if seq.metrics is not None else 0.0
        if value and seq.submitted_at - 1.0 <= value <= time.monotonic() + 1.0:
            return float(value)
        return None

    def _phase_seconds(self, seq: _Sequence) -> tuple[float, float]:
        """(prefill, decode) GPU-seconds by processor sharing (see accounting.py)."""
        share = self._share
        end = seq.ended_at if seq.ended_at is not None else time.monotonic()
        scheduled = self._engine_ts(seq, "scheduled_ts") or seq.submitted_at
        first = self._engine_ts(seq, "first_token_ts") or seq.first_out_at
        last = (self._engine_ts(seq, "last_token_ts") or seq.last_out_at) if seq.finished else end
        if seq.kind == "imported":
            return 0.0, share.charge(scheduled, last)
        if first is None:
            return share.charge(scheduled, end), 0.0
        prefill = share.charge(scheduled, first)
        if seq.kind == "remote_decode":
            return prefill, 0.0
        return prefill, share.charge(first, last)

    def _offer_text(self, tokens: list[int], text: str | None) -> None:
        """vLLM's incremental text for the tokens about to be handed out: the host detokenizes
        them right away, before it awaits anything."""
        self._pending_text = (tuple(tokens), text) if text is not None else None


# ---------------------------------------------------------------- helpers


def request_seed(request_id: str) -> int:
    """A per-request sampling seed both workers of a disaggregated pair derive alike."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little") >> 1


def kv_bytes_per_token(vllm_config: Any) -> int:
    """Bytes of KV one token occupies across the whole model (all layers, all ranks): 2 (K and V)
    x layers x KV heads x head size x element size. MLA and hybrid models store less or other
    state; this is an estimate for `KvHandle.kv_bytes`, 0 when the config cannot tell."""
    try:
        model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        layers = int(model_config.get_num_layers(parallel)) * int(parallel.pipeline_parallel_size)
        heads = int(model_config.get_total_num_kv_heads())
        head_size = int(model_config.get_head_size())
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        element = 1 if cache_dtype.startswith("fp8") else int(model_config.dtype.itemsize)
        return 2 * layers * heads * head_size * element
    except Exception:
        return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def lora_ids(adapters: Mapping[str, str]) -> dict[str, int]:
    """Each adapter's `lora_int_id` for vLLM: 1, 2, ... by name (0 means no adapter to vLLM), the
    same on every worker and every restart."""
    return {name: index for index, name in enumerate(sorted(adapters), start=1)}


def make_vllm_engine(settings: Mapping[str, Any], config: MeshConfig) -> VllmEngine:
    """Build a VllmEngine from a worker's settings and the mesh config, for the engine factory.

    Settings: "model" (the mesh model name), "model_path" (local directory or hub id vLLM loads;
    default `$RIPPLEMESH_VLLM_MODEL`, else the model name), "gpu", "vllm_role" ("aggregated",
    "prefill" or "decode"), "tensor_parallel", "gpu_memory_utilization", "nixl_side_channel_port".
    """
    model_name = settings.get("model") or config.models[0].name
    model = config.model(model_name)
    if model is None:
        raise ValueError(f"model {model_name!r} is not in the mesh config")
    port = settings.get("nixl_side_channel_port")
    return VllmEngine(
        model=model.name,
        model_path=settings.get("model_path") or os.environ.get("RIPPLEMESH_VLLM_MODEL") or model.name,
        gpu_type=settings.get("gpu", "H100"),
        block_size=config.block_size,
        max_context_tokens=model.max_context_tokens,
        role=settings.get("vllm_role", "aggregated"),
        tensor_parallel=int(settings.get("tensor_parallel", 1)),
        gpu_memory_utilization=float(settings.get("gpu_memory_utilization", 0.9)),
        nixl_side_channel_port=int(port) if port is not None else None,
        adapters={a.name: a.path for a in model.adapters if a.path},
        adapter_load_s=max((a.load_s for a in model.adapters if a.path), default=0.0),
    )
