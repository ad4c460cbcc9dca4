"""Warm starts: `up`'s children are forks of a parent that imported the services already
(ripplemesh/spawner.py). They must behave as the exec'd processes they replace: their own
environment and log file, Popen's exit codes, and no child outliving its launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ripplemesh.spawner import start_warm, warm_starts_enabled
from services.mesh.embedded_nats import free_port

RUN_ROUTER = [sys.executable, "-m", "ripplemesh", "run", "router"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    return env | extra


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_warm_child_runs_with_the_environment_and_log_it_was_given(tmp_path: Path) -> None:
    log = tmp_path / "router.log"
    # No NATS_URL in its environment (the test's own must not leak in): click says so, exit 2.
    child = start_warm(RUN_ROUTER, _env(), log)
    assert child.wait(30) == 2
    assert "Missing option '--nats-url'" in log.read_text()

    # With one (a port nothing listens on), it gets past its options and keeps trying to
    # connect until killed; a kill -9 reads as Popen's -9.
    log.write_text("")
    closed = f"nats://127.0.0.1:{free_port()}"
    child = start_warm([*RUN_ROUTER, "--data-dir", str(tmp_path / "data")], _env(NATS_URL=closed), log)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(1.0)
    assert child.poll() is None and "Missing option" not in log.read_text()
    assert os.getpgid(child.pid) == child.pid  # a process group of its own: Ctrl-C is not its
    # In ps and top, named as the command it runs.
    cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert "-m ripplemesh run router --data-dir" in cmdline
    child.send_signal(signal.SIGKILL)
    assert child.wait(10) == -signal.SIGKILL and child.returncode == -signal.SIGKILL


def test_a_warm_child_ends_when_its_launcher_is_killed(tmp_path: Path) -> None:
    """A launcher killed -9 cannot stop its children: they end with their fork server, which
    ends with the launcher (as an exec'd child ends on its parent's death)."""
    launcher = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from ripplemesh.spawner import start_warm
        child = start_warm([*{RUN_ROUTER!r}, "--data-dir", {str(tmp_path / "data")!r}],
                           {{"NATS_URL": "nats://127.0.0.1:{free_port()}", "PATH": "/usr/bin"}},
                           Path({str(tmp_path / "router.log")!r}))
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        pid = int(process.stdout.readline())
        time.sleep(0.5)
        os.kill(pid, 0)  # running
        process.kill()
        process.wait(10)
        assert _wait_gone(pid, 15), f"the warm child {pid} outlived its launcher"
    finally:
        process.kill()
        process.wait(10)


def test_which_children_start_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = [*RUN_ROUTER, "--engine", "sim"]
    assert warm_starts_enabled(RUN_ROUTER) and warm_starts_enabled(sim)
    # GPU engines' workers are exec'd (vLLM starts processes of its own), as is what is not a
    # `python -m ripplemesh` command.
    assert not warm_starts_enabled([*RUN_ROUTER[:4], "decode", "--engine", "vllm"])
    assert not warm_starts_enabled([*RUN_ROUTER[:4], "decode", "--engine", "hf"])
    assert not warm_starts_enabled([sys.executable, "-c", "pass"])
    monkeypatch.setenv("RIPPLEMESH_SPAWN", "exec")
    assert not warm_starts_enabled(sim)
