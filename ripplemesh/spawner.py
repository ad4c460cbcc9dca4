"""Starting `ripplemesh run` children as forks of a warm parent that has imported them already.

A service process spends most of its start importing its modules (about 0.7 s of CPU for a
worker, more for the ledger; seconds of wall time on two busy cores) before it connects to
anything. A child the supervisor restarts after a kill -9 paid that inside its recovery time,
and `up` paid it once per child. So the launcher keeps one *zygote*: a process started for this
alone that imports the services' modules (which starts no thread and no event loop, so forking
it is safe), then forks a child for each start it is asked for. A child only parses its
arguments, connects and starts.

Why not multiprocessing's forkserver: its children hold the server's liveness pipe open, so a
launcher killed -9 leaves server and children running. Here the zygote ends when its stdin, a
pipe only the launcher holds, closes (the launcher is gone, however it ended), and each child
dies with the zygote (PR_SET_PDEATHSIG), as an exec'd child dies with the launcher.

The zygote speaks JSON lines: on its stdin, ``{"id", "argv", "env", "cwd", "log"}`` per start;
on its stdout, ``{"id", "pid"}`` once forked and ``{"pid", "code"}`` when a child ends (Popen's
exit code: the service's own, or -N when signal N ended it). Workers of the GPU engines (hf,
vllm) are exec'd as before: their start is the model's load, and vLLM starts processes of its
own. `RIPPLEMESH_SPAWN=exec` turns warm starts off altogether.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any, Protocol

import setproctitle

from services.mesh.processes import die_with_parent

# What a child imports before it can start: the CLI, the runtime and every service.
PRELOAD = (
    "ripplemesh.cli",
    "services.mesh.runtime",
    "services.ingress.service",
    "services.admission.service",
    "services.router.service",
    "services.prefill.service",
    "services.decode.service",
    "services.autoscaler.service",
    "services.ledger.service",
    "services.batch.service",
    "services.trace_shipper.service",
)
# Engines whose workers are exec'd (see the module's docstring).
EXEC_ENGINES = frozenset({"hf", "vllm"})
# How long a start waits for the zygote to say it forked (it forks in milliseconds once its
# imports are done, which take seconds on a busy machine).
START_TIMEOUT_S = 60.0


class ChildProcess(Protocol):
    """What the launcher needs of a child process: the part of subprocess.Popen it uses."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


def warm_starts_enabled(args: list[str]) -> bool:
    """Whether this child (its command line) starts as a fork of the zygote."""
    if os.environ.get("RIPPLEMESH_SPAWN", "warm") == "exec":
        return False
    if args[:3] != [sys.executable, "-m", "ripplemesh"]:
        return False
    if "--engine" in args and args[args.index("--engine") + 1] in EXEC_ENGINES:
        return False
    return True


def start_warm(args: list[str], env: dict[str, str], log_path: Path) -> WarmChild:
    """Start `args` (``python -m ripplemesh ...``) as a fork of the zygote, its output appended
    to `log_path`."""
    return _zygote().start(args, env, log_path)


# ---------------------------------------------------------------- the launcher's side

_zygote_instance: Zygote | None = None
_zygote_lock = threading.Lock()


def _zygote() -> Zygote:
    """This process's zygote, started on first use and again if it died."""
    global _zygote_instance
    with _zygote_lock:
        if _zygote_instance is None or not _zygote_instance.alive():
            _zygote_instance = Zygote()
        return _zygote_instance


class Zygote:
    """The launcher's handle on its zygote process: starts children, hears of their ends."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from ripplemesh.spawner import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # Not PR_SET_PDEATHSIG: that follows the launcher's thread that started it, and the
            # zygote serves every later start. It ends when the launcher's end of stdin closes.
            preexec_fn=os.setpgrp,
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._stdin: IO[bytes] = self._process.stdin
        self._lock = threading.Lock()
        self._next_id = 0
        self._started: dict[int, WarmChild] = {}  # by request id, until forked
        self._children: dict[int, WarmChild] = {}  # by pid, until ended
        self._reader = threading.Thread(
            target=self._read, args=(self._process.stdout,), name="zygote-reader", daemon=True
        )
        self._reader.start()

    def alive(self) -> bool:
        return self._process.poll() is None

    def start(self, args: list[str], env: dict[str, str], log_path: Path) -> WarmChild:
        child = WarmChild(args)
        with self._lock:
            self._next_id += 1
            self._started[self._next_id] = child
            request = {
                "id": self._next_id,
                "argv": args[3:],
                "env": env,
                "cwd": os.getcwd(),
                "log": str(log_path),
            }
            self._stdin.write(json.dumps(request).encode() + b"\n")
            self._stdin.flush()
        if not child.forked.wait(START_TIMEOUT_S) or child.pid_or_none is None:
            raise RuntimeError(
                f"the zygote did not start {' '.join(args[3:5])} within {START_TIMEOUT_S:.0f}s"
            )
        return child

    def _read(self, stdout: IO[bytes]) -> None:
        for line in stdout:
            message = json.loads(line)
            with self._lock:
                if "id" in message:
                    child = self._started.pop(message["id"])
                    child.pid_or_none = message["pid"]
                    self._children[message["pid"]] = child
                    child.forked.set()
                else:
                    ended = self._children.pop(message["pid"], None)
                    if ended is not None:
                        ended.ended(message["code"])
        # The zygote is gone, and its children with it (each dies with its parent), unseen.
        with self._lock:
            for child in self._started.values():
                child.forked.set()
            for child in self._children.values():
                child.ended(-signal.SIGKILL)
            self._started.clear()
            self._children.clear()


class WarmChild:
    """A forked child as the launcher handles it (Popen's interface, as far as it uses it)."""

    def __init__(self, args: list[str]):
        self.args = args
        self.pid_or_none: int | None = None
        self.forked = threading.Event()
        self._code: int | None = None
        self._ended = threading.Event()

    @property
    def pid(self) -> int:
        assert self.pid_or_none is not None
        return self.pid_or_none

    @property
    def returncode(self) -> int | None:
        return self._code

    def poll(self) -> int | None:
        return self._code

    def ended(self, code: int) -> None:
        self._code = code
        self._ended.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout) or self._code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._code

    def send_signal(self, sig: int) -> None:
        # Only while the zygote has not reaped it: its pid cannot have been reused.
        if self._code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---------------------------------------------------------------- the zygote's side


def serve() -> None:
    """The zygote's main: import, then fork a child per request until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    setproctitle.setproctitle(f"{sys.executable} -m ripplemesh.spawner (zygote of {os.getppid()})")
    for module in PRELOAD:
        importlib.import_module(module)
    requests = os.fdopen(os.dup(0), "rb", buffering=0)
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    woken_r, woken_w = os.pipe()
    os.set_blocking(woken_w, False)
    signal.set_wakeup_fd(woken_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    selector.register(woken_r, selectors.EVENT_READ)
    inherited = (requests, replies, woken_r, woken_w, selector.fileno())
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fileobj is requests:
                chunk = requests.read(65536)
                if not chunk:
                    return  # the launcher is gone: so are we (the children with us)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    _fork_one(json.loads(line), replies, inherited)
            else:
                os.read(woken_r, 4096)
        _reap(replies)


def _reap(replies: IO[bytes]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        replies.write(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _fork_one(request: dict[str, Any], replies: IO[bytes], zygote_files: tuple[Any, ...]) -> None:
    pid = os.fork()
    if pid:
        replies.write(json.dumps({"id": request["id"], "pid": pid}).encode() + b"\n")
        return
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        for file in zygote_files:
            os.close(file if isinstance(file, int) else file.fileno())
        die_with_parent()  # its own process group; SIGTERM when the zygote ends
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [sys.executable, *request["argv"]]
        # In ps and top as the exec'd process it stands for.
        setproctitle.setproctitle(" ".join([sys.executable, "-m", "ripplemesh", *request["argv"]]))
        from ripplemesh.cli import main

        main.main(args=request["argv"], prog_name="ripplemesh")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        # What the interpreter's own exit would have done: atexit handlers, then the streams.
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
