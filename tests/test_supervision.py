"""When `up` restarts a service that exited, and when it gives up (ripplemesh/supervision.py)."""

from __future__ import annotations

from ripplemesh.supervision import ChildHistory, GiveUp, Restart, RestartPolicy, on_exit


def test_restarts_back_off_doubling_and_start_over_once_it_ran_stably() -> None:
    policy = RestartPolicy(backoff_s=0.5, backoff_max_s=4.0, max_restarts=10, window_s=1000.0)
    history = ChildHistory()
    delays = []
    now = 0.0
    for _ in range(5):
        decision = on_exit(policy, history, now, ran_for_s=1.0)
        assert isinstance(decision, Restart)
        delays.append(decision.at - now)
        now = decision.at + 1.0
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0]  # doubling, capped
    # Up for longer than stable_after_s: its next exit is a first exit again.
    decision = on_exit(policy, history, now + 100, ran_for_s=policy.stable_after_s)
    assert isinstance(decision, Restart) and decision.at - (now + 100) == 0.5


def test_a_crash_loop_is_given_up_on_and_old_exits_age_out() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=60.0)
    history = ChildHistory()
    for t in (0.0, 1.0, 2.0):
        assert isinstance(on_exit(policy, history, t, ran_for_s=0.5), Restart)
    gave_up = on_exit(policy, history, 3.0, ran_for_s=0.5)
    assert isinstance(gave_up, GiveUp) and "4 times within 60 s" in gave_up.reason
    # The same exits spread over more than the window are no loop.
    spread = ChildHistory()
    assert all(isinstance(on_exit(policy, spread, t, ran_for_s=30.0), Restart) for t in (0, 40, 80, 120, 160))
