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
  evenly, no recompute), stopping once the bound cannot beat the 2K-th best estimate; a layout
  whose smaller micro-batch missed memory is skipped for larger ones.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator

import numpy as np

from plait.cost.compute import EndsCost, LayerCost, block_loads, block_weights, ends_cost, layer_cost
from plait.cost.layout import Layout, Setting
from plait.cost.memory import memory_table_parts
from plait.cost.model import predict_layout, step_time
from plait.errors import ConfigError, NoFeasiblePlan
from plait.plan import RECOMPUTE_MODES, Plan
from plait.cost.schedule import stage_rank
from plait.search.partition import min_max_split, min_max_split_weighted
from plait import legality
from plait.axes import ALL_AXES, Degrees
from plait.search.space import Pins, check_pins, degree_choices, divisors, schedule_choices
from plait.spec import ClusterSpec, ModelSpec, TrainSpec
from plait.spec.load import load_cluster, load_model

GiB = 2**30
EXACT_SHORTLIST = 2
"""With `top` K, the best 2K candidates by the closed-form estimate are priced exactly before ranking."""


@dataclass(frozen=True)
class Candidate:
    estimate: float
    layout: Layout
    layers: tuple[int, ...]
    recompute: tuple[str, ...]


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
    or a smaller micro-batch of the same layout already missed memory."""


def plan(model, cluster, train: TrainSpec, *, num_devices=None, top=None, **pins) -> list[Plan]:
    """Feasible plans, best first. See `plan_with_stats` for the arguments."""
    return plan_with_stats(model, cluster, train, num_devices=num_devices, top=top, **pins).plans


def plan_with_stats(model: ModelSpec | str, cluster: ClusterSpec | str, train: TrainSpec, *,
                    num_devices: int | None = None, top: int | None = None, explain_infeasible: bool = True,
                    **pins) -> SearchResult:
    """Search the joint space for `model` on `num_devices` devices of `cluster` (default: all of it).

    Pins (plait.search.space.PIN_NAMES): any axis degree (dp, tp, pp, cp, ep), zero, recompute (one mode
    or one per pipeline rank), micro_batch, schedule, interleave, sequence_parallel, allow_cross_node_tp.
    Any pin that is not None is fixed. `top` K keeps the K best plans (None: every feasible plan).
    Raises ConfigError for pins no plan can honour, NoFeasiblePlan when nothing fits in memory."""
    start = time.perf_counter()
    model, cluster = load_model(model), load_cluster(cluster)  # specs, preset names or files
    if not isinstance(train, TrainSpec):
        raise ConfigError(f"train must be a TrainSpec, got {type(train).__name__}")
    n = cluster.num_devices if num_devices is None else num_devices
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ConfigError(f"num_devices={n!r} must be a positive integer")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top <= 0):
        raise ConfigError(f"top={top!r} must be a positive integer")
    pins = Pins.from_kwargs(**pins)
    if problems := legality.sequence_problems(model, train.seq_len, 1, False):
        raise legality.IllegalPlan(problems)
    check_pins(pins, model, cluster, train, n)
    setting = Setting(model, cluster.with_devices(n), train)
    search = _Search(setting, pins, None if top is None else EXACT_SHORTLIST * top)
    degrees = degree_choices(pins, model, cluster, train, n)
    if not degrees:
        raise ConfigError(_no_layout_message(model, train, n))
    search.run(degrees)
    if search.evaluated == 0 and search.pruned == 0:
        raise ConfigError(_no_schedule_message(pins, degrees, train))
    plans = search.finish(top)
    elapsed = time.perf_counter() - start
    if not plans:
        worst = search.closest_miss()
        if explain_infeasible:
            raise NoFeasiblePlan(_infeasible_message(setting, pins, worst, n))
        return SearchResult([], search.evaluated, elapsed, worst, [], search.pruned)
    return SearchResult(plans, search.evaluated, elapsed, None, search.points, search.pruned)


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


class _Search:
    """One search's state: cached per-(tp, sp, b) costs, the feasible candidates, the closest miss."""

    def __init__(self, setting: Setting, pins: Pins, shortlist: int | None) -> None:
        self.setting, self.pins, self.shortlist = setting, pins, shortlist
        self.evaluated = self.pruned = 0
        self.best: list[float] = []  # max-heap (negated) of the shortlist's estimates
        self.candidates: list[Candidate] = []
        self.points: list[tuple[float, float]] = []
        self.miss: tuple[float, Layout, tuple[int, ...], tuple[str, ...]] | None = None
        self.layer_cost = lru_cache(maxsize=None)(self._layer_cost)

    def _layer_cost(self, tp: int, sp: bool, b: int) -> tuple[LayerCost, EndsCost]:
        s = self.setting
        return (layer_cost(s.model, s.cluster, s.seq_len, b, tp, sp, s.dtype_bytes),
                ends_cost(s.model, s.cluster, s.seq_len, b, tp, sp, s.dtype_bytes))

    def modes(self, pp: int) -> list[tuple[str, ...]]:
        """Recompute choices: per-stage free choice among these mode lists (one list per rank)."""
        r = self.pins.recompute
        if r is None:
            return [RECOMPUTE_MODES] * pp
        if isinstance(r, str):
            return [(r,)] * pp
        return [(m,) for m in (r * pp if len(r) == 1 else r)]

    def layouts(self, d: Degrees) -> Iterator[Layout]:
        """Every layout of these degrees: sequence parallel x micro-batch x ZeRO x schedule, smaller b first."""
        pins, batch = self.pins, self.setting.train.global_batch
        # Unpinned, sequence parallelism is always on for tp > 1: it moves the same bytes as tensor parallelism's
        # all-reduces and keeps less activation memory, so the cost model never prefers it off.
        sps = [False] if d.tp == 1 else ([pins.sequence_parallel] if pins.sequence_parallel is not None else [True])
        # Under a pipeline plait runs ZeRO-3 as ZeRO-2 (parameters kept gathered through the schedule), so
        # it is listed only when pinned.
        zeros = [pins.zero] if pins.zero is not None else ([0, 1, 2] + ([3] if d.pp == 1 else []) if d.dp > 1 else [0])
        per_replica = batch // d.dp
        for sp in sps:
            for b in divisors(per_replica):
                if pins.micro_batch is not None and b != pins.micro_batch:
                    continue
                m = per_replica // b
                for zero in zeros:
                    for schedule, v in schedule_choices(pins, d.pp, m, self.setting.model.num_layers):
                        yield Layout(d, sp and d.tp > 1, zero, b, m, schedule, v)

    def run(self, degrees: list[Degrees]) -> None:
        """Price the layouts. With a shortlist, best-first by lower bound, stopping once no bound can beat it."""
        layouts = [layout for d in degrees for layout in self.layouts(d)]
        if self.shortlist is not None:
            bounds = [self.lower_bound(layout) for layout in layouts]
            order = sorted(range(len(layouts)), key=bounds.__getitem__)
            layouts = [layouts[i] for i in order]
            bounds = [bounds[i] for i in order]
        too_big: dict[tuple, int] = {}  # layout (but b) -> smallest micro-batch that missed memory
        for i, layout in enumerate(layouts):
            if self.shortlist is not None and len(self.best) >= self.shortlist and bounds[i] >= -self.best[0]:
                self.pruned += len(layouts) - i
                return
            key = (layout.dp, layout.tp, layout.pp, layout.sp, layout.zero, layout.schedule, layout.interleave)
            if layout.micro_batch >= too_big.get(key, layout.micro_batch + 1):
                self.pruned += 1  # activations grow with b: a larger micro-batch cannot fit either
                continue
            if not self.evaluate(layout):
                too_big[key] = min(layout.micro_batch, too_big.get(key, layout.micro_batch))

    def lower_bound(self, layout: Layout) -> float:
        """No split beats the work spread evenly: m·W/pp + (W - W/pp)/v, W = one micro-batch through all stages
        without recompute (the closed-form estimate is never below this; with shared cores, see
        plait.cost.model.lent_cores_factor, the fill may shrink down to the spread work)."""
        lc, ends = self.layer_cost(layout.tp, layout.sp, layout.micro_batch)
        work = (self.setting.model.num_layers * (lc.fwd + lc.bwd + lc.tp_fwd + lc.tp_bwd)
                + ends.embed_fwd + ends.embed_bwd + ends.head_fwd + ends.head_bwd)
        pp, m, v = layout.pp, layout.num_micro_batches, layout.interleave
        spread = m * work / pp
        # where ranks share cores, idle stages lend theirs: the fill can shrink by up to `oversubscription`
        return max(spread, (spread + (work - work / pp) / v) / self.setting.cluster.oversubscription)

    def evaluate(self, layout: Layout) -> bool:
        """Split, price and keep one layout; False when nothing fits."""
        self.evaluated += 1
        split = self.split(layout)
        if split is None:
            return False
        layers, recompute, peak = split
        est = step_time(self.setting, layout, layers, recompute, exact=False)
        self.candidates.append(Candidate(est.total, layout, layers, recompute))
        if self.shortlist is not None:
            heapq.heappush(self.best, -est.total)
            if len(self.best) > self.shortlist:
                heapq.heappop(self.best)
        self.points.append((est.total, peak))
        return True

    def split(self, layout: Layout) -> tuple[tuple[int, ...], tuple[str, ...], float] | None:
        """(layers per virtual stage, recompute per rank, peak memory) of the best split, or None."""
        s, pp, v = self.setting, layout.pp, layout.interleave
        lc, ends = self.layer_cost(layout.tp, layout.sp, layout.micro_batch)
        rank_modes = self.modes(pp)
        all_modes = tuple(RECOMPUTE_MODES)
        fixed_mem, layer_states, layer_act = memory_table_parts(s, layout, all_modes)
        layer_mem = layer_states[:, None] + layer_act
        per_layer = np.array([lc.fwd + lc.bwd + lc.tp_fwd + lc.tp_bwd + lc.recompute[m] for m in all_modes])
        cap = s.cluster.memory_bytes
        stages = layout.num_stages
        fixed_time = np.zeros(stages)
        fixed_time[0] += ends.embed_fwd + ends.embed_bwd + ends.embed_tp
        fixed_time[-1] += ends.head_fwd + ends.head_bwd + ends.head_tp
        allowed = np.array([[m in rank_modes[r] for m in all_modes] for r in range(pp)])
        if v > 1:
            choice = self._interleaved_modes(layout, fixed_mem, layer_mem, allowed, cap)
            if choice is None:
                return None
            allowed = np.zeros_like(allowed)
            allowed[np.arange(pp), choice] = True
        ranks = np.array([stage_rank(layout.schedule, pp, k) for k in range(stages)])
        big = np.where(allowed[ranks], 0.0, np.inf)  # a mode not allowed on a rank never fits
        weights = block_weights(s.model, s.seq_len)
        if weights is None:
            split = min_max_split(s.model.num_layers, fixed_time, np.tile(per_layer, (stages, 1)),
                                  fixed_mem[ranks] / v + big, layer_mem[ranks], np.full(stages, cap / v))
        else:  # blocks that differ: each stage's range of blocks, weighed
            split = min_max_split_weighted(weights.time, weights.params, weights.activations, fixed_time,
                                           np.tile(per_layer, (stages, 1)), fixed_mem[ranks] / v + big,
                                           layer_states[ranks], layer_act[ranks], np.full(stages, cap / v))
        if split is None:
            self._note_miss(layout, fixed_mem, layer_mem, allowed, cap)
            return None
        chosen = [split.modes[r] if v == 1 else int(np.argmax(allowed[r])) for r in range(pp)]
        loads = block_loads(s.model, s.seq_len, split.layers)
        owned = [layout.stages_of(r) for r in range(pp)]
        peak = float(max(fixed_mem[r, i] + sum(loads[k][1] for k in owned[r]) * layer_states[r]
                         + sum(loads[k][2] for k in owned[r]) * layer_act[r, i] for r, i in enumerate(chosen)))
        return split.layers, tuple(all_modes[i] for i in chosen), peak

    def _interleaved_modes(self, layout, fixed_mem, layer_mem, allowed, cap) -> np.ndarray | None:
        """Interleaved ranks run one mode over all their chunks: the cheapest that fits an even share."""
        share = math.ceil(self.setting.model.num_layers / layout.pp)
        fits = (fixed_mem + share * layer_mem <= cap) & allowed
        if not fits.any(axis=1).all():
            self._note_miss(layout, fixed_mem, layer_mem, allowed, cap)
            return None
        return np.argmax(fits, axis=1)  # modes are ordered none < selective < full

    def _note_miss(self, layout, fixed_mem, layer_mem, allowed, cap) -> None:
        """Remember by how much the most frugal allowed version of this layout misses memory."""
        share = math.ceil(self.setting.model.num_layers / layout.pp)
        need = np.where(allowed, fixed_mem + share * layer_mem, np.inf).min(axis=1)
        excess = float(need.max() - cap)
        if self.miss is None or excess < self.miss[0]:
            frugal = tuple(RECOMPUTE_MODES[int(np.where(allowed[r])[0][-1])] for r in range(layout.pp))
            self.miss = (excess, layout, (), frugal)

    def closest_miss(self) -> Plan | None:
        if self.miss is None:
            return None
        _, layout, _, recompute = self.miss
        return self.to_plan(layout, (), recompute)

    def to_plan(self, layout: Layout, layers: tuple[int, ...], recompute: tuple[str, ...]) -> Plan:
        s = self.setting
        plan = Plan(degrees=layout.degrees, sequence_parallel=layout.sp, zero=layout.zero,
                    recompute=recompute, micro_batch=layout.micro_batch, num_micro_batches=layout.num_micro_batches,
                    schedule=layout.schedule, interleave=layout.interleave, layers_per_stage=layers,
                    model=s.model, train=s.train, cluster=s.cluster)
        pred = predict_layout(s, Layout.of(plan), plan.layers_per_stage, plan.recompute)
        return plan.replace(predicted=pred)

    def finish(self, top: int | None) -> list[Plan]:
        ranked = sorted(self.candidates, key=lambda c: c.estimate)  # stable: enumeration order breaks ties
        if top is not None:
            ranked = ranked[: EXACT_SHORTLIST * top]
        plans = [self.to_plan(c.layout, c.layers, c.recompute) for c in ranked]
        cap = self.setting.cluster.memory_bytes
        plans = [p for p in plans if p.predicted.peak_memory_bytes <= cap * (1 + 1e-9)]
        # Ties in time (e.g. micro-batch sizes the model prices alike) go to the plan with less memory.
        plans.sort(key=lambda p: (round(p.predicted.step_time_s, 9), p.predicted.peak_memory_bytes))
        return plans[:top] if top is not None else plans


def _infeasible_message(setting: Setting, pins: Pins, worst: Plan | None, n: int) -> str:
    model, cluster = setting.model, setting.cluster
    if worst is None:
        return f"no plan for {model.name} on {n} devices of {cluster.name} fits"
    miss = (worst.predicted.peak_memory_bytes - cluster.memory_bytes) / GiB
    smallest = smallest_fitting_devices(setting, pins, n)
    hint = (f"the smallest device count of {cluster.name} that fits is {smallest}" if smallest
            else f"no device count up to {64 * max(n, cluster.num_devices)} fits; lower seq_len or global_batch")
    return (f"{model.name} fits no plan on {n} devices of {cluster.name} ({cluster.memory_bytes / GiB:.0f} GiB each): "
            f"the closest candidate ({worst.describe()}) needs {worst.predicted.peak_memory_bytes / GiB:.1f} GiB, "
            f"{miss:.1f} GiB too much; {hint}")


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
