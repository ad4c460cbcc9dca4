"""`ripplemesh simulate`: what the command does, behind its click options (commands/simulate.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from services.simulator.admission import DEFAULT_ADMISSION
from services.simulator.autoscaling import DEFAULT_AUTOSCALER, parse_autoscaler
from services.simulator.core import SimOptions
from services.simulator.fleet import parse_fleet
from services.simulator.harness import compare
from services.simulator.metrics import SimResult
from services.simulator.policies import POLICY_NAMES, parse_router_config
from services.simulator.workload import AgenticWorkload, Workload, generator_name, load_workload


def parse_window(text: str | None) -> tuple[float, float] | None:
    """'START:END' in seconds from the trace's start (either side may be empty)."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    if not sep:
        raise ValueError(f"window {text!r}: expected START:END in seconds")
    low = float(start) if start.strip() else 0.0
    high = float(end) if end.strip() else float("inf")
    if not low < high:
        raise ValueError(f"window {text!r}: START must be before END")
    return (low, high)


def run_seed(workload: Workload, seed: int | None = None) -> int:
    """The simulator's seed for a run: the generator's own, else `seed` (0 when None)."""
    return workload.seed if isinstance(workload, AgenticWorkload) else (seed or 0)


def simulate(
    *,
    workload: str,
    fleet: str,
    policies: Sequence[str],
    out: Path | None,
    rate_scale: float = 1.0,
    window: str | None = None,
    limit: int | None = None,
    repeat: int = 1,
    block_size: int | None = None,
    model: str | None = None,
    deadline_s: float | None = None,
    seed: int | None = None,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.1,
    abandon_past_deadline: bool = True,
    upper_bound: bool = True,
    plots: bool = True,
    console: Console | None = None,
    admissions: Sequence[str] = (),
    router_config: str | None = None,
    autoscaler: str = DEFAULT_AUTOSCALER,
    skip_bad: bool = False,
) -> list[SimResult]:
    """Run every policy in `policies` (all of them when empty) under every admission variant in
    `admissions` (ripplemesh's when empty; simulator/admission.py) on the workload and fleet,
    with ripplemesh's policy's knobs as `router_config` sets them (`key=value,...`), the
    autoscaled pools following `autoscaler` (simulator/autoscaling.py); `skip_bad` counts and
    skips a workflow trace's bad lines (recorded.py) rather than stopping at the first."""
    spec = workload
    if seed is not None and generator_name(spec) is not None and "seed=" not in spec:
        spec = f"{spec}{',' if ':' in spec else ':'}seed={seed}"
    loaded = load_workload(
        spec,
        rate_scale=rate_scale,
        window=parse_window(window),
        limit=limit,
        block_size=block_size,
        model=model,
        repeat=repeat,
        deadline_s=deadline_s,
        skip_bad=skip_bad,
    )
    options = SimOptions(
        abandon_past_deadline=abandon_past_deadline,
        slo_ttft_s=slo_ttft_s,
        slo_tpot_s=slo_tpot_s,
        prefix_upper_bound=upper_bound,
        router_config=parse_router_config(router_config),
        autoscaler=autoscaler,
    )
    names = list(policies) or list(POLICY_NAMES)
    fleet_spec = parse_fleet(fleet)
    parse_autoscaler(autoscaler, fleet_spec)  # a bad spec fails before any run
    return compare(
        loaded,
        fleet_spec,
        names,
        seed=run_seed(loaded, seed),
        options=options,
        out=out,
        console=console,
        plots=plots,
        admissions=list(admissions) or [DEFAULT_ADMISSION],
    )
