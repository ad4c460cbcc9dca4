"""GPU and model figures the sim engine's performance model is built from.

GPU figures are the vendors' public datasheet numbers (dense BF16 tensor TFLOPS, without
sparsity; HBM capacity and bandwidth):
- H100 SXM5: 989 TFLOPS, 80 GB HBM3 at 3.35 TB/s (NVIDIA H100 datasheet).
- H200 SXM: 989 TFLOPS, 141 GB HBM3e at 4.8 TB/s (NVIDIA H200 datasheet).
- A100 80GB SXM: 312 TFLOPS, 80 GB HBM2e at 2.039 TB/s (NVIDIA A100 datasheet).
- L40S: 362 TFLOPS, 48 GB GDDR6 at 864 GB/s (NVIDIA L40S datasheet).
- B200: 2,250 TFLOPS, 180 GB HBM3e at 8 TB/s (NVIDIA DGX B200 / HGX B200 specs, per GPU).
Model shapes are from the models' published configs (config.json of Meta-Llama-3-8B/70B).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    dense_bf16_tflops: float
    hbm_gb: float
    hbm_tb_per_s: float
    # Link used for KV hand-off between workers (GB/s): NVLink-class inside a node, RDMA across.
    kv_link_gb_per_s: float


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    params_b: float
    layers: int
    hidden: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, per layer, per KV head.
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


GPUS: dict[str, GpuProfile] = {
    "H100": GpuProfile("H100", 989.0, 80.0, 3.35, 50.0),
    "H200": GpuProfile("H200", 989.0, 141.0, 4.8, 50.0),
    "A100-80GB": GpuProfile("A100-80GB", 312.0, 80.0, 2.039, 25.0),
    "L40S": GpuProfile("L40S", 362.0, 48.0, 0.864, 12.5),
    "B200": GpuProfile("B200", 2250.0, 180.0, 8.0, 100.0),
}

MODELS: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape("llama-3-8b", 8.03, 32, 4096, 32, 8, 128),
    "llama-3-70b": ModelShape("llama-3-70b", 70.6, 80, 8192, 64, 8, 128),
}


def gpu(name: str) -> GpuProfile:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU type {name!r}; known: {', '.join(GPUS)}") from None


def model_shape(name: str) -> ModelShape:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(MODELS)}") from None
