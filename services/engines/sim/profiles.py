"""GPU and model figures the sim engine's performance model is built from, and the published
throughput it is calibrated against.

GPU figures are the vendors' public datasheet numbers, dense tensor-core TFLOPS (without the 2:4
sparsity that doubles the headline figure) and HBM capacity and bandwidth, per GPU:
- H100 SXM5: 989 BF16 / 1,979 FP8 TFLOPS, 80 GB HBM3 at 3.35 TB/s (NVIDIA H100 Tensor Core GPU
  datasheet, SXM column).
- H200 SXM: 989 BF16 / 1,979 FP8 TFLOPS, 141 GB HBM3e at 4.8 TB/s (NVIDIA H200 datasheet).
- A100 80GB SXM: 312 BF16 TFLOPS, no FP8 tensor cores, 80 GB HBM2e at 2,039 GB/s (NVIDIA A100
  datasheet). FP8 weights on it are weight-only (dequantised to BF16 for the matmuls).
- L40S: 362 BF16 / 733 FP8 TFLOPS, 48 GB GDDR6 at 864 GB/s (NVIDIA L40S datasheet).
- B200: 2,250 BF16 / 4,500 FP8 TFLOPS, 180 GB HBM3e at 8 TB/s (NVIDIA HGX B200 / DGX B200
  specifications, 8-GPU totals of 18 / 36 dense PFLOPS, 1,440 GB and 64 TB/s divided by 8).
Memory sizes are as marketed, which are binary: nvidia-smi shows 81,559 MiB on an "80 GB" H100.

The KV hand-off link is one RDMA NIC per GPU, as in the DGX systems: ConnectX-7 at 400 Gb/s
(50 GB/s) on DGX H100, DGX H200 and DGX B200, HDR 200 Gb/s (25 GB/s) on DGX A100. L40S servers are
PCIe machines without a standard NIC per GPU; 100 GbE (12.5 GB/s) is an assumption.

Model shapes are from the models' published configs (config.json of Meta-Llama-3-8B and -70B;
Llama 3.1 and 3.3 keep the same shapes): layers, hidden size, heads, KV heads (GQA), head dim,
vocabulary (128,256, untied input embedding and LM head).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Bytes per weight or KV value for the precisions the model knows.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
GIB = 1024**3


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    dense_bf16_tflops: float
    # 0 where the GPU has no FP8 tensor cores (A100): FP8 weights then run at the BF16 rate.
    dense_fp8_tflops: float
    hbm_gb: float
    hbm_tb_per_s: float
    # Link used for KV hand-off between workers (GB/s).
    kv_link_gb_per_s: float

    def dense_tflops(self, dtype: str) -> float:
        if dtype == "fp8" and self.dense_fp8_tflops > 0:
            return self.dense_fp8_tflops
        return self.dense_bf16_tflops


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    params_b: float
    layers: int
    hidden: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    # Precision of the weights (and so of the matmuls, where the GPU has it) and of the KV cache.
    dtype: str = "bf16"
    kv_dtype: str = "bf16"

    def __post_init__(self) -> None:
        for value in (self.dtype, self.kv_dtype):
            if value not in DTYPE_BYTES:
                raise ValueError(f"unknown dtype {value!r}; known: {', '.join(DTYPE_BYTES)}")

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def layer_params(self) -> float:
        """Parameters in the transformer layers: all but the input embedding and the LM head."""
        return self.params_b * 1e9 - 2 * self.lm_head_params

    @property
    def weight_bytes(self) -> float:
        """Memory the weights occupy."""
        return self.params_b * 1e9 * DTYPE_BYTES[self.dtype]

    @property
    def weight_read_bytes(self) -> float:
        """Weights one forward pass reads: all but the input embedding (only its rows are read)."""
        return (self.params_b * 1e9 - self.lm_head_params) * DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, per layer, per KV head.
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    def with_dtype(self, dtype: str, kv_dtype: str | None = None) -> ModelShape:
        return replace(self, dtype=dtype, kv_dtype=kv_dtype or dtype)


GPUS: dict[str, GpuProfile] = {
    "H100": GpuProfile("H100", 989.0, 1979.0, 80.0, 3.35, 50.0),
    "H200": GpuProfile("H200", 989.0, 1979.0, 141.0, 4.8, 50.0),
    "A100-80GB": GpuProfile("A100-80GB", 312.0, 0.0, 80.0, 2.039, 25.0),
    "L40S": GpuProfile("L40S", 362.0, 733.0, 48.0, 0.864, 12.5),
    "B200": GpuProfile("B200", 2250.0, 4500.0, 180.0, 8.0, 50.0),
}

_LLAMA_3_8B = ModelShape("llama-3-8b", 8.03, 32, 4096, 32, 8, 128, 128256)
_LLAMA_3_70B = ModelShape("llama-3-70b", 70.6, 80, 8192, 64, 8, 128, 128256)
MODELS: dict[str, ModelShape] = {
    "llama-3-8b": _LLAMA_3_8B,
    "llama-3-70b": _LLAMA_3_70B,
    # Same architecture, longer context (RoPE scaling): the same figures per token.
    "llama-3.1-8b": replace(_LLAMA_3_8B, name="llama-3.1-8b"),
    "llama-3.1-70b": replace(_LLAMA_3_70B, name="llama-3.1-70b"),
    "llama-3.3-70b": replace(_LLAMA_3_70B, name="llama-3.3-70b"),
}


def gpu(name: str) -> GpuProfile:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU type {name!r}; known: {', '.join(GPUS)}") from None


def model_shape(name: str) -> ModelShape:
    """A model shape by name, with an optional precision suffix: "llama-3-8b" (BF16),
    "llama-3-8b:fp8" (FP8 weights and KV), "llama-3-8b:fp8:bf16" (FP8 weights, BF16 KV)."""
    base, *dtypes = name.split(":")
    try:
        shape = MODELS[base]
    except KeyError:
        raise ValueError(f"unknown model shape {base!r}; known: {', '.join(MODELS)}") from None
    if len(dtypes) > 2:
        raise ValueError(f"model shape {name!r}: expected name[:dtype[:kv_dtype]]")
    if dtypes:
        shape = shape.with_dtype(dtypes[0], dtypes[1] if len(dtypes) == 2 else None)
    return shape


# ------------------------------------------------------------------ published throughput

TRTLLM_PERF_OVERVIEW = (
    "NVIDIA TensorRT-LLM docs, Performance Overview, 'Throughput Measurements' "
    "(docs/source/performance/perf-overview.md, v1.0-era revision; "
    "https://nvidia.github.io/TensorRT-LLM/performance/perf-overview.html): "
    "Total Output Throughput, trtllm-bench, PyTorch backend, ModelOpt FP8 checkpoints"
)


@dataclass(frozen=True, slots=True)
class PublishedThroughput:
    """A published maximum-throughput figure: every request queued at once, output tokens/s."""

    gpu: str
    shape: str  # a model_shape() name, precision included
    tensor_parallel: int
    input_tokens: int
    output_tokens: int
    requests: int  # how many requests the published run used
    output_tokens_per_s: float
    source: str


# The figures are per revision of the document; releases before and after report different
# numbers for the same cells (the software improves), so each is a point, not a constant.
# FP8 KV is assumed: NVIDIA's FP8 checkpoints quantise the KV cache too, and with a BF16 cache
# the memory-bound model cannot approach these numbers (half the batch fits).
PUBLISHED: tuple[PublishedThroughput, ...] = (
    # The calibration point (tests/engines/test_sim.py::test_calibration_*).
    PublishedThroughput("H100", "llama-3.1-8b:fp8", 1, 1000, 1000, 3000, 15220.0, TRTLLM_PERF_OVERVIEW),
    # Out-of-sample checks, shown by `ripplemesh bench engine`, not fitted.
    PublishedThroughput("H200", "llama-3.1-8b:fp8", 1, 1000, 1000, 3000, 17744.0, TRTLLM_PERF_OVERVIEW),
    PublishedThroughput("H200", "llama-3.3-70b:fp8", 1, 1000, 1000, 3000, 2909.0, TRTLLM_PERF_OVERVIEW),
    PublishedThroughput("H100", "llama-3.3-70b:fp8", 2, 1000, 1000, 3000, 4205.0, TRTLLM_PERF_OVERVIEW),
)
CALIBRATION = PUBLISHED[0]
