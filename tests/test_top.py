"""`ripplemesh top` as a user runs it: one frame of a real `ripplemesh up` with the official
openai client's requests on it, a live view that Ctrl-C ends, a NATS that is not there; and the
frame's rendering from a hand-built snapshot."""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import nats
import openai
import pytest
from rich.console import Console

from ripplemesh.top import (
    LedgerFigures,
    RecentEvents,
    TopSnapshot,
    build_snapshot,
    render,
)
from schemas.events import (
    ModelOutlook,
    PoolPlan,
    PrefillCompleted,
    RequestRejected,
    ScalingDecision,
    WorkerRole,
    WorkerState,
)
from schemas.subjects import WORKERS
from services.mesh.bus import kv_keys
from services.mesh.embedded_nats import free_port
from services.mesh.nats_auth import load_credentials
from tests.test_up import _user_env, running_up

NOW = 1_700_000_000.0


def _text(snapshot: TopSnapshot, now: float = NOW) -> str:
    console = Console(file=io.StringIO(), width=220, color_system=None)
    console.print(render(snapshot, now))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def _row(text: str, worker_id: str) -> list[str]:
    """The cells of a worker's row in the workers table."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0] == worker_id:
            return cells
    raise AssertionError(f"no row for {worker_id} in:\n{text}")


def _pool(text: str, pool: str) -> list[str] | None:
    """The cells of a pool's row in the pools table (None: no row for it)."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0] == pool:
            return cells
    return None


def _state(worker_id: str, pool: str, *, age_s: float, draining: bool = False, **kw: int) -> WorkerState:
    role: WorkerRole = "prefill" if pool.startswith("prefill") else "decode"
    return WorkerState(
        event_id=f"{worker_id}-1",
        occurred_at=NOW - age_s,
        worker_id=worker_id,
        role=role,
        pool=pool,
        model="llama-3-8b",
        engine="sim",
        gpu_type="H100",
        price_per_hour=3.0,
        block_size=16,
        kv_blocks_total=kw.get("total", 1000),
        kv_blocks_used=kw.get("used", 250),
        kv_blocks_cached=kw.get("cached", 40),
        queue_depth=kw.get("queue", 3),
        running=kw.get("running", 7),
        tokens_per_s=512.0,
        started_at=NOW - 100,
        draining=draining,
    )


def _plan(pool: str, desired: int) -> PoolPlan:
    return PoolPlan(
        pool=pool,
        model="llama-3-8b",
        role="decode",
        gpu_type="H100",
        serving=2,
        warming=0,
        draining=1,
        desired=desired,
        utilisation=0.5,
        cost_per_hour=6.0,
        reason=f"steady at {desired}",
    )


def test_render_shows_stale_and_draining_workers_pools_rejections_and_cost() -> None:
    recent = RecentEvents(window_s=60.0)
    for i, reason in enumerate(["quota", "quota", "capacity"]):
        recent.add(
            RequestRejected(
                event_id=f"rej-{i}",
                occurred_at=NOW - 5,
                request_id=f"r{i}",
                tenant="demo",
                stage="admission",
                reason=reason,  # type: ignore[arg-type]
                message="no",
            )
        )
    # Outside the window, and a duplicate: neither counts.
    old = RequestRejected(
        event_id="rej-old",
        occurred_at=NOW - 120,
        request_id="old",
        tenant="demo",
        stage="router",
        reason="no_workers",
        message="no",
    )
    recent.add(old)
    recent.add(
        PrefillCompleted(
            event_id="pf-1",
            occurred_at=NOW - 2,
            request_id="r9",
            tenant="demo",
            worker_id="decode-a",
            gpu_type="H100",
            gpu_seconds=0.1,
            prompt_tokens=400,
            cached_tokens=300,
            ttft_s=0.05,
        )
    )
    recent.prune(NOW)
    scaling = ScalingDecision(
        event_id="plan-1",
        occurred_at=NOW - 4,
        mode="act",
        trigger="interval",
        pools=[_plan("decode-H100", 3)],
        models=[
            ModelOutlook(
                model="llama-3-8b",
                observed_rate=1.0,
                forecast_rate=1.0,
                horizon_s=60.0,
                mean_prompt=400.0,
                mean_output=50.0,
                hit_rate=0.75,
                prefill_load=100.0,
                decode_load=50.0,
            )
        ],
        cost_per_hour=9.0,
    )
    snapshot = build_snapshot(
        [
            _state("decode-a", "decode-H100", age_s=0.4),
            _state("decode-b", "decode-H100", age_s=8.5),
            _state("decode-c", "decode-H100", age_s=0.7, draining=True, running=1, queue=0),
        ],
        now=NOW,
        recent=recent,
        scaling=scaling,
        cost=LedgerFigures(
            window="1h",
            cost_per_successful_task_usd=0.0123,
            spend_usd=1.5,
            idle_spend_usd=0.25,
            wasted_spend_usd=0.05,
            succeeded=120,
            failed=2,
            running=3,
        ),
        source="nats://test:4222",
    )
    text = _text(snapshot)

    fresh = _row(text, "decode-a")
    assert fresh[1:4] == ["decode-H100", "llama-3-8b", "serving"]
    assert fresh[4:8] == ["7", "3", "250/1000 25%", "40"]
    assert fresh[8] == "75% of 1"  # 300 of its 400 prompt tokens were cached
    assert fresh[10] == "0.4 s ago"

    stale = _row(text, "decode-b")
    assert stale[3] == "stale" and stale[10] == "8.5 s ago (stale)"
    assert stale[8] == "-"  # no prefill in the window

    draining = _row(text, "decode-c")
    assert draining[3] == "draining" and draining[4:6] == ["1", "0"]

    # The pool: 3 wanted by the plan, 1 serving (one draining, one stale).
    assert _pool(text, "decode-H100") == [
        "decode-H100",
        "llama-3-8b",
        "decode",
        "3",
        "1",
        "1",
        "1",
        "steady at 3",
    ]
    assert "autoscaler plan 4 s ago, act mode, $9.00/h planned" in text

    assert "Rejected in the last 1 min: 3 (quota 2, capacity 1)" in text
    assert "Cost per successful task (ledger, last 1h): $0.0123; tasks 120 succeeded, 2 failed" in text
    assert "spend $1.50 (idle $0.25, wasted $0.05)" in text


def test_render_without_plan_ledger_or_workers_says_so() -> None:
    snapshot = build_snapshot([], now=NOW, cost_note="no ledger address: pass --ledger-url")
    text = _text(snapshot)
    assert "no worker heart-beats in the WORKERS bucket" in text
    assert "Pools (no autoscaler plan on the bus yet)" in text
    assert "Rejected in the last 5 min: 0 (none)" in text
    assert "Cost per successful task: unknown (no ledger address: pass --ledger-url)" in text


def test_recent_events_forget_what_leaves_the_window_and_count_duplicates_once() -> None:
    recent = RecentEvents(window_s=10.0)
    rejected = RequestRejected(
        event_id="e1",
        occurred_at=NOW,
        request_id="r",
        tenant="demo",
        stage="admission",
        reason="deadline",
        message="late",
    )
    recent.add(rejected)
    recent.add(rejected)
    assert recent.rejections(NOW) == {"deadline": 1}
    recent.prune(NOW + 11)
    assert recent.rejections(NOW + 11) == {}
    recent.add(rejected)  # forgotten, so no longer a duplicate; still outside the window
    assert recent.rejections(NOW + 11) == {}


def test_cost_figures_read_from_the_ledger_report() -> None:
    report = {
        "fleet": {
            "cost_per_successful_task_usd": None,
            "spend_usd": 0.5,
            "idle_spend_usd": 0.5,
            "wasted_spend_usd": 0.0,
            "tasks": {"succeeded": 0, "failed": 0, "running": 1, "total": 1},
        }
    }
    figures = LedgerFigures.from_report(report)
    assert figures.cost_per_successful_task_usd is None and figures.running == 1
    text = _text(build_snapshot([], now=NOW, cost=figures))
    assert "Cost per successful task (ledger, last 1h): - (no task has succeeded yet)" in text


def _top(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ripplemesh", "top", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**_user_env(), "COLUMNS": "220"},
    )


def test_a_nats_where_nothing_listens_is_a_one_line_error(tmp_path: Path) -> None:
    started = time.monotonic()
    result = _top("--once", "--nats-url", f"nats://127.0.0.1:{free_port()}", "--data-dir", str(tmp_path))
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    assert re.search(
        r"Error: cannot reach NATS at nats://127\.0\.0\.1:\d+: connection refused", result.stderr
    ), result.stderr
    assert elapsed < 10, elapsed


async def _workers(data_dir: Path, servers: str) -> list[WorkerState]:
    creds = load_credentials(data_dir / "credentials" / "services.json")
    nc = await nats.connect(servers.split(","), **creds.connect_options())
    try:
        js = nc.jetstream()
        kv = await js.key_value(WORKERS.bucket)
        states = []
        for key in await kv_keys(js, WORKERS.bucket):
            entry = await kv.get(key)
            assert entry.value
            states.append(msgspec.json.decode(entry.value, type=WorkerState))
        return states
    finally:
        await nc.close()


@pytest.mark.timeout(200)
def test_top_once_shows_each_worker_its_pool_figures_rejections_and_cost(tmp_path: Path) -> None:
    with running_up(tmp_path, "--time-scale", "0.05") as up:
        client = up.client()
        prompt = "tell me about the sea " * 40
        for i in range(3):
            reply = client.chat.completions.create(
                model="llama-3-8b",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=8 + i,
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 8 + i
        with pytest.raises(openai.APIStatusError) as rejected:
            client.chat.completions.create(
                model="llama-3-8b",
                messages=[{"role": "user", "content": "too late"}],
                max_tokens=8,
                extra_headers={"x-ripple-deadline-ms": "1"},
            )
        assert rejected.value.status_code == 503
        workers = asyncio.run(_workers(up.data_dir, up.ready_line.split()[2]))
        assert {w.pool for w in workers} == {"prefill-H100", "decode-H100"}

        # The ledger records within a second or so and the autoscaler plans every 5 s: look
        # again until both are on the frame, as a user would.
        deadline, text = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            result = _top("--once", "--data-dir", str(up.data_dir))
            assert result.returncode == 0, result.stderr
            text = result.stdout
            succeeded = re.search(r"tasks (\d+) succeeded", text)
            planned = all((_pool(text, p) or ["-"] * 4)[3] != "-" for p in ("prefill-H100", "decode-H100"))
            if succeeded and int(succeeded.group(1)) >= 3 and planned:
                break
            time.sleep(1)
        else:
            raise AssertionError(text)

        for worker in workers:
            cells = _row(text, worker.worker_id)
            assert cells[1] == worker.pool and cells[2] == "llama-3-8b" and cells[3] == "serving"
            assert cells[4].isdigit() and cells[5].isdigit()  # running, queue
            assert re.fullmatch(rf"\d+/{worker.kv_blocks_total} \d+%", cells[6]), cells
            assert cells[7].isdigit()  # cached blocks
            age = re.fullmatch(r"(\d+\.\d) s ago", cells[10])
            assert age and float(age.group(1)) < 3, cells
        # The three requests share a prompt: whoever prefilled them found most of it cached.
        hits = [c[8] for c in (_row(text, w.worker_id) for w in workers) if c[8] != "-"]
        assert hits and all(re.fullmatch(r"\d+% of \d+", h) for h in hits)
        assert max(int(h.split("%")[0]) for h in hits) >= 50
        for pool in ("prefill-H100", "decode-H100"):
            cells = _pool(text, pool) or []
            assert cells[2:5] == [pool.split("-")[0], "1", "1"], text  # role, desired, actual
        assert re.search(r"Rejected in the last 5 min: \d+ \(.*deadline 1", text), text
        assert re.search(r"Cost per successful task \(ledger, last 1h\): \$\d", text), text

        # The live view: frames until Ctrl-C, which ends it cleanly.
        live = subprocess.Popen(
            [sys.executable, "-m", "ripplemesh", "top", "--interval", "0.2", "--data-dir", str(up.data_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**_user_env(), "COLUMNS": "220"},
        )
        time.sleep(3)
        os.kill(live.pid, signal.SIGINT)
        out, err = live.communicate(timeout=15)
        assert live.returncode == 0, err
        assert "Traceback" not in err
        assert all(w.worker_id in out for w in workers) and "Cost per successful task" in out
