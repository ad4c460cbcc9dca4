"""The pure rules behind migration: what the client has, where its stream resumes, when a worker
is lost; and the sim engine continuing a resumed request with the tokens it would have given."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from schemas.events import (
    InferenceRequest,
    OutputConstraint,
    Resumption,
    StreamFailed,
    StreamFinished,
    TokenChunk,
    ToolFunction,
    Usage,
)
from services.engines.base import RealClock
from services.engines.host import HAND_BACK_TIMEOUT_S
from services.engines.sim.engine import SimEngine
from services.mesh.block_hash import chain_block_hashes
from services.mesh.resumption import first_seq, output_before, prompt_proper
from services.router.liveness import Liveness
from services.router.resume import AlreadyEnded, FinishNow, GiveUp, Resume, delivered, plan

PROMPT = list(range(100, 140))  # 40 tokens: two full blocks of 16


def request(max_tokens: int = 10, **extra: object) -> InferenceRequest:
    return InferenceRequest(
        request_id="r1",
        tenant="acme",
        model="llama-3-8b",
        api="nats",
        prompt_tokens=PROMPT,
        block_size=16,
        block_hashes=chain_block_hashes(PROMPT, 16, model="llama-3-8b"),
        max_tokens=max_tokens,
        submitted_at=1.0,
        **extra,  # type: ignore[arg-type]
    )


def chunk(seq: int, *tokens: int) -> TokenChunk:
    return TokenChunk(
        event_id=f"r1-{seq}", occurred_at=1.0, request_id="r1", seq=seq, token_ids=list(tokens), text=""
    )


def test_delivered_is_the_gapless_prefix_of_the_stream() -> None:
    got = delivered(request(), [chunk(0, 7), chunk(1, 8, 9), chunk(3, 11), chunk(1, 8, 9)])
    assert (got.next_seq, got.token_ids, got.final) == (2, (7, 8, 9), False)
    assert delivered(request(), []).next_seq == 0
    finished = StreamFinished(
        event_id="r1-2",
        occurred_at=1.0,
        request_id="r1",
        seq=2,
        finish_reason="length",
        usage=Usage(prompt_tokens=40, completion_tokens=3),
    )
    assert delivered(request(), [chunk(0, 7), chunk(1, 8, 9), finished]).final
    failed = StreamFailed(
        event_id="r1-0",
        occurred_at=1.0,
        request_id="r1",
        seq=0,
        code="internal",
        message="x",
        http_status=503,
    )
    assert delivered(request(), [failed]).final


def test_a_resumed_request_counts_what_its_prompt_carries() -> None:
    # Migrated once after 3 tokens in 2 chunks: its prompt ends with them, its stream at seq 2.
    once = msgspec.structs.replace(
        request(max_tokens=7),
        prompt_tokens=[*PROMPT, 7, 8, 9],
        resumption=Resumption(migration=1, next_seq=2, output_tokens=3),
    )
    assert (first_seq(once), output_before(once), prompt_proper(once)) == (2, 3, PROMPT)
    # Chunks before its resume point are not read again (they may have aged out of the stream).
    got = delivered(once, [chunk(2, 10), chunk(3, 11)])
    assert (got.next_seq, got.token_ids) == (4, (7, 8, 9, 10, 11))


def test_plan_resumes_with_the_prompt_and_delivered_tokens() -> None:
    got = delivered(request(), [chunk(0, 7), chunk(1, 8, 9)])
    decision = plan(request(), got, max_migrations=3, from_worker="decode-0", reason="was lost")
    assert isinstance(decision, Resume)
    resumed = decision.request
    assert resumed.prompt_tokens == [*PROMPT, 7, 8, 9]
    assert resumed.block_hashes == chain_block_hashes([*PROMPT, 7, 8, 9], 16, model="llama-3-8b")
    assert resumed.max_tokens == 7
    assert resumed.resumption == Resumption(migration=1, next_seq=2, output_tokens=3)
    assert (decision.migration, decision.delivered_tokens, decision.remaining_tokens) == (1, 3, 7)
    # A second migration builds on the first: the same prompt proper, the whole output so far.
    again = plan(resumed, delivered(resumed, [chunk(2, 10)]), max_migrations=3, from_worker="d1", reason="x")
    assert isinstance(again, Resume)
    assert again.request.prompt_tokens == [*PROMPT, 7, 8, 9, 10]
    assert again.request.max_tokens == 6
    assert again.request.resumption == Resumption(migration=2, next_seq=3, output_tokens=4)


def test_plan_refuses_to_continue_what_another_worker_cannot_continue_faithfully() -> None:
    """A constrained output part-way written (its grammar's state does not travel), or an output
    past max_migrated_output_tokens, fails with a clear error rather than a different output."""
    tool_call = OutputConstraint(kind="tool_call", tools=[ToolFunction(name="get_weather")])
    forced = request(constraint=tool_call)
    got = delivered(forced, [chunk(0, 7), chunk(1, 8)])
    refused = plan(forced, got, max_migrations=3, from_worker="decode-0", reason="was lost")
    assert isinstance(refused, GiveUp) and refused.seq == 2
    assert "a tool_call output 2 tokens in" in refused.message and "send the request again" in refused.message
    # Nothing delivered yet: placed again from the start, which is faithful.
    assert isinstance(
        plan(forced, delivered(forced, []), max_migrations=3, from_worker="d", reason="x"), Resume
    )
    long = plan(request(), got, max_migrations=3, from_worker="d", reason="x", max_output_tokens=1)
    assert isinstance(long, GiveUp) and "max_migrated_output_tokens (1)" in long.message
    assert isinstance(
        plan(request(), got, max_migrations=3, from_worker="d", reason="x", max_output_tokens=2), Resume
    )


def test_plan_gives_up_past_the_limit_and_finishes_or_drops_what_is_done() -> None:
    got = delivered(request(), [chunk(0, 7)])
    give_up = plan(request(), got, max_migrations=0, from_worker="decode-0", reason="was lost")
    assert isinstance(give_up, GiveUp)
    assert give_up.seq == 1 and give_up.migration == 1
    assert "the limit is 0 migration(s)" in give_up.message and "1 of 10 tokens" in give_up.message
    everything = delivered(request(max_tokens=2), [chunk(0, 7), chunk(1, 8)])
    done = plan(request(max_tokens=2), everything, max_migrations=3, from_worker="d", reason="x")
    assert done == FinishNow(seq=2, usage=Usage(prompt_tokens=40, completion_tokens=2))
    ended = delivered(
        request(),
        [
            chunk(0, 7),
            StreamFinished(
                event_id="r1-1",
                occurred_at=1.0,
                request_id="r1",
                seq=1,
                finish_reason="stop",
                usage=Usage(prompt_tokens=40, completion_tokens=1),
            ),
        ],
    )
    assert isinstance(plan(request(), ended, max_migrations=3, from_worker="d", reason="x"), AlreadyEnded)


def test_liveness_probes_late_workers_and_loses_silent_ones() -> None:
    life = Liveness()
    life.heartbeat("w1", heartbeat_at=100.0, revision=5, draining=False)
    life.heartbeat("w2", heartbeat_at=100.5, revision=6, draining=False)
    assert life.verdicts(101.9).probe == []
    assert life.verdicts(102.0).probe == ["w1"]  # two heartbeats missed: ask it
    life.probed("w1", 102.0)
    assert life.verdicts(102.2).probe == []  # asked already
    assert life.verdicts(102.5).probe == ["w1", "w2"]
    assert life.next_due(102.2) == pytest.approx(102.5)
    verdicts = life.verdicts(103.0)
    assert verdicts.lost == [("w1", 5)]  # 3 s without a heartbeat: lost, at that revision
    life.lost("w1", 103.0)
    assert life.verdicts(103.0).scan == [("w1", "worker_lost")]
    life.scanned("w1", 103.0)
    assert life.verdicts(103.5).scan == []
    assert life.verdicts(104.0).scan == [("w1", "worker_lost")]  # rescanned every second
    # A fresh heartbeat (a restart) brings it back; an older one replayed does not.
    life.heartbeat("w1", heartbeat_at=102.9, revision=9, draining=False)
    assert "w1" in life.gone
    life.heartbeat("w1", heartbeat_at=104.0, revision=9, draining=False)
    assert "w1" not in life.gone and life.is_alive("w1", 104.5)


def test_liveness_a_deleted_entry_is_gone_drained_if_it_said_so() -> None:
    life = Liveness()
    life.heartbeat("w1", heartbeat_at=100.0, revision=1, draining=True)
    life.heartbeat("w2", heartbeat_at=100.0, revision=2, draining=False)
    life.removed("w1", 100.5)
    life.removed("w2", 100.5)
    assert sorted(life.verdicts(100.5).scan) == [("w1", "worker_drained"), ("w2", "worker_lost")]
    for worker_id in ("w1", "w2"):
        life.scanned(worker_id, 100.5)
    assert life.verdicts(161.0).scan == [] and life.gone == {}  # forgotten after a minute


def test_liveness_a_worker_back_under_its_id_before_it_was_missed_has_its_predecessors_work_taken() -> None:
    """Killed and restarted within a heartbeat or two, a worker never looks lost; its new
    `started_at` says the predecessor is gone, and the work sent before it is taken over."""
    life = Liveness()
    life.heartbeat("w1", heartbeat_at=100.0, revision=1, draining=False, started_at=50.0)
    life.heartbeat("w1", heartbeat_at=101.0, revision=2, draining=False, started_at=50.0)
    assert life.verdicts(101.0).predecessors == []  # the same incarnation
    life.heartbeat("w1", heartbeat_at=101.6, revision=3, draining=False, started_at=101.5)
    verdicts = life.verdicts(101.6)
    assert verdicts.predecessors == [("w1", 101.5)] and verdicts.lost == [] and life.is_alive("w1", 101.6)
    life.predecessor_scanned("w1", 101.6)
    assert life.verdicts(102.0).predecessors == []
    assert life.verdicts(102.6).predecessors == [("w1", 101.5)]  # again every second, a while
    life.predecessor_scanned("w1", 102.6)
    assert life.verdicts(117.0).predecessors == [] and life.restarted == {}
    # A worker first heard of long after its start, or an older heartbeat replayed, is no restart.
    life.heartbeat("w2", heartbeat_at=101.0, revision=4, draining=False, started_at=80.0)
    life.heartbeat("w1", heartbeat_at=100.5, revision=1, draining=False, started_at=50.0)
    assert life.restarted == {}


def test_liveness_a_router_just_started_scans_a_worker_that_just_started() -> None:
    """A router restarted meanwhile never saw the worker's previous start: a worker first heard
    of within the scan window of its start may have a predecessor's work left."""
    life = Liveness()
    life.heartbeat("w1", heartbeat_at=101.0, revision=1, draining=False, started_at=100.0)
    assert life.verdicts(101.0).predecessors == [("w1", 100.0)]
    life.predecessor_scanned("w1", 101.0)
    life.heartbeat("w1", heartbeat_at=102.0, revision=2, draining=False, started_at=100.0)
    assert life.verdicts(102.0).predecessors == [("w1", 100.0)]  # the same start: scanned again
    life.predecessor_scanned("w1", 102.0)
    # The window runs from the worker's start, shorter than it waits (HAND_BACK_TIMEOUT_S).
    assert life.verdicts(100.0 + life.predecessor_scan_for_s + 1).predecessors == []
    assert life.restarted == {}
    assert life.predecessor_scan_for_s < HAND_BACK_TIMEOUT_S


def test_liveness_a_second_restart_within_the_window_after_a_stop_scans_from_the_newer_start() -> None:
    """Restarted, then stopped (its entry deleted) and started again within the scan window of
    the first restart: the newest incarnation's predecessors are everything before its own start,
    not before the first restart's (work sent to the one in between was left behind)."""
    life = Liveness()
    life.heartbeat("w1", heartbeat_at=100.5, revision=1, draining=False, started_at=100.0)
    assert life.verdicts(100.5).predecessors == [("w1", 100.0)]
    life.predecessor_scanned("w1", 100.5)
    life.removed("w1", 105.0)
    life.heartbeat("w1", heartbeat_at=106.5, revision=3, draining=False, started_at=106.0)
    assert life.verdicts(106.5).predecessors == [("w1", 106.0)]


async def test_sim_engine_resumes_a_migrated_request_with_the_same_tokens() -> None:
    engine = SimEngine(model="llama-3-8b", clock=RealClock(time_scale=0.0))
    await engine.start()
    try:
        whole = await generate(engine, request(max_tokens=12))
        # The client got 5 tokens in 3 chunks; the rest comes from a placement elsewhere.
        got = delivered(
            request(max_tokens=12), [chunk(0, *whole[:1]), chunk(1, *whole[1:3]), chunk(2, *whole[3:5])]
        )
        decision = plan(request(max_tokens=12), got, max_migrations=1, from_worker="d", reason="x")
        assert isinstance(decision, Resume)
        rest = await generate(engine, msgspec.structs.replace(decision.request, request_id="r1-again"))
        assert whole[:5] + rest == whole
    finally:
        await engine.stop()


async def generate(engine: SimEngine, req: InferenceRequest) -> list[int]:
    result = await engine.prefill(req)
    tokens = [result.first_token_id]
    async for step in engine.decode(req.request_id, result.first_token_id):
        tokens.extend(step.token_ids)
    await asyncio.sleep(0)
    return tokens
