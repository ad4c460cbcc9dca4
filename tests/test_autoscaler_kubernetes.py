"""The Kubernetes actuator (services/autoscaler/kubernetes_actuator.py) through its protocol.

No cluster can run on this machine, so a small in-test HTTP server stands in for the Kubernetes
API: a Starlette app served by uvicorn on a free port, driven by the real `kubernetes` client. It
keeps Deployments and their pods, answers just the calls the actuator makes (read a Deployment,
list pods by label selector, merge-patch a pod, a Deployment and its scale subresource), and
plays the ReplicaSet controller: scaled down, it deletes the pods with the lowest
`controller.kubernetes.io/pod-deletion-cost` first (the newest first among equals); deleted pods
linger, terminating, until the test ends them; scaled up, it adds pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes.config.kube_config
import pytest
import pytest_asyncio
import uvicorn
from kubernetes import client
from kubernetes.client import V1LabelSelector, V1LabelSelectorRequirement
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from services.autoscaler.actuator import ActuatorError, PoolActual, ScaleAction
from services.autoscaler.kubernetes_actuator import (
    DECISION_ANNOTATION,
    DELETION_COST,
    REASON_ANNOTATION,
    REMOVE_COST,
    KubernetesActuator,
    default_deployment_name,
    label_selector,
)

NS = "ripplemesh"
DECODE = "decode-H100"
PREFILL = "prefill-H100"
POOLS = {DECODE: "ripplemesh-decode-h100", PREFILL: "ripplemesh-prefill-h100"}
MERGE_PATCHES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
TIMEOUT_S = 0.5


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386 JSON merge patch, in place (null deletes a key)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


def _status(code: int, reason: str, message: str) -> JSONResponse:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
    return JSONResponse({**body, "message": message, "reason": reason, "code": code}, status_code=code)


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in selector.split(","):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        else:
            raise ValueError(f"the fake API takes equality selectors only, not {term!r}")
    return True


@dataclass
class FakeCluster:
    """The API server's state, plus the faults a test asks for."""

    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Operation ("read-deployment", "list-pods", "patch-pod", "patch-deployment", "scale", or
    # "*" for all) -> the HTTP status it answers with.
    fail: dict[str, int] = field(default_factory=dict)
    hang: set[str] = field(default_factory=set)
    # Pods deleted the moment a patch for them arrives (answered 404): deleted meanwhile.
    vanish_on_patch: set[str] = field(default_factory=set)
    requests: list[tuple[str, str, str]] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)  # ends what hangs
    _seq: Iterator[int] = field(default_factory=itertools.count)

    def add_deployment(self, name: str, pool: str, role: str, replicas: int) -> None:
        labels = {
            "app.kubernetes.io/name": "ripplemesh",
            "ripplemesh.io/pool": pool,
            "ripplemesh.io/role": role,
        }
        self.deployments[name] = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": NS, "labels": dict(labels), "annotations": {}},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": dict(labels)},
                "template": {
                    "metadata": {"labels": dict(labels)},
                    "spec": {"containers": [{"name": "worker", "image": "ripplemesh:test"}]},
                },
            },
            "status": {"replicas": replicas},
        }
        self.reconcile(name)

    def add_pod(self, name: str, labels: dict[str, str], phase: str = "Running") -> None:
        seq = next(self._seq)
        self.pods[name] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": dict(labels),
                "annotations": {},
                "creationTimestamp": f"2025-01-01T00:{seq // 60:02d}:{seq % 60:02d}Z",
                "uid": f"uid-{seq}",
            },
            "spec": {"containers": [{"name": "worker", "image": "ripplemesh:test"}]},
            "status": {"phase": phase},
            "_seq": seq,
        }

    def selected(self, deployment: str) -> list[dict[str, Any]]:
        labels = self.deployments[deployment]["spec"]["selector"]["matchLabels"]
        return [
            pod
            for pod in self.pods.values()
            if all(pod["metadata"]["labels"].get(k) == v for k, v in labels.items())
        ]

    def reconcile(self, deployment: str) -> None:
        """The ReplicaSet controller, at once: add pods, or delete the cheapest ones."""
        spec = self.deployments[deployment]["spec"]
        live = [
            p
            for p in self.selected(deployment)
            if "deletionTimestamp" not in p["metadata"] and p["status"]["phase"] == "Running"
        ]
        for _ in range(spec["replicas"] - len(live)):
            self.add_pod(f"{deployment}-{next(self._seq):05d}", spec["template"]["metadata"]["labels"])
        excess = len(live) - spec["replicas"]
        if excess > 0:

            def rank(pod: dict[str, Any]) -> tuple[int, int]:
                return int(pod["metadata"]["annotations"].get(DELETION_COST, "0")), -pod["_seq"]

            for pod in sorted(live, key=rank)[:excess]:
                pod["metadata"]["deletionTimestamp"] = "2025-01-01T01:00:00Z"
        self.deployments[deployment]["status"]["replicas"] = spec["replicas"]

    def finish_terminations(self) -> None:
        """The kubelet, once the workers have drained: terminating pods are gone."""
        for name in [n for n, p in self.pods.items() if "deletionTimestamp" in p["metadata"]]:
            del self.pods[name]

    def pod_names(self, deployment: str) -> list[str]:
        return sorted(p["metadata"]["name"] for p in self.selected(deployment))

    def snapshot(self) -> str:
        return json.dumps([self.deployments, self.pods], sort_keys=True)


@dataclass
class Holder:
    cluster: FakeCluster = field(default_factory=FakeCluster)


def _public(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if not k.startswith("_")}


def fake_api(holder: Holder) -> Starlette:
    async def gate(request: Request, op: str) -> JSONResponse | None:
        cluster = holder.cluster
        cluster.requests.append((request.method, request.url.path, request.headers.get("content-type", "")))
        if op in cluster.hang or "*" in cluster.hang:
            # Past the client's timeout (or until the test is over); then it changes nothing.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cluster.released.wait(), timeout=10 * TIMEOUT_S)
            return _status(504, "Timeout", "too late")
        code = cluster.fail.get(op) or cluster.fail.get("*")
        if code == 403:
            return _status(403, "Forbidden", f'{op} is forbidden: User "system:serviceaccount:x" cannot')
        if code:
            return _status(code, "InternalError", f"{op}: etcdserver: request timed out")
        return None

    async def patch_body(request: Request) -> dict[str, Any] | JSONResponse:
        content_type = request.headers.get("content-type", "")
        body = await request.json()
        if content_type not in MERGE_PATCHES or not isinstance(body, dict):
            return _status(415, "UnsupportedMediaType", f"the fake takes merge patches, not {content_type}")
        return body

    def deployment_or_404(name: str) -> dict[str, Any] | JSONResponse:
        found = holder.cluster.deployments.get(name)
        if found is None:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        return found

    async def deployment(request: Request) -> JSONResponse:
        op = "read-deployment" if request.method == "GET" else "patch-deployment"
        if (refused := await gate(request, op)) is not None:
            return refused
        found = deployment_or_404(request.path_params["name"])
        if isinstance(found, JSONResponse):
            return found
        if request.method == "PATCH":
            body = await patch_body(request)
            if isinstance(body, JSONResponse):
                return body
            _merge(found, body)
            holder.cluster.reconcile(request.path_params["name"])
        return JSONResponse(found)

    async def scale(request: Request) -> JSONResponse:
        if (refused := await gate(request, "scale")) is not None:
            return refused
        name = request.path_params["name"]
        found = deployment_or_404(name)
        if isinstance(found, JSONResponse):
            return found
        body = await patch_body(request)
        if isinstance(body, JSONResponse):
            return body
        replicas = body["spec"]["replicas"]
        if not isinstance(replicas, int) or replicas < 0:
            return _status(422, "Invalid", f"spec.replicas: Invalid value: {replicas}")
        found["spec"]["replicas"] = replicas
        holder.cluster.reconcile(name)
        selector = ",".join(f"{k}={v}" for k, v in found["spec"]["selector"]["matchLabels"].items())
        return JSONResponse(
            {
                "apiVersion": "autoscaling/v1",
                "kind": "Scale",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"replicas": replicas},
                "status": {"replicas": replicas, "selector": selector},
            }
        )

    async def pods(request: Request) -> JSONResponse:
        if (refused := await gate(request, "list-pods")) is not None:
            return refused
        selector = request.query_params.get("labelSelector", "")
        items = [
            _public(p)
            for p in holder.cluster.pods.values()
            if not selector or _matches(p["metadata"]["labels"], selector)
        ]
        return JSONResponse({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})

    async def pod(request: Request) -> JSONResponse:
        if (refused := await gate(request, "patch-pod")) is not None:
            return refused
        name = request.path_params["name"]
        if name in holder.cluster.vanish_on_patch:
            holder.cluster.pods.pop(name, None)
        found = holder.cluster.pods.get(name)
        if found is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        body = await patch_body(request)
        if isinstance(body, JSONResponse):
            return body
        _merge(found, body)
        return JSONResponse(_public(found))

    base = f"/apis/apps/v1/namespaces/{NS}/deployments/{{name}}"
    return Starlette(
        routes=[
            Route(base, deployment, methods=["GET", "PATCH"]),
            Route(f"{base}/scale", scale, methods=["PATCH"]),
            Route(f"/api/v1/namespaces/{NS}/pods", pods, methods=["GET"]),
            Route(f"/api/v1/namespaces/{NS}/pods/{{name}}", pod, methods=["PATCH"]),
        ]
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server() -> AsyncIterator[tuple[Holder, str]]:
    holder = Holder()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        fake_api(holder), log_level="warning", lifespan="off", timeout_graceful_shutdown=1
    )
    uv = uvicorn.Server(config)
    task = asyncio.create_task(uv.serve(sockets=[sock]))
    while not uv.started:
        await asyncio.sleep(0.01)
    yield holder, f"http://127.0.0.1:{port}"
    uv.should_exit = True
    with contextlib.suppress(Exception):
        await asyncio.wait_for(task, timeout=5)
    sock.close()


def _api_client(host: str) -> client.ApiClient:
    configuration = client.Configuration(host=host)
    return client.ApiClient(configuration)


@pytest.fixture
def cluster(server: tuple[Holder, str]) -> Iterator[FakeCluster]:
    holder, _ = server
    holder.cluster = FakeCluster()
    holder.cluster.add_deployment(POOLS[DECODE], DECODE, "decode", 3)
    holder.cluster.add_deployment(POOLS[PREFILL], PREFILL, "prefill", 1)
    yield holder.cluster
    holder.cluster.released.set()


@pytest.fixture
def actuator(server: tuple[Holder, str]) -> Iterator[KubernetesActuator]:
    _, host = server
    made = KubernetesActuator(_api_client(host), NS, [DECODE, PREFILL], request_timeout_s=TIMEOUT_S)
    yield made
    made.close()


async def test_actual_lists_each_pools_pods_by_selector(
    cluster: FakeCluster, actuator: KubernetesActuator
) -> None:
    cluster.add_pod("stranger", {"app": "other"})
    going = cluster.pod_names(POOLS[DECODE])[0]
    labels = cluster.deployments[POOLS[DECODE]]["spec"]["template"]["metadata"]["labels"]
    cluster.add_pod("evicted", labels, phase="Failed")
    cluster.pods[going]["metadata"]["deletionTimestamp"] = "2025-01-01T01:00:00Z"

    actual = await actuator.actual()

    decode = [n for n in cluster.pod_names(POOLS[DECODE]) if n not in (going, "evicted")]
    assert actual == {
        DECODE: PoolActual(DECODE, replicas=tuple(decode), stopping=(going,)),
        PREFILL: PoolActual(PREFILL, replicas=tuple(cluster.pod_names(POOLS[PREFILL]))),
    }
    assert len(decode) == 2


async def test_scale_up_adds_pods_and_annotates_the_decision(
    cluster: FakeCluster, actuator: KubernetesActuator
) -> None:
    before = (await actuator.actual())[DECODE].replicas

    await actuator.apply(
        ScaleAction(DECODE, desired=5, add=2, decision_id="dec-1", reason="scale up: memory")
    )

    after = (await actuator.actual())[DECODE]
    assert len(after.replicas) == 5 and set(before) < set(after.replicas)
    assert after.stopping == ()
    deployment = cluster.deployments[POOLS[DECODE]]
    assert deployment["spec"]["replicas"] == 5
    assert deployment["metadata"]["annotations"][DECISION_ANNOTATION] == "dec-1"
    assert deployment["metadata"]["annotations"][REASON_ANNOTATION] == "scale up: memory"
    assert len(cluster.pod_names(POOLS[PREFILL])) == 1  # the other pool is left alone
    patches = [ct for method, _, ct in cluster.requests if method == "PATCH"]
    assert patches and all(ct == "application/merge-patch+json" for ct in patches)


async def test_scale_down_removes_exactly_the_named_pod(
    cluster: FakeCluster, actuator: KubernetesActuator
) -> None:
    # The oldest pod: without its deletion cost the ReplicaSet would delete the newest.
    oldest, *others = cluster.pod_names(POOLS[DECODE])

    await actuator.apply(ScaleAction(DECODE, desired=2, remove=(oldest,), decision_id="dec-2"))

    assert cluster.pods[oldest]["metadata"]["annotations"][DELETION_COST] == REMOVE_COST
    actual = (await actuator.actual())[DECODE]
    assert actual == PoolActual(DECODE, replicas=tuple(others), stopping=(oldest,))
    cluster.finish_terminations()
    assert cluster.pod_names(POOLS[DECODE]) == others
    assert cluster.deployments[POOLS[DECODE]]["metadata"]["annotations"][DECISION_ANNOTATION] == "dec-2"


async def test_a_pod_to_remove_that_is_gone_is_skipped(
    cluster: FakeCluster, actuator: KubernetesActuator
) -> None:
    first, second, third = cluster.pod_names(POOLS[DECODE])
    cluster.vanish_on_patch.add(second)  # deleted between the list and the patch: answered 404

    await actuator.apply(ScaleAction(DECODE, desired=1, remove=("ghost", second, first), decision_id="dec-3"))

    cluster.finish_terminations()
    assert cluster.pod_names(POOLS[DECODE]) == [third]
    assert not any(path.endswith("/pods/ghost") for _, path, _ in cluster.requests)
    assert cluster.deployments[POOLS[DECODE]]["spec"]["replicas"] == 1


async def test_never_below_zero(cluster: FakeCluster, actuator: KubernetesActuator) -> None:
    await actuator.apply(ScaleAction(PREFILL, desired=-3, decision_id="dec-4"))
    assert cluster.deployments[POOLS[PREFILL]]["spec"]["replicas"] == 0
    assert (await actuator.actual())[PREFILL].replicas == ()


@pytest.mark.parametrize("code", [403, 500])
@pytest.mark.parametrize("op", ["*", "read-deployment", "list-pods", "patch-pod", "scale"])
async def test_an_api_error_is_an_actuator_error_and_changes_nothing(
    cluster: FakeCluster, actuator: KubernetesActuator, code: int, op: str
) -> None:
    cluster.fail[op] = code
    before = cluster.snapshot()
    target = cluster.pod_names(POOLS[DECODE])[1]

    with pytest.raises(ActuatorError, match=f"HTTP {code}") as raised:
        await actuator.apply(ScaleAction(DECODE, desired=2, remove=(target,), decision_id="dec-5"))

    assert f"{NS}/" in str(raised.value)  # names what it tried
    if op == "scale":
        # The pod was marked before the scale failed: harmless, the plan is tried again with it
        # (and a later action that does not name it takes the mark off).
        cluster.pods[target]["metadata"]["annotations"].pop(DELETION_COST)
    assert cluster.snapshot() == before
    if op in ("*", "read-deployment", "list-pods"):
        with pytest.raises(ActuatorError, match=f"HTTP {code}"):
            await actuator.actual()


async def test_a_stale_mark_is_taken_off(cluster: FakeCluster, actuator: KubernetesActuator) -> None:
    first, second, third = cluster.pod_names(POOLS[DECODE])
    cluster.fail["scale"] = 500
    with pytest.raises(ActuatorError):
        await actuator.apply(ScaleAction(DECODE, desired=2, remove=(first,), decision_id="dec-6"))
    cluster.fail.clear()

    await actuator.apply(ScaleAction(DECODE, desired=2, remove=(second,), decision_id="dec-7"))

    assert DELETION_COST not in cluster.pods[first]["metadata"]["annotations"]
    cluster.finish_terminations()
    assert cluster.pod_names(POOLS[DECODE]) == [first, third]


async def test_no_answer_is_an_actuator_error_within_the_timeout(
    cluster: FakeCluster, actuator: KubernetesActuator
) -> None:
    cluster.hang.add("scale")
    before = cluster.deployments[POOLS[DECODE]]["spec"]["replicas"]
    started = time.monotonic()
    with pytest.raises(ActuatorError, match="no answer"):
        await actuator.apply(ScaleAction(DECODE, desired=1, decision_id="dec-8"))
    assert time.monotonic() - started < 2 * TIMEOUT_S + 1
    assert cluster.deployments[POOLS[DECODE]]["spec"]["replicas"] == before
    assert DECISION_ANNOTATION not in cluster.deployments[POOLS[DECODE]]["metadata"]["annotations"]


async def test_nothing_listening_is_an_actuator_error() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # a port nothing listens on
    actuator = KubernetesActuator(
        _api_client(f"http://127.0.0.1:{port}"), NS, [DECODE], request_timeout_s=TIMEOUT_S
    )
    with pytest.raises(ActuatorError, match="no answer"):
        await actuator.actual()
    with pytest.raises(ActuatorError, match="no answer"):
        await actuator.apply(ScaleAction(DECODE, desired=1))
    actuator.close()


async def test_an_unmanaged_pool_is_refused(cluster: FakeCluster, actuator: KubernetesActuator) -> None:
    with pytest.raises(ActuatorError, match="not managed"):
        await actuator.apply(ScaleAction("decode-B200", desired=1))


async def test_deployment_names_by_mapping_or_default(
    server: tuple[Holder, str], cluster: FakeCluster
) -> None:
    _, host = server
    cluster.add_deployment("custom-name", "decode-L40S", "decode", 2)
    actuator = KubernetesActuator(_api_client(host), NS, {"decode-L40S": "custom-name"})
    actual = await actuator.actual()
    assert list(actual) == ["decode-L40S"] and len(actual["decode-L40S"].replicas) == 2
    actuator.close()
    assert default_deployment_name("decode-H100") == "ripplemesh-decode-h100"


async def test_from_environment_reads_the_kubeconfig(
    server: tuple[Holder, str], cluster: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, host = server
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": host}}],
                "users": [{"name": "me", "user": {"token": "t"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "me"}}],
                "current-context": "fake",
            }
        )
    )
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    actuator = KubernetesActuator.from_environment(NS, [PREFILL])
    assert len((await actuator.actual())[PREFILL].replicas) == 1
    actuator.close()

    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "none"))
    with pytest.raises(ActuatorError, match="kubeconfig"):
        KubernetesActuator.from_environment(NS, [PREFILL])


def test_label_selector_from_a_deployments_selector() -> None:
    selector = V1LabelSelector(
        match_labels={"ripplemesh.io/pool": "decode-H100", "app": "ripplemesh"},
        match_expressions=[
            V1LabelSelectorRequirement(key="tier", operator="In", values=["a", "b"]),
            V1LabelSelectorRequirement(key="canary", operator="DoesNotExist"),
            V1LabelSelectorRequirement(key="gpu", operator="Exists"),
            V1LabelSelectorRequirement(key="zone", operator="NotIn", values=["x"]),
        ],
    )
    assert label_selector(selector) == (
        "app=ripplemesh,ripplemesh.io/pool=decode-H100,tier in (a,b),!canary,gpu,zone notin (x)"
    )
    with pytest.raises(ValueError, match="empty"):
        label_selector(V1LabelSelector())
