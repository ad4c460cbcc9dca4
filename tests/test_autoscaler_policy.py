"""The autoscaler's plan (services/autoscaler/policy.py): what an operator would see it decide."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.autoscaler.capacity import EngineProfile, Slo, replica_capacity
from services.autoscaler.forecast import ForecastSettings, ModelForecast, Window
from services.autoscaler.policy import Observation, PlannerState, Pool, Replica, Settings, plan
from services.engines.sim.perf import PerfModel
from services.engines.sim.profiles import gpu, model_shape

MODEL = "llama-3.1-8b"


def profile(gpu_type: str = "H100") -> EngineProfile:
    perf = PerfModel(gpu(gpu_type), model_shape(MODEL))
    return EngineProfile(perf=perf, kv_capacity_tokens=perf.kv_capacity_tokens(0.9))


def pool(name: str, role: str = "decode", gpu_type: str = "H100", price: float = 4.0, **kw: object) -> Pool:
    return Pool(
        name=name,
        model=MODEL,
        role=role,  # type: ignore[arg-type]
        gpu_type=gpu_type,
        price_per_hour=price,
        profile=profile(gpu_type),
        **kw,  # type: ignore[arg-type]
    )


def window(
    end: float, rate: float, prompt: int = 2000, output: int = 200, hit: float = 0.0, span: float = 5.0
) -> Window:
    arrivals = round(rate * span)
    return Window(
        start=end - span,
        end=end,
        arrivals=arrivals,
        prompt_tokens=arrivals * prompt,
        cached_tokens=round(arrivals * prompt * hit),
        output_tokens=arrivals * output,
        completed=arrivals,
    )


def serving(pool_name: str, count: int, *, cached: list[int] | None = None) -> list[Replica]:
    cached = cached or [0] * count
    return [Replica(f"{pool_name}-{i}", pool_name, "serving", cached_blocks=cached[i]) for i in range(count)]


DEFAULTS = Settings()
START = PlannerState()


def runs(pools, windows, replicas=(), settings_=DEFAULTS, state=START, **obs):  # type: ignore[no-untyped-def]
    """Plan over a series of windows (the fleet left as it is between them): every plan."""
    plans = []
    for w in windows:
        state, result = plan(state, [Observation(MODEL, w, **obs)], pools, replicas, settings_, now=w.end)
        plans.append(result)
    return state, plans


def run(pools, windows, replicas=(), settings_=DEFAULTS, state=START, **obs):  # type: ignore[no-untyped-def]
    """`runs`, the last plan."""
    state, plans = runs(pools, windows, replicas, settings_, state, **obs)
    return state, plans[-1]


def first_removal(plans, name):  # type: ignore[no-untyped-def]
    return next((p.pool(name) for p in plans if p.pool(name).remove), None)


def test_a_burst_scales_up_at_once_and_warming_replicas_count_as_capacity_coming() -> None:
    pools = [pool("decode-h100", max_replicas=32)]
    replicas = serving("decode-h100", 2)
    state, calm = run(pools, [window(t, 2.0) for t in (5, 10, 15)], replicas)
    assert calm.pool("decode-h100").desired <= 2
    state, burst = run(pools, [window(20, 40.0)], replicas, state=state)
    grown = burst.pool("decode-h100")
    assert grown.add > 0 and grown.desired > 2 and "scale up" in grown.reason
    # Planned again at once (woken by a held request, say): the new replicas are warming, and
    # the same load asks for nothing more.
    warming = [Replica(f"new-{i}", "decode-h100", "warming") for i in range(grown.add)]
    again_seen = [Observation(MODEL, window(20, 40.0))]
    _, again = plan(state, again_seen, pools, replicas + warming, DEFAULTS, 20.5)
    assert again.pool("decode-h100").add == 0 and again.pool("decode-h100").warming == grown.add


def test_the_prefill_to_decode_ratio_follows_the_mix_and_the_cache_hit_rate() -> None:
    pools = [pool("prefill-h100", role="prefill", max_replicas=64), pool("decode-h100", max_replicas=64)]

    def sizes(**mix: float) -> tuple[int, int]:
        _, p = run(pools, [window(t, 20.0, **mix) for t in (5, 10)])  # type: ignore[arg-type]
        return p.pool("prefill-h100").desired, p.pool("decode-h100").desired

    long_prompts = sizes(prompt=16000, output=50)
    long_outputs = sizes(prompt=200, output=2000)
    assert long_prompts[0] / long_prompts[1] > long_outputs[0] / long_outputs[1]
    cold, warm = sizes(prompt=16000, output=50, hit=0.0), sizes(prompt=16000, output=50, hit=0.9)
    assert warm[0] < cold[0]  # cached prompt tokens are not prefilled again


def test_capacity_is_added_where_a_unit_of_work_is_cheapest_and_removed_where_dearest() -> None:
    h100 = replica_capacity(profile("H100"), uncached_prompt=2000, context=2100, slo=Slo())
    h200 = replica_capacity(profile("H200"), uncached_prompt=2000, context=2100, slo=Slo())
    assert h200.decode_tokens_per_s > h100.decode_tokens_per_s  # more bandwidth, same FLOPS
    # H200 at a price below its decode advantage: cheaper per output token.
    pools = [
        pool("decode-h100", price=4.0, min_replicas=1, max_replicas=16),
        pool("decode-h200", gpu_type="H200", price=4.4, min_replicas=0, max_replicas=16),
    ]
    mix = {"prompt": 200, "output": 1500}
    _, up = run(pools, [window(t, 30.0, **mix) for t in (5, 10)], serving("decode-h100", 1))  # type: ignore[arg-type]
    assert up.pool("decode-h200").add > 0 and up.pool("decode-h100").add == 0
    # Then the need falls below what is running: after the delay the dearer work goes first.
    pools = [dataclasses.replace(p, min_replicas=0) for p in pools]
    fleet = serving("decode-h100", 3) + serving("decode-h200", 3)
    quick = Settings(scale_down_delay_s=10.0)
    _, plans = runs(pools, [window(t, 2.0, **mix) for t in (100, 105, 110, 115)], fleet, settings_=quick)  # type: ignore[arg-type]
    down = next(p for p in plans if p.changes)
    assert len(down.pool("decode-h100").remove) == 3 and len(down.pool("decode-h200").remove) == 2


def test_a_scale_down_waits_and_a_load_on_the_boundary_does_not_flap() -> None:
    pools = [pool("decode-h100", max_replicas=32)]
    state, p = run(pools, [window(t, 30.0) for t in (5, 10)])
    size = p.pool("decode-h100").desired
    replicas = serving("decode-h100", size)
    decisions = []
    # The load wobbles +-5% around what `size` replicas carry, for two minutes.
    for i, t in enumerate(range(15, 135, 5)):
        state, p = run(pools, [window(t, 30.0 * (1.05 if i % 2 else 0.95))], replicas, state=state)
        decisions.append(p.pool("decode-h100"))
    assert all(not d.remove for d in decisions)
    assert sum(1 for d in decisions if d.add) <= 1
    # A real fall: nothing goes before the delay, the surplus goes after it.
    settings_ = Settings(scale_down_delay_s=30.0)
    state, early = run(pools, [window(140, 3.0), window(145, 3.0)], replicas, settings_, state=state)
    assert not early.pool("decode-h100").remove and "scale-down in" in early.pool("decode-h100").reason
    _, late = runs(pools, [window(t, 3.0) for t in range(150, 185, 5)], replicas, settings_, state=state)
    assert first_removal(late, "decode-h100") is not None


def test_the_replicas_drained_are_those_holding_the_fewest_cached_blocks() -> None:
    pools = [pool("decode-h100", max_replicas=8)]
    replicas = serving("decode-h100", 4, cached=[900, 10, 500, 40])
    quick = Settings(scale_down_delay_s=20.0)
    _, plans = runs(pools, [window(t, 0.5) for t in range(5, 60, 5)], replicas, quick)
    removed = first_removal(plans, "decode-h100").remove
    assert removed[:2] == ("decode-h100-1", "decode-h100-3")
    assert "decode-h100-0" not in removed


def test_idle_goes_to_zero_and_a_held_request_brings_one_replica_per_role_back_at_once() -> None:
    pools = [
        pool("prefill-h100", role="prefill", min_replicas=0, max_replicas=4),
        pool("decode-h100", min_replicas=0, max_replicas=4),
    ]
    replicas = serving("prefill-h100", 1) + serving("decode-h100", 1)
    quick = Settings(idle_to_zero_s=30.0)
    state, _ = run(pools, [window(5, 1.0)], replicas, quick)
    _, before_idle = run(pools, [window(t, 0.0) for t in (10, 15, 20)], replicas, quick, state=state)
    assert not before_idle.changes  # not idle long enough: one of each stays
    state, idle = runs(pools, [window(t, 0.0) for t in range(25, 45, 5)], replicas, quick, state=state)
    assert first_removal(idle, "prefill-h100").remove == ("prefill-h100-0",)
    assert first_removal(idle, "decode-h100").remove == ("decode-h100-0",)
    assert "to zero" in first_removal(idle, "decode-h100").reason
    state, held = run(pools, [window(50, 0.0)], (), quick, state=state, held=1)
    assert held.pool("prefill-h100").add == 1 and held.pool("decode-h100").add == 1
    assert "from zero: 1 held" in held.pool("decode-h100").reason


def test_a_measured_ttft_over_the_slo_adds_capacity_before_the_forecast_would() -> None:
    pools = [pool("prefill-h100", role="prefill", max_replicas=32), pool("decode-h100", max_replicas=32)]
    replicas = serving("prefill-h100", 2) + serving("decode-h100", 2)
    state, quiet = run(pools, [window(t, 4.0) for t in (5, 10)], replicas)
    _, slow = run(pools, [window(15, 4.0)], replicas, state=state, ttft_p90_s=6.0)
    assert slow.pool("prefill-h100").desired > quiet.pool("prefill-h100").desired
    assert "TTFT p90 6 s over the SLO 2 s" in slow.pool("prefill-h100").reason


def test_a_ttft_measured_on_fewer_replicas_than_serve_now_scales_those_not_the_grown_pool() -> None:
    """Requests that waited 20 s behind 2 replicas get their first token just after 2 more joined:
    the correction doubles the 2 the wait was measured on (already there), not the 4 serving now;
    the same TTFT measured on a pool that served 4 all along doubles it."""
    pools = [pool("decode-h100", max_replicas=32)]
    quiet_state, _ = run(pools, [window(t, 4.0) for t in (5, 10, 15, 20)], serving("decode-h100", 2))
    _, grown = run(pools, [window(25, 4.0)], serving("decode-h100", 4), state=quiet_state, ttft_p90_s=20.0)
    steady_state, _ = run(pools, [window(t, 4.0) for t in (5, 10, 15, 20)], serving("decode-h100", 4))
    _, steady = run(pools, [window(25, 4.0)], serving("decode-h100", 4), state=steady_state, ttft_p90_s=20.0)
    assert grown.pool("decode-h100").desired == 4
    assert "on the 2 serving then" in grown.pool("decode-h100").reason
    assert steady.pool("decode-h100").desired == 8
    assert "on the 4 serving then" in steady.pool("decode-h100").reason


def test_the_fleet_budget_is_never_exceeded() -> None:
    pools = [pool("prefill-h100", role="prefill", max_replicas=32), pool("decode-h100", max_replicas=32)]
    _, p = run(pools, [window(t, 200.0) for t in (5, 10)], (), Settings(budget_per_hour=40.0))
    assert p.cost_per_hour <= 40.0
    assert "budget" in p.pool("decode-h100").reason or "budget" in p.pool("prefill-h100").reason
    assert p.pool("prefill-h100").desired >= 1 and p.pool("decode-h100").desired >= 1


def test_bad_limits_and_a_stale_observation() -> None:
    with pytest.raises(ValueError, match="min_replicas 3 > max_replicas 2"):
        pool("decode-h100", min_replicas=3, max_replicas=2)
    pools = [pool("decode-h100", max_replicas=8)]
    state, _ = run(pools, [window(100, 10.0)])
    older = [Observation(MODEL, window(50, 500.0))]
    stale = plan(state, older, pools, serving("decode-h100", 1), DEFAULTS, 100)
    assert stale[0].forecasts[MODEL] == state.forecasts[MODEL]  # an older window changes nothing


def test_the_forecast_follows_a_trend_and_learns_a_season() -> None:
    f = ModelForecast()
    cfg = ForecastSettings()
    for t in range(5, 100, 5):
        f = f.observe(window(t, t / 10.0), cfg)  # rising by 0.1 req/s every second
    assert f.predict(95 + 60, cfg) > f.predict(95, cfg) > 8.0
    # Damped: a step is not extrapolated into a ramp for a whole start-up time.
    step = ModelForecast().observe(window(5, 2.0), cfg).observe(window(10, 40.0), cfg)
    assert step.predict(10 + 65, cfg) < 2 * 40.0
    season = ForecastSettings(season_s=100.0)
    s = ModelForecast()
    for t in range(5, 400, 5):
        s = s.observe(window(t, 20.0 if (t % 100) < 50 else 2.0), season)
    # At 395 the quiet half is in the level; the busy half's return is forecast.
    assert s.predict(425, season) > 15.0 and s.predict(475, season) < 10.0
    assert ModelForecast().observe(window(5, 20.0), season).predict(25, season) == pytest.approx(20.0)


@settings(max_examples=60, deadline=None)
@given(
    rates=st.lists(st.floats(0, 300), min_size=1, max_size=8),
    prompt=st.integers(10, 30000),
    output=st.integers(1, 4000),
    hit=st.floats(0, 1),
    budget=st.one_of(st.none(), st.floats(20, 400)),
    sizes=st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)),
)
def test_any_plan_keeps_the_limits_the_budget_and_drains_only_its_own_replicas(
    rates: list[float],
    prompt: int,
    output: int,
    hit: float,
    budget: float | None,
    sizes: tuple[int, int, int],
) -> None:
    pools = [
        pool("prefill-h100", role="prefill", min_replicas=1, max_replicas=8),
        pool("decode-h100", min_replicas=1, max_replicas=8),
        pool("decode-h200", gpu_type="H200", price=6.0, min_replicas=0, max_replicas=6),
    ]
    replicas = [r for p, n in zip(pools, sizes, strict=True) for r in serving(p.name, n)]
    settings_ = Settings(budget_per_hour=budget, scale_down_delay_s=0.0)
    state = PlannerState()
    for i, rate in enumerate(rates):
        w = window(5.0 * (i + 1), rate, prompt=prompt, output=output, hit=hit)
        state, p = plan(state, [Observation(MODEL, w)], pools, replicas, settings_, now=w.end)
        for decision, spec in zip(p.pools, pools, strict=True):
            assert spec.min_replicas <= decision.desired <= max(spec.max_replicas, decision.serving)
            assert set(decision.remove) <= {r.replica_id for r in replicas if r.pool == spec.name}
            kept = decision.serving + decision.warming - len(decision.remove)
            assert decision.desired == kept + decision.add
        if budget is not None and budget >= 8.0:  # the minimums fit: the plan does too
            assert p.cost_per_hour <= budget + 1e-6
        sizes_now = [d.desired for d in p.pools]
        replicas = [r for p_, n in zip(pools, sizes_now, strict=True) for r in serving(p_.name, n)]


def test_prompts_are_prefilled_where_that_and_the_kv_hand_off_cost_least() -> None:
    pools = [
        pool("prefill-l40s", role="prefill", gpu_type="L40S", price=1.0, min_replicas=0, max_replicas=8),
        pool("decode-h200", gpu_type="H200", price=4.0, min_replicas=0, max_replicas=8),
    ]
    windows = [window(t, 10.0, prompt=4000, output=100) for t in (5, 10)]
    # The KV of a 4,000-token prompt is about 0.5 GB: at $0.01/GB its hand-off costs more than
    # the decode GPU's prefill saves; free, the cheap prefill GPU takes the prompts.
    _, dear = run(pools, windows, settings_=Settings(kv_transfer_usd_per_gb=0.01))
    assert dear.pool("prefill-l40s").desired == 0 and "aggregated" in dear.pool("prefill-l40s").reason
    assert dear.pool("decode-h200").desired >= 1
    _, free = run(pools, windows, settings_=Settings(kv_transfer_usd_per_gb=0.0))
    assert free.pool("prefill-l40s").desired >= 1


def test_a_plan_woken_right_after_another_does_not_read_its_short_window_as_a_rate() -> None:
    pools = [pool("decode-h100", max_replicas=16)]
    state, _ = run(pools, [window(t, 5.0) for t in (5, 10)])
    one_request = Window(start=10.0, end=10.001, arrivals=1, prompt_tokens=2000, output_tokens=0)
    after, p = plan(
        state, [Observation(MODEL, one_request, held=0)], pools, serving("decode-h100", 2), DEFAULTS, 10.001
    )
    assert after.forecasts[MODEL] == state.forecasts[MODEL]
    assert p.models[0].observed_rate == pytest.approx(state.forecasts[MODEL].level, rel=1e-3)
    assert not p.pool("decode-h100").add
