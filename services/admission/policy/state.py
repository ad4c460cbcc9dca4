"""What admission holds between decisions (`AdmissionState`): the tenants' quota usage, the
fleet as the workers' heartbeats last told it (`FleetLoad`) with the admissions and completions
heard since, and the deferral queue (its entries, `Entry`, and the heaps that order them). It
decides nothing: saturation.py, queue.py and decide.py read and update it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.admission.policy.quota import TenantUsage
from services.admission.policy.types import AdmissionRequest, Outcome, Prediction
from services.router.policy import WorkerSpeed


@dataclass(frozen=True, slots=True)
class FleetLoad:
    """The workers' state as their heartbeats last told it."""

    observed_at: float
    workers: int  # live workers (not draining, heartbeat fresh)
    waiting: int  # requests queued on them
    running: int
    kv_utilisation: float  # KV blocks used / KV blocks, over live workers
    context_tokens: int = 0  # KV tokens of the running batches
    fastest: WorkerSpeed | None = None  # the live worker whose lone decode step is quickest


@dataclass(slots=True)
class Entry:
    request: AdmissionRequest
    key: tuple[int, int, int, float, int]  # dispatch order, smallest first
    start: float  # fair-queuing start tag
    finish: float
    due: float
    offered_at: float
    prediction: Prediction | None
    predicted_at: float
    removed: bool = False


@dataclass(slots=True)
class AdmissionState:
    usage: dict[str, TenantUsage] = field(default_factory=dict)
    fleet: FleetLoad | None = None
    # Requests admitted (by any replica) and finished since `fleet` was observed.
    admitted_since: int = 0
    finished_since: int = 0
    # ... of them Batch API lines (no queue ahead of an interactive request: `saturation`).
    batch_admitted_since: int = 0
    batch_finished_since: int = 0
    saturation: float = 0.0  # the last computed (a metric)
    deferred: dict[str, Entry] = field(default_factory=dict)
    deferred_bytes: int = 0
    # Decisions on deferred requests, for the caller to take (`take_outcomes`).
    outcomes: list[Outcome] = field(default_factory=list)
    _queue: list[tuple[tuple[int, int, int, float, int], Entry]] = field(default_factory=list)
    _due: list[tuple[float, int, Entry]] = field(default_factory=list)
    # The queue by shedding rank, lowest first (`lowest`); removed entries are dropped lazily.
    _ranks: list[tuple[tuple[int, int, int, float, float], int, Entry]] = field(default_factory=list)
    _virtual: dict[str, float] = field(default_factory=dict)  # per class
    # Per class, the queued entries by start tag: the fair queue's virtual time is the smallest
    # start tag still waiting (entries served out of tag order, ahead of others by level or
    # workflow standing, must not pull it forward: it would erase the other tenants' credit).
    _starts: dict[str, list[tuple[float, int, Entry]]] = field(default_factory=dict)
    _last_finish: dict[tuple[str, str], float] = field(default_factory=dict)  # (class, tenant)
    _seq: int = 0
