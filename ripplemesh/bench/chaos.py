"""`ripplemesh bench chaos`: the mesh as `up` runs it, under a steady load of streaming requests
from the official openai client, while a service is killed (SIGKILL) every few seconds.

Services are killed in turn by kind (decode, prefill, router, admission, ledger, ingress, and
on a NATS cluster a NATS node), a random one of the kind, so each kind dies about equally
often; `up`'s supervisor (the same `Mesh.tend` that `up` calls) restarts them. The load is
open-loop at `rate` requests per second, greedy, each prompt one of a small set, so that every
completed stream can be checked against what an undisturbed mesh answers for the same prompt
(asked once the drill is over).

Figures:
- requests sent, completed, failed by reason, and those cut because the ingress process holding
  their HTTP connection was killed (a client's retry would land on the restarted one);
- tokens duplicated or missing in the completed streams (chunks against the usage), and streams
  whose text differs from the reference;
- the ledger's count of completed requests against the mesh's (the drill's and the references');
- per kill, the time from the kill until the supervisor saw the service healthy again.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import random
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import openai
from rich.console import Console
from rich.table import Table

from ripplemesh.launcher import Mesh
from services.mesh.config import DEFAULT_CONFIG
from services.mesh.embedded_nats import free_port

KINDS = ("decode", "prefill", "router", "admission", "ledger", "ingress", "batch")
API_KEY = "rm-demo-key"
PROMPTS = [f"chaos prompt {i}: explain how the mesh keeps a stream going " * 3 for i in range(16)]


@dataclass
class Outcome:
    prompt: int
    started: float
    ended: float = 0.0
    text: str = ""
    chunks: int = 0
    completion_tokens: int | None = None
    finish: str | None = None
    error: str | None = None
    request_id: str | None = None  # from the first chunk's id
    detail: str | None = None  # what cut a connection (the HTTP client's own error)


@dataclass
class Kill:
    kind: str
    name: str
    at: float
    recovered_s: float | None = None


@dataclass
class Drill:
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    # When the load generator's own event loop ran late by more than a second, and by how
    # much: a client whose loop stalls past its connect timeout fails on its own.
    stalls: list[tuple[float, float]] = field(default_factory=list)
    load_niceness: int = 0  # the load generator's (LOAD_NICENESS where the host allows it)


async def _watch_loop(drill: Drill, every_s: float = 0.1) -> None:
    while True:
        before = time.monotonic()
        await asyncio.sleep(every_s)
        late = time.monotonic() - before - every_s
        if late > 1.0:
            drill.stalls.append((before, late))


async def _one(api: openai.AsyncOpenAI, outcome: Outcome, max_tokens: int) -> None:
    try:
        stream = await api.chat.completions.create(
            model="llama-3-8b",
            messages=[{"role": "user", "content": PROMPTS[outcome.prompt]}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            outcome.request_id = outcome.request_id or chunk.id.removeprefix("chatcmpl-")
            if chunk.usage is not None:
                outcome.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    outcome.text += choice.delta.content
                    outcome.chunks += 1
                outcome.finish = choice.finish_reason or outcome.finish
    except openai.APIStatusError as exc:
        outcome.error = f"HTTP {exc.status_code}"
    except openai.APIConnectionError as exc:
        outcome.error = "connection cut"
        outcome.detail = repr(exc.__cause__ or exc)[:200]
    except Exception as exc:
        # An error event mid-stream (openai.APIError): its message says which (stalled, failed).
        outcome.error = f"{type(exc).__name__}: {str(exc)[:60]}"
    finally:
        outcome.ended = time.monotonic()


def _supervise(mesh: Mesh, stop: threading.Event, console: Console) -> None:
    while not stop.is_set():
        for line in mesh.tend():
            console.print(f"[dim]{line}")
        time.sleep(0.1)


def _kinds(mesh: Mesh) -> tuple[str, ...]:
    return (*KINDS, "nats") if len(mesh.nats_children) > 1 else KINDS


def _kill_one(mesh: Mesh, kind: str, rng: random.Random) -> Kill | None:
    running = [
        c
        for c in [*mesh.nats_children, *mesh.children]
        if c.name.split("-")[0] == kind and c.state == "running" and c.process is not None
    ]
    if not running:
        return None
    child = rng.choice(running)
    assert child.process is not None
    child.process.send_signal(signal.SIGKILL)
    return Kill(kind, child.name, time.monotonic())


# The clients stand for machines elsewhere: on a small host the load generator would otherwise
# share its CPU with the mesh it drives, and a client starved for seconds times out on its own
# (a ConnectTimeout whose SYN the kernel answered at once). So it runs in a process of its own,
# ahead of the mesh's where the host allows (root may lower a niceness; anyone else runs it at
# the mesh's), and says how often its own loop still ran late.
LOAD_NICENESS = -10


def _load_process(
    port: int, duration_s: float, rate: float, max_tokens: int, seed: int, results: Any
) -> None:
    """The load, in its own process: sends `("start", t)` then `("done", outcomes, stalls)`."""
    with contextlib.suppress(PermissionError, OSError):
        os.setpriority(os.PRIO_PROCESS, 0, LOAD_NICENESS)
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    drill = asyncio.run(_load(port, duration_s, rate, max_tokens, seed, results, niceness))
    results.put(("done", drill.outcomes, drill.stalls, niceness))


async def _load(
    port: int, duration_s: float, rate: float, max_tokens: int, seed: int, results: Any, niceness: int
) -> Drill:
    rng = random.Random(seed)
    drill = Drill()
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
    tasks: list[asyncio.Task[None]] = []
    start = time.monotonic()  # CLOCK_MONOTONIC: the same clock in the drill's process
    results.put(("start", start, niceness))
    watch = asyncio.create_task(_watch_loop(drill))
    try:
        sent = 0
        while (now := time.monotonic()) - start < duration_s:
            while sent < (now - start) * rate:
                outcome = Outcome(prompt=rng.randrange(len(PROMPTS)), started=time.monotonic())
                drill.outcomes.append(outcome)
                tasks.append(asyncio.create_task(_one(api, outcome, max_tokens)))
                sent += 1
            await asyncio.sleep(0.005)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)
    finally:
        watch.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await api.close()
    return drill


def _drill(
    mesh: Mesh, *, duration_s: float, rate: float, kill_every_s: float, max_tokens: int, seed: int
) -> Drill:
    """The load in its own process; the kills from here, each `kill_every_s` from its start."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    load = context.Process(
        target=_load_process,
        args=(mesh.http_port, duration_s, rate, max_tokens, seed, results),
        name="chaos-load",
        daemon=True,
    )
    load.start()
    rng = random.Random(seed + 1)
    drill = Drill()
    try:
        _, start, drill.load_niceness = results.get(timeout=60)
        turn = 0
        next_kill = start + kill_every_s
        while next_kill - start < duration_s:
            time.sleep(max(0.0, next_kill - time.monotonic()))
            kinds = _kinds(mesh)
            kill = _kill_one(mesh, kinds[turn % len(kinds)], rng)
            turn += 1
            if kill is not None:
                drill.kills.append(kill)
            next_kill += kill_every_s
        # The streams still open, then the ones cut waiting out their timeouts: within 180 s.
        _, drill.outcomes, drill.stalls, _ = results.get(timeout=duration_s + 240)
        load.join(timeout=30)
    finally:
        if load.is_alive():
            load.kill()
            load.join(timeout=10)
    return drill


async def _references(mesh: Mesh, max_tokens: int) -> list[str]:
    """What the healed mesh answers for each prompt."""
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key=API_KEY, max_retries=2)
    try:
        replies = await asyncio.gather(
            *(
                api.chat.completions.create(
                    model="llama-3-8b",
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=max_tokens,
                    temperature=0,
                )
                for prompt in PROMPTS
            )
        )
    finally:
        await api.close()
    return [r.choices[0].message.content or "" for r in replies]


def _all_running(mesh: Mesh, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(c.state == "running" for c in mesh.children):
            return True
        time.sleep(0.2)
    return False


def _ledger_completed(mesh: Mesh) -> int:
    with urllib.request.urlopen(f"{mesh.child('ledger').url}/v1/ledger/totals", timeout=5) as response:
        totals: dict[str, Any] = msgspec.json.decode(response.read())
    return int(totals["requests"]["completed"])


def _ledger_status(mesh: Mesh, request_id: str) -> str | None:
    try:
        url = f"{mesh.child('ledger').url}/v1/ledger/requests/{request_id}"
        with urllib.request.urlopen(url, timeout=5) as response:
            row: dict[str, Any] = msgspec.json.decode(response.read())
    except OSError:
        return None
    return str(row.get("status"))


def _recoveries(mesh: Mesh, drill: Drill) -> None:
    """Each kill's recovery: the supervisor's times from seeing the exit (within 0.1 s of the
    kill) to the service healthy again, in order per child."""
    by_child = {c.name: list(c.recoveries_s) for c in [*mesh.nats_children, *mesh.children]}
    for kill in drill.kills:
        times = by_child.get(kill.name) or []
        kill.recovered_s = times.pop(0) if times else None


def _write_timeline(drill: Drill, path: Path) -> None:
    """The kills and the failed requests, in time order (seconds since the drill began), beside
    the mesh's logs in the data directory: what a failure coincided with."""
    begin = min([o.started for o in drill.outcomes] + [k.at for k in drill.kills], default=0.0)
    rows: list[dict[str, Any]] = (
        [{"at": round(k.at - begin, 3), "kill": k.name, "kind": k.kind} for k in drill.kills]
        + [
            {"at": round(at - begin, 3), "load_generator_stalled_s": round(late, 3)}
            for at, late in drill.stalls
        ]
        + [
            {
                "at": round(o.started - begin, 3),
                "ended": round(o.ended - begin, 3),
                "error": o.error or "no final chunk",
                "request_id": o.request_id,
                "chunks": o.chunks,
                "detail": o.detail,
            }
            for o in drill.outcomes
            if o.error is not None or o.finish is None
        ]
    )
    rows.sort(key=lambda row: row["at"])
    path.write_text("".join(msgspec.json.encode(row).decode() + "\n" for row in rows))


def run_chaos_bench(
    *,
    duration_s: float,
    rate: float,
    kill_every_s: float,
    max_tokens: int,
    prefill: int,
    decode: int,
    nats_cluster: int,
    time_scale: float,
    seed: int,
    console: Console,
    ingress: int = 1,
    data_dir: Path | None = None,
) -> dict[str, Any]:
    with contextlib.ExitStack() as cleanup:
        if data_dir is None:  # kept only when given: its logs tell what each failure was
            data_dir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="ripplemesh-chaos-")))
        data_dir.mkdir(parents=True, exist_ok=True)
        config = data_dir / "ripplemesh.toml"
        config.write_text(DEFAULT_CONFIG.read_text())
        mesh = Mesh(
            data_dir=data_dir,
            config_path=config,
            http_port=free_port(),
            prefill=prefill,
            decode=decode,
            time_scale=time_scale,
            nats_cluster=nats_cluster,
            ingress=ingress,
        )
        console.print(
            f"chaos drill: {duration_s:g} s at {rate:g} requests/s, a kill every {kill_every_s:g} s, "
            f"{prefill} prefill + {decode} decode + {ingress} ingress, NATS {nats_cluster} node(s)"
        )
        stop = threading.Event()
        with mesh:
            supervisor = threading.Thread(target=_supervise, args=(mesh, stop, console), daemon=True)
            supervisor.start()
            try:
                drill = _drill(
                    mesh,
                    duration_s=duration_s,
                    rate=rate,
                    kill_every_s=kill_every_s,
                    max_tokens=max_tokens,
                    seed=seed,
                )
                _write_timeline(drill, data_dir / "chaos-timeline.jsonl")
                healed = _all_running(mesh, timeout_s=60)
                references = asyncio.run(_references(mesh, max_tokens))
                time.sleep(3)  # the ledger's last events
                ledger_completed = _ledger_completed(mesh)
                # Streams cut with their ingress: the workers went on and finished them.
                finished_unread = sum(
                    1
                    for o in drill.outcomes
                    if o.error is not None
                    and o.request_id
                    and _ledger_status(mesh, o.request_id) == "completed"
                )
            finally:
                stop.set()
                supervisor.join(5)
            _recoveries(mesh, drill)
    return _report(drill, references, ledger_completed, finished_unread, healed, max_tokens, console)


def _report(
    drill: Drill,
    references: list[str],
    ledger_completed: int,
    finished_unread: int,
    healed: bool,
    max_tokens: int,
    console: Console,
) -> dict[str, Any]:
    # An ingress is down from its kill until the supervisor saw it healthy (a second or so): a
    # stream it held is cut, and a request sent meanwhile finds no one listening on the port.
    down = [(k.at, k.at + (k.recovered_s or 60.0) + 0.5) for k in drill.kills if k.kind == "ingress"]
    completed = [o for o in drill.outcomes if o.error is None and o.finish is not None]
    failed = [o for o in drill.outcomes if o not in completed]
    cut_by_ingress = [
        o
        for o in failed
        if o.error == "connection cut" and any(o.started <= end and o.ended >= begin for begin, end in down)
    ]
    other_failures = Counter(o.error or "no final chunk" for o in failed if o not in cut_by_ingress)
    duplicated = sum(max(0, o.chunks - (o.completion_tokens or o.chunks)) for o in completed)
    missing = sum(max(0, (o.completion_tokens or max_tokens) - o.chunks) for o in completed)
    mismatched = sum(1 for o in completed if o.text != references[o.prompt])
    not_cut = len(drill.outcomes) - len(cut_by_ingress)
    mesh_completed = len(completed) + len(references)
    recovered = [k.recovered_s for k in drill.kills if k.recovered_s is not None]

    table = Table(title="chaos drill", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("requests sent", str(len(drill.outcomes)))
    table.add_row("completed", str(len(completed)))
    table.add_row("cut with a killed ingress, or sent while it was down", str(len(cut_by_ingress)))
    for reason, count in sorted(other_failures.items()):
        table.add_row(f"failed: {reason}", str(count))
    table.add_row("completed / not held by a killed ingress", f"{len(completed) / max(1, not_cut):.4f}")
    table.add_row("tokens duplicated", str(duplicated))
    table.add_row("tokens missing", str(missing))
    table.add_row("streams differing from the reference", str(mismatched))
    table.add_row(
        "ledger completed / mesh completed + finished unread (cut with the ingress)",
        f"{ledger_completed} / {mesh_completed} + {finished_unread}",
    )
    table.add_row(
        "cut before their first chunk (no id to look up in the ledger)",
        str(sum(1 for o in cut_by_ingress if o.request_id is None)),
    )
    table.add_row("every service running at the end", "yes" if healed else "NO")
    worst_stall = max((late for _, late in drill.stalls), default=0.0)
    table.add_row(
        f"load generator's own loop late > 1 s (times, worst s; its niceness {drill.load_niceness})",
        f"{len(drill.stalls)}, {worst_stall:.1f}",
    )
    console.print(table)

    kills = Table(title="kills", show_header=True)
    for column in ("kind", "kills", "back within (s): median", "max", "not back"):
        kills.add_column(column, justify="right")
    for kind in dict.fromkeys(k.kind for k in drill.kills):
        of_kind = [k for k in drill.kills if k.kind == kind]
        times = [k.recovered_s for k in of_kind if k.recovered_s is not None]
        kills.add_row(
            kind,
            str(len(of_kind)),
            f"{statistics.median(times):.2f}" if times else "-",
            f"{max(times):.2f}" if times else "-",
            str(len(of_kind) - len(times)),
        )
    console.print(kills)
    return {
        "sent": len(drill.outcomes),
        "completed": len(completed),
        "cut_by_ingress": len(cut_by_ingress),
        "failed": dict(other_failures),
        "duplicated_tokens": duplicated,
        "missing_tokens": missing,
        "mismatched": mismatched,
        "ledger_completed": ledger_completed,
        "mesh_completed": mesh_completed,
        "finished_unread": finished_unread,
        "kills": len(drill.kills),
        "recovery_max_s": max(recovered, default=0.0),
        "healed": healed,
        "load_generator_stalls": len(drill.stalls),
    }
