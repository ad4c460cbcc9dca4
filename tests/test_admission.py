"""Admission as a real process (two, for shared quotas) on a real NATS server, with ingress in front
for the HTTP statuses. The workers are heartbeats the test puts in the WORKERS bucket, so the
fleet's saturation is the test's to set; what admission decides is read off the bus."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from ripplemesh.launcher import _healthy
from schemas.events import (
    AdmissionDecision,
    DecodeCompleted,
    InferenceRequest,
    RequestAdmitted,
    RequestPrepared,
    StreamFailed,
    Usage,
    WorkerState,
    WorkflowRef,
    WorkflowSpend,
    decode_event,
    encode_event,
    new_event_id,
)
from schemas.subjects import (
    ADMISSION_QUOTAS,
    PREFIX,
    WORKERS,
    WORKFLOW_SPEND,
    event_subject,
    prepared_subject,
)
from services.admission.policy import AdmissionLimits, AdmissionRequest, TenantQuota
from services.admission.shared_quota import SharedQuota
from services.mesh.block_hash import chain_block_hashes
from services.mesh.bus import Bus
from services.mesh.embedded_nats import EmbeddedNats, free_port
from services.mesh.processes import die_with_parent

pytestmark = pytest.mark.timeout(120)

MODEL = "llama-3-8b"
KEY = "rm-admission-key"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


CONFIG = f"""
block_size = 16
max_prompt_tokens = 4000
first_token_timeout_s = 10.0

[[models]]
name = "{MODEL}"
shape = "llama-3-8b"
max_context_tokens = 8192

[admission]
max_defer_s = 4.0
queue_per_worker = 4.0

[tenants.acme]
api_keys_sha256 = ["{_digest(KEY)}"]
requests_per_s = 1000.0
request_burst = 1000.0
tokens_per_s = 10000000.0
token_burst = 10000000.0

[tenants.tiny]
api_keys_sha256 = []
requests_per_s = 0.5
request_burst = 1.0

[tenants.backlog]
api_keys_sha256 = []
requests_per_s = 0.5
request_burst = 1.0

[tenants.prompts]
api_keys_sha256 = []
input_tokens_per_s = 100.0
input_token_burst = 100.0

[tenants.capped]
api_keys_sha256 = []
max_concurrency = 1

[tenants.shared]
api_keys_sha256 = []
requests_per_s = 0.01
request_burst = 10.0

[tenants.fair-a]
api_keys_sha256 = []
weight = 2.0

[tenants.fair-b]
api_keys_sha256 = []
weight = 1.0

[gpu_prices_per_hour]
H100 = 3.0
"""


# ------------------------------------------------------------------ processes


class Service:
    def __init__(self, name: str, service: str, nats_url: str, config: Path, data_dir: Path, port: int = 0):
        self.name = name
        self.port = port or free_port()
        self.log = data_dir / "logs" / f"{name}.log"
        self.args = [
            sys.executable,
            "-m",
            "ripplemesh",
            "run",
            service,
            "--nats-url",
            nats_url,
            "--data-dir",
            str(data_dir),
            "--http-port",
            str(self.port),
            "--config",
            str(config),
        ]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Service:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=die_with_parent
            )
        deadline = time.monotonic() + 60
        while not _healthy(self.url):
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not healthy; see {self.log}")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on the service's /metrics."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as response:
            text = response.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )


@pytest.fixture(scope="module")
def admission_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("admission")
    config = root / "ripplemesh.toml"
    config.write_text(CONFIG)
    nats = EmbeddedNats(root / "nats").start()
    services = []
    try:
        admission = Service("admission-0", "admission", nats.url, config, root).start()
        services.append(admission)
        ingress = Service("ingress", "ingress", nats.url, config, root).start()
        services.append(ingress)
        yield {"nats": nats, "config": config, "root": root, "admission": admission, "ingress": ingress}
    finally:
        for service in reversed(services):
            service.stop()
        nats.stop()


# ------------------------------------------------------------------ the bus, from the test's side


class Observed:
    """What admission did, read off the bus: admissions, rejections, decisions, by request."""

    def __init__(self) -> None:
        self.admitted: dict[str, float] = {}
        self.order: list[str] = []
        self.rejected: dict[str, StreamFailed] = {}
        self.rejected_at: dict[str, float] = {}
        self.decisions: dict[str, list[AdmissionDecision]] = {}

    def on(self, data: bytes) -> None:
        event = decode_event(data)
        now = time.time()
        if isinstance(event, RequestAdmitted):
            self.admitted[event.request.request_id] = now
            self.order.append(event.request.request_id)
        elif isinstance(event, StreamFailed):
            self.rejected[event.request_id] = event
            self.rejected_at[event.request_id] = now
        elif isinstance(event, AdmissionDecision):
            self.decisions.setdefault(event.request_id, []).append(event)

    def decided(self, request_id: str) -> bool:
        return request_id in self.admitted or request_id in self.rejected

    def deferred(self, request_id: str) -> bool:
        return any(d.outcome == "deferred" for d in self.decisions.get(request_id, []))

    async def until(self, predicate: Any, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not observed within {timeout_s} s: admitted {len(self.admitted)}, rejected "
                    f"{ {r: f.code for r, f in self.rejected.items()} }, decisions "
                    f"{ {r: [d.outcome for d in ds] for r, ds in self.decisions.items()} }"
                )
            await asyncio.sleep(0.05)


class Fleet:
    """Worker heartbeats the test controls: their queue depth sets the fleet's saturation."""

    def __init__(self, bus: Bus, workers: int = 1):
        self.bus = bus
        self.ids = [f"fake-{uuid.uuid4().hex[:6]}-{i}" for i in range(workers)]
        self.queue_depth = 0
        self.started_at = time.time()
        self._task: asyncio.Task[None] | None = None

    async def beat(self) -> None:
        kv = await self.bus.key_value(WORKERS)
        for worker_id in self.ids:
            state = WorkerState(
                event_id=new_event_id(),
                occurred_at=time.time(),
                worker_id=worker_id,
                role="decode",
                pool="fake",
                model=MODEL,
                engine="sim",
                gpu_type="H100",
                price_per_hour=3.0,
                block_size=16,
                kv_blocks_total=10_000,
                kv_blocks_used=0,
                kv_blocks_cached=0,
                queue_depth=self.queue_depth,
                running=0,
                tokens_per_s=0.0,
                started_at=self.started_at,
            )
            await kv.put(worker_id, encode_event(state))

    async def set(self, queue_depth: int) -> None:
        """New heartbeats now; admission sees them at its next refresh (0.5 s)."""
        self.queue_depth = queue_depth
        await self.beat()
        await asyncio.sleep(0.8)

    async def __aenter__(self) -> Fleet:
        async def beating() -> None:
            while True:
                await self.beat()
                await asyncio.sleep(0.5)

        await self.beat()
        self._task = asyncio.create_task(beating())
        await asyncio.sleep(0.8)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        kv = await self.bus.key_value(WORKERS)
        for worker_id in self.ids:
            with contextlib.suppress(Exception):
                await kv.delete(worker_id)


@pytest.fixture
async def bus(admission_mesh: dict[str, Any]) -> AsyncIterator[Bus]:
    connected = await Bus.connect(admission_mesh["nats"].url, "admission-tests")
    yield connected
    await connected.close()


@pytest.fixture
async def observed(bus: Bus) -> AsyncIterator[Observed]:
    seen = Observed()
    nc: NatsClient = bus.nc

    async def on(msg: Any) -> None:
        seen.on(msg.data)

    subscriptions = [
        await nc.subscribe(f"{PREFIX}.admitted.*", cb=on),
        await nc.subscribe(f"{PREFIX}.tokens.>", cb=on),
        await nc.subscribe(event_subject("admission"), cb=on),
    ]
    await nc.flush()
    yield seen
    for subscription in subscriptions:
        await subscription.unsubscribe()


def prepared(
    tenant: str = "acme",
    *,
    prompt_tokens: int = 32,
    max_tokens: int = 16,
    priority: str = "standard",
    level: int = 0,
    deadline_s: float | None = None,
    deadline_at: float | None = None,
    workflow: WorkflowRef | None = None,
    rid: str | None = None,
) -> RequestPrepared:
    now = time.time()
    tokens = [(i * 7919) % 50_000 + 1 for i in range(prompt_tokens)]
    request = InferenceRequest(
        request_id=rid or uuid.uuid4().hex,
        tenant=tenant,
        model=MODEL,
        api="nats",
        prompt_tokens=tokens,
        block_size=16,
        block_hashes=chain_block_hashes(tokens, 16, model=MODEL),
        max_tokens=max_tokens,
        priority=priority,  # type: ignore[arg-type]
        priority_level=level,
        deadline_at=deadline_at if deadline_at is not None else (now + deadline_s if deadline_s else None),
        workflow=workflow,
        submitted_at=now,
    )
    return RequestPrepared(event_id=new_event_id(), occurred_at=now, request=request)


async def submit(bus: Bus, *events: RequestPrepared) -> list[str]:
    for event in events:
        await bus.publish(prepared_subject(event.request.tenant), event)
    return [e.request.request_id for e in events]


def saturated_queue(workers: int = 1) -> int:
    return 8 * workers  # twice the 4 per worker that is saturation 1.0


# ------------------------------------------------------------------ quotas


async def test_quota_rejections_are_429_with_the_buckets_retry_after(bus: Bus, observed: Observed) -> None:
    async with Fleet(bus):
        first, second = await submit(bus, prepared("tiny"), prepared("tiny"))
        await observed.until(lambda: observed.decided(first) and observed.decided(second))
        assert first in observed.admitted
        over = observed.rejected[second]
        assert (over.code, over.http_status) == ("quota", 429)
        assert over.retry_after_s is not None and 1.0 < over.retry_after_s <= 2.0  # 1 request per 2 s
        assert "over its quota" in over.message

        # Input tokens: 60 fit the burst of 100 once; 150 never fit.
        fits, again, never = await submit(
            bus,
            prepared("prompts", prompt_tokens=60),
            prepared("prompts", prompt_tokens=60),
            prepared("prompts", prompt_tokens=150),
        )
        await observed.until(lambda: all(observed.decided(r) for r in (fits, again, never)))
        assert fits in observed.admitted
        assert observed.rejected[again].code == "quota" and observed.rejected[again].retry_after_s
        assert observed.rejected[never].retry_after_s is None
        assert "more than tenant 'prompts''s burst of 100" in observed.rejected[never].message


async def test_a_backlog_held_back_by_an_outage_is_charged_as_it_arrived(
    bus: Bus, observed: Observed
) -> None:
    """Requests sent at the tenant's rate, then held back (admission restarting, a NATS node
    lost) and released at once, are no burst of the tenant's: the buckets charge each as of
    its submission."""
    async with Fleet(bus):
        now = time.time()
        backlog = []
        for sent in (now - 4.4, now - 2.2, now):  # one every 2.2 s: within 1 per 2 s
            event = prepared("backlog")
            request = msgspec.structs.replace(event.request, submitted_at=sent)
            backlog.append(msgspec.structs.replace(event, request=request))
        ids = await submit(bus, *backlog)
        await observed.until(lambda: all(observed.decided(r) for r in ids))
        assert all(r in observed.admitted for r in ids), [observed.rejected.get(r) for r in ids]
        # Sent now, right after the last of them: over the rate, and refused.
        together = await submit(bus, prepared("backlog"), prepared("backlog"))
        await observed.until(lambda: all(observed.decided(r) for r in together))
        assert observed.rejected[together[1]].code == "quota"


async def test_the_concurrency_cap_holds_until_a_request_completes(bus: Bus, observed: Observed) -> None:
    async with Fleet(bus):
        (running,) = await submit(bus, prepared("capped"))
        await observed.until(lambda: observed.decided(running))
        (blocked,) = await submit(bus, prepared("capped"))
        await observed.until(lambda: observed.decided(blocked))
        assert running in observed.admitted
        assert observed.rejected[blocked].code == "quota"
        assert "concurrency cap is 1" in observed.rejected[blocked].message
        # The first one completes (as a decode worker reports it): its lease goes back.
        await bus.publish(
            event_subject("decode_completed"),
            DecodeCompleted(
                event_id=new_event_id(),
                occurred_at=time.time(),
                request_id=running,
                tenant="capped",
                worker_id="fake-0",
                gpu_type="H100",
                gpu_seconds=0.1,
                kv_transfer_bytes=0,
                usage=Usage(prompt_tokens=32, completion_tokens=16),
                finish_reason="length",
                latency_s=0.5,
            ),
        )
        await asyncio.sleep(0.5)
        (after,) = await submit(bus, prepared("capped"))
        await observed.until(lambda: observed.decided(after))
        assert after in observed.admitted


async def test_quotas_hold_across_two_admission_replicas(
    admission_mesh: dict[str, Any], bus: Bus, observed: Observed
) -> None:
    second = Service(
        "admission-1",
        "admission",
        admission_mesh["nats"].url,
        admission_mesh["config"],
        admission_mesh["root"],
    ).start()
    try:
        first = admission_mesh["admission"]
        before = {s.name: s.metric("ripplemesh_admission_decisions_total") for s in (first, second)}
        async with Fleet(bus):
            ids = await submit(bus, *(prepared("shared") for _ in range(40)))
            await observed.until(lambda: all(observed.decided(r) for r in ids), timeout_s=30)
        admitted = [r for r in ids if r in observed.admitted]
        rejected = [observed.rejected[r] for r in ids if r in observed.rejected]
        # The tenant's burst is 10 requests (and it refills one per 100 s), whichever replica decides.
        assert len(admitted) == 10
        assert len(rejected) == 30 and {r.code for r in rejected} == {"quota"}
        handled = {
            s.name: s.metric("ripplemesh_admission_decisions_total") - before[s.name] for s in (first, second)
        }
        assert all(count > 0 for count in handled.values()), handled  # both replicas took part
    finally:
        second.stop()


# ------------------------------------------------------------------ priority, fairness, workflows


async def test_under_pressure_priority_classes_and_levels_go_first_and_sheddable_is_shed(
    bus: Bus, observed: Observed
) -> None:
    async with Fleet(bus) as fleet:
        await fleet.set(saturated_queue())
        ids = await submit(
            bus,
            prepared(priority="sheddable", rid=f"shed-{uuid.uuid4().hex[:8]}"),
            prepared(priority="standard", level=-5, rid=f"low-{uuid.uuid4().hex[:8]}"),
            prepared(priority="standard", level=7, rid=f"high-{uuid.uuid4().hex[:8]}"),
            prepared(priority="critical", rid=f"crit-{uuid.uuid4().hex[:8]}"),
        )
        shed, low, high, critical = ids
        await observed.until(lambda: all(observed.deferred(r) for r in ids))
        assert not any(r in observed.admitted for r in ids)
        # Room for about one request a second: 3 waiting of 4 per worker (saturation 0.75,
        # under standard's 0.9 but over sheddable's 0.75).
        await fleet.set(3)
        await observed.until(lambda: all(r in observed.admitted for r in (critical, high, low)))
        assert [r for r in observed.order if r in ids] == [critical, high, low]
        await observed.until(lambda: shed in observed.rejected, timeout_s=10)
        assert (observed.rejected[shed].code, observed.rejected[shed].http_status) == ("capacity", 503)


async def test_tenants_share_a_class_by_weight(bus: Bus, observed: Observed) -> None:
    async with Fleet(bus, workers=3) as fleet:
        await fleet.set(saturated_queue(3))
        ids = []
        for _ in range(12):
            ids += await submit(bus, prepared("fair-b"), prepared("fair-a"))
        await observed.until(lambda: all(observed.deferred(r) for r in ids))
        await fleet.set(2)  # 6 waiting where 12 is saturation 1.0: room for about five a second
        await observed.until(lambda: sum(r in observed.admitted for r in ids) >= 9)
        first_nine = [r for r in observed.order if r in ids][:9]
        tenants = {r: ("a" if i % 2 else "b") for i, r in enumerate(ids)}
        share_a = sum(tenants[r] == "a" for r in first_nine) / 9
        assert 5 / 9 <= share_a <= 7 / 9, first_nine  # weight 2:1 -> 6 of 9


async def test_a_later_workflow_step_is_admitted_ahead_of_a_new_workflow(
    bus: Bus, observed: Observed
) -> None:
    kv = await bus.key_value(WORKFLOW_SPEND)
    now = time.time()

    def spend(workflow_id: str, status: str, spent: float, completed: int) -> bytes:
        return msgspec.json.encode(
            WorkflowSpend(
                workflow_id=workflow_id,
                tenant="acme",
                spend_usd=spent,
                gpu_seconds=1.0,
                steps_completed=completed,
                steps=5,
                status=status,  # type: ignore[arg-type]
                reason="step_failed" if status == "failed" else None,
                first_event_at=now - 30,
                last_event_at=now - 1,
                updated_at=now - 1,
            )
        )

    running, failed = f"wf-{uuid.uuid4().hex[:8]}", f"wf-{uuid.uuid4().hex[:8]}"
    await kv.put(running, spend(running, "running", 0.05, 2))  # as the ledger puts it
    await kv.put(failed, spend(failed, "failed", 0.02, 1))
    await asyncio.sleep(0.5)
    async with Fleet(bus) as fleet:
        await fleet.set(saturated_queue())
        new, doomed, later = await submit(
            bus,
            prepared(workflow=WorkflowRef(workflow_id=f"wf-{uuid.uuid4().hex[:8]}", step=1, steps=5)),
            prepared(workflow=WorkflowRef(workflow_id=failed, step=2, steps=5)),
            prepared(workflow=WorkflowRef(workflow_id=running, step=3, steps=5)),
        )
        await observed.until(lambda: all(observed.deferred(r) for r in (new, doomed, later)))
        standing = {r: observed.decisions[r][0].workflow_standing for r in (new, doomed, later)}
        assert standing == {new: "new", doomed: "doomed", later: "continuation"}
        assert observed.decisions[later][0].workflow_spent_usd == pytest.approx(0.05)
        await fleet.set(3)
        await observed.until(lambda: all(observed.decided(r) for r in (new, doomed, later)))
        order = [r for r in observed.order if r in (new, doomed, later)]
        assert order[:2] == [later, new]  # and the failed workflow's step last, if at all
        assert doomed not in order or order == [later, new, doomed]


# ------------------------------------------------------------------ deadlines


async def test_an_infeasible_deadline_is_a_503_at_once_over_http(
    admission_mesh: dict[str, Any], bus: Bus
) -> None:
    async with Fleet(bus):
        url = f"{admission_mesh['ingress'].url}/v1/completions"
        body = {"model": MODEL, "prompt": "a long essay please", "max_tokens": 3000}
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.post(
                url, json=body, headers={"Authorization": f"Bearer {KEY}", "x-ripple-deadline-ms": "2000"}
            )
        assert time.monotonic() - started < 2.0  # not after waiting for the deadline
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "deadline" and "cannot be met" in error["message"]
        assert int(response.headers["retry-after"]) >= 1


async def test_a_deferred_request_is_decided_before_its_deadline(bus: Bus, observed: Observed) -> None:
    async with Fleet(bus) as fleet:
        await fleet.set(saturated_queue())  # and it stays saturated
        timed = prepared(deadline_s=2.5, max_tokens=8)
        untimed = prepared()
        ids = await submit(bus, timed, untimed)
        await observed.until(lambda: all(observed.deferred(r) for r in ids))
        await observed.until(lambda: all(observed.decided(r) for r in ids), timeout_s=10)
        deadline_at = timed.request.deadline_at
        assert deadline_at is not None
        rejected = observed.rejected[timed.request.request_id]
        assert rejected.code == "deadline" and rejected.occurred_at < deadline_at
        # Without a deadline, the wait is bounded by max_defer_s (4 s here).
        late = observed.rejected[untimed.request.request_id]
        assert late.code == "capacity" and late.occurred_at - untimed.request.submitted_at < 6.0
        decision = observed.decisions[timed.request.request_id][0]
        assert decision.due_at is not None and decision.due_at < deadline_at


# ------------------------------------------------------------------ bad input


async def test_bad_input_gets_a_clear_rejection_and_nothing_is_queued(
    admission_mesh: dict[str, Any], bus: Bus, observed: Observed
) -> None:
    async with Fleet(bus) as fleet:
        await fleet.set(saturated_queue())  # anything valid would be deferred
        now = time.time()
        cases = {
            "unknown tenant 'ghost'": prepared("ghost"),
            "priority level 1000 is out of range": prepared(level=1000),
            "a negative deadline": prepared(deadline_at=now - 5.0),
            "the limit is 86400 s": prepared(deadline_s=30 * 86400.0),
        }
        await submit(bus, *cases.values())
        await observed.until(lambda: all(observed.decided(e.request.request_id) for e in cases.values()))
        for words, event in cases.items():
            rejected = observed.rejected[event.request.request_id]
            assert (rejected.code, rejected.http_status) == ("invalid", 400), words
            assert words in rejected.message, rejected.message
            assert event.request.request_id not in observed.decisions  # never deferred
        with urllib.request.urlopen(f"{admission_mesh['admission'].url}/healthz", timeout=5) as response:
            assert msgspec.json.decode(response.read())["deferred"] == 0


async def test_saturation_is_a_metric_from_the_workers_state(
    admission_mesh: dict[str, Any], bus: Bus
) -> None:
    async with Fleet(bus, workers=2) as fleet:
        await fleet.set(6)  # 12 waiting on 2 workers at 4 each
        await asyncio.sleep(0.6)
        assert admission_mesh["admission"].metric("ripplemesh_admission_saturation") == pytest.approx(1.5)
        await fleet.set(0)
        await asyncio.sleep(0.6)
        # Idle: what is left is one sequence's decode step against the time-per-token bound.
        assert admission_mesh["admission"].metric("ripplemesh_admission_saturation") < 0.5


async def test_a_lease_topped_up_in_the_background_takes_its_slice_as_of_the_request_that_ran_it_low(
    bus: Bus,
) -> None:
    """A backlog charged as it arrived (back-dated): the lease's background top-up must not
    move the shared bucket's time to the clock's, which would take the refill the backlog's
    next requests are due. Charged one after the other, each top-up awaited, on the real KV."""
    quota = TenantQuota(requests_per_s=0.5, request_burst=1.0)
    tasks: list[asyncio.Task[None]] = []

    def spawn(coro: Any, name: str) -> None:
        tasks.append(asyncio.create_task(coro, name=name))

    tenant = f"backlog-{uuid.uuid4().hex[:8]}"  # a fresh entry in the shared bucket
    shared = SharedQuota(await bus.key_value(ADMISSION_QUOTAS), {tenant: quota}, AdmissionLimits(), spawn)

    def sent_at(at: float) -> AdmissionRequest:
        return AdmissionRequest(
            request_id=uuid.uuid4().hex,
            tenant=tenant,
            priority="standard",
            input_tokens=32,
            output_tokens=16,
            submitted_at=at,
        )

    now = time.time()
    outcomes = []
    for sent in (now - 4.4, now - 2.2, now):  # one every 2.2 s: within 1 per 2 s
        outcomes.append(await shared.charge(sent_at(sent), quota, sent))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert outcomes == [None, None, None]
    rejected = await shared.charge(sent_at(now), quota, now)  # one more now: over the rate
    assert rejected is not None and rejected.reason == "quota"
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
