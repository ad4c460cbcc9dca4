"""When `ripplemesh up` restarts a service that exited on its own, and when it gives up. Pure:
the clock is passed in; the launcher (launcher.py) does the restarting.

A child that exits unexpectedly is restarted after a backoff that doubles with each exit in a
row (0.5 s, 1 s, 2 s, ... up to `backoff_max_s`); one that then runs `stable_after_s` counts as
recovered, and its next exit starts from the shortest backoff again. More than `max_restarts`
exits within `window_s` is a crash loop: the child is given up on (reported, left stopped) and
the rest of the mesh keeps running.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 300.0
    stable_after_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Restart:
    at: float  # when to start it again
    exits_in_a_row: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


@dataclass(slots=True)
class ChildHistory:
    exits: list[float] = field(default_factory=list)  # within the window
    in_a_row: int = 0  # exits since it last ran stably


def on_exit(policy: RestartPolicy, history: ChildHistory, now: float, ran_for_s: float) -> Restart | GiveUp:
    """A child exited at `now` after running `ran_for_s`: when to restart it, or to give up."""
    history.exits = [t for t in history.exits if now - t <= policy.window_s]
    history.exits.append(now)
    history.in_a_row = 1 if ran_for_s >= policy.stable_after_s else history.in_a_row + 1
    if len(history.exits) > policy.max_restarts:
        return GiveUp(
            f"exited {len(history.exits)} times within {policy.window_s:g} s "
            f"(more than {policy.max_restarts} restarts): a crash loop"
        )
    delay = min(policy.backoff_max_s, policy.backoff_s * 2 ** (history.in_a_row - 1))
    return Restart(at=now + delay, exits_in_a_row=history.in_a_row)
