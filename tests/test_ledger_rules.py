"""The ledger's pure rules: task status, idle accounting, windows, KV pricing, `--since`."""

from __future__ import annotations

import pytest

from schemas.events import DecodeCompleted, RequestFailed, RequestRejected, Usage
from services.ledger.figures import Figures, SinceError, parse_since
from services.ledger.fold import fold
from services.ledger.idle import IdleAccount, WorkerSample, account_idle
from services.ledger.pricing import PricingError, price_kv_transfer
from services.ledger.tasks import UNKNOWN_STEP, task_key, task_status

NOW = 1_000_000.0


def status(**facts: object) -> tuple[str, str | None]:
    base: dict[str, object] = {
        "steps": 3,
        "max_completed_step": 0,
        "max_failed_step": 0,
        "final_completed_at": None,
        "deadline_misses": 0,
        "last_event_at": NOW - 10,
        "now": NOW,
        "timeout_s": 600.0,
    }
    base.update(facts)
    return task_status(**base)  # type: ignore[arg-type]


def test_task_status_rules() -> None:
    assert status() == ("running", None)
    assert status(max_completed_step=2) == ("running", None)
    assert status(max_completed_step=3, final_completed_at=NOW - 10) == ("succeeded", None)
    # A deadline missed by any request fails the task, even one whose final step completed.
    assert status(final_completed_at=NOW, deadline_misses=1) == ("failed", "deadline_missed")
    # A failed step fails the task, until the same step (retried) or a later one completes.
    assert status(max_completed_step=1, max_failed_step=2) == ("failed", "step_failed")
    assert status(max_completed_step=2, max_failed_step=2) == ("running", None)
    assert status(max_failed_step=UNKNOWN_STEP, max_completed_step=2) == ("failed", "step_failed")
    assert status(max_failed_step=UNKNOWN_STEP, final_completed_at=NOW) == ("succeeded", None)
    # Quiet past the timeout: abandoned; without a known number of steps, done.
    assert status(last_event_at=NOW - 601, max_completed_step=2) == ("failed", "abandoned")
    assert status(last_event_at=NOW - 600, max_completed_step=2) == ("running", None)
    assert status(last_event_at=NOW - 601, steps=None, max_completed_step=2) == ("succeeded", None)
    assert status(last_event_at=NOW - 601, steps=None) == ("failed", "abandoned")


def test_task_keys() -> None:
    assert task_key("wf-1", "r1") == "wf:wf-1"
    assert task_key(None, "r1") == "rq:r1"
    assert task_key(None, "wf-1") != task_key("wf-1", "x")


def _decode(event_id: str, request_id: str, **extra: object) -> DecodeCompleted:
    fields: dict[str, object] = {
        "event_id": event_id,
        "occurred_at": NOW,
        "request_id": request_id,
        "tenant": "acme",
        "worker_id": "d0",
        "gpu_type": "h100",
        "gpu_seconds": 225.0,
        "kv_transfer_bytes": 0,
        "usage": Usage(prompt_tokens=1, completion_tokens=1),
        "finish_reason": "stop",
        "latency_s": 1.0,
    }
    fields.update(extra)
    return DecodeCompleted(**fields)  # type: ignore[arg-type]


def test_fold_tasks_workers_and_kv() -> None:
    events = [
        _decode("d1", "r1", workflow_id="wf", workflow_step=1, workflow_steps=2, kv_transfer_bytes=3 * 10**9),
        RequestFailed(
            event_id="f2",
            occurred_at=NOW + 5,
            request_id="r2",
            tenant="acme",
            workflow_id="wf",
            stage="prefill",
            message="lost",
        ),
        RequestRejected(
            event_id="j3",
            occurred_at=NOW - 5,
            request_id="r3",
            tenant="beta",
            stage="router",
            reason="no_workers",
            message="none",
        ),
        _decode("d4", "r4", deadline_at=NOW - 1),
    ]
    folded = fold(events, {"h100": 4.0}, kv_usd_per_gb=0.25)
    tasks = {t.task_key: t for t in folded.tasks}
    assert set(tasks) == {"wf:wf", "rq:r3", "rq:r4"}
    wf = tasks["wf:wf"]
    assert (wf.kind, wf.workflow_id, wf.steps, wf.max_completed_step) == ("workflow", "wf", 2, 1)
    assert wf.max_failed_step == UNKNOWN_STEP  # the failure's step is unknown (an older producer)
    assert (wf.gpu_cost_usd, wf.kv_cost_usd, wf.kv_transfer_bytes) == (0.25, 0.75, 3 * 10**9)
    assert (wf.first_event_at, wf.last_event_at, wf.completions, wf.failures) == (NOW, NOW + 5, 1, 1)
    assert (tasks["rq:r3"].max_failed_step, tasks["rq:r3"].steps, tasks["rq:r3"].tenant) == (1, 1, "beta")
    r4 = tasks["rq:r4"]
    assert (r4.final_completed_at, r4.deadline_misses, r4.max_completed_step) == (NOW, 1, 1)
    [busy] = folded.workers
    assert (busy.worker_id, busy.busy_gpu_seconds, busy.busy_cost_usd) == ("d0", 450.0, 0.25 + 0.75 + 0.25)
    rows = {row[0]: row for row in folded.events}
    assert rows["d1"][5:] == ("wf:wf", "d0", "h100", 225.0, 0.25, 3 * 10**9, 0.75)
    assert rows["f2"][5:] == ("wf:wf", None, None, None, None, None, None)
    assert folded.errors == []
    assert [r.kv_cost_usd for r in folded.requests] == [0.75, 0.0, 0.0, 0.0]


def test_kv_pricing() -> None:
    assert price_kv_transfer(2 * 10**9, 0.01) == pytest.approx(0.02)
    assert price_kv_transfer(0, 0.01) == 0.0
    with pytest.raises(PricingError, match="invalid KV transfer size"):
        price_kv_transfer(-1, 0.01)
    with pytest.raises(PricingError, match="invalid KV transfer price"):
        price_kv_transfer(1, float("nan"))


# ---------------------------------------------------------------- idle

PRICES = {"h100": 3.6}  # $0.001 per GPU-second


def sample(worker: str = "w", started_at: float = 0.0, gpu: str = "h100") -> WorkerSample:
    return WorkerSample(worker, "pool-a", gpu, started_at)


def test_idle_carries_busy_time_reported_late() -> None:
    first = account_idle([sample()], {}, 100.0, PRICES, window_s=1000.0, backfill_s=10.0)
    # First sight: covered from at most `backfill_s` back.
    [share] = first.shares
    assert (share.provisioned_gpu_seconds, share.idle_gpu_seconds) == (10.0, 10.0)
    account = first.accounts[0]
    assert (account.covered_until, account.busy_counted_s, account.debt_s) == (100.0, 0.0, 0.0)

    # 30 s of GPU time reported in a 10 s interval: no idle, 20 s of debt...
    state = IdleAccount("w", busy_total_s=30.0, covered_until=100.0, busy_counted_s=0.0, debt_s=0.0)
    second = account_idle([sample()], {"w": state}, 110.0, PRICES, window_s=1000.0)
    assert second.idle_gpu_seconds == 0.0 and second.accounts[0].debt_s == 20.0
    # ...paid back from the next intervals: over both, idle = provisioned - busy.
    state = IdleAccount("w", busy_total_s=30.0, covered_until=110.0, busy_counted_s=30.0, debt_s=20.0)
    third = account_idle([sample()], {"w": state}, 150.0, PRICES, window_s=1000.0)
    assert third.idle_gpu_seconds == 20.0 and third.accounts[0].debt_s == 0.0
    assert third.idle_cost_usd == pytest.approx(0.02)
    assert (10.0 + 40.0) - 30.0 == second.idle_gpu_seconds + third.idle_gpu_seconds


def test_idle_restarted_worker_and_windows() -> None:
    # Restarted at 500 after being covered until 300: the gap is not provisioned time.
    state = IdleAccount("w", busy_total_s=0.0, covered_until=300.0)
    result = account_idle([sample(started_at=500.0)], {"w": state}, 560.0, PRICES, window_s=60.0)
    assert [(s.window_start, s.provisioned_gpu_seconds) for s in result.shares] == [
        (480.0, 40.0),
        (540.0, 20.0),
    ]
    assert sum(s.idle_gpu_seconds for s in result.shares) == pytest.approx(60.0)
    assert result.accounts[0].started_at == 500.0
    # An interval ending exactly on a window's end stays in that window.
    state = IdleAccount("w", busy_total_s=0.0, covered_until=540.0)
    [share] = account_idle([sample()], {"w": state}, 600.0, PRICES, window_s=60.0).shares
    assert (share.window_start, share.provisioned_gpu_seconds) == (540.0, 60.0)


def test_idle_of_an_unpriced_gpu_is_an_error() -> None:
    state = IdleAccount("w", busy_total_s=0.0, covered_until=0.0)
    result = account_idle([sample(gpu="tpu")], {"w": state}, 60.0, PRICES)
    assert result.idle_gpu_seconds == 60.0 and result.idle_cost_usd == 0.0
    [error] = result.errors
    assert "no price for GPU type 'tpu'" in error.reason and "60.0 idle GPU-seconds" in error.reason


# ---------------------------------------------------------------- figures


def test_parse_since() -> None:
    assert parse_since("90s", NOW) == NOW - 90
    assert parse_since("15m", NOW) == NOW - 900
    assert parse_since("1h30m", NOW) == NOW - 5400
    assert parse_since("7d", NOW) == NOW - 7 * 86400
    assert parse_since("1700000000", NOW) == 1_700_000_000.0
    assert parse_since("2023-11-14T22:13:20Z", NOW) == 1_700_000_000.0
    assert parse_since("2023-11-14T22:13:20", NOW) == 1_700_000_000.0  # UTC unless it says
    assert parse_since("2023-11-14T23:13:20+01:00", NOW) == 1_700_000_000.0
    for bad in ("", "soon", "-5", "5 parsecs"):
        with pytest.raises(SinceError):
            parse_since(bad, NOW)


def test_figures_derivations() -> None:
    figures = Figures(gpu_spend_usd=3.0, kv_transfer_spend_usd=1.0, idle_spend_usd=2.0, wasted_spend_usd=1.5)
    assert figures.cost_per_successful_task_usd is None
    figures.add_tasks("succeeded", None, 4)
    figures.add_tasks("failed", "abandoned", 2)
    assert figures.cost_per_successful_task_usd == 6.0 / 4
    assert figures.waste_fraction == 0.25
    tenant = Figures(gpu_spend_usd=2.0, idle_spend_usd=None)
    tenant.add_tasks("succeeded", None, 1)
    assert tenant.cost_per_successful_task_usd == 2.0
    assert tenant.as_dict()["failed_by_reason"] == {"step_failed": 0, "deadline_missed": 0, "abandoned": 0}


def test_grafana_dashboard_queries_the_ledgers_metrics() -> None:
    """Every ledger metric the dashboard queries is one the ledger exports (with its labels)."""
    import json
    import re
    from pathlib import Path

    from prometheus_client import REGISTRY

    import services.ledger.service  # noqa: F401  (registers the ledger's metrics)

    root = Path(__file__).resolve().parents[1] / "infra" / "grafana"
    dashboard = json.loads((root / "dashboards" / "ledger.json").read_text())
    exported: dict[str, set[str]] = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
        if metric.name.startswith("ripplemesh_ledger_"):
            suffix = "_total" if metric.type == "counter" else ""
            exported.setdefault(metric.name + suffix, set())
    label_names = {
        "ripplemesh_ledger_spend_usd_total": {"tenant", "phase"},
        "ripplemesh_ledger_idle_spend_usd_total": {"pool"},
        "ripplemesh_ledger_errors_total": {"type"},
        "ripplemesh_ledger_events_total": {"type", "outcome"},
    }
    queried = 0
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}, panel["title"]
        for target in panel["targets"]:
            for name, selector in re.findall(r"(ripplemesh_ledger_\w+)(\{[^}]*\})?", target["expr"]):
                queried += 1
                assert name in exported, (panel["title"], name)
                labels = set(re.findall(r"(\w+)\s*=~?", selector)) - {"window"}
                for label in labels:
                    assert label in label_names.get(name, {"kind", "status", "reason", "tenant", "pool"}), (
                        panel["title"],
                        name,
                        label,
                    )
    assert queried >= 20
    provisioning = (root / "provisioning" / "dashboards" / "ripplemesh.yaml").read_text()
    assert "type: file" in provisioning and "/etc/grafana/dashboards/ripplemesh" in provisioning
