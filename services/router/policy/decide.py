"""The router's decision, from the pieces that decide each part of it: the options for a
request (`options_for`: `choose.score_options`, reused between admission's question and the
placement), whether to refuse it (refuse.py), the best of them (`choose.best_option`), and the
placement counted in the router state (`place`). Admission's question, the earliest first token
over the live placements (`earliest_first_token`), reads the same options. The clock is passed
in; nothing here does I/O."""

from __future__ import annotations

from services.router.policy.choose import best_option, load, score_options
from services.router.policy.predict import Option
from services.router.policy.prefix import PrefixView, prefix_matches
from services.router.policy.refuse import block_size_mismatch, dearest, queued_wait_s, refuse
from services.router.policy.state import RouterState
from services.router.policy.types import FirstToken, NoPlacement, Placement, RouteRequest


def options_for(
    state: RouterState, request: RouteRequest, prefix: PrefixView, now: float
) -> tuple[list[Option], int] | NoPlacement:
    """The request's options and how many workers were weighed (`choose.score_options`), or why
    there are none; the last answer is reused when nothing it read has changed (admission asks
    for the earliest first token, then the router places the request at the same instant)."""
    mismatch = block_size_mismatch(state, request.model, request.block_size, now)
    if mismatch is not None:
        return mismatch
    matched = prefix_matches(prefix, request.block_hashes)
    last = state._last_options
    if (
        last is not None
        # The view's own answer, kept alive here (not a new one at its address); two empty
        # answers are the same answer (a view without prefix sharing gives a new {} each time).
        and (last[0] is matched or not (last[0] or matched))
        and last[1] == now
        and last[2] == state._version
        and last[3] is state.config
        and last[5] is prefix
        and last[4] == request
    ):
        return last[6]  # type: ignore[return-value]
    scored = score_options(state, request, matched, now)
    state._last_options = (matched, now, state._version, state.config, request, prefix, scored)
    return scored


def place(
    state: RouterState, request: RouteRequest, prefix: PrefixView, now: float
) -> Placement | NoPlacement:
    """Choose where the request's prefill and decode run, and count the placement in `state`."""
    scored = options_for(state, request, prefix, now)
    if isinstance(scored, NoPlacement):
        return scored
    options, considered = scored
    if request.deadline_at is not None:
        refused = refuse(state.config, request, options, now)
        if (request.workflow_step or 1) == 1:
            refused = dearest(state, request, options, refused)
        if refused is not None:
            return refused
    best = best_option(options, request.request_id)
    prefill, decode = best.prefill, best.decode
    block = request.block_size
    blocks = -(-(request.prompt_tokens + request.max_tokens) // block)
    state.count(prefill.worker.worker_id, request.prompt_tokens - prefill.cached_tokens, blocks, now)
    worth = state.config.latency_worth_usd_per_s.get(request.priority, 0.0)
    if decode.worker is not prefill.worker:
        state.count(decode.worker.worker_id, 0, blocks, now)
        state.add_inflight(prefill.worker.worker_id, now + best.ttft_s, worth)
    state.add_inflight(decode.worker.worker_id, now + best.completion_s, worth)
    sunk = request.workflow_spent_usd
    others = sorted((o for o in options if o is not best), key=lambda o: o.score)[:3]
    return Placement(
        mode=best.mode,
        prefill_worker=prefill.worker.worker_id,
        decode_worker=decode.worker.worker_id,
        candidates=considered,
        decode_load=load(decode.worker, state),
        predicted_cached_tokens=prefill.cached_tokens,
        indexed_cached_tokens=prefill.indexed_tokens,
        predicted_ttft_s=best.ttft_s,
        predicted_cost_usd=best.cost_usd,
        success_probability=best.probability,
        expected_cost_per_success_usd=best.scored(sunk).expected_cost_per_success_usd,
        runners_up=tuple(o.scored(sunk) for o in others),
        policy="ripplemesh",
        predicted_completion_s=best.completion_s,
        score=best.score,
    )


def earliest_first_token(
    state: RouterState, request: RouteRequest, prefix: PrefixView, now: float
) -> FirstToken | None:
    """The lowest predicted time to first token over the live placements, and its wait (None: no
    live decode worker for the model, or a block-size mismatch). Changes nothing in `state`;
    admission uses it to tell a deadline no placement can meet, and the wait for how loaded the
    fleet is (a long prompt's own prefill on an idle worker is not load)."""
    scored = options_for(state, request, prefix, now)
    if isinstance(scored, NoPlacement):
        return None
    best = min(scored[0], key=lambda o: o.ttft_s)
    return FirstToken(best.ttft_s, queued_wait_s(best))


def earliest_ttft(state: RouterState, request: RouteRequest, prefix: PrefixView, now: float) -> float | None:
    """`earliest_first_token`'s time to first token."""
    first = earliest_first_token(state, request, prefix, now)
    return first.ttft_s if first is not None else None
