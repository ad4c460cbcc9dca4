"""When `ripplemesh up` restarts a service that exited on its own, and when it gives up. Pure:
the clock is passed in; the launcher (launcher.py) does the restarting.

A child that exits is restarted after a backoff that doubles with each exit in a row (0.5 s,
1 s, 2 s, ... up to `backoff_max_s`), an exit counting "in a row" when the child had run less
than `stable_after_s` since its start: it failed while starting or soon after. One that ran
longer (a service killed, or crashed, in the middle of its work) is restarted after the
shortest backoff again. More than `max_restarts` exits in a row is a crash loop: the child is
given up on (reported, left stopped) and the rest of the mesh keeps running.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    # A child that exits after running stably comes back at once, as systemd's RestartSec
    # (100 ms) does: its work waits meanwhile. Only exits in a row back off, doubling.
    first_restart_s: float = 0.1
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    max_restarts: int = 5
    # A service here is healthy within 1-3 s of its start; 10 s up is well past any start-up.
    stable_after_s: float = 10.0


@dataclass(frozen=True, slots=True)
class Restart:
    at: float  # when to start it again
    exits_in_a_row: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


@dataclass(slots=True)
class ChildHistory:
    in_a_row: int = 0  # exits since it last ran stably


def on_exit(policy: RestartPolicy, history: ChildHistory, now: float, ran_for_s: float) -> Restart | GiveUp:
    """A child exited at `now` after running `ran_for_s`: when to restart it, or to give up."""
    history.in_a_row = 1 if ran_for_s >= policy.stable_after_s else history.in_a_row + 1
    if history.in_a_row > policy.max_restarts:
        return GiveUp(
            f"exited {history.in_a_row} times in a row within {policy.stable_after_s:g} s of its "
            f"start (more than {policy.max_restarts} restarts): a crash loop"
        )
    if history.in_a_row == 1:
        delay = policy.first_restart_s
    else:
        delay = min(policy.backoff_max_s, policy.backoff_s * 2 ** (history.in_a_row - 2))
    return Restart(at=now + delay, exits_in_a_row=history.in_a_row)
