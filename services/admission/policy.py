"""Admission's decisions: per-tenant token buckets. Pure: state in, decision out, clock passed in.

A tenant has two buckets, one counting requests and one counting tokens (prompt + max output);
a request is admitted when both hold enough, else rejected with the time after which it would be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class TenantQuota:
    requests_per_s: float
    request_burst: float
    tokens_per_s: float
    token_burst: float


@dataclass(slots=True)
class Bucket:
    rate: float
    capacity: float
    level: float
    updated_at: float

    def refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated_at)
        self.level = min(self.capacity, self.level + elapsed * self.rate)
        self.updated_at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if it is now); inf if it never fits."""
        if amount > self.capacity:
            return float("inf")
        return max(0.0, (amount - self.level) / self.rate)


@dataclass(slots=True)
class AdmissionState:
    buckets: dict[str, tuple[Bucket, Bucket]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Admit:
    outcome: Literal["admit"] = "admit"


@dataclass(frozen=True, slots=True)
class Reject:
    reason: Literal["quota", "capacity", "deadline", "invalid", "no_workers"]
    message: str
    retry_after_s: float | None
    outcome: Literal["reject"] = "reject"


Decision = Admit | Reject


def decide(
    state: AdmissionState,
    *,
    tenant: str,
    quota: TenantQuota | None,
    tokens: int,
    deadline_at: float | None,
    now: float,
) -> Decision:
    """Admit or reject one request, charging the tenant's buckets when admitted."""
    if quota is None:
        return Reject("invalid", f"unknown tenant {tenant!r}", None)
    if deadline_at is not None and deadline_at <= now:
        return Reject("deadline", "the request's deadline passed before admission", None)
    if tenant not in state.buckets:
        state.buckets[tenant] = (
            Bucket(quota.requests_per_s, quota.request_burst, quota.request_burst, now),
            Bucket(quota.tokens_per_s, quota.token_burst, quota.token_burst, now),
        )
    requests, token_bucket = state.buckets[tenant]
    requests.refill(now)
    token_bucket.refill(now)
    wait = max(requests.wait_for(1.0), token_bucket.wait_for(float(tokens)))
    if wait == float("inf"):
        return Reject(
            "quota",
            f"the request's {tokens} tokens exceed tenant {tenant!r}'s burst of "
            f"{token_bucket.capacity:.0f} tokens",
            None,
        )
    if wait > 0:
        return Reject(
            "quota",
            f"tenant {tenant!r} is over its quota ({quota.requests_per_s:g} requests/s, "
            f"{quota.tokens_per_s:g} tokens/s)",
            wait,
        )
    requests.level -= 1.0
    token_bucket.level -= tokens
    return Admit()
