"""Lazy access to vLLM: the only place that imports it, so the rest of the package imports anywhere.

`load_vllm()` imports the handful of vLLM classes the engine uses and fails with one clear
ImportError, naming the extra to install, where vLLM is missing. Everything here is resolved at
call time, never at import time, so `import services.engines.vllm` works without vLLM or a GPU.

Paths, as of the vLLM sources this was written against (v1 engine, 2025-2026):
- `vllm.v1.engine.async_llm.AsyncLLM` (`from_engine_args`, `generate`, `abort`, `shutdown`)
- `vllm.engine.arg_utils.AsyncEngineArgs`
- `vllm.sampling_params.SamplingParams`, `RequestOutputKind`
- `vllm.config.KVTransferConfig`, `KVEventsConfig`
- `vllm.v1.metrics.loggers.StatLoggerBase`
- `vllm.v1.engine.exceptions.EngineDeadError`, `EngineGenerateError`
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

VLLM_EXTRA_HINT = "pip install 'ripplemesh[vllm]'"
MISSING_VLLM = (
    "The vLLM engine needs the `vllm` extra, which is not installed here: "
    f"{VLLM_EXTRA_HINT} (on a machine with a CUDA GPU)."
)


@dataclass(frozen=True, slots=True)
class VllmApi:
    version: str
    AsyncLLM: Any
    AsyncEngineArgs: Any
    SamplingParams: Any
    RequestOutputKind: Any
    KVTransferConfig: Any
    KVEventsConfig: Any
    StatLoggerBase: Any | None
    # vllm.lora.request.LoRARequest(lora_name, lora_int_id, lora_path): a request's adapter.
    LoRARequest: Any
    EngineDeadError: type[BaseException]
    EngineGenerateError: type[BaseException]
    # Request errors (the request's fault): vLLM's client errors where it has them, ValueError always.
    client_errors: tuple[type[BaseException], ...]


def vllm_available() -> bool:
    try:
        load_vllm()
    except ImportError:
        return False
    return True


@functools.cache
def load_vllm() -> VllmApi:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(MISSING_VLLM) from exc
    try:
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
    except ImportError as exc:
        version = getattr(vllm, "__version__", "unknown")
        raise ImportError(
            f"vLLM {version} lacks the v1 AsyncLLM API this engine is written against ({exc}); "
            f"install a current release: {VLLM_EXTRA_HINT}"
        ) from exc
    try:
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError:  # stats are optional: the engine falls back to its own counts
        StatLoggerBase = None
    client_errors: tuple[type[BaseException], ...] = (ValueError, TypeError)
    try:
        from vllm.exceptions import VLLMValidationError

        client_errors = (*client_errors, VLLMValidationError)
    except ImportError:
        pass
    try:
        from vllm.exceptions import VLLMClientError

        client_errors = (*client_errors, VLLMClientError)
    except ImportError:
        pass
    return VllmApi(
        version=getattr(vllm, "__version__", "unknown"),
        AsyncLLM=AsyncLLM,
        AsyncEngineArgs=AsyncEngineArgs,
        SamplingParams=SamplingParams,
        RequestOutputKind=RequestOutputKind,
        KVTransferConfig=KVTransferConfig,
        KVEventsConfig=KVEventsConfig,
        StatLoggerBase=StatLoggerBase,
        LoRARequest=LoRARequest,
        EngineDeadError=EngineDeadError,
        EngineGenerateError=EngineGenerateError,
        client_errors=client_errors,
    )
