"""The roofline performance model: how long a GPU takes for one scheduler step. Pure functions.

- Prefill is compute-bound: 2 FLOPs per parameter per token, plus attention's term that grows
  with the context each new token attends to, at a model FLOPs utilisation (MFU).
- Decode is memory-bound: each step reads the weights once and the KV of every sequence in the
  batch, at a memory bandwidth utilisation (MBU); it cannot be faster than its compute.
- Every step pays a fixed overhead (scheduling, kernel launches, sampling).
The efficiency factors are typical of well-tuned serving engines; issue #3 calibrates them
against published throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engines.sim.profiles import GpuProfile, ModelShape


@dataclass(frozen=True, slots=True)
class PerfModel:
    gpu: GpuProfile
    model: ModelShape
    tensor_parallel: int = 1
    mfu: float = 0.5
    mbu: float = 0.7
    step_overhead_s: float = 0.002

    @property
    def flops_per_s(self) -> float:
        return self.gpu.dense_bf16_tflops * 1e12 * self.tensor_parallel * self.mfu

    @property
    def bytes_per_s(self) -> float:
        return self.gpu.hbm_tb_per_s * 1e12 * self.tensor_parallel * self.mbu

    def prefill_seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Compute time for `new_tokens` prompt tokens after `cached_tokens` already in KV."""
        if new_tokens <= 0:
            return 0.0
        m = self.model
        linear = 2.0 * m.params_b * 1e9 * new_tokens
        # QK^T and attention-times-V: 2 matmuls x 2 FLOPs, each new token over its context.
        mean_context = cached_tokens + (new_tokens + 1) / 2.0
        attention = 4.0 * m.layers * m.attention_heads * m.head_dim * new_tokens * mean_context
        return (linear + attention) / self.flops_per_s

    def decode_seconds(self, batch: int, context_tokens: int) -> float:
        """One decode step for `batch` sequences holding `context_tokens` tokens of KV in total."""
        if batch <= 0:
            return 0.0
        m = self.model
        memory = (m.weight_bytes + context_tokens * m.kv_bytes_per_token) / self.bytes_per_s
        compute = 2.0 * m.params_b * 1e9 * batch / self.flops_per_s
        return max(memory, compute)

    def step_seconds(
        self, prefill_tokens: int, prefill_context: int, decode_batch: int, decode_context: int
    ) -> float:
        if prefill_tokens <= 0 and decode_batch <= 0:
            return 0.0
        return (
            self.step_overhead_s
            + self.prefill_seconds(prefill_tokens, prefill_context)
            + self.decode_seconds(decode_batch, decode_context)
        )

    def kv_transfer_seconds(self, kv_bytes: int) -> float:
        return kv_bytes / (self.gpu.kv_link_gb_per_s * 1e9)

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        free = self.gpu.hbm_gb * 1e9 * self.tensor_parallel * memory_fraction - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on {self.tensor_parallel}x {self.gpu.name}")
        return int(free // self.model.kv_bytes_per_token)
