"""`ripplemesh bench engine`: an engine's prefill and decode rates by batch size, side by side with
the public figures they are calibrated against.

Every figure is measured through the Engine protocol (services/engines/sim/workload.py), on the
engine's own clock: the sim engine on a VirtualClock (simulated GPU time, seconds of wall time),
real engines (hf, vllm) on the wall clock. Next to each rate:
- the datasheet roofline: the same work at 100% of the GPU's dense TFLOPS (prefill) or HBM
  bandwidth (decode), from services/engines/sim/profiles.py; the ratio is the efficiency reached;
- for the sim engine, a maximum-throughput run of each published case on the same GPU and model
  family (profiles.PUBLISHED: NVIDIA's TensorRT-LLM performance overview), in a "published"
  column, with the ratio of model to published.

Engines are built by a small registry: the sim engine directly (it needs the virtual clock),
every other kind through services.engines.factory.make_engine, as a worker builds it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from services.engines.base import Engine, VirtualClock
from services.engines.sim.perf import PerfModel
from services.engines.sim.profiles import GPUS, PUBLISHED, PublishedThroughput, model_shape
from services.engines.sim.workload import batch_rates, max_throughput

DEFAULT_BATCHES = (1, 8, 32, 128)


@dataclass
class BenchTarget:
    """A fresh, unstarted engine and the clock its rates are measured on."""

    engine: Engine
    now: Callable[[], float]
    clock: str  # "virtual" or "real"


# (gpu, model, tensor_parallel) -> target
TargetFactory = Callable[[str, str, int], BenchTarget]


def _sim_target(gpu: str, model: str, tensor_parallel: int = 1) -> BenchTarget:
    from services.engines.sim.engine import SimEngine

    clock = VirtualClock()
    engine = SimEngine(
        model=model.split(":")[0],
        shape=model,
        gpu_type=gpu,
        tensor_parallel=tensor_parallel,
        clock=clock,
        max_running=1024,  # the KV cache, not a count, bounds the batch
        max_context_tokens=131_072,
    )
    return BenchTarget(engine, clock.now, "virtual")


def _mesh_target(kind: str) -> TargetFactory:
    def build(gpu: str, model: str, tensor_parallel: int = 1) -> BenchTarget:
        from services.engines.factory import make_engine
        from services.mesh.config import MeshConfig, load_config

        config = load_config()
        if config.model(model) is None:
            # Not a configured model: a model directory (or a name the engine resolves itself).
            entry: dict[str, Any] = {"name": Path(model).name or model}
            if Path(model).exists():
                entry["path"] = model
            config = msgspec.convert({**msgspec.to_builtins(config), "models": [entry]}, MeshConfig)
            model = entry["name"]
        settings: dict[str, Any] = {"engine": kind, "gpu": gpu, "model": model}
        if tensor_parallel != 1:
            settings["tensor_parallel"] = tensor_parallel
        return BenchTarget(make_engine(settings, config), time.monotonic, "real")

    return build


ENGINE_TARGETS: dict[str, TargetFactory] = {"sim": _sim_target}


def target_factory(engine: str) -> TargetFactory:
    return ENGINE_TARGETS.get(engine) or _mesh_target(engine)


def _roofline(gpu: str, model: str, tensor_parallel: int = 1) -> PerfModel | None:
    """The datasheet bound: 100% of peak FLOPS and bandwidth, no overhead."""
    if gpu not in GPUS:
        return None
    try:
        shape = model_shape(model)
    except ValueError:
        return None
    return PerfModel(GPUS[gpu], shape, tensor_parallel, mfu=1.0, mbu=1.0, step_overhead_s=0.0)


def _same_family(model: str, published: PublishedThroughput) -> bool:
    try:
        return model_shape(model).params_b == model_shape(published.shape).params_b
    except ValueError:
        return False


async def _measure_batches(
    factory: TargetFactory,
    gpu: str,
    model: str,
    tensor_parallel: int,
    batches: Sequence[int],
    prompt_tokens: int,
    output_tokens: int,
) -> tuple[str, dict[int, tuple[float, float]]]:
    rates: dict[int, tuple[float, float]] = {}
    clock = "virtual"
    for batch in batches:
        # A fresh engine each time: no prefix cached from the last batch.
        target = factory(gpu, model, tensor_parallel)
        clock = target.clock
        await target.engine.start()
        try:
            measured = await batch_rates(
                target.engine,
                target.now,
                batch=batch,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                seed=batch,
            )
        finally:
            await target.engine.stop()
        rates[batch] = (measured.prefill_tokens_per_s, measured.decode_tokens_per_s)
    return clock, rates


async def _measure_published(factory: TargetFactory, case: PublishedThroughput, requests: int) -> float:
    target = factory(case.gpu, case.shape, case.tensor_parallel)
    await target.engine.start()
    try:
        result = await max_throughput(
            target.engine,
            target.now,
            requests=requests,
            input_tokens=case.input_tokens,
            output_tokens=case.output_tokens,
        )
    finally:
        await target.engine.stop()
    return result.output_tokens_per_s


def run_engine_bench(
    *,
    engine: str,
    gpu: str,
    model: str,
    console: Console,
    batches: Sequence[int] = DEFAULT_BATCHES,
    prompt_tokens: int = 1000,
    output_tokens: int = 128,
    published_requests: int = 1000,
    tensor_parallel: int = 1,
    factory: TargetFactory | None = None,
) -> dict[str, Any]:
    """Measure `engine` (sim, hf, vllm) serving `model` on `gpu`; print and return the figures.

    `model` is a sim model shape (e.g. "llama-3-8b", "llama-3-8b:fp8") for the sim engine, a
    configured model name or model directory for the others. `published_requests`: requests per
    maximum-throughput run of a published case (the published runs used 3,000; 0 skips them).
    """
    build = factory or target_factory(engine)
    # Only the sim engine models the GPU profile; another engine runs on whatever device it has.
    roofline = _roofline(gpu, model, tensor_parallel) if engine == "sim" else None
    cases = [p for p in PUBLISHED if engine == "sim" and p.gpu == gpu and _same_family(model, p)]

    with console.status(f"benchmarking the {engine} engine ({model} on {gpu})"):
        try:
            clock, rates = asyncio.run(
                _measure_batches(build, gpu, model, tensor_parallel, batches, prompt_tokens, output_tokens)
            )
        except ValueError as exc:  # e.g. the model does not fit the GPU at this tensor parallelism
            console.print(f"[yellow]by batch: {exc}[/yellow]")
            clock, rates = ("virtual" if engine == "sim" else "real"), {}
        published_rates = [
            asyncio.run(_measure_published(build, case, published_requests))
            for case in (cases if published_requests > 0 else [])
        ]

    where = f"{tensor_parallel}x {gpu}" if tensor_parallel != 1 else gpu
    if engine != "sim":
        where = "this machine's device"
    table = Table(
        title=f"{engine} engine: {model} on {where}, prompts of {prompt_tokens} tokens, "
        f"{output_tokens} out ({clock} clock)"
    )
    for column in ("phase", "batch", "tokens/s", "datasheet roofline", "of roofline", "published", "ratio"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    result: dict[str, Any] = {
        "engine": engine,
        "gpu": gpu,
        "model": model,
        "clock": clock,
        "tensor_parallel": tensor_parallel,
        "prefill_tokens_per_s": {},
        "decode_tokens_per_s": {},
        "prefill_roofline_tokens_per_s": {},
        "decode_roofline_tokens_per_s": {},
        "published": [],
    }
    for phase in ("prefill", "decode"):
        for batch, (prefill, decode) in rates.items():
            measured = prefill if phase == "prefill" else decode
            bound = None
            if roofline is not None:
                if phase == "prefill":
                    bound = prompt_tokens / roofline.prefill_seconds(prompt_tokens)
                else:
                    context = batch * (prompt_tokens + output_tokens // 2)
                    bound = batch / roofline.decode_seconds(batch, context)
                result[f"{phase}_roofline_tokens_per_s"][batch] = bound
            result[f"{phase}_tokens_per_s"][batch] = measured
            table.add_row(
                phase,
                str(batch),
                f"{measured:,.0f}",
                f"{bound:,.0f}" if bound else "-",
                f"{measured / bound:.0%}" if bound else "-",
                "-",
                "-",
            )
    for case, measured in zip(cases, published_rates, strict=False):
        ratio = measured / case.output_tokens_per_s
        result["published"].append(
            {
                "gpu": case.gpu,
                "shape": case.shape,
                "tensor_parallel": case.tensor_parallel,
                "input_tokens": case.input_tokens,
                "output_tokens": case.output_tokens,
                "requests": published_requests,
                "published_requests": case.requests,
                "measured_tokens_per_s": measured,
                "published_tokens_per_s": case.output_tokens_per_s,
                "ratio": ratio,
                "source": case.source,
            }
        )
        label = f"max throughput {case.input_tokens}/{case.output_tokens}"
        table.add_row(
            f"{label}, {case.shape}, TP{case.tensor_parallel}",
            f"{published_requests} req",
            f"{measured:,.0f}",
            "-",
            "-",
            f"{case.output_tokens_per_s:,.0f}",
            f"{ratio:.2f}x",
        )
    console.print(table)
    if roofline is not None:
        g = roofline.gpu
        console.print(
            f"datasheet roofline: {g.name} at {g.dense_tflops(roofline.model.dtype):,.0f} dense TFLOPS and "
            f"{g.hbm_tb_per_s} TB/s HBM, no overhead (services/engines/sim/profiles.py)"
        )
    if result["published"]:
        console.print(f"published: {cases[0].source}")
        console.print(
            f"(the published runs used {cases[0].requests:,} requests; these used {published_requests:,})"
        )
    elif engine != "sim":
        console.print("published figures are compared for the sim engine only")
    return result
