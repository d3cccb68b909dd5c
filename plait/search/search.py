"""The joint search: enumerate degrees x sequence parallel x ZeRO x micro-batches x schedules, split the
layers exactly (with recompute per stage), prune by memory, rank by predicted step time.

* Space: every dp·tp·pp = N (tp divides the heads and kv-heads and stays in a node unless allowed;
  pp <= layers; dp divides the batch), ZeRO 0-3, every micro-batch size dividing the per-replica
  batch, 1F1B (GPipe where m < pp), interleaved with v = 2..8, recompute chosen per stage by the
  split (plait.search.partition). Dominated choices are not priced: sequence parallelism off
  (same bytes moved, more memory) and GPipe where 1F1B can run (same bubble, more memory),
  unless pinned.
* Pricing: the cost model's closed-form schedule (plait.cost.model, exact=False); the shortlist
  is then priced exactly (simulated schedule) and re-ranked.
* With `top` K: layouts are priced best-first by a lower bound on their step time (the work spread
  evenly, no recompute), stopping once the bound cannot beat the 3K-th best estimate; a layout
  whose smaller micro-batch missed memory is skipped for larger ones; a split whose own stage times
  (their closed-form makespan) cannot beat it is not priced further (Pricer.split_bound).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from plait import legality
from plait.axes import ALL_AXES, Degrees
from plait.cost.layout import Setting
from plait.cost.model import rank_capacities
from plait.errors import ConfigError, NoFeasiblePlan
from plait.plan import Plan
from plait.search.pricing import EXACT_SHORTLIST, OutOfTime, Pricer
from plait.search.solvers import check_options, choose_solver, get_solver
from plait.search.space import Pins, Space, check_pins, degree_choices, divisors, searched_v_schedules
from plait.spec import ClusterSpec, ModelSpec, TrainSpec
from plait.spec.load import load_cluster, load_model

GiB = 2**30


@dataclass(frozen=True)
class SearchResult:
    plans: list[Plan]
    """Feasible plans, best first, each with `predicted` filled."""
    candidates_evaluated: int
    seconds: float
    best_infeasible: Plan | None = None
    """When nothing fits: the candidate that misses memory by the least (predicted filled)."""
    points: list[tuple[float, float]] = field(default_factory=list)
    """(estimated step time s, peak memory bytes) of every feasible candidate priced, for plots."""
    candidates_pruned: int = 0
    """Candidates not priced: a lower bound on their step time could not beat the shortlist (only with top),
    or a smaller micro-batch of the same layout already missed memory, or the solver passed them over."""
    solver: str = "exact"
    """Which solver chose the candidates (plait.search.solvers)."""
    complete: bool = True
    """False when the search stopped at its time limit (the plans are the best found by then)."""


def plan(model, cluster, train: TrainSpec, *, num_devices=None, top=None, **pins) -> list[Plan]:
    """Feasible plans, best first. See `plan_with_stats` for the arguments."""
    return plan_with_stats(model, cluster, train, num_devices=num_devices, top=top, **pins).plans


def plan_with_stats(model: ModelSpec | str, cluster: ClusterSpec | str, train: TrainSpec, *,
                    num_devices: int | None = None, top: int | None = None, explain_infeasible: bool = True,
                    solver: str = "auto", time_limit_s: float | None = None,
                    solver_options: Mapping[str, Any] | None = None, **pins) -> SearchResult:
    """Search the joint space for `model` on `num_devices` devices of `cluster` (default: all of it).

    Pins (plait.search.space.PIN_NAMES): any axis degree (dp, tp, pp, cp, ep), zero, recompute (one mode
    or one per pipeline rank), micro_batch, schedule, interleave, sequence_parallel, allow_cross_node_tp.
    Any pin that is not None is fixed. `top` K keeps the K best plans (None: every feasible plan). `solver`
    chooses how the space is searched (plait.search.solvers: exact, dichotomy, learned, or auto: exact where
    the space is small, learned beyond); `solver_options` set its budget (plait.search.solvers.SOLVER_OPTIONS,
    e.g. {"proposals": 96} for the learned solver); `time_limit_s` stops the solver there (the result says so).
    Raises ConfigError for pins no plan can honour, NoFeasiblePlan when nothing fits in memory."""
    options = dict(solver_options or {})
    check_options(solver, options)
    start = time.perf_counter()
    model, cluster = load_model(model), load_cluster(cluster)  # specs, preset names or files
    if not isinstance(train, TrainSpec):
        raise ConfigError(f"train must be a TrainSpec, got {type(train).__name__}")
    n = cluster.num_devices if num_devices is None else num_devices
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ConfigError(f"num_devices={n!r} must be a positive integer")
    if cluster.mixed and n != cluster.num_devices:
        groups = ", ".join(f"{g.name} {g.num_devices}" for g in cluster.groups)
        raise ConfigError(f"num_devices={n}: mixed cluster {cluster.name} is planned whole ({groups}); give "
                          f"{cluster.num_devices} or leave it out")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top <= 0):
        raise ConfigError(f"top={top!r} must be a positive integer")
    pins = Pins.from_kwargs(**pins)
    if problems := legality.sequence_problems(model, train.seq_len, 1, False):
        raise legality.IllegalPlan(problems)
    check_pins(pins, model, cluster, train, n)
    setting = Setting(model, cluster.with_devices(n), train)
    pricer = Pricer(setting, pins, None if top is None else EXACT_SHORTLIST * top)
    degrees = degree_choices(pins, model, cluster, train, n)
    if not degrees:
        raise ConfigError(_no_layout_message(model, train, n))
    groups = tuple((g.name, g.num_devices) for g in cluster.groups) if cluster.mixed else ()
    space = Space(pins, degrees, train.global_batch, model.num_layers, groups, model, train.seq_len,
                  v_schedules=searched_v_schedules(cluster))
    if solver == "auto":
        solver = choose_solver(space)
        options = options if solver == "learned" else {}  # the learned solver's budget, where auto picks it
    chosen = get_solver(solver, **options)
    if time_limit_s is not None:
        pricer.deadline = start + time_limit_s
    complete = True
    try:
        chosen.solve(space, pricer)
    except OutOfTime:
        complete = False
    pricer.deadline = None
    if not complete and not pricer.candidates:
        raise ConfigError(f"the {solver} solver reached its time limit ({time_limit_s:g} s) before it found a plan "
                          f"({pricer.evaluated} candidates priced); give it more time, or pin more of the plan")
    if pricer.evaluated == 0 and pricer.pruned == 0:
        raise ConfigError(_no_schedule_message(pins, degrees, train))
    plans = pricer.finish(top)
    elapsed = time.perf_counter() - start
    if not plans:
        worst = pricer.closest_miss()
        if explain_infeasible:
            raise NoFeasiblePlan(_infeasible_message(setting, pins, worst, n))
        return SearchResult([], pricer.evaluated, elapsed, worst, [], pricer.pruned, solver, complete)
    return SearchResult(plans, pricer.evaluated, elapsed, None, pricer.points, pricer.pruned, solver, complete)


def _no_layout_message(model: ModelSpec, train: TrainSpec, n: int) -> str:
    dps = [d for d in divisors(n) if train.global_batch % d == 0]
    return (f"no dp x tp x pp layout of {n} devices fits {model.name} (heads={model.num_heads}, "
            f"kv_heads={model.num_kv_heads}, layers={model.num_layers}) with global_batch={train.global_batch} "
            f"and the pins given; data-parallel degrees dividing the batch: {', '.join(map(str, dps))}")


def _no_schedule_message(pins: Pins, degrees: list[Degrees], train: TrainSpec) -> str:
    pp = sorted({d.pp for d in degrees})
    return (f"no micro-batch size and schedule satisfy the pins (micro_batch={pins.micro_batch}, "
            f"schedule={pins.schedule}, interleave={pins.interleave}) with pp in {pp} and "
            f"global_batch={train.global_batch}: 1f1b needs num_micro_batches >= pp, interleaved needs "
            f"num_micro_batches % pp == 0 and pp x interleave <= num_layers")


def _infeasible_message(setting: Setting, pins: Pins, worst: Plan | None, n: int) -> str:
    model, cluster = setting.model, setting.cluster
    if worst is None:
        return f"no plan for {model.name} on {n} devices of {cluster.name} fits"
    if cluster.mixed:  # planned whole: no other device count to try (ClusterSpec.with_devices)
        return _mixed_infeasible_message(setting, worst)
    miss = (worst.predicted.peak_memory_bytes - cluster.memory_bytes) / GiB
    smallest = smallest_fitting_devices(setting, pins, n)
    hint = (f"the smallest device count of {cluster.name} that fits is {smallest}" if smallest
            else f"no device count up to {64 * max(n, cluster.num_devices)} fits; lower seq_len or global_batch")
    return (f"{model.name} fits no plan on {n} devices of {cluster.name} ({cluster.memory_bytes / GiB:.0f} GiB each): "
            f"the closest candidate ({worst.describe()}) needs {worst.predicted.peak_memory_bytes / GiB:.1f} GiB, "
            f"{miss:.1f} GiB too much; {hint}")


def _mixed_infeasible_message(setting: Setting, worst: Plan) -> str:
    """Nothing fits a mixed cluster: the closest candidate's fullest rank against its own group's memory."""
    model, cluster = setting.model, setting.cluster
    capacities = rank_capacities(setting, worst.layout)
    used = worst.predicted.memory_per_stage
    r = max(range(len(used)), key=lambda k: used[k] - capacities[k])
    group = worst.stage_groups[r] if worst.stage_groups else cluster.groups[0].name
    groups = ", ".join(f"{g.name} {g.num_devices} x {g.memory_bytes / GiB:.0f} GiB" for g in cluster.groups)
    return (f"{model.name} fits no plan on mixed cluster {cluster.name} ({groups}): the closest candidate "
            f"({worst.describe()}) needs {used[r] / GiB:.1f} GiB on pipeline rank {r} ({group}), "
            f"{(used[r] - capacities[r]) / GiB:.1f} GiB too much; a mixed cluster is planned whole, so give its groups "
            f"more devices or memory in the cluster file, or lower seq_len or global_batch")


def device_counts(cluster: ClusterSpec, start: int, limit: int) -> list[int]:
    """Counts above `start`: powers of two below one node, then multiples of devices_per_node."""
    dpn = cluster.devices_per_node
    below = [2**k for k in range(0, 64) if 2**k < dpn and 2**k > start]
    return below + [k * dpn for k in range(max(1, start // dpn + 1), limit // dpn + 1)]


def smallest_fitting_devices(setting: Setting, pins: Pins, n: int) -> int | None:
    """Smallest device count (above n) with a feasible plan: doubling, then bisection over multiples of a node."""
    counts = device_counts(setting.cluster, n, 64 * max(n, setting.cluster.num_devices))

    def fits(count: int) -> bool:
        try:
            kwargs = {k: v for k, v in pins.to_kwargs().items() if k not in ALL_AXES}  # degrees scale with n
            result = plan_with_stats(setting.model, setting.cluster, setting.train, num_devices=count, top=1,
                                     explain_infeasible=False, **kwargs)
        except ConfigError:
            return False
        return bool(result.plans)

    lo, i = -1, 0
    while i < len(counts) and not fits(counts[i]):
        lo, i = i, (i + 1) * 2 - 1 if i else 1
    if i >= len(counts):
        i = len(counts) - 1
        if not fits(counts[i]):
            return None
    while i - lo > 1:  # counts[lo] does not fit, counts[i] does
        mid = (lo + i) // 2
        if fits(counts[mid]):
            i = mid
        else:
            lo = mid
    return counts[i]
