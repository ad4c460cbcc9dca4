"""`ripplemesh sweep`: the router's comparison with the baselines across rates, trace windows and
generator seeds, in one command (docs/router.md, "Comparison with the baselines").

One module because a sweep is one pipeline over one file layout: points, cells, margins and
summary, read top to bottom in the order docs/router.md describes them.

A sweep is a list of points (a workload at a rate on a fleet); every policy runs at every point
under every admission variant. Each such cell is one simulator run in a worker process, written
to ``OUT/<point>/<admission>/<policy>.json``. A cell whose file is already there is read, not run
again: a sweep resumes where it stopped, and after a change to one policy only its cells need
deleting. One margin per point and admission compares ripplemesh with the cheapest baseline (and
its SLO with the best baseline's); the summary groups the points of a rate, the way the issue's
targets read them, pooled and as a mean over the points with a 95% interval, which says whether
the points can tell a margin from their spread (a light-load tie is then a tie).

Two suites of points: `router_points`, the router's comparison (the Mooncake trace and the
agentic generator at fixed multiples of their rates), and `family_points`, every workload family
at light load, at capacity and at 2x and 5x overload, capacity being the rate at which the work a
run offers equals what the fleet serves at its roofline (capacity.py).
"""

from __future__ import annotations

import logging
import math
import re
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table
from scipy import stats

from services.router.policy import RouterConfig
from services.simulator.capacity import Capacity, capacity
from services.simulator.command import parse_window, run_seed
from services.simulator.core import SimOptions, run_simulation
from services.simulator.fleet import parse_fleet
from services.simulator.metrics import SimResult
from services.simulator.policies import POLICY_NAMES, router_config_changes
from services.simulator.workload import load_workload

log = logging.getLogger(__name__)

OURS = "ripplemesh"
DEFAULT_ADMISSIONS = ("ripplemesh", "rate_limit")
MOONCAKE_FLEET = "8xH100/llama-3.1-8b:fp8,8xH200/llama-3.1-8b:fp8"
AGENTIC_FLEET = "2xH100,2xH200"
# The Mooncake windows: the first 4,000 requests, and trace seconds 1302-2436 and 2436-3537
# (3,995 and 4,030 requests).
MOONCAKE_WINDOWS: tuple[tuple[str | None, int | None], ...] = (
    (None, 4000),
    ("1302:2436", None),
    ("2436:3537", None),
)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    name: str  # the cells' folder, e.g. mooncake-w1-x12
    group: str  # the points read together against a target, e.g. mooncake-x12
    workload: str  # as `ripplemesh simulate --workload`
    fleet: str
    rate_scale: float = 1.0
    window: str | None = None
    limit: int | None = None
    deadline_s: float | None = None


# The agentic generator's seeds the router's knobs were fitted on, the sweep's default. Their
# variants were weighed again on 0-9; 10 and up are held out (docs/experiments.md).
FITTED_SEEDS = (0, 1, 2, 3, 4)


def parse_seeds(text: str) -> tuple[int, ...]:
    """`5-9`, `0,3,7` or a mix: the agentic generator's seeds, in order, each once."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            low, dash, high = part.strip().partition("-")
            first, last = int(low), int(high) if dash else int(low)
            if first < 0 or last < first:
                raise ValueError
            seeds.extend(seed for seed in range(first, last + 1) if seed not in seeds)
    except ValueError:
        raise ValueError(f"seeds {text!r}: expected e.g. 5-9 or 0,3,7 (non-negative, low-high)") from None
    return tuple(seeds)


def router_points(trace: Path, seeds: Sequence[int] = FITTED_SEEDS) -> list[SweepPoint]:
    """The issue's comparison: the Mooncake conversation trace (three windows, a 30 s deadline)
    at 4, 12, 24 and 40 times its rate on 16 GPUs, and the agentic workload (`seeds`: by default
    0-4, the ones the router's knobs were fitted on) at 1, 5, 10 and 20 times 2 workflows a
    second on 4."""
    points = []
    for index, (window, limit) in enumerate(MOONCAKE_WINDOWS):
        for scale in (4, 12, 24, 40):
            points.append(
                SweepPoint(
                    f"mooncake-w{index}-x{scale}",
                    f"mooncake-x{scale}",
                    str(trace),
                    MOONCAKE_FLEET,
                    scale,
                    window,
                    limit,
                    30.0,
                )
            )
    for seed in seeds:
        for scale in (1, 5, 10, 20):
            points.append(
                SweepPoint(
                    f"agentic-s{seed}-x{scale}",
                    f"agentic-x{scale}",
                    f"agentic:workflows=3000,rate_per_s=2,seed={seed}",
                    AGENTIC_FLEET,
                    scale,
                )
            )
    return points


# ------------------------------------------------------------------ the families suite

# The fleets: two GPUs of different kinds, each a replica of llama-3.1-8b (bf16), so that every
# placement weighs a dearer, faster replica against a cheaper one. The Azure traces' requests are
# short and an hour of either holds few (19,366 and 8,819): on the H100 and H200 a third of one
# would pass in about 20 s at 5x its capacity, on the older L40S and A100 in about a minute.
FAMILY_FLEET = "1xH100,1xH200"
AZURE_FLEET = "1xL40S,1xA100-80GB"
# The loads, as multiples of each run's capacity (capacity.py): light, at capacity, overloaded.
LOADS: tuple[tuple[str, float], ...] = (("light", 0.25), ("1x", 1.0), ("2x", 2.0), ("5x", 5.0))
# The generators' seeds: held out from the router's fitting (docs/experiments.md: 10 and up).
FAMILY_SEEDS = (10, 11, 12)
TRACE_DEADLINE_S = 30.0  # the traces carry none: as the router suite's Mooncake points
# A generator's point holds five minutes of arrivals at its rate (and at least the family's
# `min_tasks`); a trace's point is its whole window at every load (at 5x, a Mooncake window lasts
# about 2 minutes, an Azure one about 1: the traces hold no more).
ARRIVALS_S = 300.0
# A generator run's capacity is its first this many workflows' (from 100 to 3,000 it moves by a
# few percent, the mix's draw: the shared prefixes' first use barely counts).
PROBE_WORKFLOWS = 1000


@dataclass(frozen=True, slots=True)
class Family:
    """A workload family: a generator (`source` its name; its runs are its seeds) or a trace
    (`source` the file's name in the traces folder; its runs, `windows`)."""

    name: str
    source: str
    fleet: str = FAMILY_FLEET
    windows: tuple[tuple[str | None, int | None], ...] = ()
    min_tasks: int = 0  # a generator's points' least number of workflows


# The Azure windows are the traces' thirds by request count, as MOONCAKE_WINDOWS are Mooncake's.
FAMILIES: tuple[Family, ...] = (
    Family("agentic", "agentic", min_tasks=1000),
    Family("coding", "coding", min_tasks=100),
    Family("rag-chat", "rag-chat", min_tasks=2000),
    Family("mooncake", "conversation_trace.jsonl", windows=MOONCAKE_WINDOWS),
    Family(
        "azure-conv",
        "AzureLLMInferenceTrace_conv.csv",
        AZURE_FLEET,
        (("0:1285", None), ("1285:2179", None), ("2179:", None)),
    ),
    Family(
        "azure-code",
        "AzureLLMInferenceTrace_code.csv",
        AZURE_FLEET,
        (("0:1086", None), ("1086:1873", None), ("1873:", None)),
    ),
)


@dataclass(frozen=True, slots=True)
class FamilyRun:
    """One run of a family, a seed or a window, at the workload's own rate."""

    family: Family
    tag: str  # s<seed> or w<window>
    workload: str  # a generator's spec without its size (`coding:seed=10`), or the trace file
    window: str | None = None
    deadline_s: float | None = None
    limit: int | None = None

    def spec(self, workflows: int) -> str:
        return f"{self.workload},workflows={workflows}" if not self.family.windows else self.workload

    def capacity(self) -> Capacity:
        """Its capacity on its family's fleet (capacity.py): a trace window's, or a generator's
        first PROBE_WORKFLOWS workflows'."""
        workload = load_workload(
            self.spec(PROBE_WORKFLOWS), window=parse_window(self.window), limit=self.limit
        )
        return capacity([workload], parse_fleet(self.family.fleet))


def family_runs(family: Family, traces: Path, seeds: Sequence[int] = FAMILY_SEEDS) -> list[FamilyRun]:
    if not family.windows:
        return [FamilyRun(family, f"s{seed}", f"{family.source}:seed={seed}") for seed in seeds]
    return [
        FamilyRun(family, f"w{index}", str(traces / family.source), window, TRACE_DEADLINE_S, limit)
        for index, (window, limit) in enumerate(family.windows)
    ]


def _three_figures(x: float) -> float:
    return float(f"{x:.3g}")


def family_points(
    traces: Path, seeds: Sequence[int] = FAMILY_SEEDS, wanted: Callable[[str], bool] | None = None
) -> list[SweepPoint]:
    """Every family at every load (LOADS): `<family>-<run>-<load>` (`coding-s10-2x`,
    `mooncake-w0-light`), grouped as `<family>-<load>`. A run's capacity, as a rate scale
    rounded to three figures, is computed once for the points `wanted` (by name) keeps."""
    points = []
    for family in FAMILIES:
        for run in family_runs(family, traces, seeds):
            name = f"{family.name}-{run.tag}"
            loads = [(load, k) for load, k in LOADS if wanted is None or wanted(f"{name}-{load}")]
            if not loads:
                continue
            if family.windows and not Path(run.workload).is_file():
                raise FileNotFoundError(f"the {family.name} trace {run.workload} is not there")
            at_capacity = run.capacity()
            scale = _three_figures(at_capacity.rate_scale)
            for load, multiple in loads:
                rate_scale = float(f"{scale * multiple:.6g}")  # an exact multiple, printed so
                arrivals = math.ceil(rate_scale * at_capacity.own_rate * ARRIVALS_S)
                points.append(
                    SweepPoint(
                        f"{name}-{load}",
                        f"{family.name}-{load}",
                        run.spec(max(family.min_tasks, arrivals)),
                        family.fleet,
                        rate_scale,
                        run.window,
                        run.limit,
                        run.deadline_s,
                    )
                )
    return points


def cell_path(out: Path, point: SweepPoint, admission: str, policy: str) -> Path:
    return out / point.name / _safe(admission) / f"{policy}.json"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)


def run_cell(
    point: SweepPoint, policy: str, admission: str, path: Path, router_config: RouterConfig | None = None
) -> Path:
    """One simulator run, written to `path` (in a worker process)."""
    workload = load_workload(
        point.workload,
        rate_scale=point.rate_scale,
        window=parse_window(point.window),
        limit=point.limit,
        deadline_s=point.deadline_s,
    )
    result = run_simulation(
        workload,
        parse_fleet(point.fleet),
        policy,
        # As `ripplemesh simulate` seeds it, so a cell gives that command's figures.
        seed=run_seed(workload),
        options=SimOptions(prefix_upper_bound=False, router_config=router_config or RouterConfig()),
        admission=admission,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    partial.write_bytes(result.to_json())
    partial.replace(path)  # a cell file is whole or absent, however the sweep was stopped
    return path


def read_cell(path: Path) -> SimResult | None:
    """A finished cell, or None when it is absent or unreadable (it is run again)."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=SimResult)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("sweep cell %s is unreadable (%s): running it again", path, exc)
        return None


@dataclass(frozen=True, slots=True)
class Margin:
    """ripplemesh at one point under one admission, against the baselines there."""

    point: str
    group: str
    admission: str
    cost_vs_best: float  # ripplemesh's cost per successful task / the cheapest baseline's - 1
    best: str  # the cheapest baseline
    slo: float  # ripplemesh's SLO attainment
    best_slo: float  # the best baseline's
    critical_succeeded: int

    @property
    def slo_pp(self) -> float:
        return (self.slo - self.best_slo) * 100


@dataclass(slots=True)
class PolicyTotals:
    """A policy's runs at the points of one rate (a group) under one admission, added up."""

    spend_usd: float = 0.0
    # The spend's three parts: GPU time no request used, GPU time of tasks that failed, and
    # GPU time (and KV transfers) of tasks that succeeded.
    idle_usd: float = 0.0
    wasted_usd: float = 0.0
    successful_usd: float = 0.0
    succeeded: int = 0
    slo_sum: float = 0.0
    points: int = 0

    def add(self, result: SimResult) -> None:
        self.spend_usd += result.total_spend_usd
        self.idle_usd += result.idle_spend_usd
        self.wasted_usd += result.wasted_spend_usd
        self.successful_usd += result.successful_spend_usd
        self.succeeded += result.tasks_succeeded
        self.slo_sum += result.slo["attainment"] or 0.0
        self.points += 1

    @property
    def cost_per_success(self) -> float:
        return self.spend_usd / self.succeeded if self.succeeded else float("inf")

    @property
    def mean_slo(self) -> float:
        return self.slo_sum / self.points if self.points else 0.0

    @property
    def task_spend(self) -> float:
        """What a successful task took itself: the spend on successful tasks over them."""
        return self.successful_usd / self.succeeded if self.succeeded else float("inf")

    def share(self, part_usd: float) -> float:
        return part_usd / self.spend_usd if self.spend_usd else 0.0


@dataclass(frozen=True, slots=True)
class PointFigures:
    """One policy's run at one point: what the per-point intervals are computed from."""

    cost_per_success: float
    slo: float


@dataclass(slots=True)
class Sweep:
    margins: list[Margin] = field(default_factory=list)
    # (group, admission) -> policy -> its runs there added up
    totals: dict[tuple[str, str], dict[str, PolicyTotals]] = field(default_factory=dict)
    # (group, admission) -> one {policy: figures} per point, in the points' order
    by_point: dict[tuple[str, str], list[dict[str, PointFigures]]] = field(default_factory=dict)
    ran: int = 0  # cells run now (the rest were read from earlier runs)
    read: int = 0


def run_sweep(
    points: Sequence[SweepPoint],
    out: Path,
    *,
    policies: Sequence[str] = POLICY_NAMES,
    admissions: Sequence[str] = DEFAULT_ADMISSIONS,
    jobs: int = 1,
    console: Console | None = None,
    router_config: RouterConfig | None = None,
) -> Sweep:
    """Run the cells not yet under `out` (in `jobs` processes), then compare every point.
    `router_config`: a variant of ripplemesh's policy, for its cells (a cell made with another
    is made again); the baselines run with the default."""
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown or OURS not in policies:
        raise ValueError(f"policies must include {OURS} and be among {', '.join(POLICY_NAMES)}")
    if len(policies) < 2:
        raise ValueError("a sweep compares ripplemesh with at least one baseline")
    console = console or Console(stderr=True)
    sweep = Sweep()
    cells = [(pt, adm, pol) for pt in points for adm in admissions for pol in policies]
    config = router_config or RouterConfig()
    wanted = router_config_changes(config)
    found = {cell: read_cell(cell_path(out, *cell)) for cell in cells}
    for (point, admission, policy), result in found.items():
        if policy == OURS and result is not None and result.router_config != wanted:
            console.print(
                f"  {point.name} {admission}: ripplemesh's run was made with router config "
                f"{result.router_config or 'default'}: making it again"
            )
            found[(point, admission, policy)] = None
    todo = [cell for cell, result in found.items() if result is None]
    sweep.read = len(cells) - len(todo)
    if todo:
        console.print(f"sweep: {len(todo)} runs to make, {sweep.read} already under {out}")
        pool = ProcessPoolExecutor(max_workers=max(1, jobs))
        try:
            futures = {
                pool.submit(
                    run_cell, pt, pol, adm, cell_path(out, pt, adm, pol), config if pol == OURS else None
                ): (pt, adm, pol)
                for pt, adm, pol in todo
            }
            for done, future in enumerate(as_completed(futures), 1):
                point, admission, policy = futures[future]
                # A run that raises stops the sweep with its error.
                found[(point, admission, policy)] = read_cell(future.result())
                sweep.ran += 1
                console.print(f"  [{done}/{len(todo)}] {point.name} {admission} {policy}")
        finally:
            # On an error or Ctrl-C the runs not started are dropped; those running finish.
            pool.shutdown(wait=True, cancel_futures=True)
    for point in points:
        for admission in admissions:
            results = {pol: found[(point, admission, pol)] for pol in policies}
            sweep.margins.append(_margin(point, admission, results))
            totals = sweep.totals.setdefault((point.group, admission), {})
            figures: dict[str, PointFigures] = {}
            for policy, result in results.items():
                if result is not None:
                    totals.setdefault(policy, PolicyTotals()).add(result)
                    cost = result.cost_per_successful_task_usd
                    figures[policy] = PointFigures(
                        cost if cost is not None else float("inf"), result.slo["attainment"] or 0.0
                    )
            sweep.by_point.setdefault((point.group, admission), []).append(figures)
    return sweep


def _margin(point: SweepPoint, admission: str, results: dict[str, SimResult | None]) -> Margin:
    ours = results[OURS]
    baselines = {name: r for name, r in results.items() if name != OURS and r is not None}
    if ours is None or not baselines:
        raise RuntimeError(f"{point.name} {admission}: a run is missing")
    costs = {
        name: r.cost_per_successful_task_usd
        for name, r in baselines.items()
        if r.cost_per_successful_task_usd is not None
    }
    best = min(costs, key=lambda name: costs[name]) if costs else next(iter(baselines))
    own = ours.cost_per_successful_task_usd
    vs_best = own / costs[best] - 1 if own is not None and costs else float("inf")
    critical = ours.task_success_by_priority.get("critical", [0, 0])[0]
    return Margin(
        point.name,
        point.group,
        admission,
        vs_best,
        best,
        ours.slo["attainment"] or 0.0,
        max(r.slo["attainment"] or 0.0 for r in baselines.values()),
        critical,
    )


CONFIDENCE = 0.95


@dataclass(frozen=True, slots=True)
class Interval:
    """A mean over a rate's points and its 95% confidence interval. Each point is one paired
    comparison (every policy ran the same workload there), and a rate has few points (three
    trace windows, five or fifteen seeds), so the interval is Student's t on the per-point
    differences. With one point it is unbounded: one run says nothing of the spread."""

    mean: float
    low: float
    high: float
    points: int

    def sign(self) -> int:
        """-1 if the whole interval is under zero, 1 if over, 0 if it holds zero."""
        return -1 if self.high < 0 else 1 if self.low > 0 else 0


def mean_interval(differences: Sequence[float]) -> Interval:
    n = len(differences)
    mean = statistics.fmean(differences)
    if n < 2 or not math.isfinite(mean):
        return Interval(mean, -math.inf, math.inf, n)
    half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * statistics.stdev(differences) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def cost_interval(ours: Sequence[float], baseline: Sequence[float]) -> Interval:
    """ripplemesh's cost per successful task against a baseline's, point by point, as a margin
    (-0.25: a quarter cheaper): the interval is taken on the log of the ratios (a margin of
    -50% and one of +100% are the same size) and turned back, so its mean is the geometric mean
    of the per-point margins."""
    logs = [math.log(a / b) if a > 0 and b > 0 else math.inf for a, b in zip(ours, baseline, strict=True)]
    on_logs = mean_interval(logs)
    return Interval(
        math.expm1(on_logs.mean), math.expm1(on_logs.low), math.expm1(on_logs.high), on_logs.points
    )


@dataclass(frozen=True, slots=True)
class GroupSummary:
    """One rate under one admission. Per point, against that point's cheapest baseline (the
    cheapest of five noisy runs, which changes from seed to seed); and pooled, each policy's
    spend over its successful tasks at all the rate's points, against the baseline that is
    cheapest so."""

    group: str
    admission: str
    points: int
    mean_cost_vs_best: float
    worst_cost_vs_best: float
    cheapest: int  # points where ripplemesh costs less than every baseline
    slo_met: int  # points where its SLO is at least the best baseline's
    mean_slo_pp: float
    critical_succeeded: int
    pooled_cost_vs_best: float  # ripplemesh's pooled cost / the cheapest baseline's pooled - 1
    pooled_best: str
    mean_slo_vs_best_pp: float  # its SLO over the points, less the best baseline's, in pp
    # Where the pooled spend went, ripplemesh's and that baseline's: the share idle and the share
    # on failed tasks; what a successful task took itself against the baseline's; and
    # ripplemesh's margin were nothing idle or wasted (its successful tasks' own spend against
    # the baseline's whole cost per success): the most a router that wastes nothing gains
    # without taking cheaper tasks or running them more cheaply.
    idle_share: float
    wasted_share: float
    best_idle_share: float
    best_wasted_share: float
    task_spend_vs_best: float
    nothing_wasted_vs_best: float
    # ripplemesh under this admission against the cheapest baseline under any admission of the
    # sweep (pooled): the whole system against the baselines as they could be deployed, the
    # project's admission or none of it.
    any_admission_cost_vs_best: float
    any_admission_best: str  # "<policy> (<admission>)"
    # What the points can tell apart from their spread: ripplemesh's cost against the pooled
    # cheapest baseline's, point by point (a margin), and its SLO against the baseline whose
    # mean SLO is best (pp), each a mean with its 95% interval.
    cost_interval: Interval
    slo_interval_pp: Interval
    slo_best: str


def summarise(sweep: Sweep) -> list[GroupSummary]:
    groups: dict[tuple[str, str], list[Margin]] = {}
    for margin in sweep.margins:
        groups.setdefault((margin.group, margin.admission), []).append(margin)
    anywhere: dict[str, tuple[float, str]] = {}  # group -> the cheapest baseline under any admission
    for (group, admission), totals in sweep.totals.items():
        for name, t in totals.items():
            if name != OURS and t.cost_per_success < anywhere.get(group, (float("inf"), ""))[0]:
                anywhere[group] = (t.cost_per_success, f"{name} ({admission})")
    summaries = []
    for (group, admission), rows in groups.items():
        totals = sweep.totals[(group, admission)]
        ours = totals[OURS]
        baselines = {name: t for name, t in totals.items() if name != OURS}
        pooled_best = min(baselines, key=lambda name: baselines[name].cost_per_success)
        best = baselines[pooled_best]
        cheapest_anywhere, anywhere_name = anywhere[group]
        slo_best = max(baselines, key=lambda name: baselines[name].mean_slo)
        per_point = [p for p in sweep.by_point[(group, admission)] if OURS in p]
        summaries.append(
            GroupSummary(
                group,
                admission,
                len(rows),
                statistics.fmean(m.cost_vs_best for m in rows),
                max(m.cost_vs_best for m in rows),
                sum(m.cost_vs_best < 0 for m in rows),
                sum(m.slo_pp >= 0 for m in rows),
                statistics.fmean(m.slo_pp for m in rows),
                sum(m.critical_succeeded for m in rows),
                ours.cost_per_success / best.cost_per_success - 1,
                pooled_best,
                (ours.mean_slo - max(t.mean_slo for t in baselines.values())) * 100,
                ours.share(ours.idle_usd),
                ours.share(ours.wasted_usd),
                best.share(best.idle_usd),
                best.share(best.wasted_usd),
                ours.task_spend / best.task_spend - 1,
                ours.task_spend / best.cost_per_success - 1,
                ours.cost_per_success / cheapest_anywhere - 1,
                anywhere_name,
                cost_interval(
                    [p[OURS].cost_per_success for p in per_point],
                    [p[pooled_best].cost_per_success for p in per_point],
                ),
                mean_interval([(p[OURS].slo - p[slo_best].slo) * 100 for p in per_point]),
                slo_best,
            )
        )
    return summaries


COST_VERDICTS = {-1: "cheaper", 0: "no clear difference", 1: "dearer"}
SLO_VERDICTS = {-1: "lower", 0: "no clear difference", 1: "higher"}
INTERVAL_COLUMNS = ("rate", "admission", "points", "cost per point [95%]", "cost", "SLO [95%]", "SLO")


def _interval_cells(g: GroupSummary) -> tuple[str, ...]:
    c, s = g.cost_interval, g.slo_interval_pp
    return (
        g.group,
        g.admission,
        str(c.points),
        f"{c.mean:+.2%} [{c.low:+.2%}, {c.high:+.2%}] {g.pooled_best}",
        COST_VERDICTS[c.sign()],
        f"{s.mean:+.2f} [{s.low:+.2f}, {s.high:+.2f}] pp {g.slo_best}",
        SLO_VERDICTS[s.sign()],
    )


def sweep_tables(sweep: Sweep) -> list[Table]:
    points = Table(title="ripplemesh against the cheapest baseline, per point")
    for column in ("point", "admission", "cost vs cheapest", "cheapest", "SLO", "best SLO"):
        left = column in ("point", "admission", "cheapest")
        points.add_column(column, justify="left" if left else "right", no_wrap=left)
    for m in sweep.margins:
        points.add_row(
            m.point, m.admission, f"{m.cost_vs_best:+.2%}", m.best, f"{m.slo:.2%}", f"{m.best_slo:.2%}"
        )
    groups = Table(title="per rate (the issue's targets: cheapest at every rate, SLO at least the best)")
    columns = (
        "rate",
        "admission",
        "mean",
        "worst",
        "cheapest",
        "SLO met",
        "SLO mean",
        "pooled",
        "pooled SLO",
    )
    for column in (*columns, "critical tasks"):
        groups.add_column(column, justify="left" if column in ("rate", "admission") else "right")
    summaries = summarise(sweep)
    for g in summaries:
        groups.add_row(
            g.group,
            g.admission,
            f"{g.mean_cost_vs_best:+.2%}",
            f"{g.worst_cost_vs_best:+.2%}",
            f"{g.cheapest}/{g.points}",
            f"{g.slo_met}/{g.points}",
            f"{g.mean_slo_pp:+.2f} pp",
            f"{g.pooled_cost_vs_best:+.2%} {g.pooled_best}",
            f"{g.mean_slo_vs_best_pp:+.2f} pp",
            f"{g.critical_succeeded:,}",
        )
    cheapest = sum(m.cost_vs_best < 0 for m in sweep.margins)
    slo_met = sum(m.slo_pp >= 0 for m in sweep.margins)
    groups.caption = (
        f"cheapest in {cheapest} of {len(sweep.margins)} runs; SLO at least the best baseline's in "
        f"{slo_met} of {len(sweep.margins)}"
    )
    spend = Table(title="where the pooled spend went: ripplemesh / the pooled cheapest baseline")
    for column in SPEND_COLUMNS:
        spend.add_column(column, justify="left" if column in ("rate", "admission") else "right")
    for g in summaries:
        spend.add_row(*_spend_cells(g))
    told = Table(
        title="what the points can tell: ripplemesh against the pooled cheapest baseline (cost) and "
        "the best-SLO baseline, per point, mean and 95% interval (Student's t)"
    )
    for column in INTERVAL_COLUMNS:
        told.add_column(column, justify="left" if column in ("rate", "admission") else "right")
    for g in summaries:
        told.add_row(*_interval_cells(g))
    return [points, groups, spend, told]


SPEND_COLUMNS = (
    "rate",
    "admission",
    "idle",
    "failed tasks",
    "per successful task",
    "nothing wasted",
    "vs any admission",
)


def _spend_cells(g: GroupSummary) -> tuple[str, ...]:
    return (
        g.group,
        g.admission,
        f"{g.idle_share:.1%} / {g.best_idle_share:.1%}",
        f"{g.wasted_share:.1%} / {g.best_wasted_share:.1%}",
        f"{g.task_spend_vs_best:+.2%}",
        f"{g.nothing_wasted_vs_best:+.2%}",
        f"{g.any_admission_cost_vs_best:+.2%} {g.any_admission_best}",
    )


def write_summary(sweep: Sweep, out: Path) -> list[Path]:
    """summary.json (every margin and group) and summary.md (a table per group: a cell per point,
    a bold cost where a baseline is cheaper, a bold SLO where one is better)."""
    groups = summarise(sweep)
    # Every policy's pooled figures per rate and admission, for comparisons the tables do not make.
    pooled = {
        f"{group} {admission}": {
            name: {
                "cost_per_success_usd": t.cost_per_success,
                "mean_slo": t.mean_slo,
                "succeeded": t.succeeded,
                "spend_usd": t.spend_usd,
            }
            for name, t in totals.items()
        }
        for (group, admission), totals in sweep.totals.items()
    }
    body = {
        "points": [asdict(m) for m in sweep.margins],
        "groups": [asdict(g) for g in groups],
        "pooled": pooled,
    }
    as_json = out / "summary.json"
    as_json.write_bytes(msgspec.json.format(msgspec.json.encode(body), indent=2))
    lines = [
        "| point | admission | cost vs cheapest baseline | SLO: ripplemesh / best baseline |",
        "|---|---|---|---|",
    ]
    for m in sweep.margins:
        cost = f"{m.cost_vs_best:+.2%}"
        slo = f"{m.slo:.2%} / {m.best_slo:.2%}"
        lines.append(
            f"| {m.point} | {m.admission} | {f'**{cost}**' if m.cost_vs_best >= 0 else cost} {m.best} | "
            f"{f'**{slo}**' if m.slo_pp < 0 else slo} |"
        )
    lines += [
        "",
        "| rate | admission | mean | worst | cheapest | SLO met | SLO mean | pooled | pooled SLO "
        "| critical tasks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        lines.append(
            f"| {g.group} | {g.admission} | {g.mean_cost_vs_best:+.2%} | {g.worst_cost_vs_best:+.2%} | "
            f"{g.cheapest}/{g.points} | {g.slo_met}/{g.points} | {g.mean_slo_pp:+.2f} pp | "
            f"{g.pooled_cost_vs_best:+.2%} {g.pooled_best} | {g.mean_slo_vs_best_pp:+.2f} pp | "
            f"{g.critical_succeeded:,} |"
        )
    lines += ["", "| " + " | ".join(SPEND_COLUMNS) + " |", "|" + "---|" * len(SPEND_COLUMNS)]
    lines += ["| " + " | ".join(_spend_cells(g)) + " |" for g in groups]
    lines += ["", "| " + " | ".join(INTERVAL_COLUMNS) + " |", "|" + "---|" * len(INTERVAL_COLUMNS)]
    lines += ["| " + " | ".join(_interval_cells(g)) + " |" for g in groups]
    as_markdown = out / "summary.md"
    as_markdown.write_text("\n".join(lines) + "\n")
    return [as_json, as_markdown]
