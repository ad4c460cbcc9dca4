"""Idle GPU time: provisioned GPU-seconds that no request used. Pure functions, no I/O.

Method. Every few seconds (the ledger's idle sampler, 5 s by default) the ledger reads the
WORKERS KV bucket: each live worker's `WorkerState` (pool, GPU type, start time). For each
worker it then accounts the interval since the last time it covered that worker:

- **provisioned** GPU-seconds: from the end of the last covered interval (or the worker's start,
  if it restarted since) to now, one GPU per worker. A worker seen for the first time is covered
  from its start, but at most `backfill_s` back: the ledger does not invent idle time for the
  years a fleet may have run before it;
- **busy** GPU-seconds: what the worker reported in prefill and decode events that the ledger
  recorded since the last sample (the ``workers`` table keeps a running sum per worker, updated
  in the same transaction as the events);
- **idle** = provisioned - busy, never below zero. GPU time is reported when a request
  completes, so a long decode can report more busy time in one interval than the interval
  holds: the excess is carried to the worker's next intervals as a debt (``idle_debt_s``), so
  that over time idle = provisioned - busy exactly, whatever the timing of the reports.

Idle GPU-seconds are priced at the same US$/GPU-hour as busy ones (the ledger's prices by GPU
type); a GPU type without a price is an error with the reason, never free. The result is added
per pool and GPU type to time windows of `window_s` seconds (``idle_spend``); an interval that
spans several windows is shared among them in proportion to its overlap with each.

A worker that stops (its key deleted, or expired 10 s after its last heartbeat) is no longer
sampled; the time between its last sample and its end (at most one interval) is not counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.ledger.pricing import PricingError, price_gpu_seconds


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """A live worker, as its heartbeat in the WORKERS bucket describes it."""

    worker_id: str
    pool: str
    gpu_type: str
    started_at: float


@dataclass(frozen=True, slots=True)
class IdleAccount:
    """What the ledger has accounted of a worker so far (its ``workers`` row).

    `covered_until` is None for a worker never sampled (a row made by its GPU time only);
    `busy_total_s` is every GPU-second it reported, `busy_counted_s` those already set against
    provisioned time, and `debt_s` the busy seconds that exceeded it.
    """

    worker_id: str
    busy_total_s: float
    covered_until: float | None = None
    busy_counted_s: float = 0.0
    debt_s: float = 0.0


@dataclass(frozen=True, slots=True)
class AccountUpdate:
    """A worker's ``workers`` row after the sample."""

    worker_id: str
    pool: str
    gpu_type: str
    started_at: float
    covered_until: float
    busy_counted_s: float
    debt_s: float


@dataclass(slots=True)
class IdleShare:
    """What one sample adds to one (window, pool, GPU type) row of ``idle_spend``."""

    window_start: float
    window_s: float
    pool: str
    gpu_type: str
    provisioned_gpu_seconds: float = 0.0
    busy_gpu_seconds: float = 0.0
    idle_gpu_seconds: float = 0.0
    idle_cost_usd: float = 0.0
    workers: int = 0


@dataclass(frozen=True, slots=True)
class IdleFailure:
    worker_id: str
    reason: str


@dataclass(slots=True)
class IdleAccounting:
    accounts: list[AccountUpdate] = field(default_factory=list)  # one per sampled worker
    shares: list[IdleShare] = field(default_factory=list)  # by window, then pool and GPU type
    errors: list[IdleFailure] = field(default_factory=list)

    @property
    def idle_cost_usd(self) -> float:
        return sum(share.idle_cost_usd for share in self.shares)

    @property
    def idle_gpu_seconds(self) -> float:
        return sum(share.idle_gpu_seconds for share in self.shares)


def account_idle(
    samples: Iterable[WorkerSample],
    accounts: Mapping[str, IdleAccount],
    now: float,
    prices: Mapping[str, float],
    *,
    window_s: float = 60.0,
    backfill_s: float = 10.0,
) -> IdleAccounting:
    """Idle time of every sampled worker since it was last covered, up to `now` (the module's
    method); `accounts` holds what was accounted before (absent: a worker never seen)."""
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"idle window must be > 0 s, not {window_s!r}")
    out = IdleAccounting()
    shares: dict[tuple[float, str, str], IdleShare] = {}
    latest = {sample.worker_id: sample for sample in samples}  # one account per worker
    for sample in latest.values():
        account = accounts.get(sample.worker_id)
        busy_total = account.busy_total_s if account is not None else 0.0
        if account is None or account.covered_until is None:
            # First sight: busy time reported before it is not set against anything.
            start = max(sample.started_at, now - backfill_s)
            busy_before, debt = busy_total, 0.0
        else:
            start = max(account.covered_until, sample.started_at)
            busy_before, debt = account.busy_counted_s, account.debt_s
        provisioned = max(0.0, now - start)
        consumed = max(0.0, busy_total - busy_before) + debt
        idle = max(0.0, provisioned - consumed)
        out.accounts.append(
            AccountUpdate(
                worker_id=sample.worker_id,
                pool=sample.pool,
                gpu_type=sample.gpu_type,
                started_at=sample.started_at,
                covered_until=max(now, start),
                busy_counted_s=busy_total,
                debt_s=max(0.0, consumed - provisioned),
            )
        )
        if provisioned <= 0.0:
            continue
        try:
            cost = price_gpu_seconds(sample.gpu_type, idle, prices)
        except PricingError as exc:
            cost = 0.0
            out.errors.append(
                IdleFailure(
                    sample.worker_id,
                    f"idle time not priced: {exc}; {idle} idle GPU-seconds of worker "
                    f"{sample.worker_id} (pool {sample.pool}) left unpriced",
                )
            )
        for window_start, overlap in _windows(start, now, window_s):
            share_key = (window_start, sample.pool, sample.gpu_type)
            share = shares.get(share_key)
            if share is None:
                share = shares[share_key] = IdleShare(window_start, window_s, sample.pool, sample.gpu_type)
            fraction = 1.0 if overlap == provisioned else overlap / provisioned
            share.provisioned_gpu_seconds += overlap
            share.busy_gpu_seconds += (provisioned - idle) * fraction
            share.idle_gpu_seconds += idle * fraction
            share.idle_cost_usd += cost * fraction
            share.workers += 1
    out.shares = [shares[key] for key in sorted(shares)]
    return out


def _windows(start: float, end: float, window_s: float) -> list[tuple[float, float]]:
    """The windows [k*window_s, (k+1)*window_s) that [start, end) overlaps, with the overlap."""
    first = math.floor(start / window_s)
    last = math.floor(end / window_s)
    if first == last or (end == last * window_s and first == last - 1):
        return [(first * window_s, end - start)]
    out: list[tuple[float, float]] = []
    for k in range(first, last + 1):
        lo, hi = max(start, k * window_s), min(end, (k + 1) * window_s)
        if hi > lo:
            out.append((k * window_s, hi - lo))
    return out
