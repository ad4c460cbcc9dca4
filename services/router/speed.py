"""A worker's roofline (`policy.WorkerSpeed`) from its GPU profile and model shape.

The router's policy predicts prefill and decode times from a handful of roofline figures; this is
where they come from: the sim engine's calibrated `PerfModel` (services/engines/sim/perf.py) for the
worker's GPU type and model shape, the same figures the sim engine runs on. The simulator builds
each worker's from its engine; the router service from the GPU type a worker reports and the
model's shape in the mesh configuration.
"""

from __future__ import annotations

import dataclasses

from services.engines.sim.perf import MBU, MFU, STEP_OVERHEAD_S, PerfModel
from services.engines.sim.profiles import GPUS, MODELS, model_shape
from services.router.policy import WorkerSpeed


def worker_speed(perf: PerfModel, *, max_batch_tokens: int = 8192, max_running: int = 256) -> WorkerSpeed:
    """The roofline figures of `perf` (its rates, weights and KV bytes), as the policy reads them."""
    model = perf.model
    return WorkerSpeed(
        flops_per_s=perf.flops_per_s,
        flops_per_token=2.0 * model.layer_params,
        flops_per_pair=4.0 * model.layers * model.attention_heads * model.head_dim,
        bytes_per_s=perf.bytes_per_s,
        weight_read_bytes=model.weight_read_bytes,
        kv_bytes_per_token=model.kv_bytes_per_token,
        step_overhead_s=perf.step_overhead_s,
        kv_link_bytes_per_s=perf.gpu.kv_link_gb_per_s * 1e9,
        max_batch_tokens=max_batch_tokens,
        max_running=max_running,
    )


# A time scale of 0 (a sim engine whose GPU work takes no time) is read as this: predictions of
# next to nothing, and finite.
MIN_TIME_SCALE = 1e-6


def time_scaled(speed: WorkerSpeed, time_scale: float) -> WorkerSpeed:
    """`speed` on the wall clock of an engine whose modelled GPU work takes `time_scale` times as
    long as modelled (a sim engine at `--time-scale 0.1` does a modelled second's work in 0.1 s):
    its rates divided by the scale, its step overhead multiplied."""
    scale = max(MIN_TIME_SCALE, time_scale)
    if scale == 1.0:
        return speed
    return dataclasses.replace(
        speed,
        flops_per_s=speed.flops_per_s / scale,
        bytes_per_s=speed.bytes_per_s / scale,
        step_overhead_s=speed.step_overhead_s * scale,
        kv_link_bytes_per_s=speed.kv_link_bytes_per_s / scale,
    )


def speed_for(
    gpu_type: str,
    shape: str,
    *,
    tensor_parallel: int = 1,
    mfu: float = MFU,
    mbu: float = MBU,
    step_overhead_s: float = STEP_OVERHEAD_S,
    max_batch_tokens: int = 8192,
    max_running: int = 256,
) -> WorkerSpeed | None:
    """The speed of `gpu_type` serving model `shape` (profiles.model_shape names), or None when
    either is unknown (the policy then assumes `policy.DEFAULT_SPEED`)."""
    if gpu_type not in GPUS or shape.split(":")[0] not in MODELS:
        return None
    perf = PerfModel(
        GPUS[gpu_type],
        model_shape(shape),
        tensor_parallel=tensor_parallel,
        mfu=mfu,
        mbu=mbu,
        step_overhead_s=step_overhead_s,
    )
    return worker_speed(perf, max_batch_tokens=max_batch_tokens, max_running=max_running)
