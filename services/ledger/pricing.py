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


BYTES_PER_GB = 1e9


def price_kv_transfer(kv_bytes: int, usd_per_gb: float) -> float:
    """The cost in US$ of moving `kv_bytes` of KV cache between workers, at `usd_per_gb` US$ per
    GB (10^9 bytes)."""
    if kv_bytes < 0:
        raise PricingError(f"invalid KV transfer size: {kv_bytes!r} bytes (must be >= 0)")
    if not math.isfinite(usd_per_gb) or usd_per_gb < 0:
        raise PricingError(f"invalid KV transfer price: {usd_per_gb!r} US$/GB")
    return kv_bytes / BYTES_PER_GB * usd_per_gb
