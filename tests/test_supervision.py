"""When `up` restarts a service that exited, and when it gives up (ripplemesh/supervision.py)."""

from __future__ import annotations

from ripplemesh.supervision import ChildHistory, GiveUp, Restart, RestartPolicy, on_exit


def test_restarts_back_off_doubling_while_it_fails_at_start_and_start_over_once_it_ran() -> None:
    policy = RestartPolicy(backoff_s=0.5, backoff_max_s=4.0, max_restarts=10, stable_after_s=10.0)
    history = ChildHistory()
    delays = []
    now = 0.0
    for _ in range(5):
        decision = on_exit(policy, history, now, ran_for_s=1.0)
        assert isinstance(decision, Restart)
        delays.append(decision.at - now)
        now = decision.at + 1.0
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0]  # doubling, capped
    # Killed after running a while: the shortest backoff again, however often it happens.
    for _ in range(20):
        now += 30.0
        decision = on_exit(policy, history, now, ran_for_s=30.0)
        assert isinstance(decision, Restart) and decision.at - now == 0.5


def test_a_crash_loop_is_given_up_on() -> None:
    policy = RestartPolicy(max_restarts=3)
    history = ChildHistory()
    for t in (0.0, 1.0, 2.0):
        assert isinstance(on_exit(policy, history, t, ran_for_s=0.5), Restart)
    gave_up = on_exit(policy, history, 3.0, ran_for_s=0.5)
    assert isinstance(gave_up, GiveUp) and "4 times in a row" in gave_up.reason
