"""A per-tenant daily budget guard: a subscriber that closes a loop. It prices every prefill
and decode as the ledger does (GPU seconds at the config's prices) and, once a tenant's spend
today (UTC) passes its budget, throttles it through the control subject admission honours
(`Context.throttle_tenant`): the tenant's new requests get 429 with Retry-After until midnight.

    RIPPLEMESH_DAILY_BUDGETS='{"demo": 5.0}' ripplemesh run-subscriber \\
        examples.budget_guard:guard --nats-url ... --nats-credentials ...

Spend is what this subscriber has seen since it started (durable: restarted, it goes on where it
stopped, but today's earlier spend is not read back from the ledger); it is an example.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections import defaultdict

from ripplemesh import Context, Subscriber
from schemas.events import DecodeCompleted, PrefillCompleted
from services.ledger.pricing import PricingError, price_gpu_seconds
from services.mesh.config import load_config

log = logging.getLogger(__name__)


def next_midnight_utc(now: float) -> float:
    today = datetime.datetime.fromtimestamp(now, tz=datetime.UTC).date()
    return datetime.datetime.combine(
        today + datetime.timedelta(days=1), datetime.time(), datetime.UTC
    ).timestamp()


class BudgetGuard:
    def __init__(self, daily_usd: dict[str, float], prices: dict[str, float]) -> None:
        self.daily_usd = daily_usd
        self.prices = prices
        self.spent: dict[tuple[str, str], float] = defaultdict(float)  # (tenant, day) -> US$
        self.throttled: set[tuple[str, str]] = set()

    def charge(self, tenant: str, gpu_type: str, gpu_seconds: float, at: float) -> bool:
        """Add the spend; True when this charge takes the tenant over its budget today."""
        day = datetime.datetime.fromtimestamp(at, tz=datetime.UTC).date().isoformat()
        try:
            self.spent[(tenant, day)] += price_gpu_seconds(gpu_type, gpu_seconds, self.prices)
        except PricingError as exc:
            log.warning("not priced", extra={"tenant": tenant, "error": str(exc)})
            return False
        budget = self.daily_usd.get(tenant)
        if budget is None or self.spent[(tenant, day)] <= budget or (tenant, day) in self.throttled:
            return False
        self.throttled.add((tenant, day))
        return True


budgets = json.loads(os.environ.get("RIPPLEMESH_DAILY_BUDGETS", "{}"))
policy = BudgetGuard({str(k): float(v) for k, v in budgets.items()}, load_config().gpu_prices_per_hour)
guard = Subscriber("budget-guard", start_from="new")


@guard.on(PrefillCompleted, DecodeCompleted)
async def spent(event: PrefillCompleted | DecodeCompleted, context: Context) -> None:
    if policy.charge(event.tenant, event.gpu_type, event.gpu_seconds, event.occurred_at):
        budget = policy.daily_usd[event.tenant]
        await context.throttle_tenant(
            event.tenant,
            until=next_midnight_utc(event.occurred_at),
            reason=f"daily budget ${budget:g} spent",
        )
        log.warning(
            "tenant throttled: daily budget spent", extra={"tenant": event.tenant, "budget_usd": budget}
        )
