"""The Grafana dashboards (infra/grafana/dashboards/) and the recording rules
(infra/prometheus/rules/) as CI checks them, offline: no Grafana, no Prometheus server.

A panel whose query names a metric no service exports draws nothing, and nobody notices until
the day it is needed. So every PromQL expression of every panel, annotation and template
variable is parsed for its metric names, and each must be one the services export (their
prometheus_client metrics, read from the default registry after importing every module that
defines some), one the rule file records, or one the collector or Tempo produces
(`traces_span_metrics_*`, `traces_service_graph_*`). Every data source must be one Grafana
provisions. promtool (Debian's `prometheus` package; skipped without it) checks the rule file,
the dashboards' PromQL syntax, and what the recording rules compute on sample series.
tests/test_prometheus.py runs the same expressions against a real Prometheus scraping `up`.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "infra" / "grafana" / "dashboards"
DATASOURCES = ROOT / "infra" / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
RULES = ROOT / "infra" / "prometheus" / "rules" / "ripple.yml"
DASHBOARD_FILES = sorted(DASHBOARDS.glob("*.json"))

# Series that are not any service's: the collector's span metrics and Tempo's service graph
# (both with exemplars), and what Prometheus itself writes for every scrape.
FOREIGN_PREFIXES = ("traces_span_metrics_", "traces_service_graph_")
PROMETHEUS_SERIES = {
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
}
# Grafana's interval variables, as a query at a one-minute resolution would see them.
GRAFANA_INTERVALS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}
# The modules that define the services' metrics, beyond those found by their imports.
SERVICE_MODULES = ("services.engines.host", "services.ingress.http_api", "ripplemesh.subscriber")


# ---------------------------------------------------------------- dashboards


def load(path: Path) -> dict[str, Any]:
    board: dict[str, Any] = json.loads(path.read_text())
    return board


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows (collapsed or not) included."""
    for panel in board.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


@dataclass(frozen=True)
class Query:
    """One query of a dashboard: a panel's target, an annotation or a template variable."""

    dashboard: str  # the file's name
    where: str  # what a user sees: the panel's title, the annotation's or variable's name
    datasource_uid: str | None
    expr: str  # as written, Grafana variables and all
    exemplar: bool = False

    def __str__(self) -> str:
        return f"{self.dashboard}: {self.where}"


def _uid(datasource: Any, default: str | None) -> str | None:
    if isinstance(datasource, dict):
        return datasource.get("uid", default)
    return datasource if isinstance(datasource, str) else default


LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<metric>.+?)\s*,\s*(?P<label>\w+)\s*\)\s*$")


def variable_query(variable: dict[str, Any]) -> str | None:
    query = variable.get("query")
    if isinstance(query, dict):
        query = query.get("query")
    return query if isinstance(query, str) and query else None


def queries(path: Path) -> list[Query]:
    """Every query of a dashboard with its data source; `label_values(metric, label)` of a
    variable counts as the expression `metric`."""
    board = load(path)
    found = []
    for panel in panels(board):
        panel_uid = _uid(panel.get("datasource"), None)
        for target in panel.get("targets", []):
            uid = _uid(target.get("datasource"), panel_uid)
            expr = target.get("expr")
            if isinstance(expr, str):
                where = f"panel {panel['title']!r} ({target.get('refId', '?')})"
                found.append(Query(path.name, where, uid, expr, bool(target.get("exemplar"))))
    for annotation in board.get("annotations", {}).get("list", []):
        expr = annotation.get("expr") or annotation.get("target", {}).get("expr")
        if expr:
            where = f"annotation {annotation['name']!r}"
            found.append(Query(path.name, where, _uid(annotation.get("datasource"), None), expr))
    for variable in board.get("templating", {}).get("list", []):
        query = variable_query(variable)
        if variable.get("type") == "query" and query is not None:
            match = LABEL_VALUES.match(query)
            expr = match["metric"] if match else query
            where = f"variable ${variable['name']}"
            found.append(Query(path.name, where, _uid(variable.get("datasource"), None), expr))
    return found


@cache
def datasources() -> dict[str, str]:
    """The provisioned data sources: uid -> type."""
    provisioned = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    return {d["uid"]: d["type"] for d in provisioned}


def prometheus_queries(paths: list[Path] = DASHBOARD_FILES) -> list[Query]:
    uids = {uid for uid, kind in datasources().items() if kind == "prometheus"}
    return [q for path in paths for q in queries(path) if q.datasource_uid in uids]


def substitute(expr: str) -> str:
    """The expression as Grafana sends it with every template variable at "All" (`.*`, which is
    what the dashboards' variables send for it) and a one-minute interval."""
    expr = re.sub(r"\$\{?(__rate_interval|__interval|__range)\}?", lambda m: GRAFANA_INTERVALS[m[1]], expr)
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", ".*", expr)


# ---------------------------------------------------------------- PromQL metric names

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*(?!\w)")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
    "atan2",
}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (functions, keywords, label names, label values
    and Grafana variables aside)."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        name = match[0]
        if name.lower() in _KEYWORDS or re.match(r"\s*\(", text[match.end() :]):
            continue  # a keyword, or a function or aggregation (a name followed by "(")
        names.add(name)
    return names


def test_metric_names_are_read_out_of_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, tenant) (rate(a_seconds_bucket{tenant=~"$tenant",'
        'x="rate(b)"}[$__rate_interval]))) / on (pool) group_left (policy) rec:ratio:rate1m offset 5m'
        " or vector(1e3) and c_total > bool 2 unless d offset 1m"
    )
    assert metric_names(expr) == {"a_seconds_bucket", "rec:ratio:rate1m", "c_total", "d"}
    assert metric_names("time() - max(g)") == {"g"}


# ---------------------------------------------------------------- what the services export


def _metric_modules() -> list[str]:
    """Every module of services/ and ripplemesh/ that uses prometheus_client, and the services'
    entry points (which import what they run)."""
    found = set(SERVICE_MODULES)
    found |= {f"services.{p.parent.name}.service" for p in (ROOT / "services").glob("*/service.py")}
    for package in ("services", "ripplemesh"):
        for path in (ROOT / package).rglob("*.py"):
            if "prometheus_client" in path.read_text():
                found.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return sorted(found)


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}


@cache
def exported_metrics() -> frozenset[str]:
    """The series names the services' /metrics carry (OpenMetrics, which Prometheus scrapes):
    every metric in the default registry once their modules are imported, with its suffixes."""
    for module in _metric_modules():
        importlib.import_module(module)
    names: set[str] = set()
    for family in REGISTRY.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return frozenset(names)


@cache
def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@cache
def recorded_metrics() -> frozenset[str]:
    return frozenset(rule["record"] for rule in rules() if "record" in rule)


def unknown_metrics(expr: str) -> set[str]:
    known = exported_metrics() | recorded_metrics() | PROMETHEUS_SERIES
    return {n for n in metric_names(expr) if n not in known and not n.startswith(FOREIGN_PREFIXES)}


def test_the_exported_set_holds_every_service_s_metrics() -> None:
    exported = exported_metrics()
    # One metric of each service process, so a module the discovery missed shows here.
    for name in (
        "ripplemesh_service_up",
        "ripplemesh_ingress_http_requests_total",
        "ripplemesh_ingress_ttft_seconds_bucket",
        "ripplemesh_admission_decisions_total",
        "ripplemesh_router_decisions_total",
        "ripplemesh_router_takeovers_total",
        "ripplemesh_worker_running",
        "ripplemesh_worker_gpu_seconds_total",
        "ripplemesh_autoscaler_desired_replicas",
        "ripplemesh_ledger_cost_per_successful_task_usd",
        "ripplemesh_subscriber_events_total",
    ):
        assert name in exported, name
    assert "ripplemesh_worker_running_total" not in exported  # a gauge has no counter suffix


# ---------------------------------------------------------------- the dashboards


def test_there_are_the_three_dashboards() -> None:
    assert {p.name for p in DASHBOARD_FILES} >= {"ledger.json", "ripple.json", "requests.json"}


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_a_dashboard_parses_and_its_panels_have_titles_and_unique_ids(path: Path) -> None:
    board = load(path)
    assert board["uid"] and board["title"]
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), f"panel ids used twice: {sorted(i for i in ids if ids.count(i) > 1)}"
    for panel in panels(board):
        assert panel.get("title"), f"panel {panel['id']} has no title"
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        assert panel["type"] == "row" or panel.get("targets"), f"panel {panel['title']!r} queries nothing"


def test_dashboard_uids_are_unique() -> None:
    uids = [load(p)["uid"] for p in DASHBOARD_FILES]
    assert len(uids) == len(set(uids))


def _datasource_refs(board: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for panel in panels(board):
        if panel["type"] != "row" or "datasource" in panel:
            yield f"panel {panel['title']!r}", panel.get("datasource")
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} ({target.get('refId')})", target.get("datasource")
    for annotation in board.get("annotations", {}).get("list", []):
        if annotation.get("builtIn"):
            continue  # Grafana's own "Annotations & Alerts"
        yield f"annotation {annotation['name']!r}", annotation.get("datasource")
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            yield f"variable ${variable['name']}", variable.get("datasource")


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_every_data_source_of_a_dashboard_is_provisioned(path: Path) -> None:
    provisioned = datasources()
    wrong = []
    for where, datasource in _datasource_refs(load(path)):
        if not isinstance(datasource, dict) or datasource.get("uid") not in provisioned:
            wrong.append(f"{where}: {datasource!r} (provisioned: {sorted(provisioned)})")
        elif datasource.get("type", provisioned[datasource["uid"]]) != provisioned[datasource["uid"]]:
            wrong.append(
                f"{where}: type {datasource['type']!r}, but {datasource['uid']!r} is a "
                f"{provisioned[datasource['uid']]} data source"
            )
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_every_query_of_a_dashboard_reads_metrics_the_mesh_exports(path: Path) -> None:
    dead = [
        f"{q}: {', '.join(sorted(unknown))}"
        for q in prometheus_queries([path])
        if (unknown := unknown_metrics(q.expr))
    ]
    assert not dead, "queries of metrics no service exports (nor a recording rule records):\n" + "\n".join(
        dead
    )


def test_every_panel_of_the_new_dashboards_has_a_prometheus_query_or_is_the_service_graph() -> None:
    for name in ("ripple.json", "requests.json"):
        with_queries = {q.where.rsplit(" (", 1)[0] for q in prometheus_queries([DASHBOARDS / name])}
        for panel in panels(load(DASHBOARDS / name)):
            if panel["type"] in ("row", "nodeGraph"):
                continue
            assert f"panel {panel['title']!r}" in with_queries, f"{name}: {panel['title']!r}"


def test_template_variables_are_matched_as_regular_expressions() -> None:
    # A multi-value variable expands to (a|b) and "All" to .*: only =~ and !~ match those.
    wrong = [
        f"{q}: {m[0]}"
        for q in prometheus_queries()
        for m in re.finditer(r'\w+\s*(?:=|!=)\s*"[^"]*\$\{?(?!__)\w+[^"]*"', q.expr)
    ]
    assert not wrong, "\n".join(wrong)


def test_latency_and_cost_histograms_show_exemplars() -> None:
    histogram_targets = [q for q in prometheus_queries() if "_bucket" in q.expr]
    assert len(histogram_targets) >= 10
    missing = [str(q) for q in histogram_targets if not q.exemplar]
    assert not missing, "histogram panels without exemplars (a trace per point):\n" + "\n".join(missing)


POOL_METRICS = re.compile(
    r"ripplemesh(_worker_|:worker_|:gpu_|:replicas_gap|_autoscaler_(desired_)?replicas|_autoscaler_scale"
    r"|_ledger_pool_|:prompt_tokens|:cache_hit)"
)
POLICY_METRICS = re.compile(r"ripplemesh(:cache_hit_ratio|:prompt_tokens|_router_decisions_total)")


def test_ripple_dashboard_shows_the_chain_per_pool_and_policy() -> None:
    board = load(DASHBOARDS / "ripple.json")
    variables = {v["name"]: variable_query(v) for v in board["templating"]["list"]}
    assert set(variables) == {"pool", "policy"}
    exprs = " ".join(q.expr for q in queries(DASHBOARDS / "ripple.json"))
    for needed in (
        "ripplemesh:cache_hit_ratio:rate1m",
        "ripplemesh:worker_running:sum",
        "ripplemesh:worker_kv_usage_ratio:avg",
        "ripplemesh:gpu_utilisation:rate1m",
        "ripplemesh:worker_queue_depth:sum",
        "ripplemesh_autoscaler_desired_replicas",
        "ripplemesh_autoscaler_replicas",
        "ripplemesh_ledger_pool_cost_per_successful_task_usd",
    ):
        assert needed in exprs, needed
    # What has a pool follows $pool; what has a routing policy, $policy.
    for q in queries(DASHBOARDS / "ripple.json"):
        if q.where.startswith("variable"):
            continue
        if POOL_METRICS.search(q.expr):
            assert '$pool"' in q.expr, q
        if POLICY_METRICS.search(q.expr):
            assert '$policy"' in q.expr, q
    annotations = {a["name"]: a["expr"] for a in board["annotations"]["list"]}
    assert "ripplemesh_autoscaler_scale_events_total" in annotations["Autoscaler actions"]
    assert "changes(" in annotations["Autoscaler actions"]
    (graph,) = [p for p in panels(board) if p["type"] == "nodeGraph"]
    assert graph["datasource"] == {"type": "tempo", "uid": "tempo"}
    assert [t["queryType"] for t in graph["targets"]] == ["serviceMap"]


def test_requests_dashboard_is_by_tenant_and_class() -> None:
    board = load(DASHBOARDS / "requests.json")
    assert {v["name"] for v in board["templating"]["list"]} == {"tenant", "priority"}
    exprs = [q.expr for q in queries(DASHBOARDS / "requests.json")]
    for histogram in ("ttft", "itl", "e2e"):
        metric = f"ripplemesh_ingress_{histogram}_seconds_bucket"
        assert any(metric in e and "histogram_quantile" in e and "tenant, priority" in e for e in exprs)
    joined = " ".join(exprs)
    assert 'outcome="reject"' in joined and "reason" in joined
    assert "ripplemesh_router_takeovers_total" in joined
    assert "ripplemesh_ingress_http_requests_total" in " ".join(r["expr"] for r in rules())


# ---------------------------------------------------------------- the recording rules

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not on PATH (Debian/Ubuntu: apt-get install prometheus; `make receivers` does it)",
)


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@needs_promtool
def test_the_rule_file_passes_promtool() -> None:
    checked = _promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


def test_every_rule_reads_metrics_the_mesh_exports() -> None:
    dead = [
        f"{r['record']}: {sorted(unknown_metrics(r['expr']))}" for r in rules() if unknown_metrics(r["expr"])
    ]
    assert not dead, "\n".join(dead)
    names = [r["record"] for r in rules()]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"ripplemesh:[a-z0-9_]+(:[a-z0-9_]+)?", n) for n in names), names


@needs_promtool
def test_every_dashboard_expression_is_valid_promql(tmp_path: Path) -> None:
    # promtool parses rule expressions; one rule per query, its group named after the panel.
    groups = [
        {"name": f"{q} #{i}", "rules": [{"record": f"dashboard:check_{i}", "expr": substitute(q.expr)}]}
        for i, q in enumerate(prometheus_queries())
    ]
    path = tmp_path / "dashboards.yml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    checked = _promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr


RULE_TESTS = """
rule_files: [RULES]
evaluation_interval: 15s
tests:
  - interval: 15s
    input_series:
      # Pool decode-H100: 3 cached and 1 computed prompt token per second; pool prefill-H100
      # has computed tokens only (its cached series was never created).
      - series: 'ripplemesh_router_prompt_tokens_total{policy="cost",pool="decode-H100",source="cached"}'
        values: '0+45x8'
      - series: 'ripplemesh_router_prompt_tokens_total{policy="cost",pool="decode-H100",source="computed"}'
        values: '0+15x8'
      - series: 'ripplemesh_router_prompt_tokens_total{policy="cost",pool="prefill-H100",source="computed"}'
        values: '0+30x8'
      # Two decode workers busy 60 % and 20 % of the time; a prefill worker that has not run yet.
      - series: 'ripplemesh_worker_gpu_seconds_total{worker="decode-0",pool="decode-H100",phase="decode"}'
        values: '0+9x8'
      - series: 'ripplemesh_worker_gpu_seconds_total{worker="decode-1",pool="decode-H100",phase="decode"}'
        values: '0+3x8'
      - series: 'ripplemesh_worker_running{worker="decode-0",pool="decode-H100"}'
        values: '4x8'
      - series: 'ripplemesh_worker_running{worker="decode-1",pool="decode-H100"}'
        values: '2x8'
      - series: 'ripplemesh_worker_running{worker="prefill-0",pool="prefill-H100"}'
        values: '0x8'
      - series: 'ripplemesh_autoscaler_desired_replicas{pool="decode-H100"}'
        values: '3x8'
      - series: 'ripplemesh_autoscaler_replicas{pool="decode-H100"}'
        values: '2x8'
      - series: 'ripplemesh_ingress_ttft_seconds_bucket{tenant="demo",priority="standard",le="0.1"}'
        values: '0+0x8'
      - series: 'ripplemesh_ingress_ttft_seconds_bucket{tenant="demo",priority="standard",le="1"}'
        values: '0+15x8'
      - series: 'ripplemesh_ingress_ttft_seconds_bucket{tenant="demo",priority="standard",le="+Inf"}'
        values: '0+15x8'
    promql_expr_test:
      - expr: ripplemesh:cache_hit_ratio:rate1m
        eval_time: 2m
        exp_samples:
          - labels: 'ripplemesh:cache_hit_ratio:rate1m{policy="cost",pool="decode-H100"}'
            value: 0.75
          - labels: 'ripplemesh:cache_hit_ratio:rate1m{policy="cost",pool="prefill-H100"}'
            value: 0
      - expr: ripplemesh:gpu_utilisation:rate1m
        eval_time: 2m
        exp_samples:
          - labels: 'ripplemesh:gpu_utilisation:rate1m{pool="decode-H100"}'
            value: 0.4
          - labels: 'ripplemesh:gpu_utilisation:rate1m{pool="prefill-H100"}'
            value: 0
      - expr: ripplemesh:worker_running:sum
        eval_time: 2m
        exp_samples:
          - labels: 'ripplemesh:worker_running:sum{pool="decode-H100"}'
            value: 6
          - labels: 'ripplemesh:worker_running:sum{pool="prefill-H100"}'
            value: 0
      - expr: ripplemesh:replicas_gap
        eval_time: 2m
        exp_samples:
          - labels: 'ripplemesh:replicas_gap{pool="decode-H100"}'
            value: 1
      - expr: ripplemesh:ttft_seconds:p95_1m
        eval_time: 2m
        exp_samples:
          - labels: 'ripplemesh:ttft_seconds:p95_1m{tenant="demo",priority="standard"}'
            value: 0.955
"""


@needs_promtool
def test_recording_rules_compute_what_their_names_say(tmp_path: Path) -> None:
    tests = tmp_path / "ripple_test.yml"
    tests.write_text(RULE_TESTS.replace("RULES", json.dumps(str(RULES))))
    tested = _promtool("test", "rules", str(tests), cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr
