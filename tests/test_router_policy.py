"""The router's seven-axis decision (services/router/policy.py): each axis moves the choice the way
it should, an unreachable deadline is refused, ties spread instead of herding, and the candidate
set stays small on a large fleet."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

import pytest

from services.router import policy
from services.router.policy import (
    DEFAULT_SPEED,
    NO_WORKERS_RETRY_S,
    NoPlacement,
    NoPrefix,
    Placement,
    RouterConfig,
    RouteRequest,
    RouterState,
    WorkerSpeed,
    WorkerView,
    cached_tokens,
    earliest_first_token,
    earliest_ttft,
    place,
)
from services.router.reporting import span_attributes
from services.router.speed import speed_for
from tests.router_views import FixedPrefix, state_of

MODEL = "llama-3.1-8b"
BLOCK = 16
NOW = 100.0
H100 = speed_for("H100", MODEL)
H200 = speed_for("H200", MODEL)
assert H100 is not None and H200 is not None
TOTAL = 30_000  # KV blocks


def view(
    worker_id: str,
    *,
    role: str = "decode",
    gpu: str = "H100",
    price: float | None = None,
    speed: WorkerSpeed | None = None,
    queued: int = 0,
    running: int = 0,
    used: int = 0,
    free: int | None = None,
    context: int | None = None,
    **extra: object,
) -> WorkerView:
    return WorkerView(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        model=MODEL,
        block_size=BLOCK,
        queue_depth=1 if queued else 0,
        running=running,
        kv_blocks_total=TOTAL,
        kv_blocks_used=used,
        heartbeat_at=NOW,
        gpu_type=gpu,
        price_per_hour=price if price is not None else (3.8 if gpu == "H200" else 3.0),
        speed=speed or (H200 if gpu == "H200" else H100),  # type: ignore[arg-type]
        kv_blocks_free=TOTAL - used if free is None else free,
        queued_tokens=queued,
        context_tokens=context if context is not None else running * 2000,
        **extra,  # type: ignore[arg-type]
    )


def request(
    rid: str = "r1",
    *,
    prompt: int = 2048,
    output: int = 200,
    deadline_in: float | None = None,
    **fields: object,
) -> RouteRequest:
    return RouteRequest(
        request_id=rid,
        tenant="t",
        model=MODEL,
        block_size=BLOCK,
        block_hashes=list(range(prompt // BLOCK)),
        prompt_tokens=prompt,
        max_tokens=output,
        deadline_at=NOW + deadline_in if deadline_in is not None else None,
        **fields,  # type: ignore[arg-type]
    )


# Request ids whose tie-break hashes differ: an assertion made for all of them holds by the axis
# under test, not by a hash that happens to favour one worker (`chosen_for_every_id`).
TIE_IDS = tuple(f"r{i}" for i in range(1, 9))


def chosen_for_every_id(
    workers: Sequence[WorkerView], req: RouteRequest, prefix: FixedPrefix | None = None
) -> set[str]:
    """The decode workers chosen for `req` under each of TIE_IDS (a fresh state each time)."""
    return {
        decide(state_of(*workers), dataclasses.replace(req, request_id=rid), prefix).decode_worker
        for rid in TIE_IDS
    }


def test_the_tie_ids_split_over_identical_workers() -> None:
    # What makes `chosen_for_every_id` a test of an axis: with nothing to tell two workers
    # apart, the ids do not all pick the same one.
    twins = [view("x", used=TOTAL // 2), view("y", used=TOTAL // 2)]
    assert chosen_for_every_id(twins, request()) == {"x", "y"}


def lax(state: RouterState) -> RouterState:
    """The state with the router's refusal of tasks not worth their cost off (a test of another
    axis on a saturated fleet, where a new task would be refused as not worth it)."""
    state.config = dataclasses.replace(state.config, worth_probability=0.0)
    return state


def decide(state: RouterState, req: RouteRequest, prefix: FixedPrefix | None = None) -> Placement:
    decision = place(state, req, prefix or FixedPrefix(), NOW)
    assert isinstance(decision, Placement), decision
    return decision


def test_the_default_speed_is_the_sim_engines_h100() -> None:
    reference = speed_for("H100", "llama-3-8b")
    assert reference is not None
    for f in dataclasses.fields(WorkerSpeed):
        assert getattr(DEFAULT_SPEED, f.name) == pytest.approx(getattr(reference, f.name), rel=1e-9)
    assert speed_for("no-such-gpu", MODEL) is None


# ------------------------------------------------------------------ one test per axis


def test_gpu_generation_and_price() -> None:
    # Equally busy workers: the cheaper GPU-second wins; at one price, the faster GPU (an H200
    # decodes from faster memory) wins.
    busy = {"used": TOTAL // 2, "running": 40}
    cheap = view("cheap", price=2.0, **busy)
    dear = view("dear", price=6.0, **busy)
    assert decide(state_of(cheap, dear), request()).decode_worker == "cheap"
    h100 = view("h100", gpu="H100", price=3.0, **busy)
    h200 = view("h200", gpu="H200", price=3.0, **busy)
    assert decide(state_of(h100, h200), request()).decode_worker == "h200"
    # And the placement's predicted cost is the ledger's charge: dearer on the dear GPU.
    on_dear = decide(state_of(dataclasses.replace(dear, worker_id="only")), request())
    on_cheap = decide(state_of(dataclasses.replace(cheap, worker_id="only")), request())
    assert on_dear.predicted_cost_usd == pytest.approx(3 * on_cheap.predicted_cost_usd, rel=1e-6)


def test_memory_headroom() -> None:
    # Worker "full" would make the request wait for blocks (its KV does not fit beside the
    # running batch); "roomy" has the space. The prefix cached on "full" does not make up for it.
    req = request(prompt=4096, output=1000)
    full = view("full", used=TOTAL - 50, running=4, context=4 * 120_000)
    roomy = view("roomy", used=TOTAL // 2, running=4, context=4 * 60_000)
    decision = decide(state_of(full, roomy), req, FixedPrefix({"full": 64}))
    assert decision.decode_worker == "roomy"
    # Fitting only by evicting cached blocks others may reuse costs their re-prefill: with the
    # same load, the worker with truly free blocks wins.
    evicting = view("evicting", used=TOTAL // 2, free=10)
    free = view("free", used=TOTAL // 2)
    assert chosen_for_every_id([evicting, free], req) == {"free"}


def test_kv_cache_state() -> None:
    req = request(prompt=8192)
    a, b = view("a", used=3000, running=8), view("b", used=3000, running=8)
    assert chosen_for_every_id([a, b], req, FixedPrefix({"b": 400})) == {"b"}
    decision = decide(state_of(a, b), req, FixedPrefix({"b": 400}))
    # Only whole cached blocks count, and the last prompt token is always computed.
    assert decision.predicted_cached_tokens == 400 * BLOCK
    full_hit = decide(state_of(a, b), req, FixedPrefix({"a": 512}))
    assert full_hit.decode_worker == "a" and full_hit.predicted_cached_tokens == 8191
    # Its TTFT is the uncached part's prefill.
    assert full_hit.predicted_ttft_s < decision.predicted_ttft_s


def test_cached_tokens_leave_one_token_to_compute() -> None:
    assert cached_tokens(3, 100, 16) == 48
    assert cached_tokens(4, 64, 16) == 63
    assert cached_tokens(0, 10, 16) == 0
    assert cached_tokens(1, 0, 16) == 0


def test_warm_weights() -> None:
    # A cold worker (weights still loading, 40 s) loses to a warm one with a backlog.
    cold = view("cold", warm=False, cold_load_s=40.0)
    warm = view("warm", queued=30_000, running=20, used=10_000)
    decision = decide(state_of(cold, warm), request())
    assert decision.decode_worker == "warm"
    assert decision.predicted_ttft_s < 40.0
    # An adapter: the worker that has it loaded, over one that would load it first.
    loaded = view("loaded", adapters=("sql-lora",), adapter_load_s=5.0, running=10, used=5000)
    missing = view("missing", adapter_load_s=5.0)
    assert decide(state_of(loaded, missing), request(adapter="sql-lora")).decode_worker == "loaded"
    # Without the adapter in the request, the idle worker is the better one.
    assert decide(state_of(loaded, missing), request()).decode_worker == "missing"


def test_tenant_priority() -> None:
    # Two busy workers (KV 90% full): "fast" has no prefill backlog but costs four times as
    # much; "cheap" has a second of backlog. Critical traffic buys the speed; sheddable traffic
    # takes the cheap worker.
    def fleet() -> RouterState:
        busy = {"used": TOTAL * 9 // 10, "running": 64}
        return state_of(view("fast", price=12.0, **busy), view("cheap", price=3.0, queued=30_000, **busy))

    assert decide(fleet(), request(priority="critical")).decode_worker == "fast"
    assert decide(fleet(), request(priority="sheddable")).decode_worker == "cheap"


def test_the_span_shows_the_score_the_options_were_ranked_by() -> None:
    # The critical request goes to "fast", though "cheap" is expected to cost less per success:
    # its latency is worth more than the price. The span shows each option's score (the
    # chosen's the lowest), and the expected cost per success beside it.
    busy = {"used": TOTAL * 9 // 10, "running": 64}
    state = state_of(view("fast", price=12.0, **busy), view("cheap", price=3.0, queued=30_000, **busy))
    placement = decide(state, request(priority="critical"))
    [cheap] = [o for o in placement.runners_up if o.decode_worker == "cheap"]
    assert cheap.expected_cost_per_success_usd < placement.expected_cost_per_success_usd
    assert placement.score is not None and cheap.score > placement.score
    attributes = span_attributes(
        placement, policy="ripplemesh", replica="r", decision_s=0.001, workflow_spent_usd=0.0
    )
    assert attributes["ripple.router.score"] == pytest.approx(placement.score)
    runners_up = attributes["ripple.router.runners_up"]
    assert isinstance(runners_up, list)
    [shown] = [line for line in runners_up if line.split()[1] == "cheap"]
    assert f"score=${cheap.score:.6f}" in shown
    assert f"per_success=${cheap.expected_cost_per_success_usd:.6f}" in shown


def test_latency_budget() -> None:
    # "slow" is cheap but has ~4 s of prefill backlog; "quick" is dear and idle. Without a
    # deadline the cheap one is fine; with 3 s to go only the quick one can make it.
    def fleet() -> RouterState:
        return state_of(
            view("slow", price=1.0, used=TOTAL // 2, queued=200_000, running=40),
            view("quick", price=12.0, used=TOTAL // 2),
        )

    relaxed = decide(fleet(), request(priority="sheddable"))
    assert relaxed.decode_worker == "slow" and relaxed.success_probability == 1.0
    tight = decide(fleet(), request(priority="sheddable", deadline_in=3.0))
    assert tight.decode_worker == "quick"
    assert tight.success_probability > 0.5
    assert tight.predicted_ttft_s < 1.0 < relaxed.predicted_ttft_s


def test_the_requests_waiting_on_a_worker_decode_beside_a_new_one() -> None:
    # "hidden" runs 4 decodes with 12 prompts (24,000 tokens) waiting; "open" runs 16 decodes
    # holding as much KV. A request placed on "hidden" is prefilled after the 12 and then decodes
    # in a batch of 17, as on "open": its predicted time per token is that batch's, not the
    # small running batch's the heartbeat shows.
    hidden = dataclasses.replace(view("hidden", running=4, queued=24_000), queue_depth=12)
    opened = view("open", running=16)
    req = request(prompt=256, output=400)
    on_hidden = decide(state_of(hidden), req)
    on_open = decide(state_of(opened), req)
    per_token_hidden = (on_hidden.predicted_completion_s - on_hidden.predicted_ttft_s) / 399
    per_token_open = (on_open.predicted_completion_s - on_open.predicted_ttft_s) / 399
    assert per_token_hidden == pytest.approx(per_token_open, rel=0.1)
    # The small running batch alone would have predicted a clearly faster decode.
    small = decide(state_of(view("small", running=4)), req)
    assert (small.predicted_completion_s - small.predicted_ttft_s) / 399 < 0.9 * per_token_open
    # Of two otherwise idle workers with the same 16 requests on them, the one whose requests
    # are already decoding takes the new one: on the other, it would wait behind 24,000 tokens
    # of prefill and hold up the 16 while its own prompt is prefilled all the same.
    assert decide(state_of(hidden, opened), request(prompt=8192, output=400)).decode_worker == "open"


def test_a_workflow_step_is_worth_its_whole_answer_not_only_its_first_token() -> None:
    # "crowded" holds the request's 3,000-token prefix but decodes 250 sequences (a step of
    # about 47 ms); "roomy" has nothing cached and decodes 70 (about 18 ms). On "crowded" the
    # first token comes sooner, on "roomy" the last one comes far sooner. A workflow's next step
    # waits for the last token, so a step with a long answer goes to "roomy"; a one-token answer
    # (all first token) stays with the cache, and so does a lone request, whose latency is its
    # time to first token.
    def fleet() -> RouterState:
        return state_of(
            view("crowded", gpu="H200", running=250, used=TOTAL // 3, context=250 * 4500),
            view("roomy", gpu="H200", running=70, used=TOTAL // 5, context=70 * 4500),
        )

    cached = FixedPrefix({"crowded": 3000 // BLOCK})
    step = {"workflow_id": "w", "workflow_step": 2, "workflow_steps": 4}
    long_answer = decide(fleet(), request(prompt=4000, output=250, **step), cached)
    assert long_answer.decode_worker == "roomy"
    on_crowded = next(r for r in long_answer.runners_up if r.decode_worker == "crowded")
    assert on_crowded.ttft_s < long_answer.predicted_ttft_s
    assert long_answer.predicted_completion_s < 0.5 * on_crowded.completion_s
    assert decide(fleet(), request(prompt=4000, output=1, **step), cached).decode_worker == "crowded"
    assert decide(fleet(), request(prompt=4000, output=250), cached).decode_worker == "crowded"


def test_an_unreachable_deadline_is_infeasible() -> None:
    # (The hopeless floor alone: the refusal of what is not worth its cost is off.)
    backlog = {"queued": 2_000_000, "running": 50, "used": TOTAL // 2}
    state = lax(state_of(view("a", **backlog), view("b", **backlog)))
    req = request(deadline_in=5.0)
    decision = place(state, req, FixedPrefix(), NOW)
    assert isinstance(decision, NoPlacement) and decision.reason == "infeasible"
    assert "deadline" in decision.message
    assert state.placed_since_heartbeat == {"a": 0, "b": 0}  # nothing placed
    # Admission's view of the same: the earliest first token, well past the deadline.
    ttft = earliest_ttft(state, req, FixedPrefix(), NOW)
    assert ttft is not None and ttft > 5.0
    # The same request with a reachable deadline is placed.
    assert isinstance(place(state, request(deadline_in=600.0), FixedPrefix(), NOW), Placement)
    # A first step of a long workflow is refused when the task as a whole has no chance (each
    # later step as risky as this one), while its last step alone, the earlier seven's spend at
    # stake, would be tried.
    ok = {"queued": 130_000, "running": 50, "used": TOTAL // 2}
    step = {"deadline_in": 7.0, "workflow_id": "wf", "workflow_steps": 8}
    first = place(lax(state_of(view("a", **ok))), request(workflow_step=1, **step), FixedPrefix(), NOW)
    last = place(
        lax(state_of(view("a", **ok))),
        request(workflow_step=8, workflow_spent_usd=0.01, **step),
        FixedPrefix(),
        NOW,
    )
    assert isinstance(first, NoPlacement) and first.reason == "infeasible", first
    assert isinstance(last, Placement)
    assert earliest_ttft(RouterState(), req, FixedPrefix(), NOW) is None  # no worker at all


def test_a_new_workflow_on_a_saturated_fleet_must_be_worth_its_cost() -> None:
    # The same 4-step workflow with the same chance of success (about 0.9 per step, 0.67 for
    # the task, under the calibration's prior) on two fleets. On an idle one its GPU time costs
    # the fleet next to nothing (idle time is paid for anyway): tried. On a saturated one (a
    # prefill backlog) it would take its full price from other work for a 67% chance: refused,
    # where a 5% floor would place it.
    # Its last step, with the earlier steps' spend at stake and only itself left, still goes.
    task = {"output": 300, "workflow_id": "wf", "workflow_steps": 4}
    busy = {"used": TOTAL // 2, "queued": 60_000, "running": 30}

    def saturated() -> RouterState:
        return state_of(view("a", **busy), view("b", **busy))

    new = place(saturated(), request(deadline_in=10.4, workflow_step=1, **task), FixedPrefix(), NOW)
    # Refused for the fleet's load, not the deadline: a capacity rejection, worth retrying later.
    assert isinstance(new, NoPlacement) and new.reason == "saturated", new
    assert "worth its cost" in new.message and "task's chance is 0.67" in new.message
    last = decide(saturated(), request(deadline_in=10.4, workflow_step=4, workflow_spent_usd=0.002, **task))
    assert 0.9 < last.success_probability < 0.97
    idle = state_of(view("a", used=1000, running=30), view("b", used=1000, running=30))
    tried = decide(idle, request(deadline_in=6.0, workflow_step=1, **task))
    assert 0.9 < tried.success_probability < 0.97
    # A sure first step still goes to the saturated fleet (worth_probability under 1): refusing
    # every new task there would also keep an autoscaled fleet from seeing the load that grows it.
    sure = place(saturated(), request("r3", deadline_in=600.0, workflow_step=1, **task), FixedPrefix(), NOW)
    assert isinstance(sure, Placement), sure
    # Below the floor of hope (5%) nothing is tried, however idle the fleet.
    hopeless = place(idle, request("r2", deadline_in=3.0, workflow_step=1, **task), FixedPrefix(), NOW)
    assert isinstance(hopeless, NoPlacement) and hopeless.reason == "infeasible"
    assert "no placement meets the deadline" in hopeless.message


def test_a_task_not_worth_its_cost_is_refused_only_while_the_fleet_is_pressed() -> None:
    # Workers with their KV 90% full: a new 4-step task's GPU time costs the fleet most of its
    # price, and its chance (0.92 a step, 0.71 for the task, under the calibration's prior) is
    # short of what that asks. With
    # no prompt queued and small batches the fleet has room: it is tried. Held back by admission
    # (arrivals outrunning the fleet), or with the decode batches at 42% of their limit or more
    # (`pressed_occupancy`), it is refused.
    task = {"output": 300, "workflow_id": "wf", "workflow_steps": 4, "workflow_step": 1}

    def fleet(running: int) -> RouterState:
        full = {"used": 27_000, "running": running}
        return state_of(view("a", **full), view("b", **full))

    tried = decide(fleet(30), request(deadline_in=6.0, **task))
    assert 0.9 < tried.success_probability < 0.95
    held = place(fleet(30), request(deadline_in=6.0, admission_wait_s=2.0, **task), FixedPrefix(), NOW)
    assert isinstance(held, NoPlacement) and held.reason == "saturated", held
    assert "worth its cost" in held.message and "task's chance is 0.71" in held.message
    assert "the fleet is pressed: admission held it 2.0 s" in held.message  # on the trace, why
    # Just under the saturation backlog (1 s) admission's hold is not yet pressure.
    assert isinstance(
        place(fleet(30), request(deadline_in=6.0, admission_wait_s=0.9, **task), FixedPrefix(), NOW),
        Placement,
    )
    # Decode batches of 101 and of 111 of 256 (a longer deadline for a like chance: the bigger
    # batches decode slower): under 42% of the limit the task is tried, over it refused.
    roomy = place(fleet(100), request(deadline_in=10.0, **task), FixedPrefix(), NOW)
    assert isinstance(roomy, Placement), roomy
    crowded = place(fleet(110), request(deadline_in=10.0, **task), FixedPrefix(), NOW)
    assert isinstance(crowded, NoPlacement) and crowded.reason == "saturated", crowded
    assert "task's chance is 0.66" in crowded.message
    assert "the fleet is pressed: its decode batch would be 111/256" in crowded.message


def test_a_saturated_refusal_says_when_the_fleet_will_have_room() -> None:
    # The same new 4-step task, refused as not worth its cost on fleets with 60k and 240k prompt
    # tokens queued on each worker (its deadline moved by the wait, so its chance is alike). Its
    # Retry-After is the wait for the prompts queued ahead of it: what admission reads as the
    # fleet's load (`earliest_first_token`), four times as long behind four times the backlog.
    task = {"output": 300, "workflow_id": "wf", "workflow_steps": 4}
    waits = []
    for queued in (60_000, 240_000):
        busy = {"used": TOTAL // 2, "queued": queued, "running": 30}
        probe = request(deadline_in=60.0, workflow_step=1, **task)
        first = earliest_first_token(
            state_of(view("a", **busy), view("b", **busy)), probe, FixedPrefix(), NOW
        )
        assert first is not None
        refused = place(
            state_of(view("a", **busy), view("b", **busy)),
            request(deadline_in=8.6 + first.wait_s, workflow_step=1, **task),
            FixedPrefix(),
            NOW,
        )
        assert isinstance(refused, NoPlacement) and refused.reason == "saturated", refused
        assert refused.retry_after_s == pytest.approx(first.wait_s, rel=0.01)
        waits.append(refused.retry_after_s)
        shown = span_attributes(
            refused, policy="ripplemesh", replica="r", decision_s=0.0, workflow_spent_usd=0.0
        )
        assert shown["ripple.router.retry_after_s"] == refused.retry_after_s  # on the trace too
    assert waits[1] > 3.5 * waits[0] and waits[0] > 1.5
    # Retrying cannot meet a deadline no placement meets; a fleet with no worker for the model
    # may have one after a heartbeat or two.
    busy = {"used": TOTAL // 2, "queued": 60_000, "running": 30}
    hopeless = place(state_of(view("a", **busy)), request(deadline_in=1.0, **task), FixedPrefix(), NOW)
    assert isinstance(hopeless, NoPlacement) and hopeless.reason == "infeasible"
    assert hopeless.retry_after_s is None
    nobody = place(RouterState(), request(deadline_in=60.0, **task), FixedPrefix(), NOW)
    assert isinstance(nobody, NoPlacement) and nobody.reason == "no_workers"
    assert nobody.retry_after_s == NO_WORKERS_RETRY_S


def test_with_the_gate_set_no_new_workflow_while_the_decode_batches_are_past_their_knee() -> None:
    # Both workers run 250 sequences of 4,000 tokens: a decode step reads a gigabyte of KV and
    # a token takes some 60 ms. A new workflow (its first step) would only slow those in flight:
    # refused, though its deadline is easy. A later step of a running workflow and a single
    # request (no workflow) still go, and the same first step goes to a fleet with short batches.
    full = {"used": TOTAL // 2, "running": 250, "context": 250 * 4000}
    task = {"output": 300, "deadline_in": 60.0, "workflow_id": "wf", "workflow_steps": 4}

    def busy(gate: float | None = 0.04) -> RouterState:
        state = lax(state_of(view("a", **full), view("b", **full)))
        state.config = dataclasses.replace(state.config, new_task_max_tpot_s=gate)
        return state

    new = place(busy(), request(workflow_step=1, **task), FixedPrefix(), NOW)
    assert isinstance(new, NoPlacement) and new.reason == "saturated", new
    assert "past their knee" in new.message
    later = decide(busy(), request(workflow_step=2, workflow_spent_usd=0.001, **task))
    assert later.success_probability > 0.99
    decide(busy(), request(output=300, deadline_in=60.0))
    short = {"used": TOTAL // 2, "running": 20, "context": 20 * 4000}
    shorter = state_of(view("a", **short), view("b", **short))
    shorter.config = busy().config
    decide(shorter, request(workflow_step=1, **task))
    # The gate is configuration, off by default (behind the project's admission it would refuse
    # what admission has just let through): without it the first step goes.
    assert RouterConfig().new_task_max_tpot_s is None
    decide(busy(None), request(workflow_step=1, **task))


def test_on_a_fleet_past_keeping_up_the_dearest_new_tasks_are_refused_first() -> None:
    # Both workers' decode batches are at their limit: the fleet is past keeping up, and the
    # router sheds the dearest new tasks: after a 2-step task (the typical one so far), a new
    # 8-step task with the same first step would take four times the fleet's time for the same
    # success: refused as saturated (worth retrying later). Another 2-step task and a later step
    # of a running workflow still go; with the rule off, the 8-step task goes too.
    full = {"used": TOTAL // 2, "running": H100.max_running, "context": H100.max_running * 1000}
    easy = {"output": 200, "deadline_in": 600.0, "workflow_step": 1}

    def fleet() -> RouterState:
        return state_of(view("a", **full), view("b", **full))

    past = fleet()
    decide(past, request("short-1", workflow_id="w1", workflow_steps=2, **easy))
    dear = place(past, request("long", workflow_id="w2", workflow_steps=8, **easy), FixedPrefix(), NOW)
    assert isinstance(dear, NoPlacement) and dear.reason == "saturated", dear
    assert "among the dearest" in dear.message
    decide(past, request("short-2", workflow_id="w3", workflow_steps=2, **easy))
    later = {**easy, "workflow_step": 2, "workflow_spent_usd": 0.001}
    decide(past, request("long-2", workflow_id="w2", workflow_steps=8, **later))
    off = fleet()
    off.config = dataclasses.replace(off.config, dearest_task_factor=None)
    decide(off, request("short-1", workflow_id="w1", workflow_steps=2, **easy))
    decide(off, request("long", workflow_id="w2", workflow_steps=8, **easy))
    # A fleet that keeps up (short batches, nothing refused lately) takes the dear task too.
    calm = state_of(view("a", running=20), view("b", running=20))
    decide(calm, request("short-1", workflow_id="w1", workflow_steps=2, **easy))
    decide(calm, request("long", workflow_id="w2", workflow_steps=8, **easy))


def test_past_keeping_up_a_critical_task_is_shed_only_at_a_dearer_bar() -> None:
    # The dearest-task rule weighs cost alone; the critical class's bar is 1.5 x the others'.
    # After a typical 4-step task, a 5-step task (a quarter dearer) is placed when it is
    # critical and refused as saturated when it is standard; a 7-step critical task, dearer
    # than its bar, is refused too.
    full = {"used": TOTAL // 2, "running": H100.max_running, "context": H100.max_running * 1000}
    easy = {"output": 200, "deadline_in": 600.0, "workflow_step": 1}
    past = state_of(view("a", **full), view("b", **full))
    decide(past, request("typical", workflow_id="w1", workflow_steps=4, **easy))
    decide(past, request("critical", workflow_id="w2", workflow_steps=5, priority="critical", **easy))
    standard = place(
        past, request("standard", workflow_id="w3", workflow_steps=5, **easy), FixedPrefix(), NOW
    )
    assert isinstance(standard, NoPlacement) and standard.reason == "saturated", standard
    dearer = request("dearer", workflow_id="w4", workflow_steps=7, priority="critical", **easy)
    refused = place(past, dearer, FixedPrefix(), NOW)
    assert isinstance(refused, NoPlacement) and "x 1.5 for its class" in refused.message, refused


def test_where_admission_controls_no_load_the_router_sheds_at_its_own_bar() -> None:
    # After a typical 5-step task, a 4-step one passes the bar of 1.0; at a bar of 0.8 for a
    # router that is the only shedding it is refused (4 steps > 0.8 x 5), but only where the
    # router is told admission controls no load (quotas only): behind the project's admission,
    # which has deferred and shed already, the bar stays 1.0.
    full = {"used": TOTAL // 2, "running": H100.max_running, "context": H100.max_running * 1000}
    easy = {"output": 200, "deadline_in": 600.0, "workflow_step": 1}

    def fleet(controls_load: bool) -> RouterState:
        past = state_of(view("a", **full), view("b", **full))
        decide(past, request("typical", workflow_id="w1", workflow_steps=5, **easy))
        past.config = dataclasses.replace(
            past.config, dearest_task_factor_alone=0.8, admission_controls_load=controls_load
        )
        return past

    dearer = request("dearer", workflow_id="w2", workflow_steps=4, **easy)
    decide(fleet(controls_load=True), dearer)
    alone = place(fleet(controls_load=False), dearer, FixedPrefix(), NOW)
    assert isinstance(alone, NoPlacement) and alone.reason == "saturated", alone
    assert "x 0.8 for its class" in alone.message


def test_workflow_sunk_cost_and_prefix() -> None:
    # "risky" is cheap with a backlog that makes a 6 s deadline a coin toss; "safe" is dear
    # and idle. A first step with nothing spent takes the cheap gamble; the last step of a
    # workflow that has already spent $0.50 is worth protecting: the safe worker.
    def fleet() -> RouterState:
        return lax(
            state_of(
                view("risky", price=2.0, used=TOTAL // 2, queued=140_000, running=40),
                view("safe", price=40.0, used=TOTAL // 2),
            )
        )

    common = {"priority": "sheddable", "deadline_in": 7.0, "workflow_id": "wf", "workflow_steps": 6}
    first = decide(fleet(), request(workflow_step=1, workflow_spent_usd=0.0, **common))
    late = decide(fleet(), request(workflow_step=6, workflow_spent_usd=0.5, **common))
    assert first.decode_worker == "risky" and 0.1 < first.success_probability < 0.95
    assert late.decode_worker == "safe" and late.success_probability > first.success_probability
    assert late.expected_cost_per_success_usd > 0.5
    # A workflow's next step goes where its prefix (the earlier steps) lives.
    a, b, c = (view(w, used=4000, running=10) for w in "abc")
    step = request(prompt=6000, workflow_id="wf", workflow_step=3)
    assert chosen_for_every_id([a, b, c], step, FixedPrefix({"c": 300})) == {"c"}


def test_aggregated_or_disaggregated_by_the_same_objective() -> None:
    # A decode worker with a big batch, and an idle prefill worker: a long uncached prompt is
    # prefilled on the prefill worker (its chunks would hold up the batch); a short one, whose
    # KV would travel for nothing, stays on the decode worker.
    def fleet() -> RouterState:
        return state_of(
            view("decode", used=TOTAL // 2, running=120, context=120 * 3000),
            view("prefill", role="prefill", used=1000),
        )

    long = decide(fleet(), request(prompt=16_000))
    assert (long.mode, long.prefill_worker, long.decode_worker) == ("disaggregated", "prefill", "decode")
    short = decide(fleet(), request(prompt=64, output=50), FixedPrefix({"decode": 3}))
    assert (short.mode, short.prefill_worker) == ("aggregated", "decode")
    # The options it weighed are on the placement, each with its predictions.
    assert long.runners_up and all(o.expected_cost_per_success_usd > 0 for o in long.runners_up)


# ------------------------------------------------------------------ ties, herding, scale


def test_a_burst_spreads_over_identical_workers() -> None:
    workers = [view(f"w{i}") for i in range(8)]
    state = state_of(*workers)
    chosen = [decide(state, request(f"burst-{i}", prompt=4096)).decode_worker for i in range(16)]
    assert Counter(chosen) == {f"w{i}": 2 for i in range(8)}


def test_exact_ties_break_by_request_not_by_worker_order() -> None:
    # Identical workers, a fresh state each time: which one a request lands on depends on the
    # request (a hash over the tied options only), never on the order the workers were heard.
    firsts = Counter(
        decide(state_of(*(view(f"w{i}") for i in range(3))), request(f"tie-{n}")).decode_worker
        for n in range(300)
    )
    assert set(firsts) == {"w0", "w1", "w2"}
    assert min(firsts.values()) > 60


def test_candidates_stay_few_on_a_large_fleet() -> None:
    workers = [
        view(
            f"w{i:04d}",
            gpu="H200" if i % 2 else "H100",
            running=i % 9,
            used=(i * 37) % TOTAL,
            queued=(i % 5) * 1000,
        )
        for i in range(1000)
    ]
    state = state_of(*workers)
    cached = FixedPrefix({f"w{i:04d}": 10 + i % 50 for i in range(0, 1000, 7)})
    config = state.config
    decision = decide(state, request(prompt=4096), cached)
    assert decision.candidates <= config.cache_candidates + 2 * config.load_candidates
    # The least-loaded candidates are the least loaded of each GPU type.
    least = state.least_loaded(MODEL, "decode", 1, NOW)
    assert {w.gpu_type for w in least} == {"H100", "H200"}
    for w in least:
        same = [x for x in workers if x.gpu_type == w.gpu_type]
        assert policy.backlog_seconds(w, state) == min(policy.backlog_seconds(x, state) for x in same)


def test_bad_fleets() -> None:
    mismatch = state_of(view("a"), dataclasses.replace(view("b"), block_size=32))
    decision = place(mismatch, request(), NoPrefix(), NOW)
    assert isinstance(decision, NoPlacement) and decision.reason == "invalid"
    only_prefill = state_of(view("p", role="prefill"))
    decision = place(only_prefill, request(), NoPrefix(), NOW)
    assert isinstance(decision, NoPlacement) and decision.reason == "no_workers"
    stale = state_of(dataclasses.replace(view("a"), heartbeat_at=NOW - 10))
    assert isinstance(place(stale, request(), NoPrefix(), NOW), NoPlacement)
    draining = state_of(dataclasses.replace(view("a"), draining=True), view("b"))
    assert decide(draining, request()).decode_worker == "b"


def test_the_kv_index_and_a_plain_mapping_of_the_same_match_place_alike() -> None:
    """The decision reads the KV index's match lazily (`KvIndex.matches`: only the workers it
    looks at); it must place every request exactly as from the whole mapping (`overlaps`), ties
    between equally deep workers included."""
    import random

    from schemas.events import KvDump
    from services.router.kv_index import KvIndex

    rng = random.Random(5)
    chain = list(range(1000, 1064))
    index = KvIndex(BLOCK)
    workers = []
    for i in range(40):
        gpu = "H200" if i % 3 == 0 else "H100"
        role = "prefill" if i % 4 == 3 else "decode"
        workers.append(
            view(f"w{i:02d}", role=role, gpu=gpu, running=i % 6, used=(i * 611) % TOTAL, queued=(i % 4) * 700)
        )
        # Few distinct depths, so that several workers tie at each.
        held = set(chain[: rng.choice([0, 8, 8, 24, 24, 64])]) | {rng.randrange(5000) for _ in range(20)}
        index.apply_dump(
            KvDump(
                event_id=f"d{i}",
                occurred_at=0.0,
                worker_id=f"w{i:02d}",
                model=MODEL,
                block_size=BLOCK,
                seq=0,
                block_hashes=sorted(held),
            )
        )

    class WholeMapping:
        """The same index seen through `overlaps` alone."""

        def overlap(self, worker_id: str, block_hashes: Sequence[int]) -> int:
            return index.overlap(worker_id, block_hashes)

        def overlaps(self, block_hashes: Sequence[int]) -> Mapping[str, int]:
            return index.overlaps(block_hashes)

    lazy, whole = state_of(*workers), state_of(*workers)
    for n in range(300):
        blocks = chain[: rng.choice([4, 16, 40, 64])] + [rng.randrange(5000) for _ in range(rng.randrange(8))]
        req = dataclasses.replace(
            request(f"r{n}", prompt=len(blocks) * BLOCK, deadline_in=20.0 if n % 2 else None),
            block_hashes=blocks,
        )
        assert place(lazy, req, index, NOW) == place(whole, req, WholeMapping(), NOW)
