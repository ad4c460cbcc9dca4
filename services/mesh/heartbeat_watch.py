"""Watching a bucket of heartbeats (WORKERS) across NATS node loss, and knowing when the view is stale.

A nats-py watch is an ordered consumer that lives on one node of the cluster. When that node is
lost, nats-py notices only after two missed 5 s heartbeats, and recreates the consumer once:
if the bucket's stream is still electing a leader then, the watch stays dark. `HeartbeatWatch`
starts the watch again whenever it fails or stays silent for `silent_after_s`, which for a
bucket written every second means it is broken.

It also says whether the view is *stale*: nothing new heard for `stale_after_s`, and the bucket
not confirmed readable since (no watch started since the silence began, or one started less
than `confirm_s` ago). Silence then cannot be told from an unreachable bucket (its stream
electing a leader after a node loss, when no heartbeat can be stored), and a reader should wait
for the view rather than take the silence for deaths. Once a watch has started and still
nothing new comes for `confirm_s`, the silence is real.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from nats.js.kv import KeyValue

log = logging.getLogger(__name__)


class HeartbeatWatch:
    def __init__(
        self,
        kv: KeyValue,
        *,
        silent_after_s: float = 3.0,
        stale_after_s: float = 3.0,
        confirm_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._kv = kv
        self.silent_after_s = silent_after_s
        self.stale_after_s = stale_after_s
        self.confirm_s = confirm_s
        self._clock = clock
        # The last update that was news (not the replay of each key's value a watch starts
        # with), and the first time since then that a watch started: the bucket was readable.
        self.heard_at = clock()
        self.checked_at: float | None = None
        self.restarts = 0

    @property
    def stale(self) -> bool:
        now = self._clock()
        if now - self.heard_at <= self.stale_after_s:
            return False
        return self.checked_at is None or now - self.checked_at < self.confirm_s

    async def updates(self) -> AsyncIterator[KeyValue.Entry]:
        """Every update, for ever: each key's latest value first (again after each restart),
        then changes as they come; delete markers included."""
        while True:
            watcher = None
            try:
                watcher = await self._kv.watchall()
                if self.checked_at is None:
                    self.checked_at = self._clock()
                replaying = True
                while True:
                    try:
                        entry = await watcher.updates(timeout=self.silent_after_s)
                    except TimeoutError:
                        break  # silent: its consumer may have gone with a NATS node
                    if entry is None:  # the end of the initial values
                        replaying = False
                        continue
                    if not replaying:
                        self.heard_at, self.checked_at = self._clock(), None
                    yield entry
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bucket is unreachable for now (an election, a reconnect)
                log.info("watch failed; starting again", extra={"error": repr(exc)})
                await asyncio.sleep(0.5)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()
            self.restarts += 1
