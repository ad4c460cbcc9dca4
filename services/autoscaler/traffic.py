"""One planning window of a model's traffic, from the events the autoscaler hears. Pure: the
shell feeds it events and the clock, and closes a window into `Observation`s at each plan.

- arrivals: requests prepared by ingress (the demand, admitted or not);
- prompt and cached tokens, and TTFT: the prefills completed (and the sum of the squared
  uncached prompt tokens, the spread the prefill capacity is planned for);
- output tokens and the inter-token latency: the decodes completed, ITL being the time after
  the first token over the tokens after it (the request's TTFT is remembered from its prefill).
Events name a worker, not a model: the model is the worker's, from its heartbeat.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

from services.autoscaler.forecast import Window
from services.autoscaler.policy import Observation

# The TTFTs remembered for decodes still to complete; the oldest are forgotten past it.
TTFTS_KEPT = 100_000


def p90(values: list[float]) -> float | None:
    """The nearest-rank 90th percentile, None for no values (the mesh's windows and the
    simulator's alike)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


@dataclass
class _Tally:
    arrivals: int = 0
    arrived_prompt_tokens: int = 0
    requested_output_tokens: int = 0
    prefilled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    uncached_tokens: int = 0
    uncached_tokens_sq: float = 0.0
    completed: int = 0
    output_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)


@dataclass
class TrafficMeter:
    started_at: float
    worker_models: dict[str, str] = field(default_factory=dict)
    _tallies: dict[str, _Tally] = field(default_factory=lambda: defaultdict(_Tally))
    _ttft: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def arrived(self, model: str, prompt_tokens: int, max_tokens: int) -> None:
        tally = self._tallies[model]
        tally.arrivals += 1
        tally.arrived_prompt_tokens += prompt_tokens
        tally.requested_output_tokens += max_tokens

    def prefilled(
        self, worker_id: str, request_id: str, prompt_tokens: int, cached_tokens: int, ttft_s: float
    ) -> None:
        model = self.worker_models.get(worker_id)
        if model is None:
            return  # a worker not heard of yet: its model is not known
        tally = self._tallies[model]
        tally.prefilled += 1
        tally.prompt_tokens += prompt_tokens
        cached = min(cached_tokens, prompt_tokens)
        tally.cached_tokens += cached
        tally.uncached_tokens += prompt_tokens - cached
        tally.uncached_tokens_sq += float(prompt_tokens - cached) ** 2
        tally.ttfts.append(ttft_s)
        self._ttft[request_id] = ttft_s
        while len(self._ttft) > TTFTS_KEPT:
            self._ttft.popitem(last=False)

    def completed(self, worker_id: str, request_id: str, output_tokens: int, latency_s: float) -> None:
        model = self.worker_models.get(worker_id)
        if model is None:
            return
        tally = self._tallies[model]
        tally.completed += 1
        tally.output_tokens += output_tokens
        ttft = self._ttft.pop(request_id, None)
        if ttft is not None and output_tokens > 1:
            tally.itls.append(max(0.0, latency_s - ttft) / (output_tokens - 1))

    def ttft_p90(self, model: str) -> float | None:
        """The window's TTFT so far (the shell checks it between plans: a miss plans at once)."""
        tally = self._tallies.get(model)
        return p90(tally.ttfts) if tally is not None else None

    def close(
        self,
        now: float,
        models: list[str],
        *,
        queued_prompt_tokens: dict[str, int],
        in_flight: dict[str, int],
        held: dict[str, int],
        reset: bool = True,
    ) -> list[Observation]:
        """The window's observations, one per model, and (`reset`) a new window from `now`;
        without, the traffic goes on accumulating (a plan woken right after another)."""
        observations = []
        for model in models:
            tally = self._tallies.get(model, _Tally())
            window = Window(
                start=self.started_at,
                end=now,
                arrivals=tally.arrivals,
                prompt_tokens=tally.prompt_tokens,
                cached_tokens=tally.cached_tokens,
                output_tokens=tally.output_tokens,
                completed=tally.completed,
                prefilled=tally.prefilled,
                arrived_prompt_tokens=tally.arrived_prompt_tokens,
                requested_output_tokens=tally.requested_output_tokens,
                uncached_prefills=tally.prefilled,
                uncached_tokens=tally.uncached_tokens,
                uncached_tokens_sq=tally.uncached_tokens_sq,
            )
            observations.append(
                Observation(
                    model=model,
                    window=window,
                    ttft_p90_s=p90(tally.ttfts),
                    itl_p90_s=p90(tally.itls),
                    queued_prompt_tokens=queued_prompt_tokens.get(model, 0),
                    held=held.get(model, 0),
                    in_flight=in_flight.get(model, 0),
                )
            )
        if reset:
            self._tallies = defaultdict(_Tally)
            self.started_at = now
        return observations
