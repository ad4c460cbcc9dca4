"""How the router's predictions turn out, learned online per GPU type, and what the decisions
read from it: the chance a completion-time prediction is met, and the share of a predicted
cached prefix the prefill finds.

The completion-time model is multiplicative: a request predicted to take `c` seconds takes
``c x exp(e)``, `e` normal with the mean and spread of the residuals ``ln((actual + f) /
(predicted + f))`` seen lately on that GPU type (the decode worker's; `f` keeps a near-zero
prediction from counting as an infinite ratio). So a router whose predictions run pessimistic
(actual a median 0.75 of predicted: a mean residual of -0.29) gives a request predicted near its
deadline the odds it has, and one whose predictions run late is told so, whatever the workload.
Until a GPU type has residuals, the prior holds: no bias, a spread of
`RouterConfig.relative_error`, weighing as `PRIOR_SAMPLES` residuals.

Residuals are averaged with a decaying weight (about the last `WINDOW_SAMPLES`): the errors move
with load and with the traffic's shape, and the calibration follows them. A request abandoned at
its deadline counts with its time so far (a lower bound: it took at least that long), so the
misses are not left out of the residuals they would darken.

Who feeds it: the router service from the lifecycle stream (DecodeCompleted, PrefillCompleted,
RequestFailed at the deadline), the simulator from its own completions. Pure; no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The prior's weight, in residuals: a GPU type's first few completions move it, but not alone.
# Chosen, not fitted: 20 residuals give a spread estimate within about 30% (chi-square, 95%).
PRIOR_SAMPLES = 20.0
# The decaying average's reach, in residuals: long enough to average over many batches, short
# enough to follow a change of load within minutes at tens of requests a second. Chosen.
WINDOW_SAMPLES = 500.0
# Seconds added to both sides of a completion-time ratio (a 10 ms prediction that took 30 ms is
# not a threefold miss that should widen the spread of 20 s predictions).
FLOOR_S = 0.05
# The narrowest spread the calibration answers with: residuals that happen to agree for a while
# must not make a deadline a certainty.
MIN_SPREAD = 0.05
_SQRT2 = math.sqrt(2.0)


@dataclass(slots=True)
class Residuals:
    """A decaying mean and variance of residuals, started from a prior."""

    mean: float
    variance: float
    weight: float = PRIOR_SAMPLES  # residuals' worth behind the figures (the prior's included)
    samples: int = 0  # residuals observed (the prior's not included)

    def add(self, residual: float) -> None:
        self.weight = min(self.weight + 1.0, WINDOW_SAMPLES)
        alpha = 1.0 / self.weight
        delta = residual - self.mean
        self.mean += alpha * delta
        self.variance = (1.0 - alpha) * (self.variance + alpha * delta * delta)
        self.samples += 1

    @property
    def spread(self) -> float:
        return max(MIN_SPREAD, math.sqrt(self.variance))


@dataclass(slots=True)
class Calibration:
    """Per GPU type: completion-time residuals, and the share of predicted cached tokens found."""

    prior_spread: float = 0.4  # RouterConfig.relative_error: the log-spread before any residual
    completion: dict[str, Residuals] = field(default_factory=dict)
    cached_share: dict[str, Residuals] = field(default_factory=dict)

    def completion_of(self, gpu_type: str) -> Residuals:
        residuals = self.completion.get(gpu_type)
        if residuals is None:
            residuals = self.completion[gpu_type] = Residuals(0.0, self.prior_spread**2)
        return residuals

    def observe_completion(self, gpu_type: str, predicted_s: float, actual_s: float) -> None:
        """A placement on a decode worker of `gpu_type` predicted to complete in `predicted_s`
        took `actual_s` (for one abandoned at its deadline: at least that)."""
        if not (math.isfinite(predicted_s) and math.isfinite(actual_s)) or predicted_s < 0 or actual_s < 0:
            return
        self.completion_of(gpu_type).add(math.log((actual_s + FLOOR_S) / (predicted_s + FLOOR_S)))

    def observe_cached(self, gpu_type: str, predicted_tokens: int, actual_tokens: int) -> None:
        """A prefill on a worker of `gpu_type` whose KV index said `predicted_tokens` of its
        prompt were cached there (`Placement.indexed_cached_tokens`, before this share) found
        `actual_tokens` (more than indexed counts as all of it)."""
        if predicted_tokens <= 0 or actual_tokens < 0:
            return
        share = self.cached_share.get(gpu_type)
        if share is None:
            share = self.cached_share[gpu_type] = Residuals(1.0, 0.0)
        share.add(min(1.0, actual_tokens / predicted_tokens))

    def found_share(self, gpu_type: str) -> float:
        """The share of a predicted cached prefix the prefill finds there (1: all of it)."""
        share = self.cached_share.get(gpu_type)
        return 1.0 if share is None else min(1.0, max(0.0, share.mean))

    def success_probability(self, gpu_type: str, completion_s: float, slack_s: float) -> float:
        """The chance a request predicted to complete in `completion_s` on a decode worker of
        `gpu_type` does so within `slack_s`."""
        if slack_s + FLOOR_S <= 0.0:
            return 0.0
        residuals = self.completion.get(gpu_type)
        if residuals is None:
            mean, spread = 0.0, max(MIN_SPREAD, self.prior_spread)
        else:
            mean, spread = residuals.mean, residuals.spread
        z = (math.log((slack_s + FLOOR_S) / (completion_s + FLOOR_S)) - mean) / spread
        return 0.5 * math.erfc(-z / _SQRT2)  # the normal CDF

    def figures(self, gpu_type: str) -> dict[str, float]:
        """One GPU type's: the completion residuals' bias (actual over predicted, the geometric
        mean) and spread, the residuals seen, and the cached share found (those it has)."""
        entry: dict[str, float] = {}
        residuals = self.completion.get(gpu_type)
        if residuals is not None:
            entry.update(
                completion_ratio=math.exp(residuals.mean),
                completion_spread=residuals.spread,
                completion_samples=float(residuals.samples),
            )
        share = self.cached_share.get(gpu_type)
        if share is not None:
            entry.update(cached_share=self.found_share(gpu_type), cached_samples=float(share.samples))
        return entry

    def summary(self) -> dict[str, dict[str, float]]:
        """Every GPU type's `figures`, for a health page and a simulator's result."""
        return {g: self.figures(g) for g in sorted(set(self.completion) | set(self.cached_share))}
