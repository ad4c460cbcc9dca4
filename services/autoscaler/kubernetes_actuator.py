"""The autoscaler's actuator on Kubernetes: each pool is one Deployment, scaled through its
``scale`` subresource.

A Deployment's size says how many pods, not which ones; the policy names the replicas that go
(`ScaleAction.remove`). So before scaling down, each of those pods gets a low
``controller.kubernetes.io/pod-deletion-cost``: the ReplicaSet controller removes the pods with
the lowest cost first, so the replica the policy chose is the one that goes (among pods that are
equally scheduled, running and ready: a pending or unready pod still goes before a ready one).
The pod is then deleted and the worker drains before it ends: the worker Deployments' preStop
hook orders the drain (infra/k8s/), and SIGTERM takes the same path (services/mesh/runtime.py).
The worker heart-beats ``draining`` at once (the routers place nothing new on it), lets its work
in flight finish, leaves the rest on the WORK stream for the routers to migrate, then exits; the
pod's ``terminationGracePeriodSeconds`` outlasts that. A mark left by an earlier action on a pod
the current one does not name is taken off, so only the pods named now are first in line.

The `kubernetes` client (the ``k8s`` extra) is synchronous: its calls run in a thread, each
bounded by `request_timeout_s`. Any failure of the API (refused, an error, no answer) is raised
as `ActuatorError`, naming what was tried; the plan is kept and tried again, and every step is
idempotent. The service account needs get/list/watch and patch on pods and get/patch on
deployments and deployments/scale in the namespace (infra/k8s/autoscaler-rbac.yaml).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.client import ApiClient, ApiException, V1LabelSelector, V1Pod

from services.autoscaler.actuator import ActuatorError, PoolActual, ScaleAction

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# Below a pod's default cost (0) and any an operator is likely to set by hand.
REMOVE_COST = "-1000"
DECISION_ANNOTATION = "ripplemesh.io/scaling-decision"
REASON_ANNOTATION = "ripplemesh.io/scaling-reason"
MERGE_PATCH = "application/merge-patch+json"
DEFAULT_REQUEST_TIMEOUT_S = 10.0

T = TypeVar("T")


def default_deployment_name(pool: str) -> str:
    """`ripplemesh-<pool>`, lower-cased: a worker's pool is `decode-H100`, a Deployment's name a
    DNS label (`ripplemesh-decode-h100`)."""
    return f"ripplemesh-{pool}".lower()


def label_selector(selector: V1LabelSelector | None) -> str:
    """A Deployment's `spec.selector` as the `labelSelector` query a pod list takes."""
    if selector is None:
        raise ValueError("the Deployment has no selector")
    terms = [f"{key}={value}" for key, value in sorted((selector.match_labels or {}).items())]
    for requirement in selector.match_expressions or []:
        values = ",".join(requirement.values or [])
        match requirement.operator:
            case "In":
                terms.append(f"{requirement.key} in ({values})")
            case "NotIn":
                terms.append(f"{requirement.key} notin ({values})")
            case "Exists":
                terms.append(requirement.key)
            case "DoesNotExist":
                terms.append(f"!{requirement.key}")
            case other:
                raise ValueError(f"unknown label selector operator {other!r}")
    if not terms:
        # An empty selector selects every pod in the namespace: never what a pool means.
        raise ValueError("the Deployment's selector is empty")
    return ",".join(terms)


@dataclass(frozen=True, slots=True)
class _Pod:
    name: str
    terminating: bool  # it has a deletionTimestamp: stopping (draining, then gone)
    deletion_cost: str | None


def _pod(pod: V1Pod) -> _Pod | None:
    """The little the actuator needs of a pod; None for one without a name or that has ended
    (Succeeded, Failed: evicted, say), which is no replica and is not stopping."""
    meta = pod.metadata
    if meta is None or not meta.name:
        return None
    if pod.status is not None and pod.status.phase in ("Succeeded", "Failed"):
        return None
    cost = (meta.annotations or {}).get(DELETION_COST)
    return _Pod(meta.name, meta.deletion_timestamp is not None, cost)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        message = ""
        try:
            body = json.loads(exc.body or "")
            if isinstance(body, dict):
                message = str(body.get("message") or "")
        except ValueError:
            message = (exc.body or "")[:200]
        return f"HTTP {exc.status} {exc.reason or ''}".rstrip() + (f": {message}" if message else "")
    return f"{type(exc).__name__}: {exc}"


class KubernetesActuator:
    """Scales one Deployment per pool, in one namespace, through the Kubernetes API."""

    def __init__(
        self,
        api_client: ApiClient,
        namespace: str,
        pools: Mapping[str, str] | Iterable[str] = (),
        *,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        """`pools`: the pools managed, as a mapping pool -> Deployment name, or an iterable of
        pool names (each Deployment named by `default_deployment_name`)."""
        self.namespace = namespace
        self.deployments: dict[str, str] = (
            dict(pools) if isinstance(pools, Mapping) else {p: default_deployment_name(p) for p in pools}
        )
        self.request_timeout_s = request_timeout_s
        self.api_client = api_client
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)

    @classmethod
    def from_environment(
        cls,
        namespace: str,
        pools: Mapping[str, str] | Iterable[str] = (),
        *,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> KubernetesActuator:
        """In a pod, its service account (in-cluster config); elsewhere, the kubeconfig
        (`$KUBECONFIG` or ~/.kube/config, its current context)."""
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except config.ConfigException:
            try:
                config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            except (config.ConfigException, OSError) as exc:
                raise ActuatorError(f"no in-cluster config and no usable kubeconfig: {exc}") from exc
        return cls(ApiClient(configuration), namespace, pools, request_timeout_s=request_timeout_s)

    def close(self) -> None:
        self.api_client.close()  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ the protocol

    async def actual(self) -> dict[str, PoolActual]:
        pools = list(self.deployments)
        found = await asyncio.gather(*(self._pool_actual(pool) for pool in pools))
        return dict(zip(pools, found, strict=True))

    async def apply(self, action: ScaleAction) -> None:
        deployment = self._deployment(action.pool)
        desired = max(0, action.desired)
        pods = await self._pods(deployment)
        remove = set(action.remove)
        for pod in pods:
            if pod.name in remove and not pod.terminating and pod.deletion_cost != REMOVE_COST:
                await self._mark_pod(pod.name, REMOVE_COST)
            elif pod.name not in remove and pod.deletion_cost == REMOVE_COST:
                # An earlier action's mark (its scale failed, or the plan changed since).
                await self._mark_pod(pod.name, None)
        # A pod named in `remove` that no longer exists is skipped: it is gone already.
        await self._call(
            f"scale Deployment {self.namespace}/{deployment} to {desired}",
            self.apps.patch_namespaced_deployment_scale,
            deployment,
            self.namespace,
            {"spec": {"replicas": desired}},
            _content_type=MERGE_PATCH,
        )
        annotations = {DECISION_ANNOTATION: action.decision_id, REASON_ANNOTATION: action.reason}
        await self._call(
            f"annotate Deployment {self.namespace}/{deployment} with decision {action.decision_id!r}",
            self.apps.patch_namespaced_deployment,
            deployment,
            self.namespace,
            {"metadata": {"annotations": annotations}},
            _content_type=MERGE_PATCH,
        )

    # ------------------------------------------------------------------ the steps

    def _deployment(self, pool: str) -> str:
        try:
            return self.deployments[pool]
        except KeyError:
            raise ActuatorError(f"pool {pool!r} is not managed here (no Deployment for it)") from None

    async def _pods(self, deployment: str) -> list[_Pod]:
        """The Deployment's pods (by its selector), ended ones left out, sorted by name."""
        found = await self._call(
            f"read Deployment {self.namespace}/{deployment}",
            self.apps.read_namespaced_deployment,
            deployment,
            self.namespace,
        )
        try:
            selector = label_selector(found.spec.selector if found.spec is not None else None)
        except ValueError as exc:
            raise ActuatorError(f"Deployment {self.namespace}/{deployment}: {exc}") from exc
        listed = await self._call(
            f"list the pods of Deployment {self.namespace}/{deployment} ({selector})",
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=selector,
        )
        pods = [pod for pod in map(_pod, listed.items) if pod is not None]
        return sorted(pods, key=lambda pod: pod.name)

    async def _pool_actual(self, pool: str) -> PoolActual:
        pods = await self._pods(self._deployment(pool))
        running = tuple(pod.name for pod in pods if not pod.terminating)
        stopping = tuple(pod.name for pod in pods if pod.terminating)
        return PoolActual(pool, replicas=running, stopping=stopping)

    async def _mark_pod(self, name: str, cost: str | None) -> None:
        """Set (or, with None, take off) the pod's deletion cost; a pod gone meanwhile is skipped."""
        what = f"set {DELETION_COST}={cost} on pod {self.namespace}/{name}"
        if cost is None:
            what = f"take {DELETION_COST} off pod {self.namespace}/{name}"
        try:
            await self._call(
                what,
                self.core.patch_namespaced_pod,
                name,
                self.namespace,
                {"metadata": {"annotations": {DELETION_COST: cost}}},
                _content_type=MERGE_PATCH,
                not_found_ok=True,
            )
        except _NotFound:
            return

    async def _call(
        self, what: str, method: Callable[..., T], *args: Any, not_found_ok: bool = False, **kwargs: Any
    ) -> T:
        """One API call in a thread, bounded; any failure raised as ActuatorError (a 404 as
        _NotFound with `not_found_ok`)."""
        kwargs["_request_timeout"] = self.request_timeout_s
        try:
            return await asyncio.to_thread(method, *args, **kwargs)
        except ApiException as exc:
            if not_found_ok and exc.status == 404:
                raise _NotFound from exc
            raise ActuatorError(f"Kubernetes API: could not {what}: {_describe(exc)}") from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ActuatorError(
                f"Kubernetes API: could not {what}: no answer ({_describe(exc)}; each call "
                f"times out after {self.request_timeout_s:g} s)"
            ) from exc
        except ValueError as exc:  # a response that does not decode as the object asked for
            raise ActuatorError(f"Kubernetes API: could not {what}: a bad answer ({exc})") from exc


class _NotFound(Exception):
    pass
