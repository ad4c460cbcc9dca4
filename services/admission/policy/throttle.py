"""Tenants throttled by a control event (`TenantThrottle` in the TENANT_THROTTLES bucket, put
by a subscriber such as a budget guard): their new requests are refused until the throttle's
`until`. Pure."""

from __future__ import annotations

from collections.abc import Mapping

from schemas.events import TenantThrottle
from services.admission.policy.types import Reject


def throttled(throttles: Mapping[str, TenantThrottle], tenant: str, now: float) -> Reject | None:
    """A 429 for a tenant under a throttle still in force (None otherwise), with Retry-After
    the time it has left."""
    throttle = throttles.get(tenant)
    if throttle is None or throttle.until <= now:
        return None
    return Reject(
        "quota",
        f"tenant {tenant!r} is throttled until {throttle.until:.0f} (unix time) by {throttle.source}: "
        f"{throttle.reason}",
        round(throttle.until - now, 3),
    )
