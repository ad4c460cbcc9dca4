"""Admission's decisions: admit now, defer (a bounded wait), or reject early with a reason. Pure:
state in, decision out, no I/O, the clock passed in. The admission service and the simulator run
these same functions.

For every request, in this order:

1. `validate`: a known tenant, a numeric priority in range, a deadline that is neither before the
   request's submission nor absurdly far: otherwise `invalid`, nothing charged or queued.
2. `charge_quota`: the tenant's token buckets (requests/s, tokens/s, input tokens/s, output
   tokens/s; prompt and `max_tokens` are what is asked) and its concurrency cap (a lease per request
   in flight, released when the request ends or lapses). Over quota: `quota` (HTTP 429) with the
   time after which the bucket would hold enough. The usage is a plain value (`TenantUsage`) so
   replicas can share it through a KV bucket with compare-and-set.
3. `offer`: deadline feasibility (the router's prediction of the earliest first token, plus the
   decode, against the request's deadline: infeasible is `deadline` at once), then the deferral
   queue, which `drain` empties in priority order while the fleet's saturation allows:
   - class first (critical, standard, sheddable), then the numeric priority within the class
     (higher first; as Gateway API Inference Extension's InferenceObjective `priority`);
   - within a class and priority, a later step of an in-flight workflow (per the ledger's
     WORKFLOW_SPEND) before the first step of a new one, and a step of a workflow the ledger has
     already failed last (whatever it costs now is waste);
   - then start-time fair queuing on tokens between tenants (weights from the config): a tenant
     flooding the mesh does not starve a quiet one.
   Each class has its own saturation bound (sheddable the lowest), and a new workflow's first step
   a slightly lower one than a continuation, so under pressure the fleet sheds from the bottom up.
   The queue is bounded in entries and bytes: when full, the lowest-ranked entry (the new request
   included) is rejected (`capacity`, HTTP 503). A deferred request is decided by its `due`:
   the time its deadline stops being reachable, or, without a deadline, `max_defer_s` after it
   came.

Saturation is computed from the workers' heartbeats (KV usage, queue depth), corrected by the
admissions and completions heard since, and from the router's predicted wait for the request.

`decide` runs all three steps with local usage (the simulator, a single replica); outcomes for
deferred requests decided meanwhile accumulate in `state.outcomes` for the caller to take.

The modules, each deciding one thing, in the order they depend on one another:

- types.py: what admission reads and answers (quotas, limits, requests, predictions, decisions),
  and a request's workflow standing;
- quota.py: `validate`, the tenants' token buckets and concurrency leases, replicas' quota leases;
- state.py: what admission holds between decisions (`AdmissionState`, `FleetLoad`);
- saturation.py: the fleet's saturation, its time per token and a request's prediction;
- queue.py: the deferral queue's order, shedding, due times and expiry;
- decide.py: `offer`, `drain` and `decide`, from the above.

This package re-exports what callers import from `services.admission.policy`.
"""

from services.admission.policy.decide import (
    decide,
    drain,
    offer,
    release,
)
from services.admission.policy.queue import (
    expire,
    next_due,
    take_outcomes,
)
from services.admission.policy.quota import (
    Bucket,
    QuotaLease,
    TenantUsage,
    charge_quota,
    leasable,
    lease_slice,
    release_quota,
    return_lease,
    take_lease,
    validate,
)
from services.admission.policy.saturation import (
    count_admitted,
    decode_step_s,
    fleet_load,
    note_admitted,
    note_finished,
    observe_fleet,
    prediction,
    saturation,
)
from services.admission.policy.state import (
    AdmissionState,
    FleetLoad,
)
from services.admission.policy.throttle import throttled
from services.admission.policy.types import (
    CLASS_RANK,
    CLASSES,
    CONTINUATION,
    CONTROLS,
    DOOMED,
    NEW,
    AdmissionLimits,
    AdmissionRequest,
    Admit,
    Control,
    Decision,
    Defer,
    Outcome,
    Prediction,
    Predictor,
    Reject,
    RejectReason,
    TenantQuota,
    no_prediction,
    workflow_standing,
)

__all__ = [
    "CLASSES",
    "CLASS_RANK",
    "CONTINUATION",
    "CONTROLS",
    "DOOMED",
    "NEW",
    "AdmissionLimits",
    "AdmissionRequest",
    "AdmissionState",
    "Admit",
    "Bucket",
    "Control",
    "Decision",
    "Defer",
    "FleetLoad",
    "Outcome",
    "Prediction",
    "Predictor",
    "QuotaLease",
    "Reject",
    "RejectReason",
    "TenantQuota",
    "TenantUsage",
    "charge_quota",
    "count_admitted",
    "decide",
    "decode_step_s",
    "drain",
    "expire",
    "fleet_load",
    "leasable",
    "lease_slice",
    "next_due",
    "no_prediction",
    "note_admitted",
    "note_finished",
    "observe_fleet",
    "offer",
    "prediction",
    "release",
    "release_quota",
    "return_lease",
    "saturation",
    "take_lease",
    "take_outcomes",
    "throttled",
    "validate",
    "workflow_standing",
]
