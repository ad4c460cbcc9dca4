"""What one replica of a pool can do within the SLOs: the engine's performance profile read as
capacity. Pure.

The profile is the sim engine's roofline (services/engines/sim/perf.py, calibrated against
NVIDIA's published TensorRT-LLM throughput): the same model that times the simulator's steps, so
the planner and the simulated fleet agree on what a GPU does. For a given request mix (mean
uncached prompt, mean context while decoding):

- **decode**: the largest batch whose step keeps the inter-token latency SLO and whose KV fits
  the replica; its output tokens per second are that batch over its step time;
- **prefill**: uncached prompt tokens per second with full chunks (`max_batch_tokens`), and the
  utilisation at which a queue of such prompts still meets the TTFT SLO (`prefill_utilisation`).
  The queue is M/G/1: Poisson arrivals, a prompt's service time its uncached tokens over that
  rate, of mean S and coefficient of variation CV. Pollaczek-Khinchine's mean wait is
  Wq = rho E[S^2] / (2 (1 - rho) E[S]) = rho S (1 + CV^2) / (2 (1 - rho)); keeping S + twice
  that wait (a tail, not the mean) under the SLO T gives
  rho <= (T - S) / ((T - S) + (1 + CV^2) S), which is 1 - S / T for prompts all of one size
  (CV = 0, M/D/1). A few long prompts in a mix of short ones make the short ones wait behind
  them: the wider the spread, the lower the utilisation. The spread is measured (the windows'
  sums of squared uncached prompt tokens, forecast.py); not measured, CV = 0.

  Chunked prefill is assumed not to change the queue: a prompt longer than a chunk is served
  over several consecutive steps, but the engine continues a prompt being prefilled before it
  admits a new one (services/engines/sim/engine.py, as vLLM), so the prompts are still served
  first come first served, each for its whole uncached length at the chunks' rate, and a long
  prompt delays those behind it by all of its chunks: its service time is its whole length,
  not one chunk's. Not modelled: a first token comes at the end of the step that finishes its
  prompt, so at full load up to one chunk's step (about 0.27 s for Llama-3-8B on an H100 at
  8192 tokens) beyond the queue's time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.engines.sim.perf import PerfModel

# The utilisation a decode pool is planned at, below the batch the ITL allows: bursts inside a
# planning interval land somewhere. Not fitted: a conventional 10% margin.
DECODE_UTILISATION = 0.9
# The prefill utilisation is (T - S) / ((T - S) + (1 + CV^2) S) (module docstring), kept within
# these bounds: below 0.3 a replica would be planned nearly idle (a prompt close to the SLO on
# its own), above 0.9 the queue's tail outgrows the mean-wait formula.
PREFILL_UTILISATION_BOUNDS = (0.3, 0.9)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 2.0
    itl_s: float = 0.1

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError("SLO targets must be > 0")


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """A pool's replicas as the performance model sees them."""

    perf: PerfModel
    kv_capacity_tokens: int
    max_batch_tokens: int = 8192
    max_running: int = 256
    # Wall seconds per modelled GPU second: 1 on real hardware; a sim engine run faster
    # (`--time-scale 0.1`) does ten times the work per wall second.
    time_scale: float = 1.0


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    prefill_tokens_per_s: float  # uncached prompt tokens per second, at full use
    prefill_utilisation: float  # the share of that the TTFT SLO allows
    decode_tokens_per_s: float  # output tokens per second at the largest batch the ITL allows
    decode_batch: int

    @property
    def prefill_at_slo(self) -> float:
        return self.prefill_tokens_per_s * self.prefill_utilisation

    @property
    def decode_at_slo(self) -> float:
        return self.decode_tokens_per_s * DECODE_UTILISATION


def prefill_utilisation(service_s: float, ttft_s: float, cv2: float = 0.0) -> float:
    """The share of a prefill replica's rate a queue of prompts may use and still meet the TTFT
    SLO `ttft_s`: M/G/1 with a mean service time `service_s` whose squared coefficient of
    variation is `cv2` (module docstring), within `PREFILL_UTILISATION_BOUNDS`. `cv2` 0 is the
    M/D/1 rule 1 - S/T; a prompt as long as the SLO on its own gets the lower bound."""
    low, high = PREFILL_UTILISATION_BOUNDS
    slack = ttft_s - service_s
    if slack <= 0:
        return low
    spread = 1.0 + (cv2 if math.isfinite(cv2) and cv2 > 0 else 0.0)
    return min(high, max(low, slack / (slack + spread * service_s)))


def replica_capacity(
    profile: EngineProfile, *, uncached_prompt: float, context: float, slo: Slo, uncached_cv2: float = 0.0
) -> ReplicaCapacity:
    """One replica's capacity for a mix: `uncached_prompt` tokens to prefill per request on
    average, `uncached_cv2` the squared coefficient of variation of those tokens (0: all of
    one size), `context` tokens of KV per sequence on average while it decodes."""
    perf, scale = profile.perf, max(profile.time_scale, 1e-9)
    chunk = profile.max_batch_tokens
    chunk_s = (perf.prefill_seconds(chunk) + perf.step_overhead_s) * scale
    prefill_rate = chunk / chunk_s
    # A prompt's service time is proportional to its uncached tokens (full chunks' rate), so its
    # coefficient of variation is the tokens'.
    service_s = max(uncached_prompt, 1.0) / prefill_rate
    utilisation = prefill_utilisation(service_s, slo.ttft_s, uncached_cv2)
    context = max(context, 1.0)
    by_memory = max(1, int(profile.kv_capacity_tokens // context))
    batch = _largest_batch(perf, context, min(profile.max_running, by_memory), slo.itl_s / scale)
    step_s = (perf.decode_seconds(batch, int(batch * context)) + perf.step_overhead_s) * scale
    return ReplicaCapacity(
        prefill_tokens_per_s=prefill_rate,
        prefill_utilisation=utilisation,
        decode_tokens_per_s=batch / step_s,
        decode_batch=batch,
    )


def _largest_batch(perf: PerfModel, context: float, limit: int, itl_s: float) -> int:
    """The largest batch (1..limit) whose decode step fits `itl_s`; 1 if none does (a replica
    still serves, only slower). A step's time grows with the batch: bisection."""

    def fits(batch: int) -> bool:
        return perf.decode_seconds(batch, int(batch * context)) + perf.step_overhead_s <= itl_s

    if fits(limit):
        return limit
    low, high = 1, limit
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def replicas_for(load_tokens_per_s: float, per_replica_tokens_per_s: float) -> float:
    """Fractional replicas a load needs (the allocation rounds up once per pool)."""
    if load_tokens_per_s <= 0:
        return 0.0
    if per_replica_tokens_per_s <= 0:
        return math.inf
    return load_tokens_per_s / per_replica_tokens_per_s
