"""The example Kubernetes manifests (infra/k8s/) as CI checks them, offline.

Every Kubernetes object there is validated against the Kubernetes 1.30 OpenAPI schemas, strictly
(an unknown field is an error), with `kubernetes_validate`, which ships the schemas: no network is
used (the test forbids it). Then the cross-references a user would otherwise find on a cluster:
selectors and labels, Services and their pods, the autoscaler's RBAC, the kustomization, the
container commands against the real `ripplemesh` CLI, the mesh config, the worker pools against
the Kubernetes actuator's naming, probes, ports and Prometheus annotations.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import click
import kubernetes_validate
import msgspec
import pytest
import yaml
from click.testing import CliRunner

from ripplemesh.cli import main
from services.autoscaler.kubernetes_actuator import default_deployment_name
from services.mesh.config import DEFAULT_CONFIG, MeshConfig

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "infra" / "k8s"
KUBERNETES_VERSION = "1.30"
NAMESPACE = "ripplemesh"
# Files under infra/k8s that are not Kubernetes objects.
NOT_OBJECTS = {"kustomization.yaml", "nats-values.yaml"}
HTTP_PORT = 8000


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name not in NOT_OBJECTS)


OBJECTS: list[tuple[str, dict[str, Any]]] = [
    (path.name, doc) for path in _manifest_files() for doc in _documents(path)
]


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in OBJECTS if doc["kind"] == kind]


def _name(doc: dict[str, Any]) -> str:
    return str(doc["metadata"]["name"])


DEPLOYMENTS = {_name(d): d for d in _of_kind("Deployment")}
SERVICES = {_name(s): s for s in _of_kind("Service")}


def _pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def _containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, deployment in DEPLOYMENTS.items():
        for container in _pod_spec(deployment)["containers"]:
            yield name, container


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet would give it (downward API values stand in)."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        else:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = {"metadata.name": "ripplemesh-pod-7c9f8-x2x4q"}.get(field, f"<{field}>")
    return env


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def _invocations(container: dict[str, Any]) -> Iterator[list[str]]:
    """Each `ripplemesh` command line the container runs: its command, and its lifecycle hooks'."""
    env = _env(container)
    yield [_expand(a, env) for a in container.get("command", []) + container.get("args", [])]
    for hook in container.get("lifecycle", {}).values():
        line = hook["exec"]["command"]
        if line[:2] == ["sh", "-c"]:
            script = re.sub(
                r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), m.group(0)), line[2]
            )
            words = shlex.split(script)
            segment: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", "||", ";"):
                    if segment and segment[0] == "ripplemesh":
                        yield segment
                    segment = []
                else:
                    segment.append(word)
        elif line and line[0] == "ripplemesh":
            yield list(line)


def _run_options(argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """`ripplemesh run ...` parsed by the real click command, without running it, in the
    container's environment (the options that read one: NATS_URL, ...)."""
    with mock.patch.dict(os.environ, env or {}):
        ctx = main.commands["run"].make_context("run", argv[2:])
    return dict(ctx.params)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("the manifest checks must not use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


# ------------------------------------------------------------------ schemas


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize(("file", "doc"), OBJECTS, ids=[f"{f}:{d['kind']}/{_name(d)}" for f, d in OBJECTS])
def test_every_object_validates_against_the_kubernetes_schemas(file: str, doc: dict[str, Any]) -> None:
    assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


@pytest.mark.usefixtures("no_network")
def test_the_validation_catches_mistakes() -> None:
    deployment = yaml.safe_load(yaml.safe_dump(DEPLOYMENTS["ripplemesh-router"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    deployment = yaml.safe_load(yaml.safe_dump(DEPLOYMENTS["ripplemesh-router"]))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_there_are_the_expected_objects() -> None:
    services = ("ingress", "admission", "router", "ledger", "autoscaler", "batch")
    workers = ("prefill-h100", "decode-h100")
    assert set(DEPLOYMENTS) == {f"ripplemesh-{n}" for n in (*services, *workers)}
    assert set(SERVICES) == {f"ripplemesh-{n}" for n in services}
    assert [_name(n) for n in _of_kind("Namespace")] == [NAMESPACE]
    assert not list(K8S.glob("*.yml")), "use .yaml: the checks read *.yaml"


# ------------------------------------------------------------------ kustomize


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == NAMESPACE
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    assert set(resources) == {p.name for p in _manifest_files()}
    for _, doc in OBJECTS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, _name(doc)


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) is not installed"
)
def test_kustomize_builds_the_same_objects() -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    docs = [d for d in yaml.safe_load_all(built) if d]
    assert sorted((d["kind"], _name(d)) for d in docs) == sorted((d["kind"], _name(d)) for _, d in OBJECTS)


# ------------------------------------------------------------------ cross-references


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_each_deployments_selector_matches_its_pods_and_no_other(name: str) -> None:
    deployment = DEPLOYMENTS[name]
    selector = deployment["spec"]["selector"]
    assert set(selector) == {"matchLabels"}, "the checks (and the actuator's tests) read matchLabels"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _selects(selector["matchLabels"], labels)
    for other, them in DEPLOYMENTS.items():
        if other != name:
            assert not _selects(selector["matchLabels"], them["spec"]["template"]["metadata"]["labels"]), (
                f"{name}'s selector also takes {other}'s pods"
            )


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_service_selects_one_deployments_pods_on_a_named_port(name: str) -> None:
    service = SERVICES[name]
    selector = service["spec"]["selector"]
    chosen = [
        d for d in DEPLOYMENTS.values() if _selects(selector, d["spec"]["template"]["metadata"]["labels"])
    ]
    assert len(chosen) == 1, f"{name} selects {[_name(d) for d in chosen]}"
    ports = {p["name"] for c in _pod_spec(chosen[0])["containers"] for p in c.get("ports", [])}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports


def test_the_autoscaler_runs_as_the_service_account_its_role_is_bound_to() -> None:
    (account,) = _of_kind("ServiceAccount")
    (role,) = _of_kind("Role")
    (binding,) = _of_kind("RoleBinding")
    assert _pod_spec(DEPLOYMENTS["ripplemesh-autoscaler"])["serviceAccountName"] == _name(account)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": _name(role),
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": _name(account), "namespace": NAMESPACE}]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    expected = {("", "pods", v) for v in ("get", "list", "watch", "patch")} | {
        ("apps", r, v) for r in ("deployments", "deployments/scale") for v in ("get", "patch")
    }
    assert granted == expected
    for name, deployment in DEPLOYMENTS.items():
        if name != "ripplemesh-autoscaler":
            spec = _pod_spec(deployment)
            assert "serviceAccountName" not in spec and spec["automountServiceAccountToken"] is False, name


# ------------------------------------------------------------------ the containers' commands


def _run_help(service: str) -> str:
    result = CliRunner().invoke(main, ["run", service, "--help"])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize(("deployment", "container"), list(_containers()), ids=[n for n, _ in _containers()])
def test_container_commands_are_real_ripplemesh_commands(deployment: str, container: dict[str, Any]) -> None:
    env = _env(container)
    invocations = list(_invocations(container))
    main_argv = invocations[0]
    assert main_argv[:2] == ["ripplemesh", "run"], main_argv
    service = main_argv[2]
    assert service in main.commands["run"].params[0].type.choices  # type: ignore[attr-defined]

    help_text = _run_help(service)
    for arg in main_argv[3:]:
        if arg.startswith("--"):
            assert f"{arg.split('=', 1)[0]} " in help_text, f"{arg} is not an option of ripplemesh run"
    options = _run_options(main_argv, env)  # raises on an unknown option or a bad value
    assert options["service"] == service
    assert options["nats_url"] == "nats://nats:4222"
    assert options["http_host"] == "0.0.0.0", "the default 127.0.0.1 is unreachable by probes"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert options["http_port"] == ports["http"] == HTTP_PORT
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod_spec(DEPLOYMENTS[deployment])["volumes"]}
    config_mount = volumes[mounts[str(options["config_file"].parent)]]
    assert config_mount["configMap"]["name"] == "ripplemesh-config"
    assert options["config_file"].name == "config.toml"
    assert str(options["data_dir"]) in mounts
    assert 1 <= options["nats_replicas"] <= 3
    if service in ("prefill", "decode"):
        assert options["worker_id"] == env["POD_NAME"], "the worker id is the pod's name (downward API)"

    for argv in invocations[1:]:  # lifecycle hooks
        assert argv[0] == "ripplemesh" and argv[1] in main.commands, argv
        with mock.patch.dict(os.environ, env):
            main.commands[argv[1]].make_context(argv[1], argv[2:])


def test_the_config_map_is_the_mesh_config() -> None:
    (config_map,) = _of_kind("ConfigMap")
    text = config_map["data"]["config.toml"]
    msgspec.toml.decode(text.encode(), type=MeshConfig)  # the services' own parse
    assert text == DEFAULT_CONFIG.read_text(), (
        "infra/k8s/config.yaml is a copy of services/mesh/default_config.toml: keep them in step"
    )


# ------------------------------------------------------------------ workers


WORKERS = {n: d for n, d in DEPLOYMENTS.items() if "ripplemesh.io/pool" in d["metadata"]["labels"]}


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_worker_pools_are_what_the_workers_report_and_the_actuator_scales(name: str) -> None:
    deployment = WORKERS[name]
    labels = deployment["metadata"]["labels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    pool, role = labels["ripplemesh.io/pool"], labels["ripplemesh.io/role"]
    assert pod_labels["ripplemesh.io/pool"] == pool and pod_labels["ripplemesh.io/role"] == role
    assert deployment["spec"]["selector"]["matchLabels"]["ripplemesh.io/pool"] == pool
    (container,) = _pod_spec(deployment)["containers"]
    options = _run_options(next(_invocations(container)), _env(container))
    assert options["service"] == role
    # services/{prefill,decode}/service.py: a worker's pool is "<role>-<gpu type>".
    assert pool == f"{role}-{options['gpu']}"
    assert name == default_deployment_name(pool)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_workers_have_time_to_drain(name: str) -> None:
    spec = _pod_spec(WORKERS[name])
    (container,) = spec["containers"]
    grace = spec["terminationGracePeriodSeconds"]
    # The runtime's shutdown after a drain: in-flight handlers, the service's stop (15 s), tasks
    # (5 s), HTTP (2 x 6 s), NATS and spans: about 40 s at worst.
    shutdown_s = 40
    (drain,) = [argv for argv in _invocations(container) if argv[:2] == ["ripplemesh", "drain"]]
    drain_grace = main.commands["drain"].make_context("drain", drain[2:]).params["grace_s"]
    assert drain_grace + shutdown_s <= grace
    hook = container["lifecycle"]["preStop"]["exec"]["command"][2]
    (sleep_s,) = re.findall(r"sleep (\d+)", hook)
    assert drain_grace <= int(sleep_s) < grace, "the hook stays open through the drain, within the grace"


# ------------------------------------------------------------------ probes, metrics, NATS


@pytest.mark.parametrize(("deployment", "container"), list(_containers()), ids=[n for n, _ in _containers()])
def test_probes_and_prometheus_annotations(deployment: str, container: dict[str, Any]) -> None:
    ports = {p["name"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    readiness = "/health" if deployment == "ripplemesh-ingress" else "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == readiness
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    annotations = DEPLOYMENTS[deployment]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == HTTP_PORT


def test_nats_comes_from_the_helm_chart_the_services_point_at() -> None:
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    assert values["config"]["jetstream"]["enabled"] is True
    assert values["config"]["cluster"] == {"enabled": True, "replicas": 3}
    readme = (K8S / "README.md").read_text()
    assert "helm repo add nats https://nats-io.github.io/k8s/helm/charts/" in readme
    assert "helm install nats nats/nats" in readme  # release "nats": its Service is nats:4222
    for _, container in _containers():
        env = _env(container)
        assert env["NATS_URL"] == "nats://nats:4222"
        assert int(env["RIPPLEMESH_NATS_REPLICAS"]) <= values["config"]["cluster"]["replicas"]


def test_click_rejects_what_the_command_check_relies_on_rejecting() -> None:
    with pytest.raises(click.UsageError):
        _run_options(["ripplemesh", "run", "decode", "--worker-idd=x"], {"NATS_URL": "nats://x:4222"})
    with pytest.raises(click.BadParameter):
        _run_options(["ripplemesh", "run", "decode", "--engine=tensorrt"], {"NATS_URL": "nats://x:4222"})
