"""Workloads for the simulator: real traces and a synthetic agentic-workflow generator, streamed.

One module because the three workloads implement one small interface (`Task`, `Workload`) and
share its prefix-hash conventions (the chain seed, `mix64`, the 512-token Mooncake blocks);
`load_workload` picks among them from one spec string.

A workload is a stream of tasks in arrival order. A task is a standalone request (a trace line)
or a workflow of several steps (an agent run); its steps are built one at a time, when the
simulator issues them, so memory holds only the tasks in flight, never the whole workload.

Prompts are described by their length and their chained block hashes (the prefix identity of
services/mesh/block_hash.py): two prompts share a cached prefix exactly when their leading hashes
are equal. Every hash chain is seeded with `block_hash.chain_seed(model)`, as the engines' are.

- `MooncakeTrace`: the Mooncake FAST'25 JSONL traces (`timestamp` ms, `input_length`,
  `output_length`, `hash_ids` of 512-token blocks). Run natively with `block_size=512` (one
  engine block per hash id), or with a block size that divides 512, each hash id then expanding
  into 512/block_size chained sub-blocks. Only full blocks are hashed, as the engines do.
- `AzureTrace`: the Azure LLM inference trace CSVs (`TIMESTAMP,ContextTokens,GeneratedTokens`);
  they carry no prefix information, so every request's blocks are its own.
- `AgenticWorkload`: tenants with priorities and quotas; workflows of several steps whose prompt
  is the previous step's prompt plus its output plus a tool result (so later steps share the
  earlier steps' prefix), think time between steps, per-step deadlines, and optional
  application-level step failures. Every random draw comes from the workflow's own seeded
  generator, so the workload is identical whatever the policy under test does. Its families,
  the same machinery with other defaults: `CodingAgentWorkload` (tenants' shared repository
  contexts, long outputs) and `RagChatWorkload` (short prompts, mostly one turn, bursts).

Workflow traces (recorded workflows replayed closed loop) are `recorded.py`'s `WorkflowTrace`, a
`MooncakeTrace` whose lines may carry tenants, priorities, deadlines and workflow steps.

Every workload takes `rate_scale` (replay at k x the arrival rate), `window` (a time window of
the trace, in seconds from its start; arrivals are re-based to 0) and `limit` (at most N tasks);
traces take `repeat` (replay the trace N times back to back, each copy's prefixes its own).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import itertools
import math
import random
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from schemas.events import PriorityClass
from services.admission.policy import TenantQuota
from services.mesh.block_hash import chain_block_hashes, chain_seed
from services.simulator.options import convert, key_values

MOONCAKE_BLOCK_TOKENS = 512
_MASK64 = (1 << 64) - 1
# Effectively no limit: admission's token buckets never run dry.
UNLIMITED = TenantQuota(requests_per_s=1e15, request_burst=1e15, tokens_per_s=1e18, token_burst=1e18)


def mix64(x: int) -> int:
    """splitmix64's finaliser: a fast, well-spread 64-bit mix (for synthetic block identities)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


# ------------------------------------------------------------------ the task model


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    priority: PriorityClass = "standard"
    quota: TenantQuota = UNLIMITED


@dataclass(frozen=True, slots=True)
class Step:
    """One request of a task."""

    prompt_tokens: int
    output_tokens: int
    block_hashes: list[int]
    deadline_s: float | None = None  # for its last token, after the step's arrival
    think_s: float = 0.0  # the wait after the previous step completes (0 for the first)
    fails: bool = False  # the step's result is unusable: an application-level failure
    # For its first token, after the step's arrival (workflow traces' `deadline_ms`): the client
    # gives up without one by then. The mesh's policies see only `deadline_s`.
    first_token_deadline_s: float | None = None
    # The model it names (served only by that model's workers); None: the workload's `model`.
    model: str | None = None


class Task(ABC):
    # The mesh's service class (schemas.events.ServiceClass): Batch API lines are "batch".
    service_class: ClassVar[str] = "interactive"
    task_id: str
    tenant: str
    priority: PriorityClass
    arrival_s: float
    steps: int
    workflow: bool

    @abstractmethod
    def step(self, index: int) -> Step:
        """Step `index` (1-based); called once per step, in order."""


class SingleRequest(Task):
    """A trace request: a task of one step."""

    __slots__ = ("_step", "arrival_s", "priority", "task_id", "tenant")
    steps = 1
    workflow = False

    def __init__(self, task_id: str, tenant: str, priority: PriorityClass, arrival_s: float, step: Step):
        self.task_id = task_id
        self.tenant = tenant
        self.priority = priority
        self.arrival_s = arrival_s
        self._step = step

    def step(self, index: int) -> Step:
        if index != 1:
            raise IndexError(f"request {self.task_id} has one step")
        return self._step


# A raw record: (timestamp in seconds from the trace's start, a builder of the task given its
# arrival time and its index in the stream).
Record = tuple[float, Callable[[float, int], Task]]


class Workload(ABC):
    """A stream of tasks in arrival order, with the block size its prefixes are hashed in."""

    name: str
    block_size: int
    model: str
    tenants: dict[str, Tenant]
    # False when no two requests can share a prefix (the simulator then skips the infinite-cache
    # bound's bookkeeping: it is zero).
    prefix_sharing: bool = True

    def __init__(
        self,
        *,
        rate_scale: float = 1.0,
        window: tuple[float, float] | None = None,
        limit: int | None = None,
    ):
        if rate_scale <= 0:
            raise ValueError("rate_scale must be > 0")
        if window is not None and not window[0] < window[1]:
            raise ValueError("window must be (start, end) with start < end")
        if limit is not None and limit < 0:
            raise ValueError("limit must be >= 0")
        self.rate_scale = rate_scale
        self.window = window
        self.limit = limit

    @abstractmethod
    def _records(self) -> Iterator[Record]:
        """The raw records, in timestamp order."""

    def tasks(self) -> Iterator[Task]:
        """The tasks, windowed, rate-scaled and limited, built lazily in arrival order."""
        start, end = self.window if self.window is not None else (0.0, math.inf)
        limit = self.limit if self.limit is not None else math.inf
        index = 0
        last = 0.0
        for timestamp, build in self._records():
            if timestamp < start:
                continue
            if timestamp >= end or index >= limit:
                return
            arrival = max(last, (timestamp - start) / self.rate_scale)
            last = arrival
            yield build(arrival, index)
            index += 1

    def count_hint(self) -> int | None:
        """How many tasks `tasks()` will yield when cheaply known (for progress bars)."""
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "block_size": self.block_size,
            "model": self.model,
            "rate_scale": self.rate_scale,
            "window": list(self.window) if self.window else None,
            "limit": self.limit,
        }


# ------------------------------------------------------------------ traces


class _Trace(Workload):
    """A trace file replayed as one tenant's single requests, `repeat` times back to back (the
    Mooncake and Azure traces)."""

    kind: ClassVar[str]
    default_block_size: ClassVar[int]

    def __init__(
        self,
        path: str | Path,
        *,
        block_size: int | None = None,
        model: str = "llama-3.1-8b",
        tenant: str = "trace",
        priority: PriorityClass = "standard",
        deadline_s: float | None = None,
        repeat: int = 1,
        rate_scale: float = 1.0,
        window: tuple[float, float] | None = None,
        limit: int | None = None,
    ):
        super().__init__(rate_scale=rate_scale, window=window, limit=limit)
        block_size = self.default_block_size if block_size is None else block_size
        self._check_block_size(block_size)
        if repeat < 1:
            raise ValueError("repeat must be >= 1")
        self.path = Path(path)
        self.name = f"{self.kind}:{self.path.name}"
        self.block_size = block_size
        self.model = model
        self.tenant = tenant
        self.priority = priority
        self.deadline_s = deadline_s
        self.repeat = repeat
        self.tenants = {tenant: Tenant(tenant, priority)}

    def _check_block_size(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")

    @abstractmethod
    def _line_count(self) -> int:
        """How many requests one replay of the file holds."""

    def count_hint(self) -> int | None:
        if self.window is not None:
            return self.limit
        total = self._line_count() * self.repeat
        return total if self.limit is None else min(total, self.limit)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": str(self.path), "repeat": self.repeat}


# ------------------------------------------------------------------ Mooncake


class _MooncakeLine(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


class MooncakeTrace(_Trace):
    kind = "mooncake"
    default_block_size = MOONCAKE_BLOCK_TOKENS

    def _check_block_size(self, block_size: int) -> None:
        if block_size < 1 or MOONCAKE_BLOCK_TOKENS % block_size:
            raise ValueError(
                f"block_size must divide {MOONCAKE_BLOCK_TOKENS} (Mooncake's block), got {block_size}"
            )

    def _hashes(self, hash_ids: list[int], prompt: int, copy: int, model: str | None = None) -> list[int]:
        full = prompt // self.block_size
        adapter = f"repeat-{copy}" if copy else None
        m = MOONCAKE_BLOCK_TOKENS // self.block_size  # engine blocks per Mooncake block
        if m == 1:
            ids = hash_ids[:full]
        else:
            ids = [h * m + j for h in hash_ids[: -(-full // m)] for j in range(m)][:full]
        # Each id a "token" of a one-token block: the project's chained hash over the ids.
        return chain_block_hashes(ids, 1, model=model or self.model, adapter=adapter)

    def _lines(self) -> Iterator[_MooncakeLine]:
        decoder = msgspec.json.Decoder(_MooncakeLine)
        with self.path.open("rb") as handle:
            for raw in handle:
                if raw.strip():
                    yield decoder.decode(raw)

    def _duration(self) -> float:
        last = 0.0
        for line in self._lines():
            last = line.timestamp
        return last / 1000.0

    def _repeat_period(self, duration_s: float, lines: int) -> float:
        """The offset between copies of the trace (`repeat`): its duration and one mean gap."""
        if self.repeat == 1:
            return 0.0
        return duration_s + duration_s / max(1, lines) if duration_s > 0 else 1.0

    def _records(self) -> Iterator[Record]:
        period = self._repeat_period(self._duration(), self._line_count()) if self.repeat > 1 else 0.0
        for copy in range(self.repeat):
            for line in self._lines():
                yield (line.timestamp / 1000.0 + copy * period, self._builder(line, copy))

    def _step(
        self,
        input_length: int,
        output_length: int,
        hash_ids: list[int],
        copy: int,
        *,
        deadline_s: float | None,
        first_token_deadline_s: float | None = None,
        think_s: float = 0.0,
        fails: bool = False,
        model: str | None = None,
    ) -> Step:
        """A trace line's request (Mooncake's fields; a workflow trace's deadlines, think time,
        whether its agent stops after it, and its model, whose hash chain its prefix is on)."""
        return Step(
            prompt_tokens=input_length,
            output_tokens=max(1, output_length),
            block_hashes=self._hashes(hash_ids, input_length, copy, model),
            deadline_s=deadline_s,
            think_s=think_s,
            fails=fails,
            first_token_deadline_s=first_token_deadline_s,
            model=model,
        )

    def _builder(self, line: _MooncakeLine, copy: int) -> Callable[[float, int], Task]:
        def build(arrival: float, index: int) -> Task:
            step = self._step(
                line.input_length, line.output_length, line.hash_ids, copy, deadline_s=self.deadline_s
            )
            return SingleRequest(f"mc{index}", self.tenant, self.priority, arrival, step)

        return build

    def _line_count(self) -> int:
        with self.path.open("rb") as handle:
            return sum(1 for raw in handle if raw.strip())


# ------------------------------------------------------------------ Azure


def _azure_time(value: str) -> float:
    """'2023-11-16 18:17:03.9799600' (7 fractional digits) -> seconds since the epoch (UTC)."""
    main, _, fraction = value.strip().partition(".")
    seconds = datetime.fromisoformat(main).timestamp()
    return seconds + (float("0." + fraction) if fraction else 0.0)


class AzureTrace(_Trace):
    kind = "azure"
    default_block_size = 16
    prefix_sharing = False
    _parsed: tuple[array[float], array[int], array[int]] | None = None

    @cached_property
    def _seed(self) -> int:
        return chain_seed(self.model)

    def _rows(self) -> Iterator[tuple[float, int, int]]:
        with self.path.open(newline="") as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if header is None or [h.strip() for h in header[:3]] != [
                "TIMESTAMP",
                "ContextTokens",
                "GeneratedTokens",
            ]:
                raise ValueError(f"{self.path}: expected the header TIMESTAMP,ContextTokens,GeneratedTokens")
            first: float | None = None
            for row in reader:
                if not row:
                    continue
                at = _azure_time(row[0])
                if first is None:
                    first = at
                yield (at - first, int(row[1]), int(row[2]))

    def _columns(self) -> tuple[array[float], array[int], array[int]]:
        """The trace's rows as arrays (seconds from its start, prompt and output tokens), parsed
        once however often the trace is replayed (24 bytes a row)."""
        if self._parsed is None:
            at, prompts, outputs = array("d"), array("q"), array("q")
            for offset, prompt, output in self._rows():
                at.append(offset)
                prompts.append(prompt)
                outputs.append(output)
            self._parsed = (at, prompts, outputs)
        return self._parsed

    def _records(self) -> Iterator[Record]:
        stream_index = itertools.count()
        if self.repeat == 1:
            for at, prompt, output in self._rows():
                yield (at, self._builder(prompt, output, next(stream_index)))
            return
        offsets, prompts, outputs = self._columns()
        count = len(offsets)
        last = offsets[-1] if count else 0.0
        period = last + (last / count if count else 1.0)
        for copy in range(self.repeat):
            for offset, prompt, output in zip(offsets, prompts, outputs, strict=True):
                yield (offset + copy * period, self._builder(prompt, output, next(stream_index)))

    def _builder(self, prompt: int, output: int, serial: int) -> Callable[[float, int], Task]:
        def build(arrival: float, index: int) -> Task:
            # No prefix information in this trace: every block is the request's own. Consecutive
            # ids from a random 62-bit base (no two requests' ranges meet in practice).
            base = mix64(self._seed ^ mix64(serial + 1)) >> 2
            hashes = list(range(base, base + prompt // self.block_size))
            step = Step(
                prompt_tokens=prompt,
                output_tokens=max(1, output),
                block_hashes=hashes,
                deadline_s=self.deadline_s,
            )
            return SingleRequest(f"az{index}", self.tenant, self.priority, arrival, step)

        return build

    def _line_count(self) -> int:
        with self.path.open("rb") as handle:
            return max(0, sum(1 for raw in handle if raw.strip()) - 1)  # less the header


# ------------------------------------------------------------------ the agentic generator


@dataclass(frozen=True, slots=True)
class AgenticTenant:
    name: str
    priority: PriorityClass = "standard"
    share: float = 1.0  # of the workflows
    system_prompt_tokens: int = 1000  # shared by all of the tenant's workflows
    step_deadline_s: float | None = 60.0
    quota: TenantQuota = UNLIMITED
    # Shared contexts after the system prompt (a coding agent's repository): `contexts` of
    # `context_tokens` each; each workflow works on one, drawn uniformly (none by default).
    contexts: int = 0
    context_tokens: int = 0
    # The model its workflows name (None: drawn from the workload's `models` mix, else its `model`).
    model: str | None = None


DEFAULT_TENANTS: tuple[AgenticTenant, ...] = (
    AgenticTenant("assistant", "critical", 0.3, system_prompt_tokens=1500, step_deadline_s=30.0),
    AgenticTenant("agents", "standard", 0.5, system_prompt_tokens=3000, step_deadline_s=60.0),
    AgenticTenant(
        "batch",
        "sheddable",
        0.2,
        system_prompt_tokens=800,
        step_deadline_s=300.0,
        quota=TenantQuota(
            requests_per_s=50.0, request_burst=100.0, tokens_per_s=400_000.0, token_burst=1_600_000.0
        ),
    ),
)

# Two tenants share the standard class with weights 2:1 (admission's fair queuing divides the
# class's tokens between them by weight); otherwise as the default.
SHARED_TENANTS: tuple[AgenticTenant, ...] = (
    AgenticTenant(
        "assistant",
        "critical",
        0.3,
        system_prompt_tokens=1500,
        step_deadline_s=30.0,
        quota=TenantQuota(weight=3.0),
    ),
    AgenticTenant(
        "agents-a",
        "standard",
        0.25,
        system_prompt_tokens=3000,
        step_deadline_s=60.0,
        quota=TenantQuota(weight=2.0),
    ),
    AgenticTenant(
        "agents-b",
        "standard",
        0.25,
        system_prompt_tokens=3000,
        step_deadline_s=60.0,
        quota=TenantQuota(weight=1.0),
    ),
    DEFAULT_TENANTS[2],
)
# Coding agents: each tenant's workflows share its repositories' contexts (tens of thousands of
# tokens after the system prompt), so a step's prompt is mostly a prefix other workflows hold.
CODING_TENANTS: tuple[AgenticTenant, ...] = (
    AgenticTenant(
        "ide",
        "critical",
        0.4,
        system_prompt_tokens=2000,
        step_deadline_s=60.0,
        contexts=4,
        context_tokens=24_000,
    ),
    AgenticTenant(
        "agents",
        "standard",
        0.4,
        system_prompt_tokens=3000,
        step_deadline_s=120.0,
        contexts=6,
        context_tokens=40_000,
    ),
    AgenticTenant(
        "ci",
        "sheddable",
        0.2,
        system_prompt_tokens=1500,
        step_deadline_s=600.0,
        contexts=2,
        context_tokens=32_000,
    ),
)

# Chat assistants with retrieval: a short system prompt, then the question and the passages
# retrieved for it, which differ from question to question (nothing shared past the system prompt).
RAG_CHAT_TENANTS: tuple[AgenticTenant, ...] = (
    AgenticTenant("support", "critical", 0.5, system_prompt_tokens=300, step_deadline_s=10.0),
    AgenticTenant("search", "standard", 0.3, system_prompt_tokens=200, step_deadline_s=20.0),
    AgenticTenant("internal", "sheddable", 0.2, system_prompt_tokens=400, step_deadline_s=60.0),
)
TENANT_SETS: dict[str, tuple[AgenticTenant, ...]] = {
    "default": DEFAULT_TENANTS,
    "shared": SHARED_TENANTS,
    "coding": CODING_TENANTS,
    "rag-chat": RAG_CHAT_TENANTS,
}


def _segment_id(name: str) -> int:
    """A named segment's identity (a system prompt, a shared context): the same in every process."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class _Chain:
    """A prompt's chained block hashes, extended as segments of tokens are appended.

    A segment is a run of tokens with an identity (`segment`, an int); a block's identity is the
    list of (segment, start, end) pieces it covers, chained onto the previous block's hash.
    """

    __slots__ = ("hashes", "parent", "pieces", "size", "tokens")

    def __init__(self, seed: int, block_size: int):
        self.parent = seed
        self.hashes: list[int] = []
        self.pieces: list[tuple[int, int, int]] = []
        self.size = block_size
        self.tokens = 0

    def append(self, segment: int, length: int) -> None:
        offset = 0
        size = self.size
        if length <= 0:
            return
        if self.tokens % size:  # first, the rest of a partly filled block
            offset = min(size - self.tokens % size, length)
            self._piece(segment, 0, offset)
        # Whole blocks of this segment: one piece each.
        parent = self.parent
        hashes = self.hashes
        whole = offset + (length - offset) // size * size
        mask = _MASK64
        append = hashes.append
        for start in range(offset, whole, size):
            # mix64(parent ^ segment ^ (start << 21) ^ ((start + size) << 42)) >> 1, inlined (a
            # long prompt appends hundreds of blocks per step).
            x = ((parent ^ segment ^ (start << 21) ^ ((start + size) << 42)) + 0x9E3779B97F4A7C15) & mask
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
            parent = (x ^ (x >> 31)) >> 1
            append(parent)
        self.parent = parent
        self.tokens += whole - offset
        if whole < length:
            self._piece(segment, whole, length)

    def _piece(self, segment: int, start: int, end: int) -> None:
        self.pieces.append((segment, start, end))
        self.tokens += end - start
        if self.tokens % self.size == 0:
            h = self.parent
            for seg, first, last in self.pieces:
                h = mix64(h ^ seg ^ (first << 21) ^ (last << 42))
            self.parent = h >> 1
            self.hashes.append(self.parent)
            self.pieces = []

    def copy(self) -> _Chain:
        other = _Chain(self.parent, self.size)
        other.hashes = list(self.hashes)
        other.pieces = list(self.pieces)
        other.tokens = self.tokens
        return other


# Each tenant's system prompt, and each tenant's shared contexts, on one model's hash chain.
_Prompts = tuple[list[_Chain], list[list[_Chain]]]


class _Workflow(Task):
    __slots__ = (
        "_chain",
        "_deadline",
        "_fails",
        "_model",
        "_news",
        "_outputs",
        "_thinks",
        "_uid",
        "arrival_s",
        "priority",
        "steps",
        "task_id",
        "tenant",
    )
    workflow = True

    def __init__(
        self,
        *,
        task_id: str,
        uid: int,
        tenant: AgenticTenant,
        system: _Chain,
        arrival_s: float,
        news: list[int],
        outputs: list[int],
        thinks: list[float],
        fails: list[bool],
        model: str | None = None,
    ):
        self.task_id = task_id
        self._uid = uid
        self._model = model
        self.tenant = tenant.name
        self.priority = tenant.priority
        self.arrival_s = arrival_s
        self.steps = len(outputs)
        self._news = news
        self._outputs = outputs
        self._thinks = thinks
        self._fails = fails
        self._deadline = tenant.step_deadline_s
        self._chain = system.copy()  # the tenant's system prompt (and context), hashed once per workload

    def step(self, index: int) -> Step:
        if not 1 <= index <= self.steps:
            raise IndexError(f"workflow {self.task_id} has {self.steps} steps")
        chain = self._chain
        if index > 1:
            # The previous step's output joins the conversation, then this step's tool result.
            chain.append(mix64((self._uid << 20) ^ (index - 1) << 2 ^ 1), self._outputs[index - 2])
        chain.append(mix64((self._uid << 20) ^ index << 2 ^ 2), self._news[index - 1])
        return Step(
            prompt_tokens=chain.tokens,
            output_tokens=self._outputs[index - 1],
            block_hashes=list(chain.hashes),
            deadline_s=self._deadline,
            think_s=self._thinks[index - 1],
            fails=self._fails[index - 1],
            model=self._model,
        )


@dataclass
class AgenticWorkload(Workload):
    """Synthetic agent runs. Sizes are log-normal around their means (sigma `spread`), capped
    at `max_tokens_per_step`; arrivals are Poisson at `rate_per_s` workflows per second."""

    workflows: int = 1000
    rate_per_s: float = 2.0
    tenants_spec: tuple[AgenticTenant, ...] = DEFAULT_TENANTS
    min_steps: int = 2
    max_steps: int = 8
    # Weights of min_steps..max_steps workflow lengths (uniform when empty).
    step_weights: tuple[float, ...] = ()
    task_tokens: float = 600.0  # the user's request, in step 1
    tool_tokens: float = 400.0  # each later step's tool result
    output_tokens: float = 250.0
    spread: float = 0.6
    max_tokens_per_step: int = 8192
    think_s: float = 3.0  # mean, exponential
    failure_rate: float = 0.0  # application-level failure of a step's result
    # Bursts: each period of `burst_every_s` seconds ends with `burst_s` seconds of arrivals at
    # `burst_factor` x `rate_per_s` (off by default: `burst_s` 0).
    burst_factor: float = 1.0
    burst_s: float = 0.0
    burst_every_s: float = 0.0
    # A daily shape (off by default: `daily_amplitude` 0): the arrival rate in each of the day's
    # 24 hours is `rate_per_s` x (1 + `daily_amplitude` x cos(2 pi (hour's middle - `peak_s`) /
    # `day_s`)), so `rate_per_s` is the day's mean and peak / trough = (1 + a) / (1 - a).
    daily_amplitude: float = 0.0
    day_s: float = 86_400.0
    peak_s: float = 14 * 3600.0  # the curve's peak, seconds into the day (14:00)
    seed: int = 0
    block_size: int = 16
    model: str = "llama-3.1-8b"
    # Several models on one fleet: each workflow names one, drawn by weight from (model, weight)
    # pairs (empty: every workflow names `model`); a tenant's own `model` overrides the draw.
    models: tuple[tuple[str, float], ...] = ()
    rate_scale: float = 1.0
    window: tuple[float, float] | None = None
    limit: int | None = None
    name: str = field(default="agentic", init=False)
    tenants: dict[str, Tenant] = field(init=False)

    def __post_init__(self) -> None:
        Workload.__init__(self, rate_scale=self.rate_scale, window=self.window, limit=self.limit)
        if not self.tenants_spec:
            raise ValueError("at least one tenant")
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError("need 1 <= min_steps <= max_steps")
        if self.step_weights and (
            len(self.step_weights) != self.max_steps - self.min_steps + 1
            or min(self.step_weights) < 0
            or sum(self.step_weights) <= 0
        ):
            raise ValueError("step_weights: one weight >= 0 per length from min_steps to max_steps")
        if any(t.contexts < 0 or t.context_tokens < 0 for t in self.tenants_spec):
            raise ValueError("a tenant's contexts and context_tokens must be >= 0")
        names = [name for name, _ in self.models]
        if self.models and (
            not all(names)
            or len(set(names)) < len(names)
            or min(w for _, w in self.models) < 0
            or sum(w for _, w in self.models) <= 0
        ):
            raise ValueError("models: distinct names, each with a weight >= 0, weights summing to > 0")
        if self.workflows < 0 or self.rate_per_s <= 0:
            raise ValueError("workflows must be >= 0 and rate_per_s > 0")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError("failure_rate must be in [0, 1]")
        if self.burst_factor <= 0 or self.burst_s < 0:
            raise ValueError("burst_factor must be > 0 and burst_s >= 0")
        if self.burst_s > 0 and not self.burst_every_s >= self.burst_s:
            raise ValueError("bursts need burst_every_s >= burst_s > 0")
        if not 0.0 <= self.daily_amplitude < 1.0 or self.day_s <= 0:
            raise ValueError("daily_amplitude must be in [0, 1) and day_s > 0")
        if self.daily_amplitude > 0 and self.burst_s > 0 and self.burst_factor != 1.0:
            raise ValueError("a daily shape and bursts do not combine")
        self.tenants = {t.name: Tenant(t.name, t.priority, t.quota) for t in self.tenants_spec}

    def _size(self, rng: random.Random, mean: float) -> int:
        sigma = self.spread
        mu = math.log(max(mean, 1.0)) - sigma * sigma / 2.0
        return max(1, min(self.max_tokens_per_step, round(rng.lognormvariate(mu, sigma))))

    def _prompts(self, model: str) -> _Prompts:
        """Each tenant's system prompt and its shared contexts (each after its system prompt), on
        the model's hash chain: hashed once per workload and model."""
        systems = []
        for t in self.tenants_spec:
            chain = _Chain(chain_seed(model), self.block_size)
            chain.append(_segment_id(f"system/{t.name}"), t.system_prompt_tokens)
            systems.append(chain)
        contexts: list[list[_Chain]] = []
        for t, system in zip(self.tenants_spec, systems, strict=True):
            chains = []
            for j in range(t.contexts):
                chain = system.copy()
                chain.append(_segment_id(f"context/{t.name}/{j}"), t.context_tokens)
                chains.append(chain)
            contexts.append(chains)
        return systems, contexts

    def _records(self) -> Iterator[Record]:
        arrivals = random.Random(self.seed)
        shares = [t.share for t in self.tenants_spec]
        prompts = {self.model: self._prompts(self.model)}

        def prompts_of(model: str) -> _Prompts:
            found = prompts.get(model)
            if found is None:
                found = prompts[model] = self._prompts(model)
            return found

        at = 0.0
        shaped = (self.burst_s > 0 and self.burst_factor != 1.0) or self.daily_amplitude > 0
        for i in range(self.workflows):
            if shaped:
                at = self._next_arrival(arrivals, at)
            else:
                at += arrivals.expovariate(self.rate_per_s)
            yield (at, self._builder(i, shares, prompts_of))

    def _rate_until(self, t: float) -> tuple[float, float]:
        """The arrival rate in force at `t` (bursts or the daily shape on) and when it next changes."""
        if self.daily_amplitude > 0:
            hour = self.day_s / 24.0
            n = math.floor(t / hour)
            middle = (n + 0.5) * hour
            phase = 2.0 * math.pi * (middle - self.peak_s) / self.day_s
            return self.rate_per_s * (1.0 + self.daily_amplitude * math.cos(phase)), (n + 1) * hour
        period, length = self.burst_every_s, self.burst_s
        n = math.floor(t / period)
        while True:
            calm_end, burst_end = n * period + (period - length), (n + 1) * period
            if t < calm_end:
                return self.rate_per_s, calm_end
            if t < burst_end:
                return self.rate_per_s * self.burst_factor, burst_end
            n += 1

    def _next_arrival(self, rng: random.Random, at: float) -> float:
        """The next arrival of a Poisson process whose rate is piecewise constant (bursts): a
        unit exponential spent over the rates in force (the inverse of the cumulative rate)."""
        left = rng.expovariate(1.0)
        t = at
        while True:
            rate, until = self._rate_until(t)
            if t + left / rate <= until:
                return t + left / rate
            left -= (until - t) * rate
            t = until

    def _builder(
        self, i: int, shares: list[float], prompts_of: Callable[[str], _Prompts]
    ) -> Callable[[float, int], Task]:
        def build(arrival: float, index: int) -> Task:
            rng = random.Random(mix64(self.seed * 1_000_003 + i))
            which = rng.choices(range(len(self.tenants_spec)), weights=shares)[0]
            tenant = self.tenants_spec[which]
            if self.step_weights:
                steps = rng.choices(range(self.min_steps, self.max_steps + 1), weights=self.step_weights)[0]
            else:
                steps = rng.randint(self.min_steps, self.max_steps)
            news = [self._size(rng, self.task_tokens)] + [
                self._size(rng, self.tool_tokens) for _ in range(steps - 1)
            ]
            outputs = [self._size(rng, self.output_tokens) for _ in range(steps)]
            thinks = [0.0] + [
                rng.expovariate(1.0 / self.think_s) if self.think_s > 0 else 0.0 for _ in range(steps - 1)
            ]
            fails = [rng.random() < self.failure_rate for _ in range(steps)]
            # Drawn last, the context only with contexts and the model only from a mix, so that
            # workloads without keep their draws.
            systems, contexts = prompts_of(self.model)
            context = rng.choice(range(len(contexts[which]))) if contexts[which] else None
            model = tenant.model
            if model is None and self.models:
                model = rng.choices([m for m, _ in self.models], weights=[w for _, w in self.models])[0]
            if model is not None and model != self.model:
                systems, contexts = prompts_of(model)
            system = systems[which] if context is None else contexts[which][context]
            return _Workflow(
                task_id=f"wf{i}",
                uid=i,
                tenant=tenant,
                system=system,
                arrival_s=arrival,
                news=news,
                outputs=outputs,
                thinks=thinks,
                fails=fails,
                model=model,
            )

        return build

    def count_hint(self) -> int | None:
        if self.window is not None:
            return self.limit
        return self.workflows if self.limit is None else min(self.workflows, self.limit)

    def describe(self) -> dict[str, Any]:
        bursts = (
            {"bursts": {"factor": self.burst_factor, "seconds": self.burst_s, "every_s": self.burst_every_s}}
            if self.burst_s > 0
            else {}
        )
        daily = (
            {"daily": {"amplitude": self.daily_amplitude, "day_s": self.day_s, "peak_s": self.peak_s}}
            if self.daily_amplitude > 0
            else {}
        )
        return {
            **Workload.describe(self),
            **bursts,
            **daily,
            "workflows": self.workflows,
            "rate_per_s": self.rate_per_s,
            "steps": [self.min_steps, self.max_steps],
            **({"step_weights": list(self.step_weights)} if self.step_weights else {}),
            "task_tokens": self.task_tokens,
            "tool_tokens": self.tool_tokens,
            "output_tokens": self.output_tokens,
            "think_s": self.think_s,
            "failure_rate": self.failure_rate,
            **({"models": [[m, w] for m, w in self.models]} if self.models else {}),
            "seed": self.seed,
            "tenants": [
                {
                    "name": t.name,
                    "priority": t.priority,
                    "share": t.share,
                    "system_prompt_tokens": t.system_prompt_tokens,
                    "step_deadline_s": t.step_deadline_s,
                    "weight": t.quota.weight,
                    **({"contexts": t.contexts, "context_tokens": t.context_tokens} if t.contexts else {}),
                    **({"model": t.model} if t.model is not None else {}),
                }
                for t in self.tenants_spec
            ],
        }


# ------------------------------------------------------------------ two more families

# The generator's machinery with other tenants (CODING_TENANTS, RAG_CHAT_TENANTS) and sizes, as a
# check that it is general. Every value is a chosen illustration unless docs/simulator.md
# ("Synthetic families") cites a source.


@dataclass
class CodingAgentWorkload(AgenticWorkload):
    """Coding agents: long shared repository contexts, several steps, long outputs (edits), tool
    results of file reads and test runs, and the tools' running time between steps."""

    workflows: int = 500
    rate_per_s: float = 0.5
    tenants_spec: tuple[AgenticTenant, ...] = CODING_TENANTS
    min_steps: int = 3
    max_steps: int = 12
    task_tokens: float = 800.0  # the issue or instruction
    tool_tokens: float = 1500.0  # a file read, a diff, a test log
    output_tokens: float = 800.0  # an edit or a patch
    spread: float = 0.8
    think_s: float = 5.0  # the tool's run (tests, a build)
    name: str = field(default="coding", init=False)


@dataclass
class RagChatWorkload(AgenticWorkload):
    """Chat assistants with retrieval: mostly one turn, some two or three, each turn's prompt the
    conversation so far plus the question and its freshly retrieved passages; bursty arrivals."""

    workflows: int = 2000
    rate_per_s: float = 2.0
    tenants_spec: tuple[AgenticTenant, ...] = RAG_CHAT_TENANTS
    min_steps: int = 1
    max_steps: int = 3
    step_weights: tuple[float, ...] = (0.6, 0.25, 0.15)
    task_tokens: float = 850.0  # the question and its passages
    tool_tokens: float = 900.0  # a follow-up and its passages
    output_tokens: float = 210.0
    think_s: float = 20.0  # the user reads and types
    burst_factor: float = 8.0
    burst_s: float = 20.0
    burst_every_s: float = 120.0
    name: str = field(default="rag-chat", init=False)


# The generators by spec name (`load_workload`).
GENERATORS: dict[str, type[AgenticWorkload]] = {
    "agentic": AgenticWorkload,
    "coding": CodingAgentWorkload,
    "rag-chat": RagChatWorkload,
}


def generator_name(spec: str) -> str | None:
    """The generator a workload spec names (`agentic`, `coding:workflows=50`, ...), else None."""
    name = spec.partition(":")[0]
    return name if name in GENERATORS else None


# ------------------------------------------------------------------ synthetic traces for tests


class ListWorkload(Workload):
    """Explicit tasks (tests and small experiments): (arrival_s, Step) pairs, one tenant."""

    def __init__(
        self,
        requests: list[tuple[float, Step]],
        *,
        block_size: int = 16,
        model: str = "llama-3.1-8b",
        tenant: Tenant | None = None,
        name: str = "list",
        rate_scale: float = 1.0,
        window: tuple[float, float] | None = None,
        limit: int | None = None,
    ):
        super().__init__(rate_scale=rate_scale, window=window, limit=limit)
        self.requests = sorted(requests, key=lambda r: r[0])
        self.block_size = block_size
        self.model = model
        self.name = name
        tenant = tenant or Tenant("trace")
        self.tenants = {tenant.name: tenant}
        self._tenant = tenant

    def _records(self) -> Iterator[Record]:
        for at, step in self.requests:
            yield (at, self._builder(step))

    def _builder(self, step: Step) -> Callable[[float, int], Task]:
        def build(arrival: float, index: int) -> Task:
            return SingleRequest(f"rq{index}", self._tenant.name, self._tenant.priority, arrival, step)

        return build

    def count_hint(self) -> int | None:
        return len(self.requests) if self.limit is None else min(len(self.requests), self.limit)


def random_prompt_hashes(model: str, block_size: int, blocks: int, salt: int) -> list[int]:
    """`blocks` chained hashes of a prompt no other salt shares (tests, synthetic traces)."""
    parent = chain_seed(model)
    out: list[int] = []
    for j in range(blocks):
        parent = mix64(parent ^ mix64((salt << 24) + j)) >> 1
        out.append(parent)
    return out


# ------------------------------------------------------------------ from a command-line spec


# A generator spec's options (`agentic:key=value,...`): the generator's fields, by type.
GENERATOR_OPTIONS: dict[str, Any] = {
    "workflows": int,
    "rate_per_s": float,
    "min_steps": int,
    "max_steps": int,
    "step_weights": str,  # a/b/c: one weight per length from min_steps to max_steps
    "task_tokens": float,
    "tool_tokens": float,
    "output_tokens": float,
    "spread": float,
    "max_tokens_per_step": int,
    "think_s": float,
    "failure_rate": float,
    "burst_factor": float,
    "burst_s": float,
    "burst_every_s": float,
    "daily_amplitude": float,
    "day_s": float,
    "peak_s": float,
    "seed": int,
    "block_size": int,
    "model": str,
    "models": str,  # NAME[:WEIGHT]/...: each workflow's model, drawn by weight (default 1)
    "tenant_models": str,  # TENANT:MODEL/...: those tenants' workflows name that model
    "tenants": str,  # a name in TENANT_SETS
}
# A JSONL trace's options (`trace.jsonl:key=value,...`): which format, and a workflow trace's.
TRACE_OPTIONS: dict[str, Any] = {"kind": str, "replay": str, "skip_bad": bool}
JSONL_KINDS = ("mooncake", "workflow")


def load_workload(
    spec: str,
    *,
    rate_scale: float = 1.0,
    window: tuple[float, float] | None = None,
    limit: int | None = None,
    block_size: int | None = None,
    model: str | None = None,
    repeat: int = 1,
    deadline_s: float | None = None,
    skip_bad: bool = False,
) -> Workload:
    """A workload from a command-line spec:

    - a generator, `agentic[:key=value,...]`, `coding[:...]` or `rag-chat[:...]` (GENERATORS; keys:
      GENERATOR_OPTIONS, e.g. `agentic:workflows=5000,rate_per_s=20,seed=1`; `tenants=shared`
      picks `SHARED_TENANTS`, `step_weights=0.6/0.3/0.1` the workflows' lengths);
    - a trace file, `PATH[:key=value,...]` (TRACE_OPTIONS): a `.jsonl` file is a workflow trace
      (recorded.py) when a line carries a field beyond Mooncake's, else a Mooncake trace, unless
      `kind=mooncake` or `kind=workflow` says which; a workflow trace takes `replay=closed|open`
      and `skip_bad=true` (as `skip_bad` here: the command's `--skip-bad`); a `.csv` file is an
      Azure trace.
    """
    common: dict[str, Any] = {"rate_scale": rate_scale, "window": window, "limit": limit}
    if model is not None:
        common["model"] = model
    generator = generator_name(spec)
    if generator is not None:
        if skip_bad:
            raise ValueError(f"skip_bad is for trace files, not the {generator} generator")
        return _generator(generator, spec.partition(":")[2], common, block_size)
    path, options = _trace_spec(spec)
    extra: dict[str, Any] = {"repeat": repeat, "deadline_s": deadline_s}
    if block_size is not None:
        extra["block_size"] = block_size
    if path.suffix == ".jsonl":
        return _jsonl_trace(path, options, skip_bad, {**common, **extra})
    if path.suffix == ".csv":
        if options or skip_bad:
            raise ValueError(f"workload {spec!r}: an Azure trace takes no options")
        return AzureTrace(path, **common, **extra)
    raise ValueError(f"workload {spec!r}: expected a Mooncake or workflow .jsonl or an Azure .csv file")


def _generator(name: str, text: str, common: dict[str, Any], block_size: int | None) -> AgenticWorkload:
    options = key_values(text, name)
    unknown = sorted(set(options) - set(GENERATOR_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown {name} option(s) {', '.join(unknown)}; known: {', '.join(GENERATOR_OPTIONS)}"
        )
    values = {k: convert(k, v, GENERATOR_OPTIONS[k], name) for k, v in options.items()}
    if "tenants" in values:
        tenants = values.pop("tenants")
        if tenants not in TENANT_SETS:
            raise ValueError(f"unknown tenant set {tenants!r}; known: {', '.join(TENANT_SETS)}")
        values["tenants_spec"] = TENANT_SETS[tenants]
    if "step_weights" in values:
        weights = values["step_weights"]
        try:
            values["step_weights"] = tuple(float(w) for w in weights.split("/"))
        except ValueError:
            raise ValueError(f"{name} option step_weights={weights!r}: expected e.g. 0.6/0.3/0.1") from None
    if "models" in values:
        values["models"] = _model_mix(name, values["models"])
    if "tenant_models" in values:
        tenants_spec = values.get("tenants_spec", GENERATORS[name].tenants_spec)
        values["tenants_spec"] = _tenant_models(name, values.pop("tenant_models"), tenants_spec)
    if block_size is not None:
        values.setdefault("block_size", block_size)
    return GENERATORS[name](**{**common, **values})


def _model_mix(name: str, text: str) -> tuple[tuple[str, float], ...]:
    """`a:3/b:1` (or `a/b`, weights 1): the (model, weight) pairs of a generator's `models` (a
    model's name may hold a colon: the weight is what follows the last one, if a number)."""
    mix = []
    for item in text.split("/"):
        model, _, weight = item.rpartition(":")
        try:
            mix.append((model.strip(), float(weight)))
        except ValueError:
            mix.append((item.strip(), 1.0))
    if not all(model for model, _ in mix):
        raise ValueError(f"{name} option models={text!r}: expected e.g. llama-3.1-8b:3/qwen-7b:1")
    return tuple(mix)


def _tenant_models(name: str, text: str, tenants: tuple[AgenticTenant, ...]) -> tuple[AgenticTenant, ...]:
    """`assistant:a/agents:b`: those tenants' workflows name those models."""
    by_name = {t.name: t for t in tenants}
    models: dict[str, str] = {}
    for item in text.split("/"):
        tenant, sep, model = item.partition(":")
        tenant = tenant.strip()
        if not sep or not model.strip():
            raise ValueError(f"{name} option tenant_models={text!r}: expected e.g. assistant:a/agents:b")
        if tenant not in by_name:
            known = ", ".join(by_name)
            raise ValueError(f"{name} option tenant_models: no tenant {tenant!r}; known: {known}")
        models[tenant] = model.strip()
    return tuple(dataclasses.replace(t, model=models.get(t.name, t.model)) for t in tenants)


def _trace_spec(spec: str) -> tuple[Path, dict[str, Any]]:
    """`PATH` or `PATH:key=value,...`: the file and its options (TRACE_OPTIONS)."""
    path = Path(spec)
    text = ""
    if not path.exists():
        head, sep, text = spec.rpartition(":")
        if not (sep and "=" in text and Path(head).exists()):
            raise ValueError(
                f"workload {spec!r}: no such file, and not a generator ({', '.join(GENERATORS)}[:...])"
            )
        path = Path(head)
    options = key_values(text, f"trace {path.name}")
    unknown = sorted(set(options) - set(TRACE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown trace option(s) {', '.join(unknown)}; known: {', '.join(TRACE_OPTIONS)}")
    return path, {k: convert(k, v, TRACE_OPTIONS[k], f"trace {path.name}") for k, v in options.items()}


def _jsonl_trace(path: Path, options: dict[str, Any], skip_bad: bool, fields: dict[str, Any]) -> Workload:
    """A Mooncake or a workflow trace, as `load_workload` says."""
    # recorded.py builds on this module's MooncakeTrace: imported here, once this module is.
    from services.simulator.recorded import WorkflowTrace, carries_workflow_fields

    skip_bad = options.get("skip_bad", skip_bad)
    kind = options.get("kind")
    workflow_only = [
        name for name, given in (("replay", "replay" in options), ("skip_bad", skip_bad)) if given
    ]
    if kind is None:
        kind = "workflow" if workflow_only or carries_workflow_fields(path) else "mooncake"
    if kind not in JSONL_KINDS:
        raise ValueError(f"trace {path.name}: kind={kind!r}, expected one of {', '.join(JSONL_KINDS)}")
    if kind == "mooncake":
        if workflow_only:
            raise ValueError(f"trace {path.name}: {', '.join(workflow_only)}: only for kind=workflow")
        return MooncakeTrace(path, **fields)
    return WorkflowTrace(path, replay=options.get("replay", "closed"), skip_bad=skip_bad, **fields)
