"""When to say no, and when to ask again. A request is refused, rather than placed:

- `block_size_mismatch`: "invalid" when it was hashed with another block size than the model's
  workers use (every cache hit would be a miss);
- `refuse`: "infeasible" when no option gives the task a useful chance of meeting its deadlines,
  or "saturated" when placing it is expected to cost more per success than it is worth (its
  chance against the marginal over the full cost of what is left), only while the fleet is
  pressed (`fleet_pressure`), or when a new workflow would decode past the bound
  (`overloaded`);
- `dearest`: "saturated" for a new task dearer than the typical one against its chance, while
  the fleet is past keeping up (it sheds the dearest new tasks first).

A saturated refusal carries its Retry-After (`room_in`: when the work queued ahead of the
request's likeliest placement is predicted done). Reads the options' predictions; `dearest`
keeps its decaying averages in the router state. The clock is passed in."""

from __future__ import annotations

import math

from services.router.policy.predict import Option
from services.router.policy.state import NEW_TASK_WEIGHT, RouterState, live_workers
from services.router.policy.types import NoPlacement, RouterConfig, RouteRequest

# A saturated refusal's Retry-After is at least a second (the ingress's HTTP header is whole
# seconds) and at most a minute: past that the prediction says little, and the client should ask
# again rather than wait out a guess.
RETRY_AFTER_BOUNDS_S = (1.0, 60.0)


def block_size_mismatch(state: RouterState, model: str, block_size: int, now: float) -> NoPlacement | None:
    """`NoPlacement("invalid")` where a live worker of the model uses another block size than
    the request was hashed with (None: none does)."""
    counts = state._size_counts.get(model)
    if not counts or (len(counts) == 1 and block_size in counts):
        return None
    mismatched = sorted(w.worker_id for w in live_workers(state, model, now) if w.block_size != block_size)
    if not mismatched:
        return None
    # Routing across a block-size mismatch would turn every cache hit into a miss.
    return NoPlacement(
        "invalid",
        f"block size mismatch: the request was hashed with {block_size}-token blocks but "
        f"worker(s) {', '.join(mismatched)} use another size; refusing to route",
    )


def refuse(
    config: RouterConfig, request: RouteRequest, options: list[Option], now: float
) -> NoPlacement | None:
    """Refuse a request whose task is not worth trying: placing it must be expected to cost less
    per success than what the fleet pays per success.

    The task succeeds only if this step and the steps still to come meet their deadlines; with
    nothing known of the later ones, each is as likely as this one is now: P = p^(1 + left).
    Placing spends, in expectation, what this step and each later step take from the fleet (the
    best option's marginal cost, GPU time at the workers' utilisation, once per step left);
    declining loses the task. The task's worth is what it costs in full (its spend so far plus
    each step left at its full price) over `worth_probability`, the chance a task whose
    steps are all paid in full must have to be worth trying: refuse when P x worth < marginal
    cost, i.e. P < worth_probability x marginal / full. On an idle fleet the marginal cost is
    near nothing (idle GPU time is paid for anyway) and only a hopeless deadline is refused; on a
    saturated one a new workflow needs the full chance, a late step of an expensive one far
    less. A task short of that chance is refused only while the fleet is pressed
    (`fleet_pressure`);
    one short of `min_success_probability` always."""
    likeliest = max(options, key=lambda o: o.probability)
    left = 0
    if request.workflow_step is not None and request.workflow_steps is not None:
        left = max(0, request.workflow_steps - request.workflow_step)
    task_probability = likeliest.probability ** (1 + left)
    best = min(options, key=lambda o: o.score)
    steps = 1 + left
    full = request.workflow_spent_usd + steps * best.cost_usd
    # (The marginal cost can exceed the charged one, the KV held for a long completion
    # included: no task needs more than the full chance.)
    floor = config.worth_probability * (min(1.0, steps * best.marginal_usd / full) if full > 0 else 0.0)
    floor = max(config.min_success_probability, floor)
    if task_probability >= floor and not overloaded(config, request, options):
        return None
    if task_probability >= floor:
        return NoPlacement(
            "saturated",
            f"the fleet's decode batches are past their knee: a new workflow would decode at "
            f"{min(o.tpot_s for o in options) * 1000:.0f} ms a token (the bound is "
            f"{(config.new_task_max_tpot_s or 0.0) * 1000:.0f} ms); its steps would only slow "
            "those in flight",
            room_in(options),
        )
    hopeless = task_probability < config.min_success_probability
    pressure = None if hopeless else fleet_pressure(config, request, best)
    if not hopeless and pressure is None:
        return None
    reason = (
        f"{'no placement meets the deadline' if hopeless else 'no placement is worth its cost'}: "
        f"the likeliest completes in {likeliest.completion_s:.2f} s (probability "
        f"{likeliest.probability:.3f}), "
        f"{request.deadline_at - now if request.deadline_at is not None else math.inf:.2f} s are left"
    )
    if left:
        reason += f"; with {left} later step(s) the task's chance is {task_probability:.3f}"
    if hopeless:
        return NoPlacement("infeasible", reason + f" (needs {floor:.3f})")
    return NoPlacement(
        "saturated", reason + f" (needs {floor:.3f}; the fleet is pressed: {pressure})", room_in(options)
    )


def fleet_pressure(config: RouterConfig, request: RouteRequest, option: Option) -> str | None:
    """What presses the fleet, as the request sees it (None: it has room): arrivals outrun it
    (admission held the request back at least `saturation_backlog_s`), or the option's decode
    batch is at least `pressed_occupancy` of its limit once the request joins, or its prefill
    waits behind `saturation_backlog_s` of other prompts."""
    if request.admission_wait_s >= config.saturation_backlog_s:
        return f"admission held it {request.admission_wait_s:.1f} s"
    decode = option.decode
    if decode.batch_share >= config.pressed_occupancy:
        return f"its decode batch would be {decode.decodes}/{decode.worker.speed.max_running}"
    if option.prefill.backlog_s >= config.saturation_backlog_s:
        return f"{option.prefill.backlog_s:.1f} s of prompts queued ahead of its prefill"
    return None


def room_in(options: list[Option]) -> float:
    """When the fleet is predicted to have room for the request: the least, over its options,
    of the wait for the prompts queued ahead of its prefill and for KV room on its decode
    worker (its own prefill and load are not waiting), within `RETRY_AFTER_BOUNDS_S`."""
    low, high = RETRY_AFTER_BOUNDS_S
    wait = min(max(queued_wait_s(o), o.decode.kv_ready_s) for o in options)
    return min(high, max(low, wait))


def queued_wait_s(option: Option) -> float:
    """The part of the option's TTFT spent waiting behind other work: all but its own prefill
    and the load of what its worker lacks."""
    return max(0.0, option.ttft_s - (option.prefill.prefill_gpu_s + option.prefill.cold_s))


def overloaded(config: RouterConfig, request: RouteRequest, options: list[Option]) -> bool:
    """A new workflow (its first step) would decode slower than `new_task_max_tpot_s` a token."""
    if config.new_task_max_tpot_s is None or (request.workflow_step or 1) > 1:
        return False
    if not request.in_workflow:
        return False
    return min(o.tpot_s for o in options) > config.new_task_max_tpot_s


def dearest(
    state: RouterState, request: RouteRequest, options: list[Option], refused: NoPlacement | None
) -> NoPlacement | None:
    """A new task's first step: `refused` (`refuse`'s answer), or a refusal of a task dearer
    than the typical one against its chance, once the fleet is past keeping up. On an
    overloaded fleet, whose spend is fixed, cost per successful task falls when its GPU time
    goes to the tasks that take the least of it.

    A step takes from the fleet its best option's marginal cost (GPU time at the workers'
    utilisation, KV held), and at least its charged cost times how full the decode batch it
    joins is (a batch at its limit is saturated however much KV and prefill it has to spare:
    each new sequence takes a slot other work would take). A typical new task costs
    `NewTasks.price_usd` (steps x the best option's charged cost, a decaying average). Refused
    when steps x taken > `dearest_task_factor` x its class's `dearest_priority_factor` x
    typical x the task's chance of success, while the fleet is past keeping up: more than
    `dearest_gate` of recent first steps refused for their cost (as not worth it, or by this
    rule), or the best option's decode batch full."""
    config = state.config
    if config.dearest_task_factor is None:
        return refused
    steps = max(1, request.workflow_steps or 1)
    best = min(options, key=lambda o: o.score)
    seen = state._new_tasks
    price = steps * best.cost_usd
    if seen.price_usd is None:
        seen.price_usd = price
    else:
        seen.price_usd += NEW_TASK_WEIGHT * (price - seen.price_usd)
    worthless = refused is not None and refused.reason == "saturated"
    seen.refused += NEW_TASK_WEIGHT * (worthless - seen.refused)
    decode = best.decode
    limit_running = decode.worker.speed.max_running
    full = decode.decodes > limit_running  # the batch once it joins: over the limit, it waits
    if refused is not None or (seen.refused <= config.dearest_gate and not full):
        return refused
    occupancy = min(1.0, decode.batch_share)
    taken = steps * max(best.marginal_usd, occupancy * best.cost_usd)
    chance = max(o.probability for o in options) ** steps
    factor = config.dearest_task_factor
    if not config.admission_controls_load and config.dearest_task_factor_alone is not None:
        factor = config.dearest_task_factor_alone
    bar = factor * config.dearest_priority_factor.get(request.priority, 1.0)
    limit = bar * seen.price_usd * chance
    if taken <= limit:
        return None
    # Refused for its cost: it counts toward the share that keeps the rule armed, as a refusal
    # as not worth its cost does. Else the rule's own refusals, by easing the load, stop those
    # refusals and disarm it while the overload lasts.
    seen.refused += NEW_TASK_WEIGHT
    return NoPlacement(
        "saturated",
        f"the fleet is past keeping up ({seen.refused:.1%} of recent new tasks refused for "
        f"their cost; decode batch {decode.decodes - 1}/{limit_running}) and this task is among "
        f"the dearest: its {steps} step(s) would take ${taken:.6f} of the fleet's time, against "
        f"${limit:.6f} for a typical task at its chance ({chance:.3f}), x {bar:g} for its class",
        room_in(options),
    )
