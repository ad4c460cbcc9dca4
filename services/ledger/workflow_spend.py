"""Each in-flight workflow's running spend, in the WORKFLOW_SPEND KV bucket.

Admission and the router read it (key: the workflow id; value: a msgspec-JSON `WorkflowSpend`)
to weigh what a workflow has already cost before they shed or place its next step.

After every batch the ledger commits, `notify` hands over the workflows the batch touched, as
the batch's transaction left them (`BatchResult.workflows`: the committed totals, so a
redelivered or reordered event never shows twice); one loop puts their values. Under load the
loop coalesces: a workflow touched by ten batches while a put was in flight is put once, with
its latest totals (batches commit one after the other, so the latest handed over is the newest).
`sweep` finds the workflows that went quiet past the task timeout without ending, and puts them
as abandoned (failed): nothing else would, since no event announces an abandonment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import msgspec
from nats.js.kv import KeyValue

from schemas.events import WorkflowSpend
from schemas.subjects import WORKFLOW_SPEND
from services.ledger.store import LedgerStore
from services.ledger.tasks import TaskFacts, workflow_key, workflow_spend

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
workflow_spend_decoder = msgspec.json.Decoder(WorkflowSpend)


def encode_workflow_spend(value: WorkflowSpend) -> bytes:
    return _encoder.encode(value)


def decode_workflow_spend(data: bytes) -> WorkflowSpend:
    """What a reader of the WORKFLOW_SPEND bucket does with an entry's value."""
    return workflow_spend_decoder.decode(data)


class WorkflowSpendPublisher:
    def __init__(
        self,
        store: LedgerStore,
        bucket: Callable[[], Awaitable[KeyValue]],
        task_timeout_s: float,
        *,
        clock: Callable[[], float] = time.time,
        concurrency: int = 64,
        ttl_s: float = WORKFLOW_SPEND.ttl_s,
    ):
        self.store = store
        self.bucket = bucket
        self.task_timeout_s = task_timeout_s
        self.clock = clock
        self.ttl_s = ttl_s
        self.published = 0
        self._limit = asyncio.Semaphore(concurrency)
        self._pending: dict[str, TaskFacts] = {}
        self._wake = asyncio.Event()
        self._swept_until: float | None = None

    def notify(self, workflows: Iterable[TaskFacts]) -> None:
        """Workflows as a committed batch left them: put them soon."""
        for facts in workflows:
            if facts.workflow_id is not None:
                self._pending[facts.workflow_id] = facts
        if self._pending:
            self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, {}
            now = self.clock()
            try:
                await self._put([workflow_spend(f, now, self.task_timeout_s) for f in pending.values()])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS unavailable: retry them later, unless newer came
                log.warning(
                    "workflow spend not published", extra={"workflows": len(pending), "error": repr(exc)}
                )
                self._pending = {**pending, **self._pending}
                await asyncio.sleep(1.0)
                self._wake.set()

    async def publish(self, workflow_ids: Iterable[str]) -> list[WorkflowSpend]:
        """Put the current spend of these workflows (those recorded); returns the values put."""
        facts = await self.store.tasks(workflow_key(w) for w in workflow_ids)
        now = self.clock()
        values = [workflow_spend(f, now, self.task_timeout_s) for f in facts if f.workflow_id is not None]
        await self._put(values)
        return values

    async def sweep(self) -> list[WorkflowSpend]:
        """Put the workflows whose last event is now older than the task timeout: abandoned
        (or, without a known number of steps, done). Each is found once per process; at start
        the sweep looks back as far as the bucket keeps entries."""
        now = self.clock()
        until = now - self.task_timeout_s
        after = self._swept_until if self._swept_until is not None else until - self.ttl_s
        if until <= after:
            return []
        facts = await self.store.quiet_workflows(after, until)
        values = [workflow_spend(f, now, self.task_timeout_s) for f in facts if f.workflow_id is not None]
        await self._put(values)
        self._swept_until = until
        return values

    async def _put(self, values: list[WorkflowSpend]) -> None:
        if not values:
            return
        kv = await self.bucket()

        async def put(value: WorkflowSpend) -> None:
            async with self._limit:
                await kv.put(value.workflow_id, encode_workflow_spend(value))

        await asyncio.gather(*(put(value) for value in values))
        self.published += len(values)
