"""The autoscaler service over the real NATS: it plans from what it hears, acts through an
actuator, and neither bad input nor a failing platform stops it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from schemas.events import (
    CapacityWanted,
    ScalingDecision,
    WorkerState,
    decode_event,
    encode_event,
    new_event_id,
)
from schemas.subjects import WORKERS, event_subject
from services.autoscaler.actuator import ActuatorError, PoolActual, ScaleAction
from services.autoscaler.launcher_actuator import LauncherActuator
from services.autoscaler.service import AutoscalerService
from services.mesh.bus import Bus
from services.mesh.config import (
    DEFAULT_CONFIG,
    AutoscalerConfig,
    AutoscalerPoolConfig,
    ConfigError,
    load_config,
)
from services.mesh.embedded_nats import EmbeddedNats
from services.mesh.runtime import Runtime, ServiceOptions
from tests.conftest import replicas_for

MODEL = "llama-3-8b"


class Platform:
    """An actuator as a platform would be: replicas it started; `fail` makes it refuse, `hang`
    makes it never answer (the service's timeout must end the call)."""

    def __init__(self) -> None:
        self.pools: dict[str, list[str]] = {"decode-H100": []}
        self.actions: list[ScaleAction] = []
        self.fail = False
        self.hang = False

    async def apply(self, action: ScaleAction) -> None:
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail:
            raise ActuatorError("quota exceeded for nvidia.com/gpu")
        self.actions.append(action)
        members = [m for m in self.pools[action.pool] if m not in action.remove]
        members += [f"{action.pool}-{len(self.actions)}-{i}" for i in range(action.add)]
        self.pools[action.pool] = members

    async def actual(self) -> dict[str, PoolActual]:
        return {pool: PoolActual(pool, replicas=tuple(members)) for pool, members in self.pools.items()}


@contextlib.asynccontextmanager
async def autoscaler(
    nats_server: EmbeddedNats, tmp_path: Path, actuator: Platform | None
) -> AsyncIterator[tuple[AutoscalerService, Bus]]:
    base = load_config()
    config = msgspec.structs.replace(
        base,
        autoscaler=AutoscalerConfig(
            interval_s=0.3,
            actuator_timeout_s=0.5,
            pools=[
                AutoscalerPoolConfig(model=MODEL, role="decode", min_replicas=0, max_replicas=4, startup_s=5)
            ],
        ),
    )
    assert nats_server.auth is not None
    bus = await Bus.connect(
        nats_server.url,
        "autoscaler",
        credentials=nats_server.auth.service,
        replicas=replicas_for(nats_server),
    )
    await bus.provision()
    runtime = Runtime(
        "autoscaler", ServiceOptions(nats_url=nats_server.url, data_dir=tmp_path, config=config), bus
    )
    service = AutoscalerService(actuator)
    await service.start(runtime)
    try:
        yield service, bus
    finally:
        await service.stop()
        await runtime.cancel_tasks()
        await bus.close()


class Decisions:
    """Every ScalingDecision published, from the moment it subscribed (flushed: in place on the
    server before anything the test does next)."""

    def __init__(self) -> None:
        self.seen: list[ScalingDecision] = []

    @classmethod
    async def collect(cls, bus: Bus) -> Decisions:
        collector = cls()

        async def on(msg) -> None:  # type: ignore[no-untyped-def]
            event = decode_event(msg.data)
            assert isinstance(event, ScalingDecision)
            collector.seen.append(event)

        await bus.nc.subscribe(event_subject("scaling"), cb=on)
        await bus.nc.flush()
        return collector

    async def first(self, predicate, timeout_s: float = 10.0) -> ScalingDecision:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while True:
            found = next((d for d in self.seen if predicate(d)), None)
            if found is not None:
                return found
            assert time.monotonic() < deadline, [d.pools for d in self.seen]
            await asyncio.sleep(0.05)


async def want_capacity(bus: Bus) -> None:
    await bus.publish(
        event_subject("capacity"),
        CapacityWanted(
            event_id=new_event_id(), occurred_at=time.time(), model=MODEL, held=2, due_at=time.time() + 30
        ),
    )


async def test_a_held_request_wakes_the_plan_and_the_platform_starts_a_replica(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    platform = Platform()
    async with autoscaler(nats_server, tmp_path, platform) as (_, bus):
        seen = await Decisions.collect(bus)
        await seen.first(lambda d: True)  # planning
        await want_capacity(bus)
        held = await seen.first(lambda d: d.pools[0].add > 0)
        assert held.mode == "act" and "from zero: 2 held" in held.pools[0].reason
        assert held.trigger == "held"  # at once, not at the interval (wakes are held 2 s apart)
        assert platform.actions[0].decision_id == held.event_id
        # The platform runs it: warming until it heart-beats, and no second scale-up meanwhile.
        later = await seen.first(lambda d: d.occurred_at > held.occurred_at)
        assert later.pools[0].warming == 1 and later.pools[0].add == 0


@pytest.mark.parametrize("trouble", ["fail", "hang"])
async def test_a_failing_platform_is_reported_and_the_plan_made_again(
    nats_server: EmbeddedNats, tmp_path: Path, trouble: str
) -> None:
    platform = Platform()
    setattr(platform, trouble, True)
    async with autoscaler(nats_server, tmp_path, platform) as (service, bus):
        seen = await Decisions.collect(bus)
        await want_capacity(bus)
        failed = await seen.first(lambda d: bool(d.failed), timeout_s=15)
        expected = "quota exceeded" if trouble == "fail" else "TimeoutError"
        assert expected in failed.failed[0] and failed.failed[0].startswith("decode-H100: ")
        # Fixed, a later plan acts: nothing was lost meanwhile.
        setattr(platform, trouble, False)
        await want_capacity(bus)
        await async_until(lambda: platform.actions)
        assert service.health()["mode"] == "act"


async def test_bad_input_is_ignored_and_planning_goes_on(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with autoscaler(nats_server, tmp_path, Platform()) as (service, bus):
        seen = await Decisions.collect(bus)
        for subject in ("rmesh.prepared.demo", event_subject("prefill_completed"), event_subject("capacity")):
            await bus.nc.publish(subject, b"{not json")
            await bus.nc.publish(subject, b'{"type": "request.prefill_completed.v1", "event_id": 3}')
        kv = await bus.key_value(WORKERS)
        await kv.put("decode-bad", b"[1, 2]")
        # A worker's state from long ago (stale) counts as a replica of its pool, nothing more.
        stale = WorkerState(
            event_id=new_event_id(),
            occurred_at=1.0,
            worker_id="decode-old",
            role="decode",
            pool="decode-H100",
            model=MODEL,
            engine="sim",
            gpu_type="H100",
            price_per_hour=3.0,
            block_size=16,
            kv_blocks_total=100,
            kv_blocks_used=0,
            kv_blocks_cached=0,
            queue_depth=0,
            running=0,
            tokens_per_s=0.0,
            started_at=1.0,
        )
        await kv.put("decode-old", encode_event(stale))
        start = time.time()
        later = await seen.first(lambda d: d.occurred_at > start + 0.5)
        assert later.pools[0].pool == "decode-H100"
        await kv.delete("decode-bad")
        await kv.delete("decode-old")
        assert "decode-H100" in service.health()["pools"]


async def test_without_an_actuator_it_observes_only(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with autoscaler(nats_server, tmp_path, None) as (_, bus):
        seen = await Decisions.collect(bus)
        await want_capacity(bus)
        would = await seen.first(lambda d: d.pools[0].desired == 1)  # what it would do, said
        assert would.mode == "observe"
        assert all(d.mode == "observe" for d in seen.seen)


async def test_the_launcher_actuator_says_when_no_supervisor_answers(bus: Bus) -> None:
    actuator = LauncherActuator(bus.nc, timeout_s=0.5)
    with pytest.raises(ActuatorError, match="no supervisor answers"):
        await actuator.actual()


async def async_until(predicate, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.05)


def test_a_pool_whose_minimum_exceeds_its_maximum_is_a_clear_config_error(tmp_path: Path) -> None:
    path = tmp_path / "ripplemesh.toml"
    pool = '[[autoscaler.pools]]\nmodel = "llama-3-8b"\nrole = "decode"\nmin_replicas = 3\nmax_replicas = 2\n'
    path.write_text(DEFAULT_CONFIG.read_text() + "\n[autoscaler]\n" + pool)
    with pytest.raises(ConfigError, match=r"autoscaler pool decode-H100: min_replicas 3 > max_replicas 2"):
        load_config(path)
