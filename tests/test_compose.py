"""docker-compose.yml against the code it runs, offline (this machine has no Docker engine).

The compose file was written by reading the code, so what can drift is checked here: each
ripplemesh container's command parses with the real `ripplemesh run` (service, options, values);
the ports its header promises, Prometheus scrapes and the health checks probe are the ones the
services are given; the collector, Tempo, Prometheus and Grafana point at each other where they
listen; every file mounted exists in the repository; the environment the services get is what
the code reads; and the demo key, model and open Grafana of the header are what the packaged
config and the Grafana settings give.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml

from ripplemesh.commands import ENGINE_CHOICES
from ripplemesh.commands.serve import SERVICES, run
from services.engines.sim.profiles import GPUS
from services.mesh.config import DEFAULT_CONFIG, load_config

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
INFRA = ROOT / "infra"
RIPPLEMESH_IMAGE = "ripplemesh:dev"


@cache
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())  # anchors and << merges
    return loaded


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose()["services"]
    return found


def ripplemesh_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services().items() if s.get("image") == RIPPLEMESH_IMAGE}


def header() -> str:
    lines = []
    for line in COMPOSE_FILE.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return " ".join(lines)


def yaml_file(relative: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / relative).read_text())
    return loaded


def command_params(name: str) -> dict[str, Any]:
    """The options `ripplemesh run` gets from this container's command, parsed by click."""
    command = [str(a) for a in ripplemesh_services()[name]["command"]]
    assert command[0] == "run", f"{name}: the image's entrypoint is `ripplemesh`; the command starts with run"
    context = run.make_context("ripplemesh run", command[1:])
    return dict(context.params)


def host_port(address: str, default_port: int | None = None) -> tuple[str, int]:
    """`host:port` or a URL, as (host, port)."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    port = parts.port or default_port
    assert parts.hostname and port, address
    return parts.hostname, port


def published_or_exposed(service: str) -> set[int]:
    spec = services()[service]
    ports = {int(str(p).split(":")[-1].split("/")[0]) for p in spec.get("ports", [])}
    return ports | {int(p) for p in spec.get("expose", [])}


# ---------------------------------------------------------------- the ripplemesh containers


def test_there_is_a_container_for_every_service() -> None:
    run_services = {command_params(name)["service"] for name in ripplemesh_services()}
    # The trace shipper serves `up` alone: in this stack each service exports to the collector.
    assert run_services == set(SERVICES) - {"trace-shipper"}


@pytest.mark.parametrize("name", sorted(ripplemesh_services()))
def test_each_command_is_a_real_ripplemesh_run(name: str) -> None:
    # click parses it as `ripplemesh run` would: an unknown service or option, a bad engine
    # choice or a non-integer port fails here, with click's message.
    try:
        params = command_params(name)
    except click.UsageError as exc:
        pytest.fail(f"{name}: {exc.format_message()}")
    assert params["service"] in SERVICES
    assert params["http_host"] == "0.0.0.0", f"{name}: other containers must reach its /metrics"
    assert params["http_port"] > 0
    nats = [host_port(url, 4222) for url in params["nats_url"].split(",")]
    assert {h for h, _ in nats} <= set(services()), nats
    if params["service"] in ("prefill", "decode"):
        assert params["worker_id"] == name, "a stable --worker-id keeps its durable consumer"
        assert params["engine"] in ENGINE_CHOICES
        assert params["gpu"] in GPUS, f"the sim knows no GPU {params['gpu']!r}"
        assert params["gpu"] in load_config(DEFAULT_CONFIG).gpu_prices_per_hour, "its GPU time is priced"


def test_the_ports_the_header_lists_are_the_services_ports() -> None:
    listed = re.search(r"--http-port for /metrics and /healthz: (.+?)\.", header())
    assert listed, "the header lists each service's --http-port"
    promised = {name: int(port) for name, port in re.findall(r"([\w-]+) (\d+)", listed[1])}
    assert promised == {name: command_params(name)["http_port"] for name in ripplemesh_services()}


@pytest.mark.parametrize("name", sorted(ripplemesh_services()))
def test_each_health_check_probes_its_own_port(name: str) -> None:
    test = " ".join(ripplemesh_services()[name]["healthcheck"]["test"])
    assert f"127.0.0.1:{command_params(name)['http_port']}/healthz" in test


def test_the_environment_is_what_the_code_reads() -> None:
    source = "\n".join(p.read_text() for d in ("services", "ripplemesh") for p in (ROOT / d).rglob("*.py"))
    envvars = {opt.envvar for opt in run.params if isinstance(opt, click.Option) and opt.envvar}
    for name, spec in ripplemesh_services().items():
        for variable in spec["environment"]:
            if variable.startswith("OTEL_") and variable != "OTEL_EXPORTER_OTLP_ENDPOINT":
                continue  # read by the OpenTelemetry SDK itself
            assert variable in envvars or f'"{variable}"' in source, f"{name}: nothing reads ${variable}"
    # The ledger's database is under the data directory, which is its volume.
    ledger = ripplemesh_services()["ledger"]
    assert any(str(v).endswith(f":{ledger['environment']['RIPPLEMESH_DATA_DIR']}") for v in ledger["volumes"])
    assert 'ENTRYPOINT ["ripplemesh"]' in (INFRA / "docker" / "Dockerfile").read_text()


def test_depends_on_names_services() -> None:
    for name, spec in services().items():
        assert set(spec.get("depends_on", [])) <= set(services()), name


# ---------------------------------------------------------------- Prometheus


def scrape_jobs() -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in yaml_file("infra/prometheus.yml")["scrape_configs"]}


def test_prometheus_scrapes_every_ripplemesh_service_on_its_http_port() -> None:
    scraped = {}
    for static in scrape_jobs()["ripplemesh"]["static_configs"]:
        for target in static["targets"]:
            host, port = host_port(target)
            assert host in ripplemesh_services(), f"{target}: no such ripplemesh container"
            params = command_params(host)
            assert port == params["http_port"], f"{target}: {host} serves /metrics on {params['http_port']}"
            assert static["labels"]["service"] == params["service"], target
            # The worker metrics carry their own `worker` label; a target label of that name
            # would rename theirs to `exported_worker`.
            assert "worker" not in static["labels"], target
            scraped[host] = port
    assert set(scraped) == set(ripplemesh_services())


def test_prometheus_scrapes_the_collector_and_tempo_where_they_listen() -> None:
    collector = yaml_file("infra/otel-collector.yaml")
    tempo = yaml_file("infra/tempo.yaml")
    (span_target,) = scrape_jobs()["spanmetrics"]["static_configs"][0]["targets"]
    host, port = host_port(span_target)
    assert host == "otel-collector"
    assert host_port(collector["exporters"]["prometheus"]["endpoint"])[1] == port
    assert port in published_or_exposed("otel-collector")
    assert "prometheus" in collector["service"]["pipelines"]["metrics"]["exporters"]
    (tempo_target,) = scrape_jobs()["tempo"]["static_configs"][0]["targets"]
    assert host_port(tempo_target) == ("tempo", tempo["server"]["http_listen_port"])
    (own,) = scrape_jobs()["prometheus"]["static_configs"][0]["targets"]
    assert host_port(own)[1] in published_or_exposed("prometheus")


def mounts(service: str) -> dict[str, Path]:
    """A container's bind mounts: container path -> the repository path mounted there."""
    found = {}
    for volume in services()[service].get("volumes", []):
        source, target = str(volume).split(":")[:2]
        if source.startswith("./"):
            found[target] = ROOT / source
    return found


def in_repository(service: str, container_path: str) -> Path:
    for target, source in mounts(service).items():
        path = PurePosixPath(container_path)
        if path == PurePosixPath(target) or PurePosixPath(target) in path.parents:
            return source / path.relative_to(target)
    raise AssertionError(f"{service}: {container_path} is not mounted from the repository")


def test_prometheus_loads_the_recording_rules_and_keeps_exemplars(tmp_path: Path) -> None:
    config = yaml_file("infra/prometheus.yml")
    command = services()["prometheus"]["command"]
    assert "--enable-feature=exemplar-storage" in command
    assert "--web.enable-remote-write-receiver" in command  # Tempo's service-graph metrics
    assert in_repository("prometheus", "/etc/prometheus/prometheus.yml") == INFRA / "prometheus.yml"
    found = []
    for pattern in config["rule_files"]:
        directory = in_repository("prometheus", str(PurePosixPath(pattern).parent))
        found += [p for p in directory.glob("*") if fnmatch.fnmatch(p.name, PurePosixPath(pattern).name)]
    assert INFRA / "prometheus" / "rules" / "ripple.yml" in found
    if shutil.which("promtool") is None:
        pytest.skip("promtool not on PATH (apt-get install prometheus; `make receivers` does it)")
    # promtool checks the config with the rule files where the container would find them.
    config["rule_files"] = [str(p) for p in found]
    checked_path = tmp_path / "prometheus.yml"
    checked_path.write_text(yaml.safe_dump(config))
    checked = subprocess.run(
        ["promtool", "check", "config", str(checked_path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


# ---------------------------------------------------------------- traces


def test_the_services_send_traces_to_the_collector_s_otlp_http_receiver() -> None:
    collector = yaml_file("infra/otel-collector.yaml")
    http_receiver = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    for name, spec in ripplemesh_services().items():
        endpoint = spec["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        # The services' exporter is OTLP over HTTP (opentelemetry-exporter-otlp-proto-http).
        assert urlsplit(endpoint).scheme == "http", name
        host, port = host_port(endpoint)
        assert host == "otel-collector" and host in spec["depends_on"], name
        assert port == host_port(http_receiver)[1], (
            f"{name}: {endpoint}, the collector listens on {http_receiver}"
        )
        assert port in published_or_exposed("otel-collector")
    assert "otlp" in collector["service"]["pipelines"]["traces"]["receivers"]


def test_the_collector_sends_traces_to_tempo_and_tempo_writes_to_prometheus() -> None:
    collector = yaml_file("infra/otel-collector.yaml")
    tempo = yaml_file("infra/tempo.yaml")
    host, port = host_port(collector["exporters"]["otlp/tempo"]["endpoint"])
    assert host == "tempo"
    assert port == host_port(tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])[1]
    assert port in published_or_exposed("tempo")
    (remote_write,) = tempo["metrics_generator"]["storage"]["remote_write"]
    assert host_port(remote_write["url"]) == ("prometheus", 9090)
    assert urlsplit(remote_write["url"]).path == "/api/v1/write"
    assert "service-graphs" in tempo["overrides"]["defaults"]["metrics_generator"]["processors"]


# ---------------------------------------------------------------- Grafana


def test_grafana_s_data_sources_point_at_prometheus_and_tempo() -> None:
    provisioned = in_repository("grafana", "/etc/grafana/provisioning/datasources") / "datasources.yaml"
    datasources = {d["uid"]: d for d in yaml.safe_load(provisioned.read_text())["datasources"]}
    assert host_port(datasources["prometheus"]["url"]) == ("prometheus", 9090)
    tempo = yaml_file("infra/tempo.yaml")
    assert host_port(datasources["tempo"]["url"]) == ("tempo", tempo["server"]["http_listen_port"])
    assert {"prometheus", "tempo"} <= set(services()["grafana"]["depends_on"])


def test_grafana_finds_the_dashboards_where_its_provisioning_looks() -> None:
    provisioning = in_repository("grafana", "/etc/grafana/provisioning/dashboards")
    (provider,) = yaml.safe_load((provisioning / "ripplemesh.yaml").read_text())["providers"]
    dashboards = in_repository("grafana", provider["options"]["path"])
    assert dashboards == INFRA / "grafana" / "dashboards"
    assert {p.name for p in dashboards.glob("*.json")} >= {"ledger.json", "ripple.json", "requests.json"}


def test_every_mounted_file_exists_in_the_repository() -> None:
    named = set(compose().get("volumes", {}))
    for name, spec in services().items():
        for volume in spec.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"
            else:
                assert source in named, f"{name}: volume {source} is not declared"


# ---------------------------------------------------------------- what the header promises


def test_the_demo_request_of_the_header_is_accepted_by_the_packaged_config() -> None:
    curl = re.search(r"curl http://localhost:8000/v1/chat/completions (.+?) Grafana", header())
    assert curl, "the header shows a curl request"
    words = shlex.split(curl[1])
    key = next(w for w in words if w.startswith("Authorization: Bearer ")).removeprefix(
        "Authorization: Bearer "
    )
    config = load_config(DEFAULT_CONFIG)
    digest = hashlib.sha256(key.encode()).hexdigest()
    assert any(digest in tenant.api_keys_sha256 for tenant in config.tenants.values()), key
    model = re.search(r'"model":"([^"]+)"', curl[1])
    assert model and model[1] in {m.name for m in config.models}
    assert command_params("ingress")["http_port"] == 8000 and 8000 in published_or_exposed("ingress")


def test_grafana_is_the_open_development_instance_the_header_says() -> None:
    assert "Grafana http://localhost:3000 (anonymous admin)" in header()
    environment = services()["grafana"]["environment"]
    assert environment["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert environment["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Admin"
    assert 3000 in published_or_exposed("grafana")
    assert 9090 in published_or_exposed("prometheus")


def test_the_ledger_api_of_the_header_is_a_ledger_route() -> None:
    from services.ledger.service import LedgerService

    assert "Ledger http://localhost:9107/v1/ledger/totals" in header()
    assert "/v1/ledger/totals" in {route.path for route in LedgerService().routes()}  # type: ignore[attr-defined]
    assert command_params("ledger")["http_port"] == 9107 and 9107 in published_or_exposed("ledger")


def test_nats_has_no_users_as_the_header_says_and_the_services_need_none() -> None:
    assert "The NATS cluster here has no users" in header()
    confs = {}
    for name in ("nats-1", "nats-2", "nats-3"):
        conf = in_repository(name, "/etc/nats/nats.conf")
        confs[name] = conf.read_text()
        assert f"server_name: {name}" in confs[name]
        # Every cluster route names a node of the compose file.
        routes = re.findall(r"nats-route://([\w-]+):(\d+)", confs[name])
        assert {h for h, _ in routes} == {"nats-1", "nats-2", "nats-3"}
    uses_auth = any(re.search(r"^\s*(authorization|accounts)\s*[{:]", c, re.M) for c in confs.values())
    for name in ripplemesh_services():
        has_credentials = command_params(name)["nats_credentials"] is not None or (
            "RIPPLEMESH_NATS_CREDENTIALS" in ripplemesh_services()[name]["environment"]
        )
        assert has_credentials == uses_auth, f"{name}: NATS users and the services' credentials disagree"
    assert ripplemesh_services()["ingress"]["environment"]["RIPPLEMESH_NATS_REPLICAS"] == "3"
