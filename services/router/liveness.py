"""Which workers are alive, which are lost, and when to look again. Pure: the clock is passed in.

A worker heart-beats every second (its `WorkerState` in the WORKERS bucket). One whose latest
heartbeat is older than `suspect_after_s` is probed (a ping on ``rmesh.control.<worker>``: "no
responders" means its connection is gone, so it is lost at once); one older than `liveness_s`
(3 s by default) is lost whatever the probe said. A lost worker, or one whose WORKERS entry was
deleted (it stopped, it was drained, or another router declared it lost), is *gone*: its work
still on the WORK stream is taken over at once, and again every `rescan_every_s` for
`rescan_for_s` (a prefill worker may hand a decode to it after it went).

A worker restarted under its id (killed, and back before anyone declared it lost) heart-beats
with a new `started_at`: its predecessor is gone though the id is alive, and the work sent
before that start (`predecessors`: the worker and the cut-off) is taken over the same way,
for `predecessor_scan_for_s` from that start, while the new incarnation waits for it to leave
its subjects. A router that itself just started knows no earlier `started_at`: a worker it
first hears of that started within that window may have a predecessor's work left, so it is
scanned the same way (a scan that finds nothing costs two reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.router.policy import LIVENESS_S

SUSPECT_AFTER_S = 2.0
PROBE_EVERY_S = 0.5
RESCAN_EVERY_S = 1.0
RESCAN_FOR_S = 60.0
PREDECESSOR_SCAN_FOR_S = 15.0

GoneReason = Literal["worker_lost", "worker_drained"]


@dataclass(slots=True)
class _Alive:
    heartbeat_at: float
    revision: int
    draining: bool
    probed_at: float | None = None
    started_at: float | None = None


@dataclass(slots=True)
class _Predecessor:
    cutoff: float  # the new incarnation's start: work sent before it was the predecessor's
    scanned_at: float | None = None


@dataclass(slots=True)
class _Gone:
    since: float
    reason: GoneReason
    scanned_at: float | None = None


@dataclass(frozen=True, slots=True)
class Verdicts:
    """What is due at `now`: workers to probe, workers lost (with the revision of the entry
    seen last, for a conditional delete), and gone workers whose work to take over."""

    probe: list[str]
    lost: list[tuple[str, int]]
    scan: list[tuple[str, GoneReason]]
    predecessors: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True)
class Liveness:
    liveness_s: float = LIVENESS_S
    suspect_after_s: float = SUSPECT_AFTER_S
    probe_every_s: float = PROBE_EVERY_S
    rescan_every_s: float = RESCAN_EVERY_S
    rescan_for_s: float = RESCAN_FOR_S
    predecessor_scan_for_s: float = PREDECESSOR_SCAN_FOR_S
    alive: dict[str, _Alive] = field(default_factory=dict)
    gone: dict[str, _Gone] = field(default_factory=dict)
    restarted: dict[str, _Predecessor] = field(default_factory=dict)

    def heartbeat(
        self,
        worker_id: str,
        heartbeat_at: float,
        revision: int,
        draining: bool,
        started_at: float | None = None,
    ) -> None:
        """A heartbeat put in WORKERS. A fresh one brings a gone worker back (a restart); one
        with a later `started_at` than the worker's last says its predecessor is gone."""
        known = self.alive.get(worker_id)
        if known is not None and heartbeat_at < known.heartbeat_at:
            return
        gone = self.gone.get(worker_id)
        if gone is not None and heartbeat_at <= gone.since:
            return  # an older heartbeat, replayed by a new watch
        self.gone.pop(worker_id, None)
        if started_at is not None and heartbeat_at - started_at <= self.predecessor_scan_for_s:
            # First heard of since its entry went (or since this router started), unless as the
            # incarnation already recorded: a second restart within the window scans anew.
            previous = self.restarted.get(worker_id)
            first_heard = known is None and (previous is None or started_at > previous.cutoff)
            newer = known is not None and known.started_at is not None and started_at > known.started_at
            if first_heard or newer:
                self.restarted[worker_id] = _Predecessor(cutoff=started_at)
        self.alive[worker_id] = _Alive(heartbeat_at, revision, draining, started_at=started_at)

    def removed(self, worker_id: str, now: float) -> None:
        """The worker's WORKERS entry was deleted: gone (drained if it said it was draining)."""
        known = self.alive.pop(worker_id, None)
        if worker_id in self.gone:
            return
        reason: GoneReason = "worker_drained" if known is not None and known.draining else "worker_lost"
        self.gone[worker_id] = _Gone(since=now, reason=reason)

    def lost(self, worker_id: str, now: float) -> None:
        """Declared lost (no heartbeat, or nobody answers its probe)."""
        self.alive.pop(worker_id, None)
        self.gone.setdefault(worker_id, _Gone(since=now, reason="worker_lost"))

    def probed(self, worker_id: str, now: float) -> None:
        known = self.alive.get(worker_id)
        if known is not None:
            known.probed_at = now

    def scanned(self, worker_id: str, now: float) -> None:
        gone = self.gone.get(worker_id)
        if gone is not None:
            gone.scanned_at = now

    def predecessor_scanned(self, worker_id: str, now: float) -> None:
        restarted = self.restarted.get(worker_id)
        if restarted is not None:
            restarted.scanned_at = now

    def is_alive(self, worker_id: str, now: float) -> bool:
        known = self.alive.get(worker_id)
        return known is not None and now - known.heartbeat_at <= self.liveness_s

    def verdicts(self, now: float) -> Verdicts:
        probe: list[str] = []
        lost: list[tuple[str, int]] = []
        for worker_id, known in self.alive.items():
            age = now - known.heartbeat_at
            if age >= self.liveness_s:
                lost.append((worker_id, known.revision))
            elif age >= self.suspect_after_s and (
                known.probed_at is None or now - known.probed_at >= self.probe_every_s
            ):
                probe.append(worker_id)
        scan: list[tuple[str, GoneReason]] = []
        for worker_id, gone in list(self.gone.items()):
            if now - gone.since > self.rescan_for_s and gone.scanned_at is not None:
                del self.gone[worker_id]  # long gone: nothing more will be sent its way
                continue
            if gone.scanned_at is None or now - gone.scanned_at >= self.rescan_every_s:
                scan.append((worker_id, gone.reason))
        predecessors: list[tuple[str, float]] = []
        for worker_id, restarted in list(self.restarted.items()):
            if now - restarted.cutoff > self.predecessor_scan_for_s and restarted.scanned_at is not None:
                del self.restarted[worker_id]
                continue
            if restarted.scanned_at is None or now - restarted.scanned_at >= self.rescan_every_s:
                predecessors.append((worker_id, restarted.cutoff))
        return Verdicts(probe=probe, lost=lost, scan=scan, predecessors=predecessors)

    def next_due(self, now: float) -> float:
        """The earliest time something may be due (a heartbeat ageing past a threshold, a
        probe to repeat, a rescan); at most `rescan_every_s` from now."""
        due = now + self.rescan_every_s
        for known in self.alive.values():
            suspect_at = known.heartbeat_at + self.suspect_after_s
            if known.probed_at is not None:
                suspect_at = max(suspect_at, known.probed_at + self.probe_every_s)
            for at in (suspect_at, known.heartbeat_at + self.liveness_s):
                if at > now:
                    due = min(due, at)
        scans = [g.scanned_at for g in self.gone.values()] + [r.scanned_at for r in self.restarted.values()]
        for scanned_at in scans:
            at = now if scanned_at is None else scanned_at + self.rescan_every_s
            due = min(due, max(at, now))
        return due
