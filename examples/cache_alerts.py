"""A cache-regression alerter: a subscriber that reads every `PrefillCompleted` and alerts when
a pool's prefix-cache hit rate over its last `window` prefills falls below `threshold`.

    ripplemesh run-subscriber examples.cache_alerts:alerts --nats-url nats://127.0.0.1:4222 \\
        --nats-credentials .ripplemesh/credentials/subscribers.json

An alert is a log line and the gauge `ripplemesh_example_cache_hit_rate{pool}`; replace `alert`
to page someone. The pool is the worker's GPU type here (a PrefillCompleted names the worker and
its GPU); a routing change that scatters a workflow's steps over workers shows up as a drop.
"""

from __future__ import annotations

import logging
from collections import defaultdict, deque

from prometheus_client import Gauge

from ripplemesh import Context, Subscriber
from schemas.events import PrefillCompleted

log = logging.getLogger(__name__)

HIT_RATE = Gauge(
    "ripplemesh_example_cache_hit_rate", "Prefix-cache hit rate of a pool's last prefills.", ["pool"]
)


class CacheWatch:
    def __init__(self, window: int = 50, threshold: float = 0.5) -> None:
        self.window = window
        self.threshold = threshold
        self.recent: dict[str, deque[tuple[int, int]]] = defaultdict(lambda: deque(maxlen=window))
        self.alerting: set[str] = set()
        self.alerts: list[tuple[str, float]] = []  # what was said, for a test or a report

    def observe(self, pool: str, prompt_tokens: int, cached_tokens: int) -> float | None:
        """The pool's hit rate once its window is full; alerts on the way down, once."""
        recent = self.recent[pool]
        recent.append((prompt_tokens, cached_tokens))
        if len(recent) < self.window:
            return None
        prompts = sum(p for p, _ in recent)
        rate = sum(c for _, c in recent) / prompts if prompts else 0.0
        HIT_RATE.labels(pool).set(rate)
        if rate < self.threshold and pool not in self.alerting:
            self.alerting.add(pool)
            self.alert(pool, rate)
        elif rate >= self.threshold:
            self.alerting.discard(pool)
        return rate

    def alert(self, pool: str, rate: float) -> None:
        self.alerts.append((pool, rate))
        log.warning("prefix-cache hit rate dropped", extra={"pool": pool, "hit_rate": round(rate, 3)})


watch = CacheWatch()
alerts = Subscriber("cache-alerts", start_from="new")


@alerts.on(PrefillCompleted)
async def prefilled(event: PrefillCompleted, context: Context) -> None:
    watch.observe(event.gpu_type, event.prompt_tokens, event.cached_tokens)
