"""`ripplemesh bench restart`: how soon a killed service is back, exec'd against warm starts.

One mesh as `up` runs it (embedded NATS, sim engine), idle. Each round kills (SIGKILL) one
service of each kind and lets `up`'s supervisor (`Mesh.tend`) restart it, alternately as a new
Python process (`RIPPLEMESH_SPAWN=exec`, as before) and as a fork of the launcher's zygote,
which has the services imported already (ripplemesh/spawner.py); the order of the two swaps
each round. The figure is the supervisor's own: from the exit it saw to the moment the service's
/healthz says it became ready. Before that, the mesh's start in each mode, two meshes one after
the other (the warm one's includes the zygote's own imports).
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ripplemesh.launcher import Child, Mesh
from ripplemesh.supervision import RestartPolicy
from services.mesh.embedded_nats import free_port

KINDS = ("decode", "prefill", "router", "admission", "ledger", "ingress", "autoscaler", "batch")
MODES = ("exec", "warm")
# A kill counts as one after stable running (restarted after 0.1 s, no backoff) once the child
# has been up this long; the bench waits that long after each recovery.
STABLE_AFTER_S = 1.0
BACK_TIMEOUT_S = 60.0


def _mesh(data: Path) -> Mesh:
    return Mesh(
        data_dir=data,
        http_port=free_port(),
        prefill=1,
        decode=1,
        time_scale=0.0,
        restart_policy=RestartPolicy(stable_after_s=STABLE_AFTER_S),
    )


def _in_mode(mode: str) -> None:
    os.environ["RIPPLEMESH_SPAWN"] = mode  # read by the launcher at each start


def _kill_and_wait(mesh: Mesh, child: Child) -> float:
    assert child.process is not None
    before = len(child.recoveries_s)
    child.process.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + BACK_TIMEOUT_S
    while len(child.recoveries_s) == before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{child.name} not back within {BACK_TIMEOUT_S:.0f}s; see {child.log_path}")
        mesh.tend()
        time.sleep(0.02)
    return child.recoveries_s[-1]


def run_restart_bench(*, rounds: int, console: Console) -> dict[str, float]:
    earlier = os.environ.get("RIPPLEMESH_SPAWN")
    start_s: dict[str, float] = {}
    back: dict[tuple[str, str], list[float]] = {(kind, mode): [] for kind in KINDS for mode in MODES}
    try:
        with tempfile.TemporaryDirectory(prefix="ripplemesh-bench-restart-") as tmp:
            for mode in MODES:
                _in_mode(mode)
                began = time.monotonic()
                with _mesh(Path(tmp) / f"start-{mode}"):
                    start_s[mode] = time.monotonic() - began
            with _mesh(Path(tmp) / "restarts") as mesh:
                for round_ in range(rounds):
                    console.print(f"[dim]round {round_ + 1} of {rounds}")
                    for kind in KINDS:
                        child = next(c for c in mesh.children if c.name.split("-")[0] == kind)
                        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                            _in_mode(mode)
                            time.sleep(STABLE_AFTER_S)
                            back[(kind, mode)].append(_kill_and_wait(mesh, child))
    finally:
        if earlier is None:
            os.environ.pop("RIPPLEMESH_SPAWN", None)
        else:
            os.environ["RIPPLEMESH_SPAWN"] = earlier
    return _report(start_s, back, rounds, console)


def _report(
    start_s: dict[str, float], back: dict[tuple[str, str], list[float]], rounds: int, console: Console
) -> dict[str, float]:
    table = Table(
        title=f"Kill -9 to ready again, s ({rounds} kills of each kind per mode, idle mesh, one machine)"
    )
    for column in ("service", "exec median", "exec max", "warm median", "warm max", "warm / exec"):
        table.add_column(column, justify="left" if column == "service" else "right")
    rows: dict[str, float] = {}
    for kind in (*KINDS, "all"):
        exec_s = back[(kind, "exec")] if kind != "all" else [s for k in KINDS for s in back[(k, "exec")]]
        warm_s = back[(kind, "warm")] if kind != "all" else [s for k in KINDS for s in back[(k, "warm")]]
        ratio = statistics.median(warm_s) / statistics.median(exec_s)
        table.add_row(
            kind,
            f"{statistics.median(exec_s):.2f}",
            f"{max(exec_s):.2f}",
            f"{statistics.median(warm_s):.2f}",
            f"{max(warm_s):.2f}",
            f"{ratio:.2f}",
        )
        rows[f"{kind}_exec_median_s"] = statistics.median(exec_s)
        rows[f"{kind}_warm_median_s"] = statistics.median(warm_s)
        rows[f"{kind}_warm_max_s"] = max(warm_s)
        rows[f"{kind}_exec_max_s"] = max(exec_s)
    console.print(table)
    console.print(
        f"`up` started (every service healthy): exec {start_s['exec']:.2f} s, warm {start_s['warm']:.2f} s "
        f"(warm / exec {start_s['warm'] / start_s['exec']:.2f})"
    )
    rows |= {"start_exec_s": start_s["exec"], "start_warm_s": start_s["warm"]}
    return rows
