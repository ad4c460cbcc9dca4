"""A step's cost on a worker's `PerfModel`: `StepCost` is `PerfModel.step_shares` with a step's
decodes taken together (tests/test_simulator.py holds the two equal on random batches), and
`_sum_of_max` sums a steady-decode chunk's step times in closed form."""

from __future__ import annotations

import math

from services.engines.sim.perf import PerfModel


class StepCost:
    """`PerfModel.step_shares` for a batch of explicit parts plus `decodes` one-token decodes
    whose contexts sum to `decode_context`, without listing the decodes.

    Built from the model's own pieces (`flops`, `kv_bytes`, `flops_per_s`, `bytes_per_s`,
    `weight_read_bytes`, `step_overhead_s`). A decode's own work is affine in its context c:
    `alpha + wt + beta * c`, with alpha and beta read off the model at c = 0 and c = 1.
    """

    __slots__ = (
        "alpha",
        "beta",
        "bytes_rate",
        "decode_bytes",
        "decode_bytes_slope",
        "decode_flops",
        "decode_flops_slope",
        "flops_per_pair",
        "flops_per_part",
        "flops_per_token",
        "flops_rate",
        "kv_per_token",
        "overhead",
        "perf",
        "weights",
        "weights_s",
    )

    def __init__(self, perf: PerfModel):
        self.perf = perf
        self.flops_rate = perf.flops_per_s
        self.bytes_rate = perf.bytes_per_s
        self.weights = perf.model.weight_read_bytes
        self.weights_s = self.weights / self.bytes_rate
        self.overhead = perf.step_overhead_s
        # A one-token decode after c tokens: flops(1, 1, c + 1) and kv_bytes(c, 1), both affine in c.
        f1 = perf.flops(1, 1, 1.0)
        f2 = perf.flops(1, 1, 2.0)
        b0 = perf.kv_bytes(0, 1)
        b1 = perf.kv_bytes(1, 1)
        self.decode_flops, self.decode_flops_slope = f1, f2 - f1
        self.decode_bytes, self.decode_bytes_slope = b0, b1 - b0
        self.alpha = f1 / self.flops_rate + b0 / self.bytes_rate
        self.beta = (f2 - f1) / self.flops_rate + (b1 - b0) / self.bytes_rate
        # `flops` and `kv_bytes` are linear: their coefficients, read off at unit arguments (exact:
        # the model's own products), give the same sums term for term without the calls.
        self.flops_per_token = perf.flops(1, 0, 0.0)
        self.flops_per_part = perf.flops(0, 1, 0.0)
        self.flops_per_pair = perf.flops(0, 0, 1.0)
        self.kv_per_token = perf.kv_bytes(1, 0)

    def decodes_only(self, decodes: int, decode_context: int) -> tuple[float, float, float]:
        """`__call__` for a step of decodes alone: (step seconds, share at context 0, slope)."""
        busy = max(
            (decodes * self.decode_flops + self.decode_flops_slope * decode_context) / self.flops_rate,
            self.weights_s
            + (decodes * self.decode_bytes + self.decode_bytes_slope * decode_context) / self.bytes_rate,
        )
        scale = busy / (decodes * self.alpha + self.weights_s + self.beta * decode_context)
        return (
            self.overhead + busy,
            self.overhead / decodes + (self.alpha + self.weights_s / decodes) * scale,
            self.beta * scale,
        )

    def __call__(
        self, parts: list[tuple[int, int]], decodes: int, decode_context: int
    ) -> tuple[float, list[float], float, float]:
        """(step seconds, each part's share, a decode's share at context 0, the slope of a
        decode's share per context token)."""
        flops_rate, bytes_rate = self.flops_rate, self.bytes_rate
        per_token, per_part, per_pair = self.flops_per_token, self.flops_per_part, self.flops_per_pair
        kv = self.kv_per_token
        new = decodes
        read = decode_context
        pairs = float(decode_context + decodes)
        part_pairs: list[float] = []
        for n, c in parts:
            p = n * c + n * (n + 1) / 2.0
            part_pairs.append(p)
            new += n
            read += c
            pairs += p
        count = len(parts) + decodes
        flops = per_token * new + per_part * count + per_pair * pairs
        nbytes = (read + new) * kv
        busy = max(flops / flops_rate, (self.weights + nbytes) / bytes_rate)
        wt = self.weights / bytes_rate / (new or 1)
        own = [
            (per_token * n + per_part + per_pair * p) / flops_rate + (c + n) * kv / bytes_rate + wt * n
            for (n, c), p in zip(parts, part_pairs, strict=True)
        ]
        decode_own0 = self.alpha + wt
        total = sum(own) + decodes * decode_own0 + self.beta * decode_context
        scale = busy / total
        overhead = self.overhead / count
        shares = [overhead + o * scale for o in own]
        return self.overhead + busy, shares, overhead + decode_own0 * scale, self.beta * scale


def _sum_of_max(c0: float, c1: float, m0: float, m1: float, first: int, stop: int) -> float:
    """The sum over j in [first, stop) of max(c0 + c1 j, m0 + m1 j)."""

    def series(a: float, b: float, lo: int, hi: int) -> float:
        n = hi - lo
        return n * a + b * (lo + hi - 1) * n / 2.0 if n > 0 else 0.0

    if c1 == m1:
        return series(c0, c1, first, stop) if c0 >= m0 else series(m0, m1, first, stop)
    # The two lines cross once; each dominates on one side.
    cross = (m0 - c0) / (c1 - m1)
    split = min(max(math.ceil(cross), first), stop)
    if c1 > m1:  # compute dominates from the crossing on
        return series(m0, m1, first, split) + series(c0, c1, split, stop)
    return series(c0, c1, first, split) + series(m0, m1, split, stop)
