"""The trace shipper: exports the spans the services write to their local files to an OTLP
receiver, so that exporting costs the request path nothing more than the local file does.

Under `ripplemesh up` with ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` set, the services keep
writing ``<data_dir>/traces/*.jsonl`` (`RIPPLEMESH_TRACES_SHIPPED=1`: microseconds a span, in
the thread that ends it) and this one background process (niceness 19) encodes and sends them
over OTLP/HTTP, every `SHIP_EVERY_S`. Encoding a span for OTLP takes about 44 us of pure Python:
in each service's export thread it competed with the event loop for the GIL; here it competes
only for idle CPU. A receiver that is down or slow loses nothing: the files keep the spans and
the shipper catches up from where it stopped (`files.SpanFiles`), and `ripplemesh trace` still
reads the files. A batch the receiver refuses or does not answer within the export timeout is
tried again (counted in ``ripplemesh_trace_shipper_export_failures_total``); a line that is not
a span is skipped and counted. Services run on their own (Kubernetes, `docker-compose.yml`)
export directly, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec
from prometheus_client import Counter, Gauge
from starlette.routing import BaseRoute

from services.mesh.runtime import Runtime
from services.mesh.tracing import SPANS_EXPORTED, traces_dir
from services.trace_shipper.files import SpanFiles
from services.trace_shipper.otlp import OtlpHttpSender, encode_request, encode_span

log = logging.getLogger(__name__)

SHIP_EVERY_S = 0.5
# Per export: the batch size the SDK's batch processor uses.
BATCH_SPANS = 512
# What one round reads at most (about 3 KB a span: a few thousand spans), so that a long
# backlog goes out in steady rounds rather than one that holds everything in memory.
ROUND_BYTES = 8 * 1024 * 1024
# What the last round gets at shutdown.
FINAL_ROUND_S = 3.0

FAILURES = Counter(
    "ripplemesh_trace_shipper_export_failures_total",
    "Exports the receiver refused or did not answer in time (the spans are tried again).",
)
SKIPPED = Counter(
    "ripplemesh_trace_shipper_lines_skipped_total", "Lines of the span files that are not spans."
)
BEHIND = Gauge("ripplemesh_trace_shipper_behind_bytes", "Bytes of spans written and not shipped yet.")
_decoder = msgspec.json.Decoder()


class TraceShipperService:
    name: ClassVar[str] = "trace-shipper"
    # Nothing waits on it: the CPU goes to the request path first.
    background: ClassVar[bool] = True

    def __init__(self, send: Callable[[bytes], bool] | None = None) -> None:
        # Posts one serialized OTLP export request; True when the receiver took it.
        self._send = send
        self._sender: OtlpHttpSender | None = None
        self._files: SpanFiles | None = None
        self.shipped = 0
        self.last_error: str | None = None

    async def start(self, runtime: Runtime) -> None:
        if self._send is None:
            self._sender = OtlpHttpSender()
            self._send = self._sender
        self._files = SpanFiles.open(traces_dir(runtime.options.data_dir))
        runtime.spawn(runtime.every(SHIP_EVERY_S, self.ship_round, "ship-spans"), "ship-spans")

    async def stop(self) -> None:
        # What the services wrote as they stopped (they stop before it: it is started first).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ship_round(), FINAL_ROUND_S)
        if self._sender is not None:
            self._sender.close()

    def routes(self) -> list[BaseRoute]:
        return []

    def health(self) -> dict[str, Any]:
        return {"shipped_spans": self.shipped, "last_error": self.last_error}

    async def ship_round(self) -> None:
        files, send = self._files, self._send
        if files is None or send is None:
            return
        for chunk in files.new_lines(ROUND_BYTES):
            lines = chunk.lines
            for start in range(0, len(lines), BATCH_SPANS):
                # In a thread: encoding and sending take milliseconds a batch.
                sent = await asyncio.to_thread(_ship, send, lines[start : start + BATCH_SPANS])
                if sent is None:
                    FAILURES.inc()
                    self.last_error = f"export failed at {time.strftime('%H:%M:%S')}"
                    BEHIND.set(files.behind_bytes())
                    return  # this file's chunk again next round
                SPANS_EXPORTED.inc(sent)
                self.shipped += sent
            files.shipped(chunk)
        BEHIND.set(files.behind_bytes())


def _ship(send: Callable[[bytes], bool], lines: list[bytes]) -> int | None:
    """Encode these lines' spans (a line that is no span skipped and counted) and send them:
    how many went, or None if the receiver did not take them."""
    by_service: dict[str, list[bytes]] = {}
    for line in lines:
        try:
            entry = _decoder.decode(line)
            span = encode_span(entry)
            by_service.setdefault(str(entry.get("service") or "ripplemesh"), []).append(span)
        except Exception:  # not JSON, or not a span: skipped, whatever is wrong with it
            SKIPPED.inc()
    count = sum(len(spans) for spans in by_service.values())
    if not count:
        return 0
    try:
        return count if send(encode_request(by_service)) else None
    except Exception as exc:  # a sender's own errors: refused, unreachable
        log.warning("span export failed", extra={"error": repr(exc)})
        return None
