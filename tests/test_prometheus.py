"""The dashboards against real parts: `ripplemesh up --autoscale`, scraped by a real Prometheus
(Debian's `prometheus`; skipped without it) with the recording rules, under traffic from the
official openai client. Every panel, annotation and template variable of every dashboard in
infra/grafana/dashboards/ must show data, as a user opening Grafana on this mesh would see it.

The Prometheus config is infra/prometheus.yml's (its job names and target labels), with the
targets `up` started instead of the compose hostnames, a 1 s scrape and rule evaluation, and the
rule files. The collector and Tempo jobs are left out: neither runs here (the service-graph
panel is a Tempo query, not PromQL).

What the traffic does, so that no panel stays empty:
- an agent's turns that extend one conversation: prefix-cache hits;
- two quick requests of a tenant whose quota allows one: admission rejects the second (429);
- a burst of streams, during which the decode worker holding most of them hangs: the router
  declares it lost and migrates its streams (takeovers); it is then killed, and the supervisor
  restarts it;
- the autoscaler's TTFT SLO is set below any real TTFT, so the traffic scales pools up (its
  actions and plan changes are annotations);
- a worker whose GPU type the price list lacks joins: the ledger's "unpriced GPU time" panel.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import yaml

from ripplemesh.traces import load_spans
from services.mesh.config import DEFAULT_CONFIG
from services.mesh.embedded_nats import free_port
from tests.test_dashboards import RULES, prometheus_queries, recorded_metrics, substitute
from tests.test_up import RunningUp, _user_env, running_up

pytestmark = [
    pytest.mark.timeout(480),
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="prometheus not on PATH (Debian/Ubuntu: apt-get install prometheus; `make receivers` does it)",
    ),
]

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_PROMETHEUS = ROOT / "infra" / "prometheus.yml"
MODEL = "llama-3-8b"
TINY_KEY = "rm-prometheus-tiny-key"
UNPRICED_GPU = "L40S"
UNPRICED_WORKER = "decode-l40s-0"
# How long, after the traffic, every expression may take to show data (the ledger refreshes its
# figures every 15 s; rates need two samples).
SHOW_DATA_WITHIN_S = 150.0
# The burst: streams at once, tokens each (the hang comes 60 tokens into the longest).
BURST = 8
BURST_TOKENS = 300

CONFIG_EXTRA = f"""
# A tenant whose quota allows one request now and then: a second one at once is rejected.
[tenants.tiny]
api_keys_sha256 = ["{hashlib.sha256(TINY_KEY.encode()).hexdigest()}"]
priority = "sheddable"
requests_per_s = 0.01
request_burst = 1.0

[autoscaler]
interval_s = 1.0
# Below any TTFT the mesh can give: every plan under traffic grows a pool.
ttft_slo_s = 0.001
# Nothing is drained while the test runs: the scraped workers stay.
scale_down_delay_s = 3600.0
idle_to_zero_s = 3600.0
"""


def mesh_config(tmp_path: Path) -> Path:
    """The packaged config, with the tiny tenant, a quick autoscaler and no price for L40S."""
    text = DEFAULT_CONFIG.read_text()
    text, removed = re.subn(rf"^{UNPRICED_GPU} = .*\n", "", text, flags=re.M)
    assert removed == 1, f"the packaged config prices {UNPRICED_GPU} no longer"
    path = tmp_path / "ripplemesh.toml"
    path.write_text(text + CONFIG_EXTRA)
    return path


def children(up: RunningUp) -> dict[str, Any]:
    return dict(json.loads((up.data_dir / "supervisor.json").read_text())["children"])


# ---------------------------------------------------------------- Prometheus


def prometheus_config(targets: dict[str, str], own_port: int) -> dict[str, Any]:
    """infra/prometheus.yml with `up`'s children as targets (child name -> host:port): the compose
    hostname of a target is the child's name, and its labels go with it."""
    compose = yaml.safe_load(COMPOSE_PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in compose["scrape_configs"]}
    labels_of = {
        target.split(":")[0]: static.get("labels", {})
        for static in jobs["ripplemesh"]["static_configs"]
        for target in static["targets"]
    }
    missing = set(labels_of) - set(targets)
    assert not missing, f"compose scrapes services `up` does not run: {missing}"
    static_configs = []
    for name, address in sorted(targets.items()):
        role = name.rsplit("-", 1)[0]
        labels = labels_of.get(name) or (
            {"service": role.split("-")[0], "worker": name} if role.startswith(("prefill", "decode")) else {}
        )
        assert labels, f"{name}: no labels for it in infra/prometheus.yml"
        static_configs.append({"targets": [address], "labels": labels})
    ripplemesh_job = {
        k: v for k, v in jobs["ripplemesh"].items() if k not in ("scrape_interval", "scrape_timeout")
    }
    return {
        "global": {
            **compose["global"],
            "scrape_interval": "1s",
            "scrape_timeout": "1s",
            "evaluation_interval": "1s",
        },
        "rule_files": [str(RULES.parent / "*.yml")],
        "scrape_configs": [
            {**ripplemesh_job, "static_configs": static_configs},
            {**jobs["prometheus"], "static_configs": [{"targets": [f"127.0.0.1:{own_port}"]}]},
        ],
    }


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    config_path: Path

    def reload(self, config: dict[str, Any], job: str, target: str, timeout_s: float = 30.0) -> None:
        """A new config (SIGHUP, as an operator reloads one), in force once `target` of `job` is
        among the active targets."""
        self.config_path.write_text(yaml.safe_dump(config))
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while not any(
            t["labels"]["job"] == job and t["labels"]["instance"] == target
            for t in self.get("/api/v1/targets", state="active")["activeTargets"]
        ):
            assert time.monotonic() < deadline, (
                f"the reloaded config has no {target}:\n{self.log.read_text()[-2000:]}"
            )
            time.sleep(0.2)

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        body = response.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"] if data["resultType"] == "vector" else [data["result"]]
        return result


@contextmanager
def running_prometheus(tmp_path: Path, config: dict[str, Any], port: int) -> Iterator[Prometheus]:
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={path}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--enable-feature=exemplar-storage",
            ],
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
        )
    prometheus = Prometheus(f"http://127.0.0.1:{port}", process, log, path)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, f"prometheus exited:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{prometheus.url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (
                f"prometheus not ready within 30 s:\n{log.read_text()[-3000:]}"
            )
            time.sleep(0.2)
        yield prometheus
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@dataclass
class Watch:
    """Every expression queried about once a second, on a thread, until each has shown data once:
    some (an annotation on a scale-up) show data only for a while after the event."""

    prometheus: Prometheus
    pending: dict[str, str]
    seen: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Watch:
        self._thread = threading.Thread(target=self._run, name="prometheus-watch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set() and self.pending:
            for key, expr in list(self.pending.items()):
                try:
                    result = self.prometheus.query(expr)
                except (AssertionError, httpx.HTTPError) as exc:
                    self.errors[key] = str(exc)
                    continue
                if result:
                    self.seen[key] = result
                    del self.pending[key]
            self._stop.wait(1.0)

    def wait(self, timeout_s: float) -> dict[str, str]:
        """What is still empty after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.5)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)
        return dict(self.pending)


# ---------------------------------------------------------------- traffic


@dataclass
class Traffic:
    """What the official client saw."""

    texts: dict[int, str] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    rejected: list[int] = field(default_factory=list)
    chunks: dict[int, int] = field(default_factory=dict)


async def stream(
    api: openai.AsyncOpenAI, traffic: Traffic, i: int, messages: list[Any], max_tokens: int
) -> None:
    try:
        response = await api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        )
        async for chunk in response:
            if chunk.choices and chunk.choices[0].delta.content:
                traffic.texts[i] = traffic.texts.get(i, "") + chunk.choices[0].delta.content
                traffic.chunks[i] = traffic.chunks.get(i, 0) + 1
    except openai.APIError as exc:
        traffic.errors[i] = repr(exc)


def decode_running(up: RunningUp) -> dict[str, int]:
    """Each decode worker's running sequences now (its /healthz)."""
    running = {}
    for name, child in children(up).items():
        if name.startswith("decode-") and child["state"] == "running":
            try:
                health = httpx.get(f"{child['url']}/healthz", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                continue
            running[name] = int(health.get("running", 0))
    return running


def hang_then_kill(up: RunningUp, victim: str, timeout_s: float = 30.0) -> None:
    """The worker hangs (SIGSTOP: no heartbeat, no answer to a probe) until the router declares it
    lost and takes its streams over; then it is killed, and the supervisor restarts it. (A worker
    killed outright may be back before the router misses it: its successor hands its work back.)"""
    pid = int(children(up)[victim]["pid"])
    router = children(up)["router"]["url"]
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout_s
        while victim not in httpx.get(f"{router}/healthz", timeout=5).json()["migration"]["gone"]:
            assert time.monotonic() < deadline, f"the router did not declare the hung {victim} lost"
            time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGKILL)


async def send_traffic(up: RunningUp) -> tuple[Traffic, str]:
    """The traffic the module docstring describes; and the worker killed mid-burst."""
    traffic = Traffic()
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="rm-demo-key", max_retries=0)
    tiny = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key=TINY_KEY, max_retries=0)
    try:
        # An agent's turns: each prompt extends the last, whose prefix the mesh has cached. A
        # turn every 1.5 s (a tool call in between), so that Prometheus's 1 s scrapes see the
        # cached tokens grow: a counter's first value, with no sample before it, is no increase.
        history: list[Any] = [{"role": "system", "content": "You are a careful research agent. " * 30}]
        for turn in range(5):
            history.append({"role": "user", "content": f"Step {turn}: what next? " + "context " * 20})
            await stream(api, traffic, turn, history, 24)
            history.append({"role": "assistant", "content": traffic.texts.get(turn, "")})
            await asyncio.sleep(1.5)

        # Over the tiny tenant's quota: one request is admitted, the next one at once is not.
        for i in (100, 101, 102):
            try:
                await tiny.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
                )
            except openai.RateLimitError:
                traffic.rejected.append(i)

        # A burst; the decode worker holding most of it hangs once the streams are under way.
        prompts = [f"burst {i}: tell me about prefix caches and batching " * 6 for i in range(BURST)]
        tasks = [
            asyncio.create_task(stream(api, traffic, 200 + i, [{"role": "user", "content": p}], BURST_TOKENS))
            for i, p in enumerate(prompts)
        ]
        deadline = time.monotonic() + 60
        while max((traffic.chunks.get(200 + i, 0) for i in range(BURST)), default=0) < 60:
            assert time.monotonic() < deadline and not all(t.done() for t in tasks), (
                "the burst ended too soon"
            )
            await asyncio.sleep(0.02)
        running = await asyncio.to_thread(decode_running, up)
        victim = max(running, key=lambda name: running[name])
        assert running[victim] > 0, running
        await asyncio.to_thread(hang_then_kill, up, victim)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)
    finally:
        await api.close()
        await tiny.close()
    return traffic, victim


@contextmanager
def unpriced_worker(up: RunningUp, config: Path, log: Path) -> Iterator[str]:
    """A decode worker of a GPU type the price list lacks joins the mesh, as an operator would
    start one by hand; its host:port, once it is healthy."""
    nats_url = up.ready_line.split()[2]
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ripplemesh",
                "run",
                "decode",
                "--nats-url",
                nats_url,
                "--nats-credentials",
                str(up.data_dir / "credentials" / "services.json"),
                "--data-dir",
                str(up.data_dir),
                "--config",
                str(config),
                "--http-port",
                str(port),
                "--worker-id",
                UNPRICED_WORKER,
                "--engine",
                "sim",
                "--gpu",
                UNPRICED_GPU,
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=_user_env(),
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"{UNPRICED_WORKER} exited:\n{log.read_text()[-2000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{UNPRICED_WORKER} not healthy:\n{log.read_text()[-2000:]}"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


# ---------------------------------------------------------------- the test


def expressions() -> dict[str, str]:
    """Every PromQL expression of the dashboards, as Grafana sends it with its variables at All,
    and every recorded series (what each query is, for the failure message)."""
    found = {str(q): substitute(q.expr) for q in prometheus_queries()}
    found |= {f"recording rule {name}": name for name in sorted(recorded_metrics())}
    return found


def test_every_panel_of_every_dashboard_shows_data_from_a_running_mesh(tmp_path: Path) -> None:
    config = mesh_config(tmp_path)
    args = ("--autoscale", "--config", str(config), "--prefill", "1", "--decode", "2")
    args += ("--min-workers", "1", "--max-workers", "3")
    with running_up(tmp_path, *args) as up:
        targets = {
            name: urlsplit(child["url"]).netloc
            for name, child in children(up).items()
            if not name.startswith("nats-")  # NATS's monitoring serves JSON; compose does not scrape it
        }
        prometheus_port = free_port()
        started = time.time()
        with running_prometheus(
            tmp_path, prometheus_config(targets, prometheus_port), prometheus_port
        ) as prom:
            # Prometheus sees the idle mesh first (and the autoscaler's first plan), so that what
            # the traffic changes shows as a change.
            wait_scraped(prom, len(targets) + 1)  # and itself
            wait_until_shown(prom, "ripplemesh_autoscaler_desired_replicas")
            watch = Watch(prom, expressions()).start()
            traffic, victim = asyncio.run(send_traffic(up))
            # What the client saw: the agent and the burst served (the killed worker's streams
            # moved), the tiny tenant turned away.
            assert traffic.errors == {}
            assert all(traffic.chunks.get(200 + i) == BURST_TOKENS for i in range(BURST)), traffic.chunks
            assert traffic.rejected, "the tiny tenant's second request was admitted"

            with unpriced_worker(up, config, tmp_path / "unpriced-worker.log") as address:
                targets[UNPRICED_WORKER] = address
                prom.reload(prometheus_config(targets, prometheus_port), "ripplemesh", address)
                empty = watch.wait(SHOW_DATA_WITHIN_S)
                assert not watch.errors.keys() & empty.keys(), {
                    k: watch.errors[k] for k in empty if k in watch.errors
                }
                listed = "\n".join(f"{where}\n    {expr}" for where, expr in empty.items())
                assert not empty, f"no data within {SHOW_DATA_WITHIN_S:.0f} s for:\n{listed}"

                # Every target is scraped, the killed worker (restarted) and the late one included.
                wait_scraped(prom, len(targets) + 1)

                assert_what_a_user_sees(prom, victim)
                assert_exemplars_lead_to_traces(prom, up, started)


def wait_scraped(prom: Prometheus, count: int, timeout_s: float = 60.0) -> None:
    """At least `count` targets are up (scraped, and the last scrape succeeded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        active = prom.get("/api/v1/targets", state="active")["activeTargets"]
        up = [t for t in active if t["health"] == "up"]
        if len(up) >= count:
            return
        down = {t["scrapeUrl"]: t["lastError"] or t["health"] for t in active if t["health"] != "up"}
        assert time.monotonic() < deadline, f"{len(up)} of {count} targets up; down: {down}"
        time.sleep(0.5)


def wait_until_shown(prom: Prometheus, expr: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not prom.query(expr):
        assert time.monotonic() < deadline, f"no data for {expr} within {timeout_s} s"
        time.sleep(0.5)


def series(prom: Prometheus, expr: str) -> list[dict[str, str]]:
    return [r["metric"] for r in prom.query(expr)]


def assert_what_a_user_sees(prom: Prometheus, victim: str) -> None:
    # Requests dashboard: the tiny tenant's rejection, by reason, and its 429.
    rejected = series(
        prom, 'sum by (tenant, reason) (ripplemesh_admission_decisions_total{outcome="reject"})'
    )
    assert {"tenant": "tiny", "reason": "quota"} in rejected, rejected
    assert series(prom, 'ripplemesh_ingress_http_requests_total{status="429"}')
    # The killed worker's streams were migrated; the router said it lost the worker.
    assert {"outcome": "migrated"} in series(prom, "sum by (outcome) (ripplemesh_router_takeovers_total)")
    assert series(prom, "ripplemesh_router_workers_lost_total > 0")
    # Ripple dashboard: the agent's turns hit the prefix cache; the autoscaler scaled up.
    assert series(prom, "max_over_time(ripplemesh:cache_hit_ratio:rate1m[10m]) > 0")
    assert series(prom, "max_over_time(ripplemesh:worker_cache_hit_ratio:rate1m[10m]) > 0")
    assert series(prom, 'ripplemesh_autoscaler_scale_events_total{direction="up"} > 0')
    assert series(prom, "max_over_time(ripplemesh:gpu_utilisation:rate1m[10m]) > 0")
    # Ledger dashboard: the L40S worker's time is unpriced, and the ledger says so.
    assert series(prom, "ripplemesh_ledger_errors_total > 0")
    assert series(prom, 'ripplemesh_worker_running{pool="decode-L40S"}')
    assert victim.startswith("decode-")


def assert_exemplars_lead_to_traces(prom: Prometheus, up: RunningUp, started: float) -> None:
    data = prom.get(
        "/api/v1/query_exemplars",
        query="ripplemesh_ingress_ttft_seconds_bucket",
        start=started,
        end=time.time(),
    )
    trace_ids = {e["labels"]["trace_id"] for s in data for e in s["exemplars"] if "trace_id" in e["labels"]}
    assert trace_ids, f"no exemplar with a trace_id: {data}"
    assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in trace_ids), trace_ids
    # Grafana's link from an exemplar opens that trace: the mesh recorded spans under it.
    deadline = time.monotonic() + 10
    while not trace_ids & {s["trace_id"] for s in load_spans(up.data_dir)}:
        assert time.monotonic() < deadline, "no span of any exemplar's trace"
        time.sleep(0.5)
