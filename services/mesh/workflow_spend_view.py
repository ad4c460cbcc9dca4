"""A local, watched copy of the WORKFLOW_SPEND KV bucket: what each running workflow has cost so far.

The ledger puts a `WorkflowSpend` under each workflow's id after every batch that touches it
(services/ledger/workflow_spend.py). A reader that must weigh a workflow's sunk cost on every
request (the router) cannot afford a KV round trip each time, so it watches the bucket and answers
from memory: `spent(workflow_id)`, 0.0 when the workflow is unknown (its first step, a ledger that
has not caught up, or a bucket it cannot read) and when the workflow is over (succeeded or failed:
nothing more is at risk). Entries leave with their delete marker, or once older than the bucket's
TTL (the server drops expired entries without telling watchers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
from prometheus_client import Counter

from schemas.events import WorkflowSpend
from schemas.subjects import WORKFLOW_SPEND
from services.mesh.bus import Bus

log = logging.getLogger(__name__)

ENTRIES = Counter(
    "ripplemesh_workflow_spend_entries_total",
    "WORKFLOW_SPEND entries a reader watched, by outcome (applied, deleted, invalid).",
    ["outcome"],
)

_decoder = msgspec.json.Decoder(WorkflowSpend)


class WorkflowSpendView:
    def __init__(
        self,
        bus: Bus,
        *,
        ttl_s: float = WORKFLOW_SPEND.ttl_s,
        clock: Callable[[], float] = time.time,
    ):
        self.bus = bus
        self.ttl_s = ttl_s
        self.clock = clock
        self._spend: dict[str, WorkflowSpend] = {}
        self._swept_at = clock()
        # Set once the bucket's current entries are loaded (tests wait on it).
        self.loaded = asyncio.Event()

    def __len__(self) -> int:
        return len(self._spend)

    def spent(self, workflow_id: str | None) -> float:
        """The workflow's spend so far while it runs; 0.0 when unknown or over."""
        if workflow_id is None:
            return 0.0
        value = self._spend.get(workflow_id)
        if value is None or value.status != "running":
            return 0.0
        return value.spend_usd

    def get(self, workflow_id: str | None) -> WorkflowSpend | None:
        """The ledger's latest entry for the workflow, whatever its status; None when unknown."""
        return self._spend.get(workflow_id) if workflow_id is not None else None

    def apply(self, key: str, value: bytes | None, operation: str | None) -> str:
        """One watched entry; returns the outcome counted."""
        if operation in ("DEL", "PURGE") or value is None:
            self._spend.pop(key, None)
            outcome = "deleted"
        else:
            try:
                spend = _decoder.decode(value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("bad workflow spend ignored", extra={"key": key, "error": str(exc)})
                outcome = "invalid"
            else:
                previous = self._spend.get(key)
                # A put from an older ledger batch never replaces a newer one.
                if previous is None or spend.updated_at >= previous.updated_at:
                    self._spend[key] = spend
                outcome = "applied"
        ENTRIES.labels(outcome).inc()
        self._sweep()
        return outcome

    def _sweep(self) -> None:
        now = self.clock()
        if now - self._swept_at < 60.0:
            return
        self._swept_at = now
        horizon = now - self.ttl_s
        for key in [k for k, v in self._spend.items() if v.updated_at < horizon]:
            del self._spend[key]

    async def run(self) -> None:
        """Watch the bucket until cancelled, starting over when the watch breaks."""
        while True:
            watcher = None
            try:
                kv = await self.bus.key_value(WORKFLOW_SPEND)
                watcher = await kv.watchall()
                while True:
                    try:
                        entry = await watcher.updates(timeout=5.0)
                    except TimeoutError:
                        self._sweep()
                        continue
                    if entry is None:
                        self.loaded.set()  # the end of the current entries
                        continue
                    self.apply(entry.key, entry.value, entry.operation)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("workflow spend watch restarted", extra={"error": repr(exc)})
                await asyncio.sleep(1.0)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()
