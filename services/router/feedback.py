"""What the router hears back from the lifecycle stream: the other replicas' placements, and how
its own predictions turned out.

Router replicas run active-active: they share the durable ``router`` consumer of the ADMITTED
work queue, so each places only part of the requests and, left alone, would count only its own
placements on a worker's load between two heartbeats. Two replicas would then both see an idle
worker as idle and herd onto it. So each reads every `RouteDecision` (``rmesh.events.
route_decision``) and counts the other replicas' placements on their workers as it counts its own
(`count_peer_placement`), until the worker's next heartbeat, which shows them.

It also reads `PrefillCompleted` (``rmesh.events.prefill_completed``) to compare each of its own
placements' predictions with what the prefill found, and `DecodeCompleted` and `RequestFailed`
(``rmesh.events.decode_completed``, ``.failed``) for how long they took: what its calibration
learns from (`reporting.Predictions`, policy/calibration.py).

Both are core subscriptions to subjects the LIFECYCLE stream also stores: no consumer state, no
acks; a message missed during a reconnect costs one placement's worth of load accuracy or one
error sample, nothing else. Bad messages are counted and skipped, never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from prometheus_client import Counter

from schemas.events import DecodeCompleted, PrefillCompleted, RequestFailed, RouteDecision, RouteOption
from schemas.subjects import event_subject
from services.router.policy import RouterState

log = logging.getLogger(__name__)

PEER_PLACEMENTS = Counter(
    "ripplemesh_router_peer_placements_total",
    "Placements read from the lifecycle stream, by what this replica did with them: counted (on "
    "the workers' load), own (its own), stale (the workers' heartbeats since already show them), "
    "unknown_worker.",
    ["outcome"],
)
FEEDBACK = Counter(
    "ripplemesh_router_feedback_messages_total",
    "Lifecycle messages the router read back, by kind (route_decision, prefill_completed, "
    "decode_completed, failed) and "
    "outcome (ok, invalid, error).",
    ["kind", "outcome"],
)

_decision_decoder = msgspec.json.Decoder(RouteDecision)
_completed_decoder = msgspec.json.Decoder(PrefillCompleted)
_decoded_decoder = msgspec.json.Decoder(DecodeCompleted)
_failed_decoder = msgspec.json.Decoder(RequestFailed)


def count_peer_placement(state: RouterState, event: RouteDecision, replica: str) -> str:
    """Count another replica's placement on its workers' load, as place() counts this replica's
    own: the prefill worker gets the uncached prompt and the KV blocks, the decode worker (when
    another) the KV blocks. A worker whose heartbeat is newer than the decision already shows
    the work (it is in its queue). Returns the outcome counted in PEER_PLACEMENTS."""
    if event.router == replica:
        outcome = "own"
    elif event.outcome != "placed" or event.chosen is None:
        return "not_placed"
    else:
        chosen = event.chosen
        prefill = state.workers.get(chosen.prefill_worker)
        decode = state.workers.get(chosen.decode_worker)
        if prefill is None or decode is None:
            outcome = "unknown_worker"
        else:
            outcome = "stale"
            if event.occurred_at > prefill.heartbeat_at:
                uncached = max(0, event.prompt_tokens - chosen.cached_tokens)
                state.count(prefill.worker_id, uncached, event.kv_blocks, event.occurred_at)
                outcome = "counted"
            if decode.worker_id != prefill.worker_id and event.occurred_at > decode.heartbeat_at:
                state.count(decode.worker_id, 0, event.kv_blocks, event.occurred_at)
                outcome = "counted"
            _count_inflight(state, event, chosen)
    PEER_PLACEMENTS.labels(outcome).inc()
    return outcome


def _count_inflight(state: RouterState, event: RouteDecision, chosen: RouteOption) -> None:
    """The placement's request runs on its workers until its predicted first token (a prefill
    worker it leaves) and last token, its latency worth its class's: what the placer's own
    state tracks, so both weigh the delay a new request would impose there alike. (Heartbeats
    do not carry it, so it is counted however recent the workers' heartbeats are.)"""
    if event.priority is None or chosen.completion_s is None:
        return
    worth = state.config.latency_worth_usd_per_s.get(event.priority, 0.0)
    if chosen.decode_worker != chosen.prefill_worker:
        state.add_inflight(chosen.prefill_worker, event.occurred_at + chosen.ttft_s, worth)
    state.add_inflight(chosen.decode_worker, event.occurred_at + chosen.completion_s, worth)


class Feedback:
    """Reads route decisions and prefill completions until cancelled (`run`)."""

    def __init__(
        self,
        nc: NatsClient,
        *,
        on_decision: Callable[[RouteDecision], object],
        on_prefill_completed: Callable[[PrefillCompleted], object],
        on_ended: Callable[[DecodeCompleted | RequestFailed], object] | None = None,
    ):
        self.nc = nc
        self.on_decision = on_decision
        self.on_prefill_completed = on_prefill_completed
        self.on_ended = on_ended
        # Set while both subscriptions are up (tests wait on it).
        self.subscribed = asyncio.Event()

    def handle(self, subject: str, data: bytes) -> str:
        """One message; returns the outcome counted."""
        kind = subject.rsplit(".", 1)[-1]
        try:
            if kind == "route_decision":
                self.on_decision(_decision_decoder.decode(data))
            elif kind == "prefill_completed":
                self.on_prefill_completed(_completed_decoder.decode(data))
            elif kind == "decode_completed" and self.on_ended is not None:
                self.on_ended(_decoded_decoder.decode(data))
            elif kind == "failed" and self.on_ended is not None:
                self.on_ended(_failed_decoder.decode(data))
            else:
                kind, outcome = "other", "invalid"
                FEEDBACK.labels(kind, outcome).inc()
                return outcome
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            FEEDBACK.labels(kind, "invalid").inc()
            log.warning("bad lifecycle message ignored", extra={"subject": subject, "error": str(exc)})
            return "invalid"
        except Exception:  # never let one message stop the feedback
            FEEDBACK.labels(kind, "error").inc()
            log.exception("lifecycle message handling failed", extra={"subject": subject})
            return "error"
        FEEDBACK.labels(kind, "ok").inc()
        return "ok"

    async def run(self) -> None:
        subjects = [event_subject("route_decision"), event_subject("prefill_completed")]
        if self.on_ended is not None:
            subjects += [event_subject("decode_completed"), event_subject("failed")]
        while True:
            subs = []
            try:
                for subject in subjects:
                    subs.append(await self.nc.subscribe(subject, cb=self._on_message))
                await self.nc.flush()
                self.subscribed.set()
                # Core subscriptions survive reconnects; stay until cancelled.
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("lifecycle subscriptions failed; retrying", extra={"error": repr(exc)})
                await asyncio.sleep(1.0)
            finally:
                self.subscribed.clear()
                for sub in subs:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()

    async def _on_message(self, msg: Msg) -> None:
        self.handle(msg.subject, msg.data)
