"""The roofline performance model: how long a GPU takes for one scheduler step. Pure functions.

A step is one forward pass over a batch of parts: a prefill chunk (n new prompt tokens after c
tokens already in KV) or a decode (one new token after c). Its time is a roofline,

    step = overhead + max(FLOPs / (peak FLOPS x MFU), bytes / (HBM bandwidth x MBU))

- FLOPs: 2 per layer parameter per new token (the matmuls), 2 per LM-head parameter per part
  (logits for the sampled position), and attention's term, 4 x layers x heads x head_dim per
  (query, key) pair: QK^T and attention-times-V; causal, so n new tokens after c make
  n*c + n(n+1)/2 pairs. Prefill chunks are large and so compute-bound.
- Bytes: the weights once per step (shared by the whole batch), each part's KV read (its c
  context tokens) and its new KV written. Decode parts carry one token each, so a decode step is
  memory-bound: weights plus the batch's KV, which is why its time rises with batch and context.
- A fixed overhead per step: scheduling, kernel launches, sampling, what CUDA graphs leave.
Peak FLOPS is the GPU's dense rate in the weights' precision (FP8 where the GPU has FP8 tensor
cores); bytes per weight and per KV value follow the model's dtypes. Tensor parallelism
multiplies FLOPS and bandwidth by the GPU count (the weights and KV heads are split over them);
its all-reduces are not modelled.

Calibration (tests/engines/test_sim.py::test_calibration_against_published_throughput): the sim
engine's own scheduler, saturated on a virtual clock with every request queued at once, against
NVIDIA's published TensorRT-LLM maximum throughput for Llama-3.1-8B FP8 on one H100 SXM at 1000
input / 1000 output tokens, 15,220 output tokens/s (profiles.PUBLISHED). With the factors below:
14,200/s with 1,000 requests (0.93x; the test's run, tolerance +-25%) and 15,800/s with the
published run's 3,000 (1.04x). The same factors, not refitted, on the other published cases
(1,000 requests each): H200 Llama-3.1-8B FP8 21,800 vs 17,744 (1.23x); H200 Llama-3.3-70B FP8
2,630 vs 2,909 (0.90x); 2x H100 Llama-3.3-70B FP8 4,820 vs 4,205 (1.15x; all-reduces are not
modelled). How the factors were chosen: within the ranges usual for tuned engines (large GEMMs
reach 50-70% of peak, decode GEMV and attention kernels 70-85% of HBM bandwidth, a CUDA-graph
step a few milliseconds of scheduling and launch), the values that bring the 3,000-request run
closest to the published figure. Sensitivity, 1,000 requests, ratio to published: MBU 0.70 /
0.75 / 0.80 give 0.90 / 0.93 / 0.97; MFU 0.6 gives 0.99; a 4 ms overhead gives 0.88.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from services.engines.sim.profiles import GIB, GpuProfile, ModelShape

# Chosen against profiles.CALIBRATION; see the module docstring.
MFU = 0.5  # model FLOPs utilisation: prefill and other compute-bound work
MBU = 0.75  # memory bandwidth utilisation: decode and other memory-bound work
STEP_OVERHEAD_S = 0.002  # per scheduler step, whatever its size


class Part(NamedTuple):
    """One sequence's share of a step: `new_tokens` computed after `context_tokens` in KV."""

    new_tokens: int
    context_tokens: int


@dataclass(frozen=True, slots=True)
class PerfModel:
    gpu: GpuProfile
    model: ModelShape
    tensor_parallel: int = 1
    mfu: float = MFU
    mbu: float = MBU
    step_overhead_s: float = STEP_OVERHEAD_S

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError("tensor_parallel must be at least 1")
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1):
            raise ValueError("mfu and mbu must be in (0, 1]")
        if self.step_overhead_s < 0:
            raise ValueError("step_overhead_s must be >= 0")

    # ------------------------------------------------------------ rates

    @property
    def flops_per_s(self) -> float:
        return self.gpu.dense_tflops(self.model.dtype) * 1e12 * self.tensor_parallel * self.mfu

    @property
    def bytes_per_s(self) -> float:
        return self.gpu.hbm_tb_per_s * 1e12 * self.tensor_parallel * self.mbu

    # ------------------------------------------------------------ work

    def _attention_flops_per_pair(self) -> float:
        m = self.model
        return 4.0 * m.layers * m.attention_heads * m.head_dim

    def flops(self, new_tokens: int, parts: int, attention_pairs: float) -> float:
        m = self.model
        return (
            2.0 * m.layer_params * new_tokens
            + 2.0 * m.lm_head_params * parts
            + self._attention_flops_per_pair() * attention_pairs
        )

    def kv_bytes(self, read_tokens: float, written_tokens: int) -> float:
        return (read_tokens + written_tokens) * self.model.kv_bytes_per_token

    def _roofline(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops_per_s, (self.model.weight_read_bytes + nbytes) / self.bytes_per_s)

    # ------------------------------------------------------------ times

    def prefill_seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """A step computing `new_tokens` prompt tokens after `cached_tokens` in KV, no overhead."""
        if new_tokens <= 0:
            return 0.0
        pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2.0
        return self._roofline(self.flops(new_tokens, 1, pairs), self.kv_bytes(cached_tokens, new_tokens))

    def decode_seconds(self, batch: int, context_tokens: int) -> float:
        """A decode step for `batch` sequences holding `context_tokens` tokens of KV in total
        (before this step's token), without overhead."""
        if batch <= 0:
            return 0.0
        # Each new token attends to its context and to itself.
        pairs = float(context_tokens + batch)
        return self._roofline(self.flops(batch, batch, pairs), self.kv_bytes(context_tokens, batch))

    def step_seconds(self, parts: Sequence[tuple[int, int]]) -> float:
        """A whole step (overhead included) for a batch of prefill chunks and decodes."""
        return sum(self.step_shares(parts)) if parts else 0.0

    def step_shares(self, parts: Sequence[tuple[int, int]]) -> list[float]:
        """Each part's share of its step's time, for parts given as `Part`s or plain
        (new_tokens, context_tokens) tuples; the shares sum to the step's time.

        The overhead is shared equally; the rest in proportion to each part's own work (its
        FLOPs and KV bytes at the model's rates, plus the weights' read split by tokens).
        """
        if not parts:
            return []
        m = self.model
        flops_rate, bytes_rate = self.flops_per_s, self.bytes_per_s
        per_token = 2.0 * m.layer_params
        per_part = 2.0 * m.lm_head_params
        per_pair = self._attention_flops_per_pair()
        kv = m.kv_bytes_per_token
        tokens = 0
        part_flops: list[float] = []
        part_bytes: list[float] = []
        for n, c in parts:
            tokens += n
            part_flops.append(per_token * n + per_part + per_pair * (n * c + n * (n + 1) / 2.0))
            part_bytes.append((c + n) * kv)
        busy = self._roofline(sum(part_flops), sum(part_bytes))
        weights_per_token = m.weight_read_bytes / bytes_rate / (tokens or 1)
        own = [
            f / flops_rate + b / bytes_rate + weights_per_token * p[0]
            for p, f, b in zip(parts, part_flops, part_bytes, strict=True)
        ]
        scale = busy / sum(own)
        overhead = self.step_overhead_s / len(parts)
        return [overhead + o * scale for o in own]

    # ------------------------------------------------------------ memory and links

    def kv_transfer_seconds(self, kv_bytes: int) -> float:
        return kv_bytes / (self.gpu.kv_link_gb_per_s * 1e9)

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV tokens that fit in `memory_fraction` of the GPUs' memory once the weights are in
        (vLLM's gpu_memory_utilization; activations come out of the remaining fraction)."""
        total = self.gpu.hbm_gb * GIB * self.tensor_parallel
        free = total * memory_fraction - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on {self.tensor_parallel}x {self.gpu.name}")
        return int(free // self.model.kv_bytes_per_token)
