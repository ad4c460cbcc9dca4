"""When `up` restarts a service that exited, and when it gives up (ripplemesh/supervision.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from ripplemesh.launcher import Child, Mesh
from ripplemesh.supervision import ChildHistory, GiveUp, Restart, RestartPolicy, on_exit
from services.mesh.embedded_nats import free_port


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
    assert delays == [0.1, 0.5, 1.0, 2.0, 4.0]  # at once, then doubling, capped
    # Killed after running a while: back at once again, however often it happens.
    for _ in range(20):
        now += 30.0
        decision = on_exit(policy, history, now, ran_for_s=30.0)
        assert isinstance(decision, Restart) and decision.at - now == pytest.approx(0.1)


def test_a_crash_loop_is_given_up_on() -> None:
    policy = RestartPolicy(max_restarts=3)
    history = ChildHistory()
    for t in (0.0, 1.0, 2.0):
        assert isinstance(on_exit(policy, history, t, ran_for_s=0.5), Restart)
    gave_up = on_exit(policy, history, 3.0, ran_for_s=0.5)
    assert isinstance(gave_up, GiveUp) and "4 times in a row" in gave_up.reason


def test_the_launcher_restarts_a_child_that_exits_and_gives_up_on_a_crash_loop(tmp_path: Path) -> None:
    """Real processes through `Mesh.tend`: one that keeps failing at start is restarted with
    backoff, then given up on, and the status and metrics files say so; one that runs is left be."""
    mesh = Mesh(data_dir=tmp_path, restart_policy=RestartPolicy(backoff_s=0.05, max_restarts=2))
    failing = Child(
        "failing", [sys.executable, "-c", "raise SystemExit(3)"], free_port(), tmp_path / "failing.log"
    )
    steady = Child(
        "steady", [sys.executable, "-c", "import time; time.sleep(60)"], free_port(), tmp_path / "steady.log"
    )
    mesh.children = [failing, steady]
    for child in mesh.children:
        mesh._spawn(child)
    said: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while failing.state != "gave_up" and time.monotonic() < deadline:
            said += mesh.tend()
            time.sleep(0.02)
        assert failing.state == "gave_up" and failing.restarts == 2 and failing.last_returncode == 3
        assert any("failing exited (3); given up on" in line and "a crash loop" in line for line in said)
        assert steady.state == "running" and steady.process is not None and steady.process.poll() is None
        status = json.loads((tmp_path / "supervisor.json").read_text())["children"]
        assert status["failing"]["state"] == "gave_up" and status["steady"]["restarts"] == 0
        metrics = (tmp_path / "supervisor.prom").read_text()
        assert 'ripplemesh_up_restarts{child="failing"} 2.0' in metrics
        assert 'ripplemesh_up_given_up{child="failing"} 1.0' in metrics
    finally:
        mesh.stop()


def test_a_recovery_counts_to_the_moment_the_service_said_it_was_ready_not_when_it_was_seen() -> None:
    from ripplemesh.launcher import _back_after

    exited = time.monotonic() - 5.0
    # Ready 3 s ago by its own clock: back 2 s after the exit, though seen only now.
    assert abs(_back_after(exited, {"ready_at": time.time() - 3.0}) - 2.0) < 0.1
    # A service that does not say (a NATS node's /healthz): when it was seen.
    assert abs(_back_after(exited, {}) - 5.0) < 0.1
    # A ready_at before the exit (a clock step) never makes a recovery negative.
    assert _back_after(exited, {"ready_at": time.time() - 60.0}) == 0.0
