"""Workflow traces: the Mooncake JSONL format plus who sent each request, its priority class, its
deadlines and its place in a workflow (docs/simulator.md, "Workflow traces").

One line a request (`WorkflowLine`, decoded strictly): Mooncake's `timestamp` (ms), `input_length`,
`output_length` and `hash_ids` (512-token blocks), and optionally `tenant`, `priority`,
`workflow_id` with `step` (1-based) and `steps`, `deadline_ms` (for the first token) and
`e2e_deadline_ms` (for the last), both after the request's arrival, `completed_ms` (when the
recording saw it complete) and `model` (the model it named; a workflow's lines name one). A line
without `workflow_id` is a single request, so a plain Mooncake file is a valid workflow trace and
gives the tasks `MooncakeTrace` gives.

`WorkflowTrace` replays it closed loop (`replay="closed"`, the default): a workflow arrives at its
step 1's timestamp and its step k+1 is issued when step k completes in the simulation, after the
recorded think time (step k+1's arrival less step k's `completed_ms`; without `completed_ms`, less
step k's arrival), through the simulator's one mechanism for workflows, so a failed or rejected
step ends its workflow as the agentic generator's do. A workflow whose lines stop before its
`steps` (it failed in the recording, or the recording ended first) is replayed to its last
recorded step, whose result its agent then cannot use: it stops there, as the recording's did.
Open loop (`replay="open"`) issues every line at its timestamp, each its own task, as the
recording saw them arrive.

The file is read once when the workload is made, to check every line (a bad line is an error
naming the file and the line, or with `skip_bad` is counted and skipped) and to index it: each
task's lines' byte offsets. The replay then reads a step's line when the simulator asks for the
step, so memory holds the index (about 120 bytes a line), not the requests.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from schemas.events import PriorityClass
from services.simulator.workload import MooncakeTrace, Record, SingleRequest, Step, Task, Tenant

Replay = Literal["open", "closed"]
REPLAYS: tuple[Replay, ...] = ("closed", "open")

_Milliseconds = Annotated[float, msgspec.Meta(ge=0)]


class WorkflowLine(msgspec.Struct, frozen=True):
    """One line of a workflow trace (fields not named here are ignored)."""

    timestamp: _Milliseconds  # the request's arrival, from the trace's start
    input_length: Annotated[int, msgspec.Meta(ge=1)]
    output_length: Annotated[int, msgspec.Meta(ge=0)]
    hash_ids: list[int]  # the prompt's 512-token blocks; an equal id, a reusable block
    tenant: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    priority: PriorityClass | None = None
    workflow_id: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    step: Annotated[int, msgspec.Meta(ge=1)] | None = None
    steps: Annotated[int, msgspec.Meta(ge=1)] | None = None
    deadline_ms: Annotated[float, msgspec.Meta(gt=0)] | None = None  # first token, after arrival
    e2e_deadline_ms: Annotated[float, msgspec.Meta(gt=0)] | None = None  # last token, after arrival
    completed_ms: _Milliseconds | None = None  # the recorded completion, from the trace's start
    model: Annotated[str, msgspec.Meta(min_length=1)] | None = None  # default: the trace's `model`


# The fields a plain Mooncake line lacks: a file carrying any of them is read as a workflow trace.
EXTENSION_FIELDS = (
    "tenant",
    "priority",
    "workflow_id",
    "step",
    "steps",
    "deadline_ms",
    "e2e_deadline_ms",
    "completed_ms",
    "model",
)
_EXTENSION_KEY = re.compile(rb'"(?:' + b"|".join(f.encode() for f in EXTENSION_FIELDS) + rb')"\s*:')


def carries_workflow_fields(path: Path) -> bool:
    """Whether any line of the JSONL file has a field of the workflow format beyond Mooncake's
    (a scan of the bytes for a key, a megabyte at a time: hash ids hold no quotes)."""
    with path.open("rb") as handle:
        tail = b""
        while chunk := handle.read(1 << 20):
            if _EXTENSION_KEY.search(tail + chunk):
                return True
            tail = chunk[-64:]  # a key split between two chunks
    return False


@dataclass(slots=True)
class _Recorded:
    """One task of the file, as the first reading finds it: a single request or a workflow."""

    line: int  # its first line's number (1-based)
    timestamp_ms: float
    offsets: list[int]  # its lines' byte offsets, in step order
    workflow_id: str | None = None
    tenant: str | None = None
    priority: PriorityClass | None = None
    model: str | None = None
    declared_steps: int | None = None
    declared_at: int = 0  # the line that declared them
    last_line: int = 0
    last_timestamp_ms: float = 0.0


@dataclass(slots=True)
class _Index:
    tasks: list[_Recorded] = field(default_factory=list)
    lines: int = 0  # replayed
    skipped: int = 0
    first_skipped: str | None = None  # "line N: why", the first line skipped
    last_timestamp_ms: float = 0.0
    tenants: dict[str, PriorityClass | None] = field(default_factory=dict)  # in order of appearance
    models: dict[str, None] = field(default_factory=dict)  # the models lines name, in that order

    def cut_short(self) -> int:
        """Workflows whose lines stop before their declared steps."""
        return sum(1 for task in self.tasks if len(task.offsets) < (task.declared_steps or 0))

    def line_offsets(self) -> array[int]:
        """Every replayed line's byte offset, in the file's order (open replay)."""
        return array("q", sorted(offset for task in self.tasks for offset in task.offsets))


class _BadLine(Exception):
    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line
        self.message = message


def _read_index(path: Path, skip_bad: bool) -> _Index:
    """Check every line and index the file's tasks (raising `ValueError` on a bad line unless
    `skip_bad`, which counts it)."""
    index = _Index()
    decoder = msgspec.json.Decoder(WorkflowLine)
    workflows: dict[str, _Recorded] = {}

    offset = 0
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            here, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                try:
                    line = decoder.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise _BadLine(number, str(exc)) from None
                step = _check_line(line, number)
                if line.workflow_id is None:
                    index.tasks.append(_Recorded(number, line.timestamp, [here], tenant=line.tenant))
                else:
                    _add_step(line, line.workflow_id, step, number, here, workflows, index.tasks)
            except _BadLine as error:
                if not skip_bad:
                    raise ValueError(f"{path}:{error.line}: {error.message}") from None
                index.skipped += 1
                if index.first_skipped is None:
                    index.first_skipped = f"line {error.line}: {error.message}"
                continue
            index.lines += 1
            index.last_timestamp_ms = max(index.last_timestamp_ms, line.timestamp)
            if line.tenant is not None:
                index.tenants.setdefault(line.tenant, line.priority)
            if line.model is not None:
                index.models.setdefault(line.model)
    return index


def _check_line(line: WorkflowLine, number: int) -> int:
    """What a line must hold on its own (its workflow's rules are `_add_step`'s); its step (0 for
    a single request)."""
    if line.workflow_id is None:
        if line.step is not None or line.steps is not None:
            raise _BadLine(number, "step or steps without workflow_id")
    elif line.step is None:
        raise _BadLine(number, f"workflow {line.workflow_id!r}: a line without its step")
    elif line.steps is not None and line.step > line.steps:
        raise _BadLine(number, f"step {line.step} of a workflow of {line.steps} steps")
    needed = line.input_length // MooncakeTrace.default_block_size
    if len(line.hash_ids) < needed:
        raise _BadLine(
            number,
            f"{len(line.hash_ids)} hash_ids for input_length {line.input_length}: its "
            f"{needed} full 512-token blocks need one each",
        )
    if line.completed_ms is not None and line.completed_ms < line.timestamp:
        raise _BadLine(number, "completed_ms is before timestamp")
    return line.step or 0


def _add_step(
    line: WorkflowLine,
    name: str,
    step: int,
    number: int,
    offset: int,
    workflows: dict[str, _Recorded],
    tasks: list[_Recorded],
) -> None:
    """A workflow's line (`name`'s step `step`): its step 1 starts a task; step k+1 must follow its
    step k, in time too, for the same tenant, and every line's `steps` must agree. (A step may
    change its class, as a request in the mesh may; the task keeps its step 1's: see
    `_RecordedWorkflow`. Its model it may not: an agent's steps extend one conversation, whose
    KV one model's workers hold.)"""
    task = workflows.get(name)
    if step == 1:
        if task is not None:
            raise _BadLine(number, f"workflow {name!r} starts again (its step 1 is line {task.line})")
        task = workflows[name] = _Recorded(
            number,
            line.timestamp,
            [offset],
            workflow_id=name,
            tenant=line.tenant,
            priority=line.priority,
            model=line.model,
            declared_steps=line.steps,
            declared_at=number if line.steps is not None else 0,
            last_line=number,
            last_timestamp_ms=line.timestamp,
        )
        tasks.append(task)
        return
    if task is None:
        raise _BadLine(number, f"step {step} of workflow {name!r} before its step 1")
    last = len(task.offsets)
    if step != last + 1:
        raise _BadLine(
            number, f"step {step} of workflow {name!r} after its step {last} (line {task.last_line})"
        )
    if line.steps is not None and task.declared_steps is not None and line.steps != task.declared_steps:
        raise _BadLine(
            number,
            f"workflow {name!r} has {line.steps} steps here, "
            f"{task.declared_steps} at line {task.declared_at}",
        )
    if line.steps is None and task.declared_steps is not None and step > task.declared_steps:
        raise _BadLine(number, f"step {step} of workflow {name!r}, of {task.declared_steps} steps")
    if line.tenant != task.tenant:
        raise _BadLine(
            number, f"workflow {name!r} is tenant {task.tenant!r}'s (line {task.line}), not {line.tenant!r}"
        )
    if line.model != task.model:
        raise _BadLine(
            number, f"workflow {name!r} names model {task.model!r} (line {task.line}), not {line.model!r}"
        )
    if line.timestamp < task.last_timestamp_ms:
        raise _BadLine(
            number, f"step {step} of workflow {name!r} arrives before its step {last} (line {task.last_line})"
        )
    if line.steps is not None and task.declared_steps is None:
        task.declared_steps, task.declared_at = line.steps, number
    task.offsets.append(offset)
    task.last_line, task.last_timestamp_ms = number, line.timestamp


class _LineReader:
    """A trace file's lines by byte offset, for one replay (closed when the replay lets go)."""

    __slots__ = ("_decoder", "_handle")

    def __init__(self, path: Path):
        self._handle = path.open("rb")
        self._decoder = msgspec.json.Decoder(WorkflowLine)

    def line(self, offset: int) -> WorkflowLine:
        handle = self._handle
        handle.seek(offset)  # within the read buffer, no system call: open replay reads in order
        return self._decoder.decode(handle.readline())

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)  # absent when the file would not open
        if handle is not None:
            handle.close()


class _RecordedWorkflow(Task):
    """A recorded workflow, closed loop: each step read from the file when the simulator issues it,
    its think time the recorded gap from the previous step's completion. Its priority class is its
    step 1's for all its steps: the simulator's tasks carry one class (admission, the router and
    the ledger's figures read the task's)."""

    __slots__ = (
        "_copy",
        "_offsets",
        "_previous_done_ms",
        "_reader",
        "_recorded",
        "_trace",
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
        tenant: str,
        priority: PriorityClass,
        arrival_s: float,
        trace: WorkflowTrace,
        reader: _LineReader,
        offsets: list[int],
        steps: int,
        copy: int,
    ):
        self.task_id = task_id
        self.tenant = tenant
        self.priority = priority
        self.arrival_s = arrival_s
        self.steps = steps  # as declared: more than the lines recorded when it was cut short
        self._recorded = len(offsets)
        self._trace = trace
        self._reader = reader
        self._offsets = offsets
        self._copy = copy
        self._previous_done_ms = 0.0

    def step(self, index: int) -> Step:
        if not 1 <= index <= self._recorded:
            raise IndexError(f"workflow {self.task_id} has {self._recorded} steps recorded")
        line = self._reader.line(self._offsets[index - 1])
        # Recorded as completed after the next step arrived (a client that did not wait): no wait.
        think_s = max(0.0, line.timestamp - self._previous_done_ms) / 1000.0 if index > 1 else 0.0
        self._previous_done_ms = line.completed_ms if line.completed_ms is not None else line.timestamp
        # Cut short in the recording: its agent stops after its last recorded step.
        stops = index == self._recorded < self.steps
        return self._trace.line_step(line, self._copy, think_s, fails=stops)


class WorkflowTrace(MooncakeTrace):
    """A workflow trace (module docstring), replayed `replay` ("closed" or "open") loop; with
    `skip_bad`, bad lines are counted (`skipped_lines` in `describe()`) and skipped. Lines without
    a tenant or a priority are `tenant`'s at `priority`, as a Mooncake trace's; without
    `e2e_deadline_ms`, a request's deadline is `deadline_s`. `rate_scale` compresses the arrivals
    of workflows (and, open loop, of every line), not the think times between their steps."""

    kind = "workflow"

    def __init__(self, path: str | Path, *, replay: str = "closed", skip_bad: bool = False, **trace: Any):
        """`trace`: `MooncakeTrace`'s options (block_size, model, tenant, priority, deadline_s,
        repeat, rate_scale, window, limit)."""
        super().__init__(path, **trace)
        if replay not in REPLAYS:
            raise ValueError(f"replay {replay!r}: expected one of {', '.join(REPLAYS)}")
        self.replay: Replay = "open" if replay == "open" else "closed"
        self.skip_bad = skip_bad
        self._index = _read_index(self.path, skip_bad)
        # The recorded tenants (each at its first line's class), and `tenant` for lines naming none.
        self.tenants = {}
        if not self._index.tenants or any(task.tenant is None for task in self._index.tasks):
            self.tenants[self.tenant] = Tenant(self.tenant, self.priority)
        for name, priority in self._index.tenants.items():
            self.tenants.setdefault(name, Tenant(name, priority or self.priority))

    @property
    def skipped_lines(self) -> int:
        return self._index.skipped

    def _line_count(self) -> int:
        return self._index.lines

    def _period(self) -> float:
        return self._repeat_period(self._index.last_timestamp_ms / 1000.0, self._index.lines)

    def count_hint(self) -> int | None:
        if self.window is not None:
            return self.limit
        per_copy = self._index.lines if self.replay == "open" else len(self._index.tasks)
        total = per_copy * self.repeat
        return total if self.limit is None else min(total, self.limit)

    def line_step(self, line: WorkflowLine, copy: int, think_s: float = 0.0, *, fails: bool = False) -> Step:
        """A line's request: its deadlines, or the trace's `deadline_s` for its last token."""
        return self._step(
            line.input_length,
            line.output_length,
            line.hash_ids,
            copy,
            deadline_s=line.e2e_deadline_ms / 1000.0 if line.e2e_deadline_ms is not None else self.deadline_s,
            first_token_deadline_s=line.deadline_ms / 1000.0 if line.deadline_ms is not None else None,
            think_s=think_s,
            fails=fails,
            model=line.model,
        )

    def _records(self) -> Iterator[Record]:
        reader = _LineReader(self.path)
        period = self._period()
        if self.replay == "open":
            offsets = self._index.line_offsets()
            for copy in range(self.repeat):
                for offset in offsets:
                    line = reader.line(offset)
                    yield (line.timestamp / 1000.0 + copy * period, self._line_builder(line, copy))
            return
        for copy in range(self.repeat):
            for task in self._index.tasks:
                yield (task.timestamp_ms / 1000.0 + copy * period, self._task_builder(task, copy, reader))

    def _single(self, line: WorkflowLine, copy: int, task_id: str, arrival: float) -> Task:
        tenant = line.tenant if line.tenant is not None else self.tenant
        priority = line.priority if line.priority is not None else self.priority
        return SingleRequest(task_id, tenant, priority, arrival, self.line_step(line, copy))

    def _line_builder(self, line: WorkflowLine, copy: int) -> Callable[[float, int], Task]:
        """Open loop: the line is a task of its own (a workflow's step named for it)."""

        def build(arrival: float, index: int) -> Task:
            if line.workflow_id is None:
                return self._single(line, copy, f"mc{index}", arrival)
            return self._single(
                line, copy, f"{self._workflow_name(line.workflow_id, copy)}-{line.step}", arrival
            )

        return build

    def _task_builder(self, task: _Recorded, copy: int, reader: _LineReader) -> Callable[[float, int], Task]:
        def build(arrival: float, index: int) -> Task:
            if task.workflow_id is None:
                return self._single(reader.line(task.offsets[0]), copy, f"mc{index}", arrival)
            return _RecordedWorkflow(
                task_id=self._workflow_name(task.workflow_id, copy),
                tenant=task.tenant if task.tenant is not None else self.tenant,
                priority=task.priority if task.priority is not None else self.priority,
                arrival_s=arrival,
                trace=self,
                reader=reader,
                offsets=task.offsets,
                steps=max(len(task.offsets), task.declared_steps or 0),
                copy=copy,
            )

        return build

    @staticmethod
    def _workflow_name(workflow_id: str, copy: int) -> str:
        return f"{workflow_id}.r{copy}" if copy else workflow_id

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "replay": self.replay,
            "lines": self._index.lines,
            "workflows": sum(1 for task in self._index.tasks if task.workflow_id is not None),
            "workflows_cut_short": self._index.cut_short(),
            "skipped_lines": self._index.skipped,
            "first_skipped": self._index.first_skipped,
            **({"models": list(self._index.models)} if self._index.models else {}),
        }
