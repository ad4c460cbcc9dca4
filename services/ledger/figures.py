"""The figures of merit, from the ledger's sums: pure functions, no I/O.

- **Spend** is everything the fleet cost: GPU-seconds reported by prefills and decodes (busy),
  KV transfers, and provisioned GPU time no request used (idle, idle.py).
- **Cost per successful task** is all spend, failed tasks' and idle included, divided by the
  number of tasks that succeeded (tasks.py). It has no value while no task has succeeded.
- **Wasted spend** is the spend on tasks that failed (a step failed, a deadline was missed, or the
  workflow was abandoned).
- **Idle spend** is the price of idle GPU time, per pool.

Per tenant, idle spend is not attributed (no tenant caused it): a tenant's cost per successful
task is its own busy spend over its successful tasks. Per pool, spend is the GPU time and KV
transfers of the pool's workers plus the pool's idle time, over the successful tasks that used
the pool. A task shared by pools counts for each.

Over a time window (`since`), spend counts when it was incurred (the event's time, or the idle
window's), and tasks count when they saw their last event.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from services.ledger.tasks import FAILURE_REASONS, FailureReason, TaskStatus

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)", re.IGNORECASE)
_DURATIONS = re.compile(rf"(?:{_DURATION.pattern})+", re.IGNORECASE)
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


class SinceError(ValueError):
    """A `--since` that is neither a duration, an ISO 8601 time nor Unix seconds."""


def parse_since(text: str, now: float) -> float:
    """The start of a window, in Unix seconds: a duration back from `now` (``90s``, ``15m``,
    ``2h``, ``7d``, ``1h30m``), an ISO 8601 time (UTC unless it says otherwise) or Unix seconds."""
    value = text.strip()
    if not value:
        raise SinceError("empty --since")
    compact = value.replace(" ", "")
    if _DURATIONS.fullmatch(compact):
        seconds = sum(float(n) * _UNIT_S[unit.lower()] for n, unit in _DURATION.findall(compact))
        return now - seconds
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds) or seconds < 0:
            raise SinceError(f"--since {text!r}: Unix seconds must be finite and >= 0")
        return seconds
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        raise SinceError(
            f"--since {text!r}: give a duration back from now (90s, 15m, 2h, 7d), "
            "an ISO 8601 time (2025-01-31T12:00:00Z) or Unix seconds"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


@dataclass(slots=True)
class Figures:
    """The figures of one group (the fleet, a tenant, a pool) over one window."""

    gpu_spend_usd: float = 0.0
    kv_transfer_spend_usd: float = 0.0
    # None where idle time is not attributed (tenants).
    idle_spend_usd: float | None = 0.0
    wasted_spend_usd: float = 0.0
    gpu_seconds: float = 0.0
    idle_gpu_seconds: float | None = 0.0
    provisioned_gpu_seconds: float | None = 0.0
    tasks_succeeded: int = 0
    tasks_failed: int = 0
    tasks_running: int = 0
    failed_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))

    def add_tasks(self, status: TaskStatus, reason: FailureReason | None, count: int) -> None:
        if status == "succeeded":
            self.tasks_succeeded += count
        elif status == "failed":
            self.tasks_failed += count
            if reason is not None:
                self.failed_by_reason[reason] = self.failed_by_reason.get(reason, 0) + count
        else:
            self.tasks_running += count

    @property
    def busy_spend_usd(self) -> float:
        return self.gpu_spend_usd + self.kv_transfer_spend_usd

    @property
    def spend_usd(self) -> float:
        return self.busy_spend_usd + (self.idle_spend_usd or 0.0)

    @property
    def cost_per_successful_task_usd(self) -> float | None:
        return self.spend_usd / self.tasks_succeeded if self.tasks_succeeded else None

    @property
    def waste_fraction(self) -> float | None:
        spend = self.spend_usd
        return self.wasted_spend_usd / spend if spend > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "cost_per_successful_task_usd": self.cost_per_successful_task_usd,
            "spend_usd": self.spend_usd,
            "busy_spend_usd": self.busy_spend_usd,
            "gpu_spend_usd": self.gpu_spend_usd,
            "kv_transfer_spend_usd": self.kv_transfer_spend_usd,
            "idle_spend_usd": self.idle_spend_usd,
            "wasted_spend_usd": self.wasted_spend_usd,
            "waste_fraction": self.waste_fraction,
            "gpu_seconds": self.gpu_seconds,
            "idle_gpu_seconds": self.idle_gpu_seconds,
            "provisioned_gpu_seconds": self.provisioned_gpu_seconds,
            "tasks": {
                "succeeded": self.tasks_succeeded,
                "failed": self.tasks_failed,
                "running": self.tasks_running,
                "total": self.tasks_succeeded + self.tasks_failed + self.tasks_running,
            },
            "failed_by_reason": dict(self.failed_by_reason),
        }
