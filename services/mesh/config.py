"""Mesh configuration: tenants, models, limits and prices, from one TOML file.

The file is ``--config``, else ``$RIPPLEMESH_CONFIG``, else the packaged default
(`default_config.toml`, a demo tenant and a simulated Llama-3-8B). Runtime locations (the NATS
URL, the data directory) come from the command line or the environment, not from this file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from schemas.events import PriorityClass
from schemas.subjects import ADMISSION_CONSUMER
from services.admission.policy import AdmissionLimits, Control
from services.batch.policy import BatchLimits

DEFAULT_CONFIG = Path(__file__).with_name("default_config.toml")

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class TenantConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # API keys are stored only as SHA-256 hex digests.
    api_keys_sha256: list[str]
    # The tenant's class: its requests' when they ask for none.
    priority: PriorityClass = "standard"
    # The highest class its requests may ask for (`x-ripple-priority`, `SubmitRequest.priority`;
    # None: its own class): a request asking above it is put in this class (`downgrade`) or
    # refused with a 403 (`reject`).
    max_priority: PriorityClass | None = None
    above_max_priority: Literal["downgrade", "reject"] = "downgrade"
    # Admission's further limits (none by default): prompt tokens/s and max-output tokens/s
    # buckets (a burst defaults to one second's worth) and requests in flight at once; and the
    # tenant's weight in fair queuing between the tenants of a priority class.
    input_tokens_per_s: PositiveFloat | None = None
    input_token_burst: PositiveFloat | None = None
    output_tokens_per_s: PositiveFloat | None = None
    output_token_burst: PositiveFloat | None = None
    max_concurrency: Annotated[int, msgspec.Meta(ge=1)] | None = None
    weight: PositiveFloat = 1.0
    requests_per_s: PositiveFloat = 20.0
    request_burst: PositiveFloat = 40.0
    tokens_per_s: PositiveFloat = 200_000.0
    token_burst: PositiveFloat = 800_000.0
    # The tenant's NATS password as a bcrypt hash (the tenant keeps the password). Without one,
    # `ripplemesh up` generates a password and writes it to <data_dir>/credentials/.
    nats_password_bcrypt: str | None = None
    # Whether the subscribers' NATS user may read this tenant's token streams (what the model
    # wrote for it): off unless the tenant's operator grants it.
    subscribers_read_tokens: bool = False


_ADMISSION = AdmissionLimits()
# Requests an admission replica holds beyond its deferral queue: those in hand, being decided.
ADMISSION_IN_HAND = 256


def admission_messages_held(max_deferred: int) -> int:
    """The JetStream messages one admission replica may hold unacknowledged: a deferred request
    holds its message until it is decided, so a full deferral queue and the requests in hand."""
    return max_deferred + ADMISSION_IN_HAND


class AdmissionConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Admission's limits: the fields of `AdmissionLimits` (services/admission/policy/types.py), whose
    defaults these are."""

    control: Control = _ADMISSION.control
    min_priority_level: int = _ADMISSION.min_priority_level
    max_priority_level: int = _ADMISSION.max_priority_level
    max_deadline_s: PositiveFloat = _ADMISSION.max_deadline_s
    max_deferred: Annotated[int, msgspec.Meta(ge=0)] = _ADMISSION.max_deferred
    max_deferred_bytes: Annotated[int, msgspec.Meta(ge=0)] = _ADMISSION.max_deferred_bytes
    max_defer_s: PositiveFloat = _ADMISSION.max_defer_s
    critical_below: PositiveFloat = _ADMISSION.critical_below
    standard_below: PositiveFloat = _ADMISSION.standard_below
    sheddable_below: PositiveFloat = _ADMISSION.sheddable_below
    new_workflow_factor: PositiveFloat = _ADMISSION.new_workflow_factor
    kv_high: PositiveFloat = _ADMISSION.kv_high
    queue_per_worker: PositiveFloat = _ADMISSION.queue_per_worker
    wait_high_s: PositiveFloat = _ADMISSION.wait_high_s
    tpot_high_s: PositiveFloat = _ADMISSION.tpot_high_s
    lease_s: PositiveFloat = _ADMISSION.lease_s
    concurrency_retry_after_s: PositiveFloat = _ADMISSION.concurrency_retry_after_s
    deadline_margin_s: Annotated[float, msgspec.Meta(ge=0)] = _ADMISSION.deadline_margin_s

    def __post_init__(self) -> None:
        # A deferred request holds its JetStream message until it is decided: past the consumer's
        # max_ack_pending the server stops delivering to every replica, and the mesh stalls.
        if admission_messages_held(self.max_deferred) > ADMISSION_CONSUMER.max_ack_pending:
            raise ValueError(
                f"admission.max_deferred = {self.max_deferred} does not fit the admission "
                f"consumer: a replica holds up to max_deferred + {ADMISSION_IN_HAND} messages "
                f"unacknowledged, and the consumer allows {ADMISSION_CONSUMER.max_ack_pending} "
                f"across all replicas (at most {ADMISSION_CONSUMER.max_ack_pending - ADMISSION_IN_HAND})"
            )

    def limits(self) -> AdmissionLimits:
        return AdmissionLimits(**msgspec.structs.asdict(self))


# An adapter's name: what a request's `model` names it by, alone or as ``<model>:<adapter>``.
AdapterName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")]


class AdapterConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A LoRA adapter served beside its model: a request names it as ``<model>:<name>`` or by
    its name alone (so a name is unique across the mesh and no model's)."""

    name: AdapterName
    # A local PEFT adapter directory (for the engines that load real weights).
    path: str | None = None
    # The sim engine's time to load it on a worker that lacks it (seconds of modelled time).
    load_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    # The sim engine's model shape (services/engines/sim/profiles.py).
    shape: str = "llama-3-8b"
    max_context_tokens: int = 8192
    # A local Hugging Face model directory: the hf and vllm engines load it, and the ingress
    # tokenizes with its tokenizer. Without one, the project's word tokenizer serves (sim, and
    # the hf engine's tiny random Llama).
    path: str | None = None
    adapters: list[AdapterConfig] = []

    def adapter(self, name: str) -> AdapterConfig | None:
        return next((a for a in self.adapters if a.name == name), None)


class AutoscalerPoolConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One pool the autoscaler sizes: its workers' pool name is ``<role>-<gpu_type>``."""

    model: str
    role: Literal["prefill", "decode"]
    gpu_type: str = "H100"
    min_replicas: Annotated[int, msgspec.Meta(ge=0)] = 1
    max_replicas: Annotated[int, msgspec.Meta(ge=0)] = 8
    # Seconds from the start of a worker to its first request served (model load, warm-up).
    startup_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0

    @property
    def name(self) -> str:
        return f"{self.role}-{self.gpu_type}"

    def __post_init__(self) -> None:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaler pool {self.name}: min_replicas {self.min_replicas} > "
                f"max_replicas {self.max_replicas}"
            )


_BATCH = BatchLimits()


class BatchConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The Batch API runner's share of the fleet: the fields of `BatchLimits`
    (services/batch/policy.py, which says what each means), whose defaults these are."""

    slots_per_worker: Annotated[int, msgspec.Meta(ge=0)] = _BATCH.slots_per_worker
    target_occupancy: Annotated[float, msgspec.Meta(ge=0, le=1)] = _BATCH.target_occupancy
    kv_high: Annotated[float, msgspec.Meta(gt=0, le=1)] = _BATCH.kv_high
    queue_per_worker: Annotated[float, msgspec.Meta(ge=0)] = _BATCH.queue_per_worker
    pressure_hold_s: Annotated[float, msgspec.Meta(ge=0)] = _BATCH.pressure_hold_s
    pushback_s: Annotated[float, msgspec.Meta(ge=0)] = _BATCH.pushback_s
    max_in_flight: Annotated[int, msgspec.Meta(ge=0)] = _BATCH.max_in_flight
    max_release: Annotated[int, msgspec.Meta(ge=0)] = _BATCH.max_release

    def limits(self) -> BatchLimits:
        return BatchLimits(**msgspec.structs.asdict(self))


class AutoscalerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The autoscaler's targets and limits (services/autoscaler/policy.py `Settings`). Without
    `pools` it plans the pools its workers announce, each kept at the size it has."""

    interval_s: PositiveFloat = 5.0
    ttft_slo_s: PositiveFloat = 2.0
    # None: admission's `tpot_high_s`, the time per token it admits below.
    itl_slo_s: PositiveFloat | None = None
    scale_down_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    idle_to_zero_s: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    budget_per_hour: Annotated[float, msgspec.Meta(ge=0)] | None = None
    # A daily (or other) shape in the traffic, for the forecast's seasonal term.
    season_s: PositiveFloat | None = None
    # Each call to the platform (start, drain, list) gets this long.
    actuator_timeout_s: PositiveFloat = 10.0
    pools: list[AutoscalerPoolConfig] = []

    def __post_init__(self) -> None:
        names = [p.name for p in self.pools]
        if len(names) != len(set(names)):
            raise ValueError(
                f"autoscaler pools named twice: {sorted(n for n in names if names.count(n) > 1)}"
            )


class MeshConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    block_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    max_prompt_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8192
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1024 * 1024
    # A client always gets tokens or an error within these.
    first_token_timeout_s: PositiveFloat = 60.0
    body_read_timeout_s: PositiveFloat = 10.0  # HTTP: the whole request body within this
    stream_idle_timeout_s: PositiveFloat = 30.0
    models: list[ModelConfig]
    tenants: dict[str, TenantConfig]
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    autoscaler: AutoscalerConfig = msgspec.field(default_factory=AutoscalerConfig)
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    gpu_prices_per_hour: dict[str, PositiveFloat]
    # The ledger prices KV cache bytes moved from a prefill to a decode worker at this many US$
    # per GB (10^9 bytes). The default, 0.01, is the order of inter-zone data transfer prices on
    # public clouds; a transfer inside one machine or rack costs less.
    kv_transfer_usd_per_gb: Annotated[float, msgspec.Meta(ge=0)] = 0.01
    # A workflow with no lifecycle event for this long, and its final step not completed, is
    # abandoned: a failed task for the ledger.
    task_timeout_s: PositiveFloat = 600.0
    # A request whose worker dies or is drained mid-stream is placed again (migrated), its
    # stream resuming where it stopped, at most this many times; past it the stream fails.
    max_migrations: Annotated[int, msgspec.Meta(ge=0)] = 3
    # ... and only while its client has received at most this many tokens (None: any number):
    # past it, replaying them all as a prompt elsewhere costs more than the client's retry.
    max_migrated_output_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None

    def __post_init__(self) -> None:
        # A request's `model` names a model, ``<model>:<adapter>`` or an adapter alone: each
        # name must mean one thing.
        models = [m.name for m in self.models]
        adapters = [a.name for m in self.models for a in m.adapters]
        for kind, names in (("models", models), ("adapters", adapters)):
            if len(names) != len(set(names)):
                raise ValueError(f"{kind} named twice: {sorted({n for n in names if names.count(n) > 1})}")
        if clashes := sorted(set(models) & set(adapters)):
            raise ValueError(f"adapters named as models: {clashes}")

    def tenant_for_api_key(self, api_key: str) -> str | None:
        digest = hashlib.sha256(api_key.encode()).hexdigest()
        for name, tenant in self.tenants.items():
            if digest in tenant.api_keys_sha256:
                return name
        return None

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def model_and_adapter(self, name: str) -> tuple[ModelConfig, AdapterConfig | None] | None:
        """What a request's `model` names: a model, ``<model>:<adapter>``, or an adapter by its
        own name; None when it names none of them."""
        model = self.model(name)
        if model is not None:
            return model, None
        base, colon, adapter_name = name.rpartition(":")
        candidates = [m for m in self.models if m.name == base] if colon else self.models
        for candidate in candidates:
            adapter = candidate.adapter(adapter_name)
            if adapter is not None:
                return candidate, adapter
        return None

    def base_model_name(self, name: str) -> str:
        """The model serving what a request's `model` names (itself when it names nothing)."""
        resolved = self.model_and_adapter(name)
        return resolved[0].name if resolved is not None else name


class ConfigError(ValueError):
    pass


def config_path(explicit: str | Path | None = None) -> Path:
    chosen = explicit or os.environ.get("RIPPLEMESH_CONFIG")
    return Path(chosen) if chosen else DEFAULT_CONFIG


def load_config(path: str | Path | None = None) -> MeshConfig:
    source = config_path(path)
    try:
        return msgspec.toml.decode(source.read_bytes(), type=MeshConfig)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {source}") from exc
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def default_data_dir() -> Path:
    return Path(os.environ.get("RIPPLEMESH_DATA_DIR", ".ripplemesh")).resolve()
