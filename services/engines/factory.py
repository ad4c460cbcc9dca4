"""Build the engine a worker runs, from its command-line settings and the mesh config."""

from __future__ import annotations

from typing import Any

from services.engines.base import Engine, RealClock
from services.mesh.config import MeshConfig

ENGINES = ("sim", "hf", "vllm")

# Optional worker settings the sim engine takes, by the engine's argument name.
_SIM_TUNING = {
    "tensor_parallel": "tensor_parallel",
    "max_running": "max_running",
    "max_batch_tokens": "max_batch_tokens",
    "kv_cache_tokens": "kv_capacity_tokens",
}


def make_engine(settings: dict[str, Any], config: MeshConfig) -> Engine:
    kind = settings.get("engine", "sim")
    model_name = settings.get("model") or config.models[0].name
    model = config.model(model_name)
    if model is None:
        raise ValueError(f"model {model_name!r} is not in the mesh config")
    if kind == "sim":
        from services.engines.sim.engine import SimEngine

        return SimEngine(
            model=model.name,
            shape=model.shape,
            gpu_type=settings.get("gpu", "H100"),
            block_size=config.block_size,
            clock=RealClock(float(settings.get("time_scale", 1.0))),
            max_context_tokens=model.max_context_tokens,
            adapters={adapter.name: adapter.load_s for adapter in model.adapters},
            **{
                engine_arg: settings[setting]
                for setting, engine_arg in _SIM_TUNING.items()
                if settings.get(setting) is not None
            },
        )
    if kind == "hf":
        from services.engines.hf.engine import HfEngine

        # A local model directory (settings, else the mesh config); with none, a tiny random Llama.
        return HfEngine(
            model=model.name,
            model_path=settings.get("model_path") or model.path,
            block_size=config.block_size,
            device=settings.get("device") or None,
            max_context_tokens=model.max_context_tokens,
            kv_cache_tokens=settings.get("kv_cache_tokens"),
            adapters={adapter.name: adapter.path for adapter in model.adapters if adapter.path},
            adapter_load_s=max((a.load_s for a in model.adapters if a.path), default=0.0),
        )
    if kind == "vllm":
        from services.engines.vllm.engine import make_vllm_engine

        # A decode worker also serves aggregated work; vLLM's KV connector role follows the worker's.
        return make_vllm_engine(
            {
                **settings,
                "model_path": settings.get("model_path") or model.path,
                "vllm_role": settings.get("vllm_role") or settings.get("role") or "aggregated",
            },
            config,
        )
    raise ValueError(f"unknown engine {kind!r}; available here: {', '.join(ENGINES)}")
