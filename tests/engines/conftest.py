"""The engine kinds the contract suite (test_contract.py) runs over, each built as the mesh builds it.

- sim: always, on a VirtualClock (no wall time spent on simulated GPU work).
- hf: when torch and transformers import and services.engines.factory.make_engine knows "hf";
  built through make_engine with a small MeshConfig (no model path: the tiny random Llama).
- vllm: when vllm imports, a CUDA GPU is present, make_engine knows "vllm" and
  RIPPLEMESH_VLLM_MODEL names a small local model.
An unavailable kind is skipped with its reason, visibly (pytest -ra lists it).
"""

from __future__ import annotations

import importlib
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from schemas.events import InferenceRequest
from services.engines.base import Engine, VirtualClock
from services.mesh.block_hash import chain_block_hashes

ENGINE_KINDS = ("sim", "hf", "vllm")
CONTRACT_MODEL = "contract-model"
CONTRACT_BLOCK = 16
CONTRACT_CONTEXT = 2048


@dataclass
class EngineKit:
    """How to build one kind of engine, and what prompts it accepts."""

    kind: str
    model: str
    block_size: int
    max_context_tokens: int
    token_range: tuple[int, int]  # prompt token ids are drawn from this range
    # build(kv_cache_tokens=None, role="aggregated") -> a new, unstarted engine.
    build: Callable[..., Engine]
    # Whether `build(kv_cache_tokens=...)` really gives a cache that small.
    sized_cache: bool = True

    def tokens(self, seed: int, n: int) -> list[int]:
        rng = random.Random(seed)
        low, high = self.token_range
        return [rng.randrange(low, high) for _ in range(n)]

    def request(
        self,
        request_id: str,
        prompt: list[int],
        *,
        max_tokens: int = 8,
        model: str | None = None,
        block_size: int | None = None,
    ) -> InferenceRequest:
        model = model or self.model
        block_size = block_size or self.block_size
        return InferenceRequest(
            request_id=request_id,
            tenant="acme",
            model=model,
            api="nats",
            prompt_tokens=prompt,
            block_size=block_size,
            block_hashes=chain_block_hashes(prompt, block_size, model=model),
            max_tokens=max_tokens,
            temperature=0.0,
            submitted_at=time.time(),
        )


def _mesh_config(**model: Any) -> Any:
    from services.mesh.config import MeshConfig

    return msgspec.convert(
        {
            "block_size": CONTRACT_BLOCK,
            "models": [{"name": CONTRACT_MODEL, "max_context_tokens": CONTRACT_CONTEXT, **model}],
            "tenants": {},
            "gpu_prices_per_hour": {},
        },
        MeshConfig,
    )


def _factory_knows(kind: str) -> bool:
    from services.engines import factory

    return kind in getattr(factory, "ENGINES", ())


def _imports(module: str) -> str | None:
    """None when `module` imports, else why not."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken install raises OSError and the like, not only ImportError
        return f"{type(exc).__name__}: {exc}"
    return None


def sim_kit() -> EngineKit:
    from services.engines.sim.engine import SimEngine

    def build(kv_cache_tokens: int | None = None, role: str = "aggregated") -> Engine:
        return SimEngine(
            model=CONTRACT_MODEL,
            block_size=CONTRACT_BLOCK,
            clock=VirtualClock(),
            max_context_tokens=CONTRACT_CONTEXT,
            kv_capacity_tokens=kv_cache_tokens,
        )

    return EngineKit("sim", CONTRACT_MODEL, CONTRACT_BLOCK, CONTRACT_CONTEXT, (300, 600), build)


def hf_kit() -> EngineKit:
    for module in ("torch", "transformers"):
        why = _imports(module)
        if why is not None:
            pytest.skip(f"hf engine: {module} does not import ({why})")
    if not _factory_knows("hf"):
        pytest.skip("hf engine: services.engines.factory.make_engine does not support 'hf' yet")
    from services.engines.factory import make_engine

    config = _mesh_config()

    def build(kv_cache_tokens: int | None = None, role: str = "aggregated") -> Engine:
        settings: dict[str, Any] = {"engine": "hf", "device": "cpu"}
        if kv_cache_tokens is not None:
            settings["kv_cache_tokens"] = kv_cache_tokens
        return make_engine(settings, config)

    # The tiny random Llama's vocabulary is the word tokenizer's plus EOS (about 700 ids).
    kit = EngineKit("hf", CONTRACT_MODEL, CONTRACT_BLOCK, CONTRACT_CONTEXT, (300, 600), build)
    probe = build(kv_cache_tokens=64 * CONTRACT_BLOCK)
    kit.sized_cache = probe.info.kv_blocks_total <= 64
    return kit


def vllm_kit() -> EngineKit:
    why = _imports("vllm")
    if why is not None:
        pytest.skip(f"vllm engine: vllm does not import ({why})")
    torch = importlib.import_module("torch")
    if not torch.cuda.is_available():
        pytest.skip("vllm engine: no CUDA GPU")
    if not _factory_knows("vllm"):
        pytest.skip("vllm engine: services.engines.factory.make_engine does not support 'vllm' yet")
    model_path = os.environ.get("RIPPLEMESH_VLLM_MODEL", "")
    if not model_path:
        pytest.skip("vllm engine: set RIPPLEMESH_VLLM_MODEL to a small local model directory")
    from services.engines.factory import make_engine

    config = _mesh_config(path=model_path)

    def build(kv_cache_tokens: int | None = None, role: str = "aggregated") -> Engine:
        from services.mesh.embedded_nats import free_port

        settings = {
            "engine": "vllm",
            "vllm_role": role,
            "model_path": model_path,
            # Up to three instances share the GPU in one test (aggregated, prefill, decode).
            "gpu_memory_utilization": float(os.environ.get("RIPPLEMESH_VLLM_GPU_MEMORY", "0.25")),
            "nixl_side_channel_port": free_port(),
        }
        return make_engine(settings, config)

    # Ids every real vocabulary has.
    return EngineKit(
        "vllm", CONTRACT_MODEL, CONTRACT_BLOCK, CONTRACT_CONTEXT, (1000, 20000), build, sized_cache=False
    )


KITS: dict[str, Callable[[], EngineKit]] = {"sim": sim_kit, "hf": hf_kit, "vllm": vllm_kit}


_built: dict[str, EngineKit | str] = {}


@pytest.fixture(params=ENGINE_KINDS)
def kit(request: pytest.FixtureRequest) -> EngineKit:
    """The kit for one engine kind (built once per session), or a skip saying why there is none."""
    kind = request.param
    if kind not in _built:
        try:
            _built[kind] = KITS[kind]()
        except pytest.skip.Exception as skipped:
            _built[kind] = str(skipped.msg)
    found = _built[kind]
    if isinstance(found, str):
        pytest.skip(found)
    return found


EngineMaker = Callable[..., Awaitable[Engine]]


@pytest_asyncio.fixture
async def new_engine(kit: EngineKit) -> AsyncIterator[EngineMaker]:
    """`await new_engine(kv_cache_tokens=None, role="aggregated")`: a started engine of the kit's
    kind, stopped after the test."""
    started: list[Engine] = []

    async def make(kv_cache_tokens: int | None = None, role: str = "aggregated") -> Engine:
        engine = kit.build(kv_cache_tokens=kv_cache_tokens, role=role)
        await engine.start()
        started.append(engine)
        return engine

    yield make
    for engine in reversed(started):
        await engine.stop()
