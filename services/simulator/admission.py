"""Admission variants the simulator compares: the same policy module with its controls on or off.

A variant is named on the command line as ``NAME[:key=value,...]``:

- ``ripplemesh``: services/admission/policy/ in full: the tenants' quotas, priority classes and
  shedding, weighted fair queuing, deadline feasibility from the router's prediction, workflow
  protection, bounded deferral. Keys: any field of `AdmissionLimits` (e.g.
  ``ripplemesh:queue_per_worker=6,max_defer_s=20``).
- ``rate_limit``: a plain per-tenant rate limiter, the policy's token buckets and nothing else
  (`control="rate_limit"`). By default the workload's own tenant quotas; with
  ``tokens_per_s=N`` (and optionally ``burst_s``, default 1) every tenant instead gets a token
  bucket of N x its weight share (weights from the workload's tenants), as an operator would size
  static limits to a fleet that serves N tokens per second.
- ``none``: no admission control: everything valid is admitted at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from services.admission.policy import CONTROLS, AdmissionLimits, TenantQuota
from services.simulator.options import convert, key_values

DEFAULT_ADMISSION = "ripplemesh"


@dataclass(frozen=True, slots=True)
class AdmissionVariant:
    name: str  # the spec as given, for labels
    limits: AdmissionLimits
    tokens_per_s: float | None = None  # rate_limit: the fleet's token rate split by weight
    burst_s: float = 1.0

    def quotas(self, tenants: dict[str, TenantQuota]) -> dict[str, TenantQuota]:
        """The tenants' quotas as this variant applies them."""
        if self.tokens_per_s is None:
            return dict(tenants)
        total = sum(q.weight for q in tenants.values()) or 1.0
        out = {}
        for name, quota in tenants.items():
            rate = self.tokens_per_s * quota.weight / total
            out[name] = TenantQuota(tokens_per_s=rate, token_burst=rate * self.burst_s, weight=quota.weight)
        return out


_LIMIT_FIELDS = {f.name: f.type for f in fields(AdmissionLimits) if f.name != "control"}


def parse_admission(spec: str) -> AdmissionVariant:
    """`ripplemesh`, `rate_limit[:tokens_per_s=N,burst_s=S]`, `none`, each with AdmissionLimits
    fields as options."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in CONTROLS:
        raise ValueError(f"unknown admission {name!r}; known: {', '.join(CONTROLS)}")
    limits = AdmissionLimits(control=name)
    tokens_per_s: float | None = None
    burst_s = 1.0
    changes: dict[str, Any] = {}
    for key, value in key_values(rest, "admission").items():
        if name == "rate_limit" and key in ("tokens_per_s", "burst_s"):
            number = convert(key, value, float, "admission")
            if number <= 0:
                raise ValueError(f"admission option {key} must be > 0")
            if key == "tokens_per_s":
                tokens_per_s = number
            else:
                burst_s = number
            continue
        if key not in _LIMIT_FIELDS:
            known = ", ".join(sorted(_LIMIT_FIELDS))
            raise ValueError(
                f"unknown admission option {key!r}; known: {known} (rate_limit: tokens_per_s, burst_s)"
            )
        changes[key] = convert(key, value, _LIMIT_FIELDS[key], "admission")
    return AdmissionVariant(spec, replace(limits, **changes), tokens_per_s, burst_s)
