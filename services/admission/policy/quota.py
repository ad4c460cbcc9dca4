"""Whether a request may be charged: `validate` (a known tenant, a priority in range, a deadline
neither before submission nor absurdly far) and the tenant's quota: its token buckets and
concurrency leases (`charge_quota`, `release_quota`), over quota a `Reject("quota")` with the
retry-after the buckets give. Replicas share the usage (`TenantUsage`) or take slices of it in
advance (`leasable`, `lease_slice`, `take_lease`, `return_lease`, `QuotaLease`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.admission.policy.types import (
    CLASS_RANK,
    CLASSES,
    AdmissionLimits,
    AdmissionRequest,
    Reject,
    TenantQuota,
)

# ------------------------------------------------------------------ validation


def validate(
    request: AdmissionRequest, quota: TenantQuota | None, limits: AdmissionLimits, now: float
) -> Reject | None:
    if quota is None:
        return Reject("invalid", f"unknown tenant {request.tenant!r}", None)
    if request.priority not in CLASS_RANK:
        return Reject(
            "invalid", f"priority must be one of {', '.join(CLASSES)}, not {request.priority!r}", None
        )
    if not limits.min_priority_level <= request.priority_level <= limits.max_priority_level:
        return Reject(
            "invalid",
            f"priority level {request.priority_level} is out of range "
            f"[{limits.min_priority_level}, {limits.max_priority_level}]",
            None,
        )
    if request.input_tokens < 0 or request.output_tokens < 1:
        return Reject("invalid", "a request needs a prompt and max_tokens >= 1", None)
    deadline = request.deadline_at
    if deadline is not None:
        if not math.isfinite(deadline):
            return Reject("invalid", f"the deadline {deadline} is not a time", None)
        if deadline <= request.submitted_at:
            return Reject(
                "invalid",
                f"the deadline is {request.submitted_at - deadline:.3f} s before the request was "
                "submitted (a negative deadline)",
                None,
            )
        if deadline - request.submitted_at > limits.max_deadline_s:
            return Reject(
                "invalid",
                f"the deadline is {deadline - request.submitted_at:.0f} s after submission; the "
                f"limit is {limits.max_deadline_s:.0f} s",
                None,
            )
        if deadline <= now:
            return Reject("deadline", "the request's deadline passed before admission", None)
    return None


# ------------------------------------------------------------------ quotas


@dataclass(slots=True)
class Bucket:
    rate: float
    capacity: float
    level: float
    updated_at: float

    def refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated_at)
        self.level = min(self.capacity, self.level + elapsed * self.rate)
        self.updated_at = max(self.updated_at, now)

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if it is now); inf if it never fits."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)


@dataclass(slots=True)
class TenantUsage:
    """A tenant's quota state: its buckets' levels and its requests in flight (request id -> when
    the lease lapses). Shared between admission replicas (one KV entry per tenant)."""

    buckets: dict[str, Bucket] = field(default_factory=dict)
    in_flight: dict[str, float] = field(default_factory=dict)


def _asked(name: str, request: AdmissionRequest) -> float:
    if name == "requests":
        return 1.0
    if name == "input_tokens":
        return float(request.input_tokens)
    if name == "output_tokens":
        return float(request.output_tokens)
    return float(request.tokens)


def _synced_buckets(usage: TenantUsage, quota: TenantQuota, now: float) -> list[tuple[str, Bucket]]:
    """The tenant's limited buckets, brought to the configuration and refilled to `now`."""
    configured = list(quota.buckets())
    for name in [n for n in usage.buckets if n not in {c[0] for c in configured}]:
        del usage.buckets[name]  # the limit was lifted
    synced = []
    for name, rate, capacity in configured:
        bucket = usage.buckets.get(name)
        if bucket is None:
            bucket = usage.buckets[name] = Bucket(rate, capacity, capacity, now)
        elif bucket.rate != rate or bucket.capacity != capacity:  # the config changed
            bucket.rate, bucket.capacity = rate, capacity
            bucket.level = min(bucket.level, capacity)
        bucket.refill(now)
        synced.append((name, bucket))
    return synced


def _shortfall(
    buckets: list[tuple[str, Bucket]], quota: TenantQuota, request: AdmissionRequest
) -> Reject | None:
    """Over quota (with the retry-after its buckets give), or None when every bucket holds enough."""
    wait = 0.0
    for name, bucket in buckets:
        needed = _asked(name, request)
        wait_here = bucket.wait_for(needed)
        if wait_here == math.inf:
            return Reject(
                "quota",
                f"the request asks {needed:.0f} {name.replace('_', ' ')}, more than tenant "
                f"{request.tenant!r}'s burst of {bucket.capacity:.0f}",
                None,
            )
        wait = max(wait, wait_here)
    if wait > 0:
        limited = ", ".join(f"{rate:g} {name.replace('_', ' ')}/s" for name, rate, _ in quota.buckets())
        return Reject("quota", f"tenant {request.tenant!r} is over its quota ({limited})", wait)
    return None


def charge_quota(
    usage: TenantUsage, quota: TenantQuota, request: AdmissionRequest, limits: AdmissionLimits, now: float
) -> Reject | None:
    """Charge the request to the tenant's buckets and take a concurrency lease, or reject it with
    the retry-after its buckets give. Charging the same request twice (a redelivery) is a no-op."""
    if request.request_id in usage.in_flight:
        return None
    buckets = _synced_buckets(usage, quota, now)
    rejected = _shortfall(buckets, quota, request)
    if rejected is not None:
        return rejected
    for lapsed in [r for r, until in usage.in_flight.items() if until <= now]:
        del usage.in_flight[lapsed]
    if quota.max_concurrency is not None and len(usage.in_flight) >= quota.max_concurrency:
        return Reject(
            "quota",
            f"tenant {request.tenant!r} has {len(usage.in_flight)} requests in flight; its "
            f"concurrency cap is {quota.max_concurrency}",
            limits.concurrency_retry_after_s,
        )
    for name, bucket in buckets:
        bucket.level -= _asked(name, request)
    if quota.max_concurrency is not None:
        lease = now + limits.lease_s
        if request.deadline_at is not None:
            lease = min(lease, request.deadline_at + 1.0)
        usage.in_flight[request.request_id] = lease
    return None


# A replica's quota lease: a slice of the tenant's shared buckets taken in advance (counted as
# consumed there) and spent locally, request by request, with no shared write per request.
# Leasing applies to tenants without a concurrency cap (a cap needs each request's own entry).


def leasable(quota: TenantQuota) -> bool:
    """Whether the tenant's requests can be charged to a local lease."""
    return quota.max_concurrency is None and any(True for _ in quota.buckets())


def lease_slice(quota: TenantQuota, lease_s: float) -> dict[str, float]:
    """How much of each bucket a replica takes at a time: `lease_s` seconds of its rate."""
    return {name: rate * lease_s for name, rate, _ in quota.buckets()}


def take_lease(
    usage: TenantUsage,
    quota: TenantQuota,
    request: AdmissionRequest,
    want: dict[str, float],
    now: float,
) -> Reject | dict[str, float]:
    """Take a slice of the shared buckets: at least what `request` asks, up to `want` of each
    bucket as far as its level allows. Over quota: the rejection `charge_quota` would give."""
    buckets = _synced_buckets(usage, quota, now)
    rejected = _shortfall(buckets, quota, request)
    if rejected is not None:
        return rejected
    taken = {}
    for name, bucket in buckets:
        amount = max(_asked(name, request), min(want.get(name, 0.0), bucket.level))
        bucket.level -= amount
        taken[name] = amount
    return taken


def return_lease(usage: TenantUsage, quota: TenantQuota, amounts: dict[str, float], now: float) -> None:
    """Give a lease's unspent remainder back to the shared buckets (never above their capacity)."""
    for name, bucket in _synced_buckets(usage, quota, now):
        bucket.level = min(bucket.capacity, bucket.level + amounts.get(name, 0.0))


@dataclass(slots=True)
class QuotaLease:
    """What a replica holds of a tenant's buckets, and when it last spent from it."""

    amounts: dict[str, float] = field(default_factory=dict)
    spent_at: float = 0.0

    def add(self, taken: dict[str, float]) -> None:
        for name, amount in taken.items():
            self.amounts[name] = self.amounts.get(name, 0.0) + amount

    def spend(self, request: AdmissionRequest, now: float) -> bool:
        """Charge the request to the lease if it holds enough of every bucket it was taken from."""
        asked = {name: _asked(name, request) for name in self.amounts}
        if not self.amounts or any(self.amounts[name] < amount for name, amount in asked.items()):
            return False
        for name, amount in asked.items():
            self.amounts[name] -= amount
        self.spent_at = now
        return True

    def running_low(self, slice_: dict[str, float]) -> bool:
        """Under half a slice of some bucket left: time to take more before it runs out."""
        return any(self.amounts.get(name, 0.0) < amount / 2 for name, amount in slice_.items())

    def take_all(self) -> dict[str, float]:
        amounts, self.amounts = self.amounts, {}
        return amounts


def release_quota(usage: TenantUsage, request_id: str) -> bool:
    """The request ended: give its concurrency lease back. False if it held none."""
    return usage.in_flight.pop(request_id, None) is not None
