"""The router service on a real NATS server: every decision as a RouteDecision with its predictions,
decision and prediction-error metrics, the workflow's spend from the ledger's bucket, and two
active-active replicas that share the load they place instead of herding onto one worker.

Routers run in this process (two RouterService instances, each with its own connection, as two
processes would have); workers are heartbeats in the WORKERS bucket plus a KV dump responder, so
the placements land nowhere and are counted where they are published.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, get_args, get_type_hints

import msgspec
import pytest
from nats.aio.msg import Msg
from prometheus_client import REGISTRY

from schemas.events import (
    DecodeCompleted,
    InferenceRequest,
    KvDump,
    PrefillCompleted,
    PrefillWork,
    RequestAdmitted,
    RequestRejected,
    RouteDecision,
    Usage,
    WorkerState,
    WorkflowRef,
    WorkflowSpend,
    encode_event,
    new_event_id,
)
from schemas.subjects import WORKERS, WORKFLOW_SPEND, admitted_subject, event_subject, kv_dump_subject
from services.mesh.block_hash import chain_block_hashes
from services.mesh.bus import Bus
from services.mesh.config import MeshConfig, load_config
from services.mesh.embedded_nats import EmbeddedNats
from services.mesh.runtime import Runtime, ServiceOptions
from services.mesh.workflow_spend_view import WorkflowSpendView
from services.router import reporting
from services.router.feedback import count_peer_placement
from services.router.kv_index import KvIndex
from services.router.policy import (
    NoPlacement,
    NoPrefix,
    Placement,
    PrefixView,
    RouterConfig,
    RouteRequest,
    RouterState,
    earliest_first_token,
    place,
)
from services.router.service import REJECTION_REASONS, RouterService, route_request, router_config, view_of

pytestmark = pytest.mark.timeout(120)

MODEL = "llama-3-8b"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def own_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """A NATS server of this module's own: no other router consumes its admitted requests."""
    server = EmbeddedNats(tmp_path_factory.mktemp("nats-router")).start()
    yield server
    server.stop()


@pytest.fixture
async def bus(own_nats: EmbeddedNats) -> AsyncIterator[Bus]:
    connected = await Bus.connect(own_nats.url, "tests")
    await connected.provision()
    yield connected
    await connected.close()


@contextlib.asynccontextmanager
async def router_replica(url: str, config: MeshConfig, data_dir: Path) -> AsyncIterator[RouterService]:
    """One router replica with its own connection, started and stopped as its process would be."""
    bus = await Bus.connect(url, "router")
    await bus.provision()
    runtime = Runtime("router", ServiceOptions(nats_url=url, data_dir=data_dir, config=config), bus)
    service = RouterService()
    await service.start(runtime)
    try:
        yield service
    finally:
        await runtime.stop_consumers()
        await service.stop()
        await runtime.cancel_tasks()
        await bus.close()


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def eventually(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.02)


class Fleet:
    """Decode workers as the router sees them: heartbeats in WORKERS, and a KV dump responder
    for each (the blocks it caches)."""

    def __init__(self, bus: Bus, label: str, count: int):
        self.bus = bus
        self.ids = [f"{label}-{uuid.uuid4().hex[:6]}-{i}" for i in range(count)]
        self.started_at = time.time()
        self.blocks: dict[str, list[int]] = {w: [] for w in self.ids}
        self._subs: list[Any] = []

    async def start(self) -> Fleet:
        for worker_id in self.ids:
            self._subs.append(await self.bus.nc.subscribe(kv_dump_subject(worker_id), cb=self._dump))
        await self.bus.nc.flush()
        return self

    async def stop(self) -> None:
        kv = await self.bus.key_value(WORKERS)
        for worker_id in self.ids:
            with contextlib.suppress(Exception):
                await kv.delete(worker_id)
        for sub in self._subs:
            await sub.unsubscribe()

    def state(
        self, worker_id: str, *, queue_depth: int = 0, block_size: int = BLOCK_SIZE, **load: int
    ) -> WorkerState:
        """A heartbeat; `load` sets its other load fields (queued_tokens, running, ...)."""
        state = WorkerState(
            event_id=new_event_id(),
            occurred_at=time.time(),
            worker_id=worker_id,
            role="decode",
            pool="decode-H100",
            model=MODEL,
            engine="sim",
            gpu_type="H100",
            price_per_hour=3.6,
            block_size=block_size,
            kv_blocks_total=30_000,
            kv_blocks_used=0,
            kv_blocks_cached=len(self.blocks[worker_id]),
            queue_depth=queue_depth,
            running=0,
            tokens_per_s=0.0,
            started_at=self.started_at,
        )
        return msgspec.structs.replace(state, **load) if load else state

    async def heartbeat(self, load: dict[str, int] | None = None, **queue_depths: int) -> list[WorkerState]:
        """Every worker's heartbeat: its queue depth by name, and `load`'s other fields for all."""
        kv = await self.bus.key_value(WORKERS)
        states = [self.state(w, queue_depth=queue_depths.get(w, 0), **(load or {})) for w in self.ids]
        for state in states:
            await kv.put(state.worker_id, encode_event(state))
        return states

    async def _dump(self, msg: Msg) -> None:
        worker_id = msg.subject.split(".")[2]
        dump = KvDump(
            event_id=new_event_id(),
            occurred_at=time.time(),
            worker_id=worker_id,
            model=MODEL,
            block_size=BLOCK_SIZE,
            seq=0,
            block_hashes=self.blocks[worker_id],
            started_at=self.started_at,
        )
        await msg.respond(encode_event(dump))


def inference_request(
    tokens: list[int],
    *,
    max_tokens: int = 16,
    deadline_at: float | None = None,
    workflow: WorkflowRef | None = None,
    block_size: int = BLOCK_SIZE,
) -> InferenceRequest:
    return InferenceRequest(
        request_id=f"r-{uuid.uuid4().hex[:12]}",
        tenant="acme",
        model=MODEL,
        api="nats",
        prompt_tokens=tokens,
        block_size=block_size,
        block_hashes=chain_block_hashes(tokens, block_size, model=MODEL),
        max_tokens=max_tokens,
        deadline_at=deadline_at,
        workflow=workflow,
        submitted_at=time.time(),
    )


async def admit(bus: Bus, request: InferenceRequest, waited_s: float = 0.0) -> None:
    await bus.publish(
        admitted_subject("standard"),
        RequestAdmitted(event_id=new_event_id(), occurred_at=time.time(), request=request, waited_s=waited_s),
    )


class Collected:
    """Core subscriptions to what the routers publish: work, decisions, rejections."""

    def __init__(self) -> None:
        self.work: dict[str, PrefillWork] = {}
        self.decisions: dict[str, RouteDecision] = {}
        self.rejections: dict[str, RequestRejected] = {}

    async def start(self, bus: Bus) -> Collected:
        async def on_work(msg: Msg) -> None:
            work = msgspec.json.decode(msg.data, type=PrefillWork)
            self.work[work.request.request_id] = work

        async def on_decision(msg: Msg) -> None:
            decision = msgspec.json.decode(msg.data, type=RouteDecision)
            self.decisions[decision.request_id] = decision

        async def on_rejection(msg: Msg) -> None:
            rejection = msgspec.json.decode(msg.data, type=RequestRejected)
            self.rejections[rejection.request_id] = rejection

        await bus.nc.subscribe("rmesh.work.prefill.*", cb=on_work)
        await bus.nc.subscribe(event_subject("route_decision"), cb=on_decision)
        await bus.nc.subscribe(event_subject("rejected"), cb=on_rejection)
        await bus.nc.flush()
        return self


def placed_total() -> float:
    return sum(
        counter("ripplemesh_router_decisions_total", policy="ripplemesh", outcome="placed", mode=mode)
        for mode in ("aggregated", "disaggregated")
    )


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


# ---------------------------------------------------------------- decisions, metrics, predictions


async def test_every_decision_is_an_event_with_its_predictions_and_is_counted(
    bus: Bus, own_nats: EmbeddedNats, test_config: Path, tmp_path: Path
) -> None:
    rng = random.Random(11)
    prefix = random_tokens(rng, 1024)
    fleet = await Fleet(bus, "dec", 2).start()
    holder = fleet.ids[0]
    fleet.blocks[holder] = chain_block_hashes(prefix, BLOCK_SIZE, model=MODEL)
    collected = await Collected().start(bus)
    config = load_config(test_config)
    placed = placed_total()
    invalid = counter(
        "ripplemesh_router_decisions_total", policy="ripplemesh", outcome="invalid", mode="none"
    )
    infeasible = counter(
        "ripplemesh_router_decisions_total", policy="ripplemesh", outcome="infeasible", mode="none"
    )
    timed = counter("ripplemesh_router_decision_seconds_count")
    compared = counter("ripplemesh_router_prediction_error_cached_tokens_count", direction="under")
    cached_error_sum = counter("ripplemesh_router_prediction_error_cached_tokens_sum", direction="under")
    ttft_error_sum = counter("ripplemesh_router_prediction_error_ttft_seconds_sum", direction="under")
    try:
        async with router_replica(own_nats.url, config, tmp_path) as router:
            await fleet.heartbeat()
            assert router.kv_index is not None
            await eventually(
                lambda: router.kv_index.synced(holder) and router.kv_index.block_count(holder) == 64
            )

            # Placed: on the worker caching the prefix, with what the policy predicted.
            request = inference_request(prefix + random_tokens(rng, 200))
            await admit(bus, request)
            await eventually(
                lambda: request.request_id in collected.decisions and request.request_id in collected.work
            )
            decision = collected.decisions[request.request_id]
            work = collected.work[request.request_id]
            assert decision.outcome == "placed" and decision.policy == "ripplemesh"
            assert decision.router == router.replica_id
            assert decision.chosen is not None and decision.chosen.prefill_worker == holder
            assert decision.chosen.cached_tokens == 1024  # the whole prefix, as the index holds it
            assert decision.chosen.ttft_s > 0 and 0 < decision.chosen.success_probability <= 1
            assert decision.chosen.expected_cost_per_success_usd is not None
            assert fleet.ids[1] in {o.prefill_worker for o in decision.runners_up}
            assert all(o.expected_cost_per_success_usd is not None for o in decision.runners_up)
            # The score shown is the one the options were ranked by: the chosen has the lowest.
            assert decision.chosen.score is not None
            assert all(o.score is not None and o.score >= decision.chosen.score for o in decision.runners_up)
            assert decision.chosen.completion_s is not None
            assert decision.chosen.completion_s > decision.chosen.ttft_s
            assert decision.prompt_tokens == 1224 and decision.kv_blocks == -(-(1224 + 16) // BLOCK_SIZE)
            assert decision.candidates >= 2 and decision.decision_s > 0
            # The index's size and the live workers are exported while the router runs.
            assert counter("ripplemesh_router_kv_indexed_blocks") >= 64
            assert counter("ripplemesh_router_live_workers") == 2
            # The prediction travels with the work, timed from the decision.
            assert work.prediction == decision.chosen and work.occurred_at == decision.occurred_at

            # The prefill's outcome, 16 more tokens cached than predicted, 50 ms later than predicted.
            completed = PrefillCompleted(
                event_id=new_event_id(),
                occurred_at=decision.occurred_at + decision.chosen.ttft_s + 0.05,
                request_id=request.request_id,
                tenant="acme",
                worker_id=holder,
                gpu_type="H100",
                gpu_seconds=0.01,
                prompt_tokens=1224,
                cached_tokens=decision.chosen.cached_tokens + 16,
                ttft_s=0.2,
            )
            await bus.publish(event_subject("prefill_completed"), completed)
            await eventually(
                lambda: (
                    counter("ripplemesh_router_prediction_error_cached_tokens_count", direction="under")
                    > compared
                )
            )
            # 16 tokens and 50 ms more than predicted: under-predictions of that size.
            assert counter("ripplemesh_router_prediction_error_cached_tokens_sum", direction="under") == (
                cached_error_sum + 16
            )
            assert counter(
                "ripplemesh_router_prediction_error_ttft_seconds_sum", direction="under"
            ) == pytest.approx(ttft_error_sum + 0.05, abs=1e-6)
            # The prefill found more than the index claimed: the calibration's share stays whole.
            assert router.state.calibration.found_share("H100") == 1.0
            # Kept until the request ends: its completion, 1.5x the predicted time, is what the
            # calibration learns from, on the decode worker's GPU type.
            assert len(router.predictions) == 1
            predicted_s = decision.chosen.completion_s or 0.0
            assert predicted_s > 0
            finished = DecodeCompleted(
                event_id=new_event_id(),
                occurred_at=decision.occurred_at + 1.5 * predicted_s,
                request_id=request.request_id,
                tenant="acme",
                worker_id=holder,
                gpu_type="H100",
                gpu_seconds=0.05,
                kv_transfer_bytes=0,
                usage=Usage(prompt_tokens=1224, completion_tokens=request.max_tokens),
                finish_reason="length",
                latency_s=1.5 * predicted_s,
            )
            await bus.publish(event_subject("decode_completed"), finished)
            await eventually(lambda: len(router.predictions) == 0)
            learned = router.health()["calibration"]["H100"]
            assert learned["completion_samples"] == 1
            # One residual of ln(1.5) against a prior of 20: about a twentieth of the way.
            assert 1.0 < learned["completion_ratio"] < 1.05
            # Another router's (or an unknown) request is not compared.
            await bus.publish(
                event_subject("prefill_completed"),
                msgspec.structs.replace(completed, event_id=new_event_id(), request_id="r-elsewhere"),
            )
            # Not placed: a block size no worker uses, and a deadline already past.
            mismatched = inference_request(random_tokens(rng, 64), block_size=32)
            late = inference_request(random_tokens(rng, 64), deadline_at=time.time() - 1.0)
            await admit(bus, mismatched)
            await admit(bus, late)
            await eventually(lambda: {mismatched.request_id, late.request_id} <= set(collected.rejections))
            await eventually(lambda: {mismatched.request_id, late.request_id} <= set(collected.decisions))
            assert collected.decisions[mismatched.request_id].outcome == "invalid"
            assert "block size mismatch" in (collected.decisions[mismatched.request_id].message or "")
            assert collected.decisions[late.request_id].outcome == "infeasible"
            assert collected.decisions[late.request_id].chosen is None
            # The client hears why: no placement meets its deadline, and retrying cannot help.
            assert collected.rejections[late.request_id].reason == "deadline"
            assert collected.rejections[late.request_id].retry_after_s is None
            assert collected.rejections[mismatched.request_id].retry_after_s is None
            assert not {mismatched.request_id, late.request_id} & set(collected.work)
            assert (
                counter("ripplemesh_router_prediction_error_cached_tokens_count", direction="under")
                == compared + 1
            )

            # Garbage read back from the lifecycle subjects is counted and skipped; routing goes on.
            junk = {
                kind: counter("ripplemesh_router_feedback_messages_total", kind=kind, outcome="invalid")
                for kind in ("route_decision", "prefill_completed")
            }
            for kind in junk:
                await bus.nc.publish(event_subject(kind), b'{"type": "router.decision.v1", "junk": 1')
            await eventually(
                lambda: all(
                    counter("ripplemesh_router_feedback_messages_total", kind=kind, outcome="invalid")
                    > before
                    for kind, before in junk.items()
                )
            )
            again = inference_request(prefix + random_tokens(rng, 100))
            await admit(bus, again)
            await eventually(lambda: again.request_id in collected.work)
        assert placed_total() == placed + 2
        assert counter(
            "ripplemesh_router_decisions_total", policy="ripplemesh", outcome="invalid", mode="none"
        ) == (invalid + 1)
        assert (
            counter(
                "ripplemesh_router_decisions_total", policy="ripplemesh", outcome="infeasible", mode="none"
            )
            == infeasible + 1
        )
        assert counter("ripplemesh_router_decision_seconds_count") >= timed + 3
    finally:
        await fleet.stop()


# ---------------------------------------------------------------- workflow spend


async def test_the_workflows_spend_reaches_the_decision(
    bus: Bus, own_nats: EmbeddedNats, test_config: Path, tmp_path: Path
) -> None:
    rng = random.Random(12)
    fleet = await Fleet(bus, "wf", 1).start()
    collected = await Collected().start(bus)
    spend_kv = await bus.key_value(WORKFLOW_SPEND)
    now = time.time()
    running = WorkflowSpend(
        workflow_id=f"wf-{uuid.uuid4().hex[:8]}",
        tenant="acme",
        spend_usd=1.25,
        gpu_seconds=1200.0,
        steps_completed=3,
        steps=5,
        status="running",
        first_event_at=now - 60,
        last_event_at=now - 1,
        updated_at=now,
    )
    failed = msgspec.structs.replace(
        running, workflow_id=f"wf-{uuid.uuid4().hex[:8]}", status="failed", reason="step_failed"
    )
    await spend_kv.put(running.workflow_id, msgspec.json.encode(running))
    await spend_kv.put(failed.workflow_id, msgspec.json.encode(failed))
    try:
        async with router_replica(own_nats.url, load_config(test_config), tmp_path) as router:
            await fleet.heartbeat()
            assert router.workflow_spend is not None
            await eventually(lambda: router.workflow_spend.spent(running.workflow_id) == 1.25)
            requests = {
                "running": inference_request(
                    random_tokens(rng, 64),
                    workflow=WorkflowRef(workflow_id=running.workflow_id, step=4, steps=5),
                ),
                "failed": inference_request(
                    random_tokens(rng, 64),
                    workflow=WorkflowRef(workflow_id=failed.workflow_id, step=4, steps=5),
                ),
                "unknown": inference_request(
                    random_tokens(rng, 64), workflow=WorkflowRef(workflow_id="wf-unknown", step=1)
                ),
                "none": inference_request(random_tokens(rng, 64)),
            }
            for request in requests.values():
                await admit(bus, request)
            ids = {r.request_id for r in requests.values()}
            await eventually(lambda: ids <= set(collected.decisions))
            spent = {
                name: collected.decisions[r.request_id].workflow_spent_usd for name, r in requests.items()
            }
            assert spent == {"running": 1.25, "failed": 0.0, "unknown": 0.0, "none": 0.0}
            assert collected.decisions[requests["running"].request_id].workflow_step == 4

            # A newer figure replaces it; the entry's deletion forgets it.
            await spend_kv.put(
                running.workflow_id,
                msgspec.json.encode(msgspec.structs.replace(running, spend_usd=2.5, updated_at=now + 1)),
            )
            await eventually(lambda: router.workflow_spend.spent(running.workflow_id) == 2.5)
            await spend_kv.delete(running.workflow_id)
            await eventually(lambda: router.workflow_spend.spent(running.workflow_id) == 0.0)
    finally:
        await fleet.stop()


@contextlib.asynccontextmanager
async def loaded_router(
    bus: Bus, own_nats: EmbeddedNats, test_config: Path, tmp_path: Path, label: str, load: dict[str, int]
) -> AsyncIterator[tuple[RouterService, Collected, PrefixView]]:
    """A router replica that sees two decode workers with `load` (their heartbeat's load
    fields), what it publishes, and its prefix view."""
    fleet = await Fleet(bus, label, 2).start()
    collected = await Collected().start(bus)
    try:
        async with router_replica(own_nats.url, load_config(test_config), tmp_path) as router:
            await fleet.heartbeat(load)
            await eventually(lambda: set(fleet.ids) <= set(router.state.workers))
            yield router, collected, router.kv_index if router.kv_index is not None else NoPrefix()
    finally:
        await fleet.stop()


async def test_a_saturated_refusal_tells_the_client_when_to_retry(
    bus: Bus, own_nats: EmbeddedNats, test_config: Path, tmp_path: Path
) -> None:
    # Both workers have 240k prompt tokens queued: a new 4-step workflow whose deadline it would
    # likely but not surely meet is not worth its cost there. The client gets a capacity
    # rejection (503) whose Retry-After is the predicted wait for the prompts queued ahead of it.
    rng = random.Random(17)
    busy = {"queued_tokens": 240_000, "running": 30, "kv_blocks_used": 15_000}
    async with loaded_router(bus, own_nats, test_config, tmp_path, "sat", busy) as loaded:
        router, collected, prefix = loaded
        assert router.state.config.admission_controls_load  # the mesh config's default admission
        task = WorkflowRef(workflow_id=f"wf-{uuid.uuid4().hex[:6]}", step=1, steps=4)
        probe = inference_request(random_tokens(rng, 64), max_tokens=300, workflow=task)
        first = earliest_first_token(router.state, route_request(probe), prefix, time.time())
        assert first is not None and first.wait_s > 5.0  # longer than the old fixed 5 s
        # A deadline the policy, on a copy of the router's state, refuses as saturated.
        request = msgspec.structs.replace(probe, deadline_at=time.time() + first.wait_s + 8.6)
        expected = place(copy.deepcopy(router.state), route_request(request), prefix, time.time())
        assert isinstance(expected, NoPlacement) and expected.reason == "saturated", expected
        await admit(bus, request)
        await eventually(lambda: request.request_id in collected.rejections)
        rejection = collected.rejections[request.request_id]
        assert (rejection.stage, rejection.reason) == ("router", "capacity")  # a 503 at ingress
        assert collected.decisions[request.request_id].outcome == "saturated"
        assert rejection.retry_after_s == pytest.approx(first.wait_s, rel=0.05)
        assert request.request_id not in collected.work


async def test_admissions_hold_on_a_request_tells_the_router_the_fleet_is_pressed(
    bus: Bus, own_nats: EmbeddedNats, test_config: Path, tmp_path: Path
) -> None:
    # Two workers with their KV 90% full but no prompt queued and small batches: a new 4-step
    # workflow with about half a chance costs the fleet most of its price. Straight from
    # admission it is tried (the fleet has room: refusing it would lose a task and free
    # little); held back two seconds by admission (arrivals outrunning the fleet), the same
    # task is refused as not worth its cost. The hold comes from RequestAdmitted's waited_s.
    rng = random.Random(23)
    full = {"running": 30, "kv_blocks_used": 27_000, "context_tokens": 60_000}
    async with loaded_router(bus, own_nats, test_config, tmp_path, "held", full) as loaded:
        router, collected, prefix = loaded

        def task() -> InferenceRequest:
            workflow = WorkflowRef(workflow_id=f"wf-{uuid.uuid4().hex[:6]}", step=1, steps=4)
            return inference_request(
                random_tokens(rng, 2048), max_tokens=300, workflow=workflow, deadline_at=time.time() + 5.0
            )

        # (The fresh one first: a refused new task arms the dearest-task rule for the next.)
        fresh = task()
        expected = place(copy.deepcopy(router.state), route_request(fresh), prefix, time.time())
        assert isinstance(expected, Placement), expected
        await admit(bus, fresh)
        # The work and the decision event travel apart: wait for both.
        await eventually(
            lambda: fresh.request_id in collected.work and fresh.request_id in collected.decisions
        )
        chosen = collected.decisions[fresh.request_id].chosen
        assert chosen is not None and 0.5 < chosen.success_probability < 0.95
        held = task()
        expected = place(copy.deepcopy(router.state), route_request(held, 0.0, 2.0), prefix, time.time())
        assert isinstance(expected, NoPlacement) and expected.reason == "saturated", expected
        await admit(bus, held, waited_s=2.0)
        await eventually(lambda: held.request_id in collected.rejections)
        assert collected.decisions[held.request_id].outcome == "saturated"
        message = collected.rejections[held.request_id].message
        assert "no placement is worth its cost" in message and "admission held it 2.0 s" in message


def test_the_router_knows_from_the_mesh_config_whether_admission_controls_the_load(
    test_config: Path,
) -> None:
    # Where admission enforces quotas only, the router is the only shedding under overload and
    # sheds at its own bar (RouterConfig.dearest_task_factor_alone); it reads which from the
    # admission section of the config the mesh runs with (the project's admission by default:
    # a started replica has it, in test_a_saturated_refusal_tells_the_client_when_to_retry).
    config = load_config(test_config)
    assert config.admission.control == "ripplemesh"
    assert router_config(config).admission_controls_load
    for control in ("rate_limit", "none"):
        admission = msgspec.structs.replace(config.admission, control=control)
        policy_config = router_config(msgspec.structs.replace(config, admission=admission))
        assert policy_config.admission_controls_load is False
        assert policy_config.kv_transfer_usd_per_gb == config.kv_transfer_usd_per_gb


def test_every_refusal_of_the_policy_reaches_the_client_with_a_rejection_reason() -> None:
    # A new NoPlacement reason without a rejection reason would fail the request in the shell.
    refusals = set(get_args(get_type_hints(NoPlacement)["reason"]))
    assert refusals == set(REJECTION_REASONS)
    rejection_reasons = set(get_args(get_type_hints(RequestRejected)["reason"]))
    assert set(REJECTION_REASONS.values()) <= rejection_reasons
    # Too busy now is a capacity rejection (503, retry later); a hopeless deadline is not.
    assert REJECTION_REASONS["saturated"] == "capacity" and REJECTION_REASONS["infeasible"] == "deadline"


def test_the_spend_view_ignores_bad_and_older_entries() -> None:
    view = WorkflowSpendView(bus=None)  # type: ignore[arg-type]  # apply() needs no connection
    value = WorkflowSpend(
        workflow_id="wf-a",
        tenant="acme",
        spend_usd=0.5,
        gpu_seconds=10.0,
        steps_completed=1,
        status="running",
        first_event_at=1.0,
        last_event_at=2.0,
        updated_at=3.0,
    )
    assert view.apply("wf-a", msgspec.json.encode(value), "PUT") == "applied"
    older = msgspec.structs.replace(value, spend_usd=0.1, updated_at=2.5)
    assert view.apply("wf-a", msgspec.json.encode(older), "PUT") == "applied"
    assert view.spent("wf-a") == 0.5
    assert view.apply("wf-a", b"{not json", "PUT") == "invalid"
    assert view.spent("wf-a") == 0.5 and view.spent(None) == 0.0 and view.spent("wf-b") == 0.0
    assert view.apply("wf-a", None, "DEL") == "deleted"
    assert view.spent("wf-a") == 0.0


# ---------------------------------------------------------------- a sim engine run faster


def test_a_worker_run_faster_than_the_wall_clock_is_predicted_in_wall_time_at_the_ledgers_cost() -> None:
    """A sim engine at `--time-scale 0.1` does a modelled second's GPU work in 0.1 s and is
    charged the modelled second: the router predicts a tenth of the time at the same cost (it had
    predicted the modelled time, so under `make up --time-scale 0.1` it saw a worker that had
    long finished its prompts as still busy with them and placed a request sharing its prefix
    elsewhere)."""
    fleet = Fleet.__new__(Fleet)  # only its WorkerState builder: no bus here
    fleet.started_at, fleet.blocks = time.time() - 60, {"w": []}
    now = time.time()
    heartbeat = msgspec.structs.replace(fleet.state("w", queued_tokens=6_000, running=3), occurred_at=now)
    req = RouteRequest(
        request_id="r",
        tenant="acme",
        model=MODEL,
        block_size=BLOCK_SIZE,
        block_hashes=[],
        prompt_tokens=4_000,
        max_tokens=200,
    )

    def decided(time_scale: float) -> Placement:
        state = RouterState()
        state.observe(view_of(msgspec.structs.replace(heartbeat, time_scale=time_scale), {MODEL: MODEL}))
        decision = place(state, req, NoPrefix(), now)
        assert isinstance(decision, Placement)
        return decision

    modelled, faster = decided(1.0), decided(0.1)
    assert faster.predicted_ttft_s == pytest.approx(0.1 * modelled.predicted_ttft_s, rel=1e-9)
    assert faster.predicted_completion_s == pytest.approx(0.1 * modelled.predicted_completion_s, rel=1e-9)
    assert faster.predicted_cost_usd == pytest.approx(modelled.predicted_cost_usd, rel=1e-9)
    # The queue at the heartbeat drains at the wall-clock rate: 0.2 s on, a tenth-speed
    # prediction would still see most of it waiting; at the engine's real speed it is gone.
    later = RouterState()
    later.observe(view_of(msgspec.structs.replace(heartbeat, time_scale=0.1), {MODEL: MODEL}))
    drained = place(later, req, NoPrefix(), now + 0.2)
    assert isinstance(drained, Placement)
    assert drained.predicted_ttft_s < faster.predicted_ttft_s
    # GPU work that takes no time (time scale 0): next to nothing, and finite.
    instant = decided(0.0)
    assert 0.0 < instant.predicted_ttft_s < 1e-3
    assert instant.predicted_cost_usd == pytest.approx(modelled.predicted_cost_usd, rel=1e-6)


# ---------------------------------------------------------------- active-active replicas


def test_a_replica_counts_another_replicas_placement_as_the_placer_did() -> None:
    """The load a RouteDecision tells the other replicas about is the load place() counted."""
    rng = random.Random(14)
    now = time.time()
    fleet = Fleet.__new__(Fleet)  # only its WorkerState builder: no bus here
    fleet.started_at, fleet.blocks = now - 60, {}
    views = []
    for i, role in enumerate(("prefill", "prefill", "decode", "decode", "decode")):
        worker_id = f"w{i}"
        fleet.blocks[worker_id] = []
        # Busy decode workers and idle prefill workers: long prompts are handed off.
        queue = 6 if role == "decode" else 0
        state = msgspec.structs.replace(fleet.state(worker_id, queue_depth=queue), role=role, occurred_at=now)
        views.append(view_of(state, {MODEL: MODEL}))
    prefix = random_tokens(rng, 320)
    index = KvIndex(BLOCK_SIZE)
    index.apply_dump(
        KvDump(
            event_id="d",
            occurred_at=now,
            worker_id="w1",
            model=MODEL,
            block_size=BLOCK_SIZE,
            seq=0,
            block_hashes=chain_block_hashes(prefix, BLOCK_SIZE, model=MODEL),
        )
    )
    # Free KV transfers, so that hand-offs (counted on two workers) are among the placements.
    config = RouterConfig(kv_transfer_usd_per_gb=0.0)
    placer, peer = RouterState(config=config), RouterState(config=config)
    for view in views:
        placer.observe(view)
        peer.observe(view)
    modes = set()
    for i in range(24):
        request = inference_request(
            prefix + random_tokens(rng, rng.randrange(16, 900)), max_tokens=rng.randrange(1, 200)
        )
        request = msgspec.structs.replace(request, priority=rng.choice(["critical", "standard", "sheddable"]))
        decided_at = now + 0.01 * (i + 1)
        decision = place(placer, route_request(request), index, decided_at)
        assert not isinstance(decision, NoPlacement), decision
        modes.add(decision.mode)
        event = reporting.decision_event(
            event_id=new_event_id(),
            decided_at=decided_at,
            request=request,
            decision=decision,
            policy=decision.policy,
            replica="placer",
            decision_s=0.0,
            workflow_spent_usd=0.0,
        )
        assert count_peer_placement(peer, event, "peer") == "counted"
    assert peer.placed == placer.placed and peer.placed_since_heartbeat == placer.placed_since_heartbeat
    later = now + 1.0
    for view in views:
        assert peer.prefill_rate(view.worker_id, later) == pytest.approx(
            placer.prefill_rate(view.worker_id, later)
        )
    # And the requests still running there, with what a second of their latency is worth: what
    # the delay a new request would impose on them is weighed by (critical ones among them).
    running = 0
    for view in views:
        # After the last decision, in time order (the states drop what has ended as they read).
        for at in (decided_at, later, now + 30.0):
            count, worth = peer.inflight(view.worker_id, at)
            expected_count, expected_worth = placer.inflight(view.worker_id, at)
            assert count == expected_count and worth == pytest.approx(expected_worth, abs=1e-12)
            running += count
    assert running > 0
    assert "disaggregated" in modes, modes  # hand-offs were counted too
    # Its own decisions, and those older than a worker's latest heartbeat, are not counted again.
    assert count_peer_placement(peer, msgspec.structs.replace(event, router="peer"), "peer") == "own"
    stale = msgspec.structs.replace(event, occurred_at=now - 1.0)
    assert count_peer_placement(peer, stale, "peer") == "stale"


# A burst of requests sharing a prefix that one idle worker caches; the other workers each have
# a queue. One router puts the first requests on the holder, then spreads once its backlog
# catches up with the others'. Two routers that did not see each other's placements would each
# do that, and pile about twice as many onto the holder.
REPLICA_BURST = 32
SHARED_PREFIX = 256
SUFFIX = 2048
OTHERS_QUEUE = 16
ARRIVAL_GAP_S = 0.01


def _burst(rng: random.Random) -> tuple[list[int], list[InferenceRequest]]:
    prefix = random_tokens(rng, SHARED_PREFIX)
    return prefix, [inference_request(prefix + random_tokens(rng, SUFFIX)) for _ in range(REPLICA_BURST)]


def _offline_counts(
    states: list[WorkerState],
    holder_blocks: list[int],
    requests: list[InferenceRequest],
    decisions: dict[str, RouteDecision],
    *,
    blind: bool,
) -> collections.Counter[str]:
    """Where the pure policy puts the burst, from the same worker views and prefix, each request
    decided at the time it was decided live: by one router (`blind=False`), or by the live
    replicas' shares if neither had heard of the other's placements (`blind=True`)."""
    index = KvIndex(BLOCK_SIZE)
    index.apply_dump(
        KvDump(
            event_id="d",
            occurred_at=0.0,
            worker_id=states[0].worker_id,
            model=MODEL,
            block_size=BLOCK_SIZE,
            seq=0,
            block_hashes=holder_blocks,
        )
    )
    shapes = {MODEL: MODEL}
    routers: dict[str, RouterState] = {}
    counts: collections.Counter[str] = collections.Counter()
    for request in sorted(requests, key=lambda r: decisions[r.request_id].occurred_at):
        decided = decisions[request.request_id]
        state = routers.get(decided.router if blind else "one")
        if state is None:
            state = routers[decided.router if blind else "one"] = RouterState()
            for worker in states:
                state.observe(view_of(worker, shapes))
        decision = place(state, route_request(request), index, decided.occurred_at)
        assert not isinstance(decision, NoPlacement), decision
        counts[decision.prefill_worker] += 1
    return counts


async def test_two_replicas_spread_a_burst_by_load_instead_of_herding(
    bus: Bus, own_nats: EmbeddedNats, test_config: Path, tmp_path: Path
) -> None:
    rng = random.Random(13)
    prefix, burst = _burst(rng)
    fleet = await Fleet(bus, "herd", 4).start()
    holder = fleet.ids[0]
    fleet.blocks[holder] = chain_block_hashes(prefix, BLOCK_SIZE, model=MODEL)
    queues = {w: OTHERS_QUEUE for w in fleet.ids[1:]}
    collected = await Collected().start(bus)
    config = load_config(test_config)
    counted_before = counter("ripplemesh_router_peer_placements_total", outcome="counted")
    try:
        async with (
            router_replica(own_nats.url, config, tmp_path / "a") as first,
            router_replica(own_nats.url, config, tmp_path / "b") as second,
        ):
            replicas = (first, second)
            await fleet.heartbeat(**queues)
            for router in replicas:
                assert router.kv_index is not None and router.feedback is not None
                index = router.kv_index
                await eventually(lambda index=index: index.synced(holder) and index.block_count(holder) > 0)
                await asyncio.wait_for(router.feedback.subscribed.wait(), 5)
            # A fresh heartbeat right before the burst: the burst is over long before the next
            # one would be due, so only the placements (own and the other replica's) add load.
            states = await fleet.heartbeat(**queues)
            await eventually(
                lambda: all(r.state.workers[holder].heartbeat_at == states[0].occurred_at for r in replicas)
            )
            for request in burst:
                await admit(bus, request)
                await asyncio.sleep(ARRIVAL_GAP_S)
            ids = {r.request_id for r in burst}
            await eventually(lambda: ids <= set(collected.work) and ids <= set(collected.decisions), 20)
    finally:
        await fleet.stop()

    live = collections.Counter(collected.work[r.request_id].prefill_worker for r in burst)
    by_replica = collections.Counter(collected.decisions[r.request_id].router for r in burst)
    one_router = _offline_counts(states, fleet.blocks[holder], burst, collected.decisions, blind=False)
    blind_pair = _offline_counts(states, fleet.blocks[holder], burst, collected.decisions, blind=True)
    # Both replicas took a real share of the burst (a work-queue split), else nothing is shown.
    assert len(by_replica) == 2 and min(by_replica.values()) >= REPLICA_BURST // 4, by_replica
    # The scenario herds when replicas do not share: the blind pair piles more onto the holder.
    herd = blind_pair[holder] - one_router[holder]
    assert herd >= 4, (one_router, blind_pair)
    # Sharing, the pair places about as one router would (a placement or two may cross in flight).
    assert live[holder] <= one_router[holder] + max(2, herd // 3), (live, one_router, blind_pair)
    assert set(live) == set(fleet.ids), live  # the burst spread over every worker
    assert (
        counter("ripplemesh_router_peer_placements_total", outcome="counted")
        >= counted_before + REPLICA_BURST // 2
    )
