"""The router's decision: where a request's prefill and decode run. Pure; clock passed in.

ripplemesh places each request where it minimises the **expected cost per successful
completion**. For every candidate placement (one worker serving both phases, aggregated; or a
prefill worker handing its KV to a decode worker, disaggregated) it predicts, from the seven axes:

- GPU generation and price: prefill and decode speed from the worker's roofline (`WorkerSpeed`:
  FLOPs, HBM bandwidth, weights, KV bytes per token), and its $/s;
- memory headroom: whether the request's KV blocks fit beside the running batch, the wait for
  blocks when they do not, and the cached blocks of others it would evict;
- KV cache state: the prefix the worker already caches (`PrefixView`), so only the uncached part
  is prefilled (and, disaggregated, only the blocks the decode worker lacks travel);
- warm weights: the model and adapter loaded, or the load time and its cost;
- tenant priority: what a second of the request's latency (to its first token; for a
  workflow's step, to its last) is worth for its class (`RouterConfig`);
- latency budget: predicted TTFT (queue + uncached prefill + cold load) and completion time
  (TTFT + KV transfer + decode at the worker's predicted time per token) against the deadline,
  as a probability of meeting it, from how predictions on that GPU type have turned out;
- workflow: the spend a late step of a workflow puts at risk (failing it wastes every earlier
  step), and the workflow's prefix, which lives where its earlier steps ran.

and scores it as

    (marginal cost + latency worth + sunk cost at risk) / P(success)

marginal cost = the request's GPU-seconds priced on each worker + KV transfer + cold load + the
re-prefill of evicted blocks; sunk cost = what the workflow spent already; P(success) = the
probability of completing by the deadline (1 without one). The lowest score wins; aggregated and
disaggregated options compete on the same score. With sunk cost 0 and P = 1 the score is just
the cheapest fast placement; as the sunk cost grows, the probability of success weighs more.
When no option has a useful probability of meeting a hard deadline, or placing the task is
expected to cost more per success than it is worth (its chance against the marginal over the
full cost of what is left: `refuse.refuse`), the request is `NoPlacement("infeasible")` or
`NoPlacement("saturated")` respectively: it is rejected instead of spending GPU time on it.

Candidates are pruned so that a decision costs O(k log n), not O(n): the workers caching the
longest prefix of the request (from the prefix view's `overlaps`) plus the k least-loaded
workers of each role and GPU type (a lazily maintained heap in `RouterState`). Exact ties break
on a hash of (request, worker) computed only for the tied workers. Each placement is counted in
the state (requests, tokens and KV blocks placed since the worker's last heartbeat), so a burst
between two heartbeats spreads instead of herding.

The modules, each deciding one thing, in the order they depend on one another:

- speed.py: how long work takes on a worker (its roofline, a prefill's wall and GPU time);
- types.py: what the decision reads and answers (workers, config, request, placements);
- calibration.py: how its predictions have turned out, per GPU type (the chance of success
  and the share of an indexed prefix found read it);
- state.py: what the router knows of its workers and has placed on them (`RouterState`);
- prefix.py: what is cached where (the prefix view, a request's matches);
- predict.py: one option's completion time, cost, chance of success and score;
- choose.py: the candidates, their options, and the best of them;
- refuse.py: when to say no (infeasible, saturated, the dearest new tasks) and the Retry-After;
- decide.py: `place` and `earliest_first_token`, from the above.

This package re-exports what callers import from `services.router.policy`.
"""

from services.router.policy.choose import least_loaded_worker, load, tie_break
from services.router.policy.decide import earliest_first_token, earliest_ttft, place
from services.router.policy.predict import MAX_PREFILL_LOAD
from services.router.policy.prefix import NoPrefix, PrefixView, cached_tokens
from services.router.policy.refuse import RETRY_AFTER_BOUNDS_S
from services.router.policy.speed import DEFAULT_SPEED, WorkerSpeed
from services.router.policy.state import (
    NEW_TASK_WEIGHT,
    RouterState,
    backlog_seconds,
    backlog_tokens,
    live_workers,
)
from services.router.policy.types import (
    LIVENESS_S,
    NO_WORKERS_RETRY_S,
    FirstToken,
    Mode,
    NoPlacement,
    Placement,
    Priority,
    Role,
    RouterConfig,
    RouteRequest,
    ScoredOption,
    WorkerView,
    no_workers,
)

# The names the router's baselines (baselines.py) and their tests read from the old module.
_tie_break = tie_break
_least_loaded = least_loaded_worker

__all__ = [
    "DEFAULT_SPEED",
    "LIVENESS_S",
    "MAX_PREFILL_LOAD",
    "NEW_TASK_WEIGHT",
    "NO_WORKERS_RETRY_S",
    "RETRY_AFTER_BOUNDS_S",
    "FirstToken",
    "Mode",
    "NoPlacement",
    "NoPrefix",
    "Placement",
    "PrefixView",
    "Priority",
    "Role",
    "RouteRequest",
    "RouterConfig",
    "RouterState",
    "ScoredOption",
    "WorkerSpeed",
    "WorkerView",
    "backlog_seconds",
    "backlog_tokens",
    "cached_tokens",
    "earliest_first_token",
    "earliest_ttft",
    "least_loaded_worker",
    "live_workers",
    "load",
    "no_workers",
    "place",
    "tie_break",
]
