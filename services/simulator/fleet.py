"""The simulated fleet: pools of sim engines (GPU type, model shape, role, size, autoscaling).

A fleet comes from a TOML file (the fields of `FleetSpec` and `PoolSpec`) or a compact string,
pools separated by commas:

    64xH100                               64 H100s serving llama-3.1-8b (bf16), aggregated
    16xH200/llama-3.1-8b:fp8              a model shape with its precision (profiles.model_shape)
    prefill:8xH100,decode:24xH100         disaggregated: a prefill pool and a decode pool
    4..32xH100                            autoscaled between 4 and 32 replicas, starting at 4
    0..8xH100                             autoscaled between 0 and 8 (to zero when idle), starting at 0
    8xH100/llama-3-70b:fp8@2              tensor parallelism 2 (each replica two GPUs)
    2xH100/llama-3.1-8b,2xH100/llama-3-70b:fp8@2
                                          two models, each its pool (the shapes name two models)
    2xH100/qwen-7b=llama-3.1-8b           model qwen-7b on the llama-3.1-8b shape

A pool serves one model, the name requests carry (`PoolSpec.model`; none: the workload's). In a
compact string, `MODEL=SHAPE` names it; and where the pools' shapes name more than one model
(shape names less their precision, `llama-3.1-8b` and `llama-3-70b`), each pool naming a shape
serves the model of that name (a pool naming none, the workload's). Shapes of one model in
several precisions (`llama-3-8b`, `llama-3-8b:fp8`) are one model's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from services.autoscaler.capacity import Slo
from services.autoscaler.policy import Settings
from services.engines.sim import profiles
from services.engines.sim.engine import SimEngine
from services.engines.sim.perf import MBU, MFU, STEP_OVERHEAD_S

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
_DEFAULT_SETTINGS = Settings()
_DEFAULT_SLO = Slo()


class PoolSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = ""
    role: Literal["decode", "prefill"] = "decode"  # "decode" pools serve aggregated when no prefill pool
    gpu: str = "H100"
    shape: str = "llama-3.1-8b"
    model: str | None = None  # the model it serves (requests naming it); default: the workload's
    replicas: Count = 1  # at the start (an autoscaled pool's start may be its minimum, 0 too)
    autoscale: bool = False
    min_replicas: Count = 1
    max_replicas: Count | None = None  # default: max(replicas, min_replicas)
    tensor_parallel: Positive = 1
    max_batch_tokens: Positive = 8192
    max_running: Positive = 256
    max_context_tokens: Positive = 131_072
    kv_capacity_tokens: Positive | None = None
    memory_fraction: float = 0.9
    mfu: float = MFU
    mbu: float = MBU
    step_overhead_s: NonNegative = STEP_OVERHEAD_S
    # A new replica is billed from its start but serves only after this (model load, warm-up).
    startup_s: NonNegative = 60.0

    def label(self, index: int) -> str:
        return self.name or f"{self.role}-{self.gpu}-{index}".lower()

    @property
    def high(self) -> int:
        """The most replicas the pool may have."""
        return self.max_replicas if self.max_replicas is not None else max(self.replicas, self.min_replicas)

    def engine(self, *, model: str, block_size: int) -> SimEngine:
        """The worker's engine, built by the sim engine's own constructor (never started)."""
        return SimEngine(
            model=model,
            shape=self.shape,
            gpu_type=self.gpu,
            block_size=block_size,
            tensor_parallel=self.tensor_parallel,
            max_batch_tokens=self.max_batch_tokens,
            max_running=self.max_running,
            kv_capacity_tokens=self.kv_capacity_tokens,
            max_context_tokens=self.max_context_tokens,
            mfu=self.mfu,
            mbu=self.mbu,
            step_overhead_s=self.step_overhead_s,
            memory_fraction=self.memory_fraction,
        )


class FleetSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pools: list[PoolSpec]
    block_size: Positive | None = None  # default: the workload's
    heartbeat_s: float = 1.0  # the workers' heartbeat (services/engines/host.py HEARTBEAT_S)
    # The autoscaler's planning interval (the policy's `Settings.interval_s`; the baselines plan
    # at their own, services/autoscaler/baselines.py) and the fleet timeline's sampling interval.
    autoscale_interval_s: float = 5.0
    # The policy's settings (services/autoscaler/policy.py `Settings`), defaults as there.
    scale_down_delay_s: NonNegative = _DEFAULT_SETTINGS.scale_down_delay_s
    ttft_slo_s: float = _DEFAULT_SLO.ttft_s
    itl_slo_s: float = _DEFAULT_SLO.itl_s
    idle_to_zero_s: NonNegative = _DEFAULT_SETTINGS.idle_to_zero_s
    budget_per_hour: NonNegative | None = _DEFAULT_SETTINGS.budget_per_hour
    # A request for a model with no serving replica is held for one to come up, at most until
    # its deadline, or this long where it has none; then it is rejected (no capacity in time).
    hold_limit_s: NonNegative = 120.0
    # The hpa-queue baseline's target: queued + running sequences per decode replica (the
    # project's earlier HPA-style rule's default); prefill replicas' is
    # `prefill_sequences_per_replica`.
    sequences_per_replica: Annotated[float, msgspec.Meta(gt=0)] = 64.0
    prefill_sequences_per_replica: Annotated[float, msgspec.Meta(gt=0)] = 8.0
    gpu_prices_per_hour: dict[str, float] | None = None  # default: the mesh config's
    kv_transfer_usd_per_gb: NonNegative | None = None  # default: the mesh config's

    def __post_init__(self) -> None:
        if not self.pools:
            raise ValueError("a fleet needs at least one pool")
        if self.heartbeat_s <= 0 or self.autoscale_interval_s <= 0:
            raise ValueError("heartbeat_s and autoscale_interval_s must be > 0")
        if self.ttft_slo_s <= 0 or self.itl_slo_s <= 0:
            raise ValueError("ttft_slo_s and itl_slo_s must be > 0")
        names: set[str] = set()
        for index, pool in enumerate(self.pools):
            label = pool.label(index)
            if label in names:
                raise ValueError(f"two pools are named {label!r}")
            names.add(label)
            if pool.max_replicas is not None and pool.max_replicas < pool.min_replicas:
                raise ValueError(f"pool {label}: max_replicas < min_replicas")
        if not any(p.role == "decode" for p in self.pools):
            raise ValueError("a fleet needs a decode (or aggregated) pool")

    @property
    def replicas(self) -> int:
        return sum(p.replicas for p in self.pools)

    def settings(self) -> Settings:
        """The autoscaler policy's settings for this fleet."""
        return Settings(
            slo=Slo(ttft_s=self.ttft_slo_s, itl_s=self.itl_slo_s),
            interval_s=self.autoscale_interval_s,
            scale_down_delay_s=self.scale_down_delay_s,
            idle_to_zero_s=self.idle_to_zero_s,
            budget_per_hour=self.budget_per_hour,
        )


_POOL = re.compile(
    r"^(?:(?P<role>prefill|decode):)?"
    r"(?:(?P<low>\d+)\.\.(?P<high>\d+)|(?P<count>\d+))x(?P<gpu>[A-Za-z0-9_-]+)"
    r"(?:/(?:(?P<model>[A-Za-z0-9_./:-]+)=)?(?P<shape>[A-Za-z0-9_.:-]+?))?(?:@(?P<tp>\d+))?$"
)


def parse_fleet(spec: str) -> FleetSpec:
    """A fleet from a TOML file path or a compact string (see the module docstring)."""
    path = Path(spec)
    if spec.endswith(".toml"):
        if not path.exists():
            raise ValueError(f"fleet file not found: {spec}")
        return msgspec.toml.decode(path.read_bytes(), type=FleetSpec)
    pools: list[PoolSpec] = []
    named: list[str | None] = []  # the model each pool's `/...` names
    for item in filter(None, (part.strip() for part in spec.split(","))):
        match = _POOL.match(item)
        if match is None:
            raise ValueError(
                f"bad pool {item!r}: expected [prefill:|decode:]N[..M]xGPU[/[model=]shape][@tp], e.g. 64xH100"
            )
        fields: dict[str, object] = {"gpu": match["gpu"], "role": match["role"] or "decode"}
        if match["count"] is not None:
            fields["replicas"] = int(match["count"])
        else:
            low, high = int(match["low"]), int(match["high"])
            fields.update(replicas=low, min_replicas=low, max_replicas=high, autoscale=True)
        if match["shape"]:
            fields["shape"] = match["shape"]
            try:
                profiles.model_shape(match["shape"])
            except ValueError as error:
                raise ValueError(
                    f"pool {item!r}: {error}; a model of another name takes a shape: "
                    f"{match['shape']}=llama-3.1-8b"
                ) from None
        if match["model"]:
            fields["model"] = match["model"]
        if match["tp"]:
            fields["tensor_parallel"] = int(match["tp"])
        pools.append(msgspec.convert(fields, PoolSpec))
        named.append(match["model"] or (match["shape"].partition(":")[0] if match["shape"] else None))
    if len({name for name in named if name is not None}) > 1:
        # The shapes name several models: each pool naming one serves the model of that name.
        pools = [
            msgspec.structs.replace(pool, model=name) if name is not None and pool.model is None else pool
            for pool, name in zip(pools, named, strict=True)
        ]
    return FleetSpec(pools=pools)
