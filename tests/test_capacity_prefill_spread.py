"""The prefill rule's spread of prompt sizes (services/autoscaler/capacity.py): an M/G/1 queue
whose wait grows with the uncached prompts' squared coefficient of variation, measured by the
mesh's TrafficMeter and the simulator alike, and CV = 0 (the M/D/1 rule 1 - S/T) where an
observation does not carry it."""

from __future__ import annotations

import itertools
import math

import msgspec
import pytest

from services.autoscaler.capacity import (
    PREFILL_UTILISATION_BOUNDS,
    EngineProfile,
    Slo,
    prefill_utilisation,
    replica_capacity,
)
from services.autoscaler.forecast import ForecastSettings, ModelForecast, Window
from services.autoscaler.policy import Observation, PlannerState, Pool, Settings, plan
from services.autoscaler.traffic import TrafficMeter
from services.engines.sim.perf import PerfModel
from services.engines.sim.profiles import gpu, model_shape

MODEL = "llama-3.1-8b"
LOW, HIGH = PREFILL_UTILISATION_BOUNDS


def profile() -> EngineProfile:
    perf = PerfModel(gpu("H100"), model_shape(MODEL))
    return EngineProfile(perf=perf, kv_capacity_tokens=perf.kv_capacity_tokens(0.9))


def moments(prompts: list[int]) -> tuple[int, int, float]:
    return len(prompts), sum(prompts), float(sum(p * p for p in prompts))


def cv2_of(prompts: list[int]) -> float:
    n, total, sq = moments(prompts)
    return n * sq / total**2 - 1.0


@pytest.mark.parametrize(("service_s", "ttft_s"), [(0.5, 2.0), (0.4, 1.0), (0.2, 0.5)])
def test_no_spread_is_the_md1_rule(service_s: float, ttft_s: float) -> None:
    expected = 1.0 - service_s / ttft_s
    assert LOW <= expected <= HIGH
    assert prefill_utilisation(service_s, ttft_s) == pytest.approx(expected)
    assert prefill_utilisation(service_s, ttft_s, 0.0) == pytest.approx(expected)


def test_the_rule_keeps_the_mean_prompt_plus_twice_the_pk_wait_at_the_slo() -> None:
    service_s, ttft_s, cv2 = 0.3, 2.0, 1.5
    rho = prefill_utilisation(service_s, ttft_s, cv2)
    wait = rho * service_s * (1 + cv2) / (2 * (1 - rho))  # Pollaczek-Khinchine
    assert service_s + 2 * wait == pytest.approx(ttft_s)


def test_a_wider_spread_plans_a_lower_utilisation() -> None:
    values = [prefill_utilisation(0.3, 2.0, cv2) for cv2 in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)]
    assert all(a > b for a, b in itertools.pairwise(values))


def test_bounds_are_kept() -> None:
    assert prefill_utilisation(1e-4, 2.0) == HIGH  # a short prompt: the tail's cap
    assert prefill_utilisation(1e-4, 2.0, 50.0) == HIGH  # short even with a spread
    assert prefill_utilisation(0.3, 2.0, 1e6) == LOW  # a huge spread: nearly idle, the floor
    assert prefill_utilisation(2.0, 2.0) == LOW  # a prompt as long as the SLO
    assert prefill_utilisation(5.0, 2.0, 3.0) == LOW
    # No spread claimed from nonsense: negative or not a number is none.
    assert prefill_utilisation(0.5, 2.0, -1.0) == prefill_utilisation(0.5, 2.0)
    assert prefill_utilisation(0.5, 2.0, math.nan) == prefill_utilisation(0.5, 2.0)


def test_replica_capacity_without_a_spread_is_unchanged_and_a_spread_only_lowers_prefill() -> None:
    p, slo = profile(), Slo(ttft_s=2.0)
    base = replica_capacity(p, uncached_prompt=4000, context=4500, slo=slo)
    assert replica_capacity(p, uncached_prompt=4000, context=4500, slo=slo, uncached_cv2=0.0) == base
    service_s = 4000 / base.prefill_tokens_per_s
    assert base.prefill_utilisation == pytest.approx(min(HIGH, 1 - service_s / slo.ttft_s))
    spread = replica_capacity(p, uncached_prompt=4000, context=4500, slo=slo, uncached_cv2=6.0)
    assert spread.prefill_utilisation < base.prefill_utilisation
    assert spread.prefill_tokens_per_s == base.prefill_tokens_per_s
    assert (spread.decode_tokens_per_s, spread.decode_batch) == (base.decode_tokens_per_s, base.decode_batch)


def window(end: float, prompts: list[int], *, spread: bool = True, span: float = 5.0) -> Window:
    n, total, sq = moments(prompts)
    extra = {"uncached_prefills": n, "uncached_tokens": total, "uncached_tokens_sq": sq} if spread else {}
    return Window(
        start=end - span,
        end=end,
        arrivals=n,
        prompt_tokens=total,
        output_tokens=n * 200,
        completed=n,
        **extra,  # type: ignore[arg-type]
    )


# 90% short prompts, 10% long: mean 2,000 uncached tokens, CV^2 about 7.3.
MIXED = ([200] * 9 + [18_200]) * 50
EVEN = [2000] * 500


def test_the_forecast_measures_the_spread_and_an_old_window_falls_back_to_none() -> None:
    settings = ForecastSettings()
    f = ModelForecast().observe(window(5.0, MIXED), settings)
    assert f.uncached_cv2 == pytest.approx(cv2_of(MIXED))
    assert ModelForecast().observe(window(5.0, EVEN), settings).uncached_cv2 == pytest.approx(0.0)
    assert ModelForecast().observe(window(5.0, MIXED, spread=False), settings).uncached_cv2 == 0.0
    # A window lacking the fields later keeps what was measured (nothing new to average in).
    later = f.observe(window(10.0, MIXED, spread=False), settings)
    assert later.uncached_cv2 == pytest.approx(f.uncached_cv2)


def test_a_window_encoded_without_the_fields_decodes_with_no_spread() -> None:
    old = {"start": 0.0, "end": 5.0, "arrivals": 10, "prompt_tokens": 20_000, "completed": 10}
    decoded = msgspec.convert(old, Window)
    assert (decoded.uncached_prefills, decoded.uncached_tokens, decoded.uncached_tokens_sq) == (0, 0, 0.0)
    assert ModelForecast().observe(decoded, ForecastSettings()).uncached_cv2 == 0.0
    new = window(5.0, MIXED)
    assert msgspec.convert(msgspec.to_builtins(new), Window) == new


def test_the_traffic_meter_counts_the_uncached_prompts_and_their_squares() -> None:
    meter = TrafficMeter(started_at=0.0, worker_models={"prefill-0": MODEL})
    events = [(3000, 2800), (3000, 0), (1000, 1200), (500, 0)]  # (prompt, cached): cached capped
    for i, (prompt, cached) in enumerate(events):
        meter.prefilled("prefill-0", f"r{i}", prompt, cached, 0.5)
    (obs,) = meter.close(5.0, [MODEL], queued_prompt_tokens={}, in_flight={}, held={})
    uncached = [200, 3000, 0, 500]
    assert obs.window.uncached_prefills == 4
    assert obs.window.uncached_tokens == sum(uncached)
    assert obs.window.uncached_tokens_sq == pytest.approx(sum(u * u for u in uncached))
    assert obs.window.prompt_tokens - obs.window.cached_tokens == sum(uncached)


def prefill_replicas(prompts: list[int], *, spread: bool) -> tuple[int, float]:
    pools = [
        Pool("prefill-h100", MODEL, "prefill", "H100", 4.0, profile(), min_replicas=0, max_replicas=32),
        Pool("decode-h100", MODEL, "decode", "H100", 4.0, profile(), min_replicas=0, max_replicas=32),
    ]
    state, result = PlannerState(), None
    for end in (5.0, 10.0, 15.0):
        w = window(end, prompts, spread=spread, span=5.0)  # 100 requests a second
        state, result = plan(state, [Observation(MODEL, w)], pools, [], Settings(), now=end)
    assert result is not None
    return result.pool("prefill-h100").desired, result.models[0].uncached_cv2  # type: ignore[union-attr]


def test_the_plan_sizes_prefill_for_the_spread_and_not_without_it() -> None:
    even, even_cv2 = prefill_replicas(EVEN, spread=True)
    old, old_cv2 = prefill_replicas(MIXED, spread=False)  # an old producer: no spread known
    mixed, mixed_cv2 = prefill_replicas(MIXED, spread=True)
    assert even_cv2 == pytest.approx(0.0, abs=1e-9) and old_cv2 == 0.0
    assert mixed_cv2 == pytest.approx(cv2_of(MIXED), rel=1e-3)
    assert old == even  # same mean prompt, no spread: today's rule
    assert mixed > even
