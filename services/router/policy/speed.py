"""How long work takes on a worker: its roofline (`WorkerSpeed`), the speed a worker that reports
none is assumed to have (`DEFAULT_SPEED`), and from them the wall time and the GPU time of a
prefill (`prefill_seconds`, `prefill_gpu_seconds`). Pure arithmetic on a worker's figures: what
the worker is doing now comes in as arguments (state.py keeps it, predict.py reads it)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerSpeed:
    """A worker's roofline: what its GPU(s) and model make a step cost (the sim engine's
    PerfModel figures; services/router/speed.py builds one from a GPU profile and model shape).

    A step computing n new tokens (in p parts, with a attention query-key pairs, reading r KV
    tokens) lasts overhead + max(FLOPs / flops_per_s, bytes / bytes_per_s) with FLOPs =
    n x flops_per_token + a x flops_per_pair and bytes = weight_read_bytes + (r + n) x
    kv_bytes_per_token."""

    flops_per_s: float
    flops_per_token: float
    flops_per_pair: float
    bytes_per_s: float
    weight_read_bytes: float
    kv_bytes_per_token: int
    step_overhead_s: float
    kv_link_bytes_per_s: float
    max_batch_tokens: int = 8192
    max_running: int = 256

    @property
    def prefill_tokens_per_s(self) -> float:
        """Compute-bound prompt tokens per second, attention aside."""
        return self.flops_per_s / self.flops_per_token

    def step_seconds(self, new_tokens: float, pairs: float, read_tokens: float) -> float:
        compute = (new_tokens * self.flops_per_token + pairs * self.flops_per_pair) / self.flops_per_s
        memory = (
            self.weight_read_bytes + (read_tokens + new_tokens) * self.kv_bytes_per_token
        ) / self.bytes_per_s
        return self.step_overhead_s + (compute if compute > memory else memory)

    def decode_step_seconds(self, decodes: int, context_tokens: float) -> float:
        """One step of `decodes` one-token decodes over `context_tokens` of KV in all."""
        return self.step_seconds(decodes, context_tokens + decodes, context_tokens)


# Llama-3-8B in BF16 on one H100 SXM, as the sim engine models it (profiles.py, perf.py); what a
# worker that reports no speed is assumed to be. tests/test_router_policy.py holds it equal to
# services/router/speed.py's worker_speed of that profile.
DEFAULT_SPEED = WorkerSpeed(
    flops_per_s=989e12 * 0.5,
    flops_per_token=2.0 * (8.03e9 - 2 * 128256 * 4096),
    flops_per_pair=4.0 * 32 * 32 * 128,
    bytes_per_s=3.35e12 * 0.75,
    weight_read_bytes=(8.03e9 - 128256 * 4096) * 2,
    kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
    step_overhead_s=0.002,
    kv_link_bytes_per_s=50e9,
)


def prefill_seconds(
    speed: WorkerSpeed,
    new: float,
    cached: float,
    decodes: int,
    context: float,
    prompt: float | None = None,
    step_read_bytes: float | None = None,
) -> float:
    """Wall time to prefill `new` tokens after `cached`, in chunks beside `decodes` decodes
    (holding `context` tokens of KV). `prompt`: the tokens are many prompts of about this size
    (a queue), not one (attention grows with each prompt's own length, not the queue's).
    `step_read_bytes`: what each step reads besides the prompt's own KV (the weights and the
    decodes' KV), when the caller has it already (`worker_figures`)."""
    if new <= 0:
        return 0.0
    chunk = max(1, speed.max_batch_tokens - decodes)
    steps = math.ceil(new / chunk)
    if prompt is None:
        pairs = new * cached + new * (new + 1) / 2.0
    else:
        pairs = new * (prompt + 1) / 2.0
    if step_read_bytes is None:
        step_read_bytes = speed.weight_read_bytes + context * speed.kv_bytes_per_token
    compute = (
        (new + steps * decodes) * speed.flops_per_token + (pairs + steps * context) * speed.flops_per_pair
    ) / (speed.flops_per_s)
    memory = (steps * step_read_bytes + (new + cached) * speed.kv_bytes_per_token) / speed.bytes_per_s
    return steps * speed.step_overhead_s + max(compute, memory)


def prefill_gpu_seconds(speed: WorkerSpeed, new: float, cached: float) -> float:
    """The request's own share of its prefill steps (what the ledger charges it)."""
    if new <= 0:
        return 0.0
    pairs = new * cached + new * (new + 1) / 2.0
    compute = (new * speed.flops_per_token + pairs * speed.flops_per_pair) / speed.flops_per_s
    return compute + speed.step_overhead_s * math.ceil(new / speed.max_batch_tokens)
