"""RouterState's index of live workers per model (`RouterState.live`, `live_workers`): the same
workers, in the same order, as filtering every worker the router knows."""

from __future__ import annotations

import random

from services.router.policy import LIVENESS_S, RouterState, WorkerView, live_workers


def _view(worker_id: str, model: str, role: str, at: float, draining: bool = False) -> WorkerView:
    return WorkerView(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        model=model,
        block_size=16,
        queue_depth=0,
        running=0,
        kv_blocks_total=100,
        kv_blocks_used=0,
        heartbeat_at=at,
        draining=draining,
    )


def _scan(state: RouterState, model: str, now: float) -> list[WorkerView]:
    return [
        w
        for w in state.workers.values()
        if w.model == model and not w.draining and now - w.heartbeat_at <= LIVENESS_S
    ]


def test_the_index_matches_a_scan_of_every_worker() -> None:
    rng = random.Random(4)
    state = RouterState()
    now = 0.0
    for _ in range(3000):
        now += rng.choice((0.0, 0.0, 0.1, 0.7, 2.0))
        action = rng.random()
        worker_id = f"w{rng.randrange(12)}"
        if action < 0.55:
            at = now - rng.choice((0.0, 0.0, 1.0, 4.0))
            state.observe(
                _view(
                    worker_id,
                    rng.choice(("a", "a", "b")),
                    rng.choice(("decode", "prefill")),
                    at,
                    rng.random() < 0.1,
                )
            )
        elif action < 0.62:
            state.forget(worker_id)
        for model in ("a", "b", "c"):
            expected = _scan(state, model, now)
            assert live_workers(state, model, now) == expected
            live, decoders, prefillers = state.live(model, now)
            assert live == expected
            assert decoders == [w for w in expected if w.role == "decode"]
            assert prefillers == [w for w in expected if w.role == "prefill"]


def test_a_silent_worker_leaves_the_live_list_when_its_heartbeat_ages() -> None:
    state = RouterState()
    state.observe(_view("old", "m", "decode", 0.0))
    state.observe(_view("new", "m", "decode", 2.0))
    assert [w.worker_id for w in live_workers(state, "m", 2.0)] == ["old", "new"]
    assert [w.worker_id for w in live_workers(state, "m", LIVENESS_S + 0.5)] == ["new"]
    # An earlier clock (another replica's) sees it live again.
    assert [w.worker_id for w in live_workers(state, "m", 1.0)] == ["old", "new"]
