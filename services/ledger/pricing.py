"""Pricing of GPU time: pure functions, no I/O.

A GPU type without a configured price is an error, never a free GPU: silently pricing it at zero
would make the ledger under-report spend exactly where the configuration is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

SECONDS_PER_HOUR = 3600.0


class PricingError(ValueError):
    """GPU time that cannot be priced (unknown GPU type, invalid duration or price)."""


def price_gpu_seconds(gpu_type: str, gpu_seconds: float, prices: Mapping[str, float]) -> float:
    """The cost in US$ of `gpu_seconds` on one GPU of `gpu_type`, at `prices` (US$ per hour)."""
    if not math.isfinite(gpu_seconds) or gpu_seconds < 0:
        raise PricingError(f"invalid GPU time for {gpu_type!r}: {gpu_seconds!r} s (must be finite and >= 0)")
    price = prices.get(gpu_type)
    if price is None:
        known = ", ".join(sorted(prices)) or "none"
        raise PricingError(f"no price for GPU type {gpu_type!r} (priced types: {known})")
    if not math.isfinite(price) or price < 0:
        raise PricingError(f"invalid price for GPU type {gpu_type!r}: {price!r} US$/h")
    return gpu_seconds / SECONDS_PER_HOUR * price
