"""Pricing a layout, shared by every solver: the joint space's candidates priced by the cost model, with
the exact stage split (plait.search.partition), the best-so-far shortlist, the closest miss when nothing fits,
and the Plan a candidate becomes. Solvers (plait.search.solvers) differ only in which layouts they ask for.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from plait.cost.compute import EndsCost, LayerCost, Slicing, block_loads, block_weights, ends_cost, sliced_layer_cost
from plait.cost.layout import Setting
from plait.plan import Layout
from plait.cost.memory import LayoutMemory, memory_table_parts, states_overflow
from plait.cost.model import (StageTimes, closed_form_makespan, predict_layout, rank_capacities, rank_costs, rank_tail,
                              step_time, tail_lower_bound)
from plait.cost.schedule import stage_rank
from plait.plan import V_SCHEDULES
from plait.plan import RECOMPUTE_MODES, Plan
from plait.search.partition import min_max_split, min_max_split_weighted
from plait.search.space import Pins, grad_syncs

EXACT_SHORTLIST = 3
"""With `top` K, the best 3K candidates by the closed-form estimate are priced exactly before ranking (2K missed
Llama 3 8B at s = 32768 on 16 H100s: among interleaved plans within 0.5% of each other the estimate put v = 6
seventh, exact pricing second; tests/unit/test_moe_cp_cost.py)."""


class OutOfTime(Exception):
    """The search's time limit passed (Pricer.deadline): the solver stops where it is."""


@dataclass(frozen=True)
class Candidate:
    estimate: float
    layout: Layout
    layers: tuple[int, ...]
    recompute: tuple[str, ...]


@lru_cache(maxsize=256)
def stage_ranks(schedule: str, pp: int, interleave: int) -> np.ndarray:
    """The pipeline rank of every virtual stage (plait.cost.schedule.stage_rank), read-only."""
    ranks = np.array([stage_rank(schedule, pp, k) for k in range(pp * interleave)])
    ranks.flags.writeable = False
    return ranks


class Pricer:
    """One search's pricing state: cached per-(tp, sp, b) costs, the feasible candidates priced so far, the
    shortlist's estimates, the closest miss."""

    def __init__(self, setting: Setting, pins: Pins, shortlist: int | None) -> None:
        self.setting, self.pins, self.shortlist = setting, pins, shortlist
        self.evaluated = self.pruned = 0
        self.best: list[float] = []  # max-heap (negated) of the shortlist's estimates
        self.candidates: list[Candidate] = []
        self.points: list[tuple[float, float]] = []
        self.miss: tuple[float, Layout, tuple[int, ...], tuple[str, ...]] | None = None
        self._costs = lru_cache(maxsize=None)(self._layer_cost)
        self._overflows: dict[tuple, float] = {}
        self._tails: dict[tuple, float] = {}
        self._work: dict[tuple, tuple[float, float]] = {}
        self._slowest: dict[tuple, tuple[float, float]] = {}
        self._added: dict[tuple, tuple[float, float, float]] = {}
        self.deadline: float | None = None
        """time.perf_counter() after which evaluate() raises OutOfTime (None: no limit)."""
        self.bound_splits = False
        """Skip pricing a split whose slowest stage alone proves the step slower than the shortlist's cutoff
        (`split_bound`); evaluate() then returns inf for a layout none of whose variants was kept that way. The
        exact solver sets it: its result is the same; the other solvers steer by the figures evaluate() returns."""

    def layer_cost(self, layout: Layout, group: str | None = None) -> tuple[LayerCost, EndsCost]:
        """One layer's and the ends' cost of a micro-batch of `layout` on `group`'s hardware (cached: many layouts
        share a slicing and micro-batch size)."""
        return self._costs(layout.slicing, layout.micro_batch, group)

    def _layer_cost(self, cut: Slicing, b: int, group: str | None) -> tuple[LayerCost, EndsCost]:
        s = self.setting
        cluster = s.cluster.view(group) if group is not None else s.cluster
        return (sliced_layer_cost(s.model, cluster, s.seq_len, b, cut, s.dtype_bytes, s.train.document_len),
                ends_cost(s.model, cluster, s.seq_len, b, cut, s.dtype_bytes))

    def modes(self, pp: int) -> list[tuple[str, ...]]:
        """Recompute choices: per-stage free choice among these mode lists (one list per rank)."""
        r = self.pins.recompute
        if r is None:
            return [RECOMPUTE_MODES] * pp
        if isinstance(r, str):
            return [(r,)] * pp
        return [(m,) for m in (r * pp if len(r) == 1 else r)]

    def lower_bound(self, layout: Layout) -> float:
        """No split beats the work spread evenly: m·W/pp + (W - W/pp)/v, W = one micro-batch through all stages
        without recompute (the closed-form estimate is never below this; with shared cores, see
        plait.cost.model.lent_cores_factor, the fill may shrink down to the spread work; on a V, a fill of one
        layer's forward per rank before it: see below)."""
        return self.bound(layout.slicing, layout.micro_batch, layout.pp, layout.num_micro_batches, layout.interleave,
                          layout.schedule)

    def bound(self, cut: Slicing, b: int, pp: int, m: int, v: int, schedule: str) -> float:
        """`lower_bound` of a layout cut `cut` running m micro-batches of b on pp ranks with `schedule` (v chunks)."""
        work, layer_fwd = self._bound_work(cut, b)
        spread = m * work / pp
        if schedule in V_SCHEDULES:
            # the V's closed form is the latest rank's m micro-batches after the first forward reaches it: no less
            # than their mean, m·W/pp plus the mean wait, Σ_r Σ_{k<r} fwd_k / pp, each stage a layer at least
            fill = layer_fwd * (pp - 1) / 2
        else:
            fill = (work - work / pp) / v
        # where ranks share cores, idle stages lend theirs: the fill can shrink by up to `oversubscription`
        return max(spread, (spread + fill) / self.setting.cluster.oversubscription)

    def tail_bound(self, layout: Layout) -> float:
        """A lower bound on the step's data-parallel tail and optimizer step, whatever the split
        (plait.cost.model.tail_lower_bound; 0 on a mixed cluster, whose ranks differ), less a margin far above
        rounding. The step's estimate is at least lower_bound + tail_bound: the exact solver orders and stops by it."""
        if self.setting.cluster.mixed:
            return 0.0
        # the micro-batches count where the step reduces after each, or fully_shard gathers again for each
        per_micro_batch = layout.grad_sync == "micro_batch" or layout.dp_mode.reshard_after_forward
        key = (layout.degrees, layout.zero, layout.data_parallel, layout.schedule, layout.interleave,
               layout.num_micro_batches if per_micro_batch else 0, layout.grad_sync)
        if key not in self._tails:
            self._tails[key] = tail_lower_bound(self.setting, layout) * (1 - 1e-9)
        return self._tails[key]

    def _bound_work(self, cut: Slicing, b: int) -> tuple[float, float]:
        """lower_bound's W (a micro-batch through every stage, nothing recomputed) and the least forward of a stage
        (one layer), at the fastest group's pace; cached per slicing and micro-batch size."""
        key = (cut, b)
        if key not in self._work:
            groups = [g.name for g in self.setting.cluster.groups] or [None]  # mixed: the fastest group's pace bounds
            lc, ends = min((self._costs(cut, b, g) for g in groups), key=lambda costs: costs[0].fwd + costs[0].bwd)
            work = (self.setting.model.num_layers * lc.total
                    + ends.embed_fwd + ends.embed_bwd + ends.head_fwd + ends.head_bwd)
            weights = block_weights(self.setting.model, self.setting.seq_len)
            self._work[key] = work, (lc.fwd + lc.comm_fwd) * (min(weights.time) if weights else 1.0)
        return self._work[key]

    def even_memory(self, layout: Layout) -> tuple[float, float]:
        """Peak bytes of the fullest rank with the layers spread evenly: (fully recomputed, nothing recomputed)."""
        fixed, states, acts = memory_table_parts(self.setting, layout, RECOMPUTE_MODES)
        per_rank = fixed + self.setting.model.num_layers / layout.pp * (states[:, None] + acts)  # [pp, mode]
        return float(per_rank[:, -1].max()), float(per_rank[:, 0].max())

    def cutoff(self) -> float:
        """The estimate a layout must beat to enter the shortlist (inf until it is full)."""
        if self.shortlist is None or len(self.best) < self.shortlist:
            return math.inf
        return -self.best[0]

    def evaluate(self, layout: Layout) -> float | None:
        """Split, price and keep one layout, with each of its gradient reductions (plait.search.space.grad_syncs);
        the estimated step time of the faster that fits, or None when nothing fits. The variants take one place
        in the shortlist: they are the same layout but for when gradients are reduced."""
        start = len(self.candidates)
        skipped = False
        for sync in grad_syncs(layout):
            variant = layout if sync == layout.grad_sync else dataclasses.replace(layout, grad_sync=sync)
            skipped |= self._evaluate_one(variant) == math.inf
        if len(self.candidates) == start:
            return math.inf if skipped else None  # inf: it fits, but cannot enter the shortlist (bound_splits)
        kept = min(self.candidates[start:], key=lambda c: c.estimate)
        self.candidates[start:] = [kept]
        best = kept.estimate
        if self.shortlist is not None:
            heapq.heappush(self.best, -best)
            if len(self.best) > self.shortlist:
                heapq.heappop(self.best)
        return best

    def _evaluate_one(self, layout: Layout) -> float | None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise OutOfTime()
        self.evaluated += 1
        if self.overflow(layout) > 0:  # the model states alone overflow every split of this layout
            self._note_overflow(layout)
            return None
        cutoff = self.cutoff()
        if self.bound_splits and cutoff < math.inf and self.presplit_bound(layout) > cutoff * (1 + 1e-9):
            self.evaluated, self.pruned = self.evaluated - 1, self.pruned + 1  # no split of it can beat the shortlist
            return math.inf
        memory = None
        if not layout.stage_groups:  # a uniform cluster: one memory model for every rank, checked before splitting
            memory = LayoutMemory(self.setting, layout)
            if not memory.may_fit():
                self._note_overflow(layout, memory)
                return None
        split = self.split(layout, memory)
        if split is None:
            return None
        layers, recompute, peak, stage_seconds = split
        cutoff = self.cutoff()
        if self.bound_splits and cutoff < math.inf:
            bound = self.split_bound(layout, stage_seconds)
            if bound > cutoff * (1 + 1e-9) or self.rank_tail_bound(layout, layers, stage_seconds, bound) > cutoff * (
                    1 + 1e-9):  # (a margin far above rounding: what is skipped is slower than the cutoff)
                self.evaluated, self.pruned = self.evaluated - 1, self.pruned + 1  # it cannot beat the shortlist
                return math.inf
        est = step_time(self.setting, layout, layers, recompute, exact=False)
        self.candidates.append(Candidate(est.total, layout, layers, recompute))
        self.points.append((est.total, peak))
        return est.total

    def presplit_bound(self, layout: Layout) -> float:
        """`split_bound` of the best split there could be: no recompute, no memory limit, every rank's share of whole
        blocks (0 where blocks differ, ranks differ, or ranks share cores). Rank r's stages take f_r + n_r·t (f_r:
        the ends it holds, t: a block without recompute, n_r >= v blocks), so the slowest rank takes at least T*, the
        least bound under which ranks can hold all L blocks; the closed form grows with the slowest rank (and, but
        for the V, with the sum of the stages, the same for every split): 1F1B W + (m - 1)·T*, interleaved
        (m - 1/v)·T* + W/v, a V m·T* (its forwards, priced 0 by split_bound, only add)."""
        s = self.setting
        if (layout.stage_groups or s.cluster.oversubscription > 1.0
                or block_weights(s.model, s.seq_len) is not None):
            return 0.0
        pp, m, v = layout.pp, layout.num_micro_batches, layout.interleave
        if pp == 1:
            return 0.0  # split_bound prices the one stage exactly
        key = (layout.slicing, layout.micro_batch, layout.schedule, pp, v)
        if key not in self._slowest:
            self._slowest[key] = self._slowest_rank(layout)
        slowest, work = self._slowest[key]
        if layout.schedule in V_SCHEDULES:
            pipe = m * slowest
        elif layout.schedule == "interleaved":
            pipe = (m - 1 / v) * slowest + work / v
        else:
            pipe = work + (m - 1) * slowest
        return pipe + self.tail_bound(layout)

    def _slowest_rank(self, layout: Layout) -> tuple[float, float]:
        """(T*, W) of `presplit_bound`: the least time the slowest rank can take, less a margin far above rounding, and
        the stages' sum without recompute."""
        pp, v, num_layers = layout.pp, layout.interleave, self.setting.model.num_layers
        lc, ends = self.layer_cost(layout)
        t = lc.total
        ranks = stage_ranks(layout.schedule, pp, v)
        fixed = [0.0] * pp
        fixed[ranks[0]] += ends.embed_fwd + ends.embed_bwd + ends.embed_tp
        fixed[ranks[-1]] += ends.head_fwd + ends.head_bwd + ends.head_tp

        def most(bound: float, f: float) -> int:  # the most n with f + n·t <= bound, as the candidates are summed
            n = math.floor((bound - f) / t)
            return n + 1 if f + (n + 1) * t <= bound else n

        def holds(bound: float) -> bool:  # every rank within `bound` with v blocks or more, all L of them held
            counts = [most(bound, f) for f in fixed]
            return min(counts) >= v and sum(counts) >= num_layers

        # T* is a rank time f + n·t between (⌊L/pp⌋ - 1)·t (below, every rank holds fewer than L/pp blocks) and
        # max f + ⌈L/pp⌉·t (every rank holding ⌈L/pp⌉ >= v): only those candidates are looked at
        low, high = (num_layers // pp - 1) * t, max(fixed) + -(-num_layers // pp) * t
        candidates = sorted({f + n * t for f in set(fixed)
                             for n in range(max(v, math.floor((low - f) / t)), math.ceil((high - f) / t) + 2)})
        lo, hi = 0, len(candidates) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if holds(candidates[mid]):
                hi = mid
            else:
                lo = mid + 1
        return candidates[lo] * (1 - 1e-9), (sum(fixed) + num_layers * t) * (1 - 1e-9)

    def split_bound(self, layout: Layout, stage_seconds: np.ndarray) -> float:
        """A lower bound on the estimated step time of a split whose virtual stages take `stage_seconds` a
        micro-batch, forward and backward, as the split prices them (plait.search.partition: without fully_shard's
        hooks and the schedule's host time, which only add): the closed-form makespan of those times
        (plait.cost.model.closed_form_makespan grows with every stage's time; the forwards' share of the V's fill
        and the transfers, left at 0, only add), to which the step adds the data-parallel tail and the optimizer
        (>= 0). 0 where ranks share cores (lent cores may shrink the makespan: plait.cost.model.lent_cores_factor)."""
        tail = self.tail_bound(layout)
        if self.setting.cluster.oversubscription > 1.0:
            return tail
        if layout.pp == 1:
            return layout.num_micro_batches * float(stage_seconds.sum()) + tail
        stages = tuple(float(t) for t in stage_seconds)
        zeros = (0.0,) * len(stages)
        return closed_form_makespan(StageTimes(zeros, stages, stages, zeros, zeros), layout, 0.0) + tail

    def rank_tail_bound(self, layout: Layout, layers: tuple[int, ...], stage_seconds: np.ndarray,
                        split_bound: float | None = None) -> float:
        """A lower bound on the estimated step time of a split, tighter than `split_bound` where the data-parallel
        tail is exposed (looser where rank 0 holds fewer parameters than the mean and the tail hides: both are
        checked): the split's makespan bound, plus rank 0's tail and optimizer step as the estimate prices them
        (plait.cost.model.rank_tail; the estimate adds the largest rank's, which is no less), with its micro-batch's
        forward and backward each taken at most at the whole of its stages' time, which only hides more of the
        tail: the split's seconds, plus what the estimate adds to them (fully_shard's hooks, the schedule's host
        time, the loss); less a margin far above rounding. 0 on a mixed cluster or shared cores (like split_bound).
        `split_bound`: the split's, where the caller has it already."""
        s = self.setting
        if s.cluster.mixed or s.cluster.oversubscription > 1.0:
            return 0.0
        key = (layout.slicing, layout.micro_batch, layout.dp_mode.carrier, layout.pp, layout.schedule)
        if key not in self._added:  # what the estimate adds to a layer (per time load) and to a stage, and the loss
            lc, ends = self.layer_cost(layout)
            hooked, _, stage_host = rank_costs(s, layout)  # the layer as the estimate prices it
            per_layer = hooked.total - lc.total + max(hooked.recompute[m] - lc.recompute[m] for m in lc.recompute)
            self._added[key] = per_layer, 2 * stage_host, ends.loss_fwd + ends.loss_bwd
        per_layer, per_stage, loss = self._added[key]
        stages = layout.rank_stages[0]
        loads = block_loads(s.model, s.seq_len, layers)
        most = (sum(float(stage_seconds[k]) + loads[k][0] * per_layer + per_stage for k in stages) + loss) * (1 + 1e-6)
        tail, opt = rank_tail(s, layout, 0, sum(layers[k] for k in stages), True, layout.num_stages - 1 in stages,
                              most, most, sum(loads[k][1] for k in stages))
        if split_bound is None:
            split_bound = self.split_bound(layout, stage_seconds)
        return (split_bound - self.tail_bound(layout) + tail + opt) * (1 - 1e-9)

    def overflow(self, layout: Layout) -> float:
        """plait.cost.memory.states_overflow, once per layout but its micro-batch and key/value exchange."""
        key = (layout.degrees, layout.zero, layout.data_parallel, layout.schedule, layout.interleave,
               layout.stage_groups)
        if key not in self._overflows:
            self._overflows[key] = states_overflow(self.setting, layout)
        return self._overflows[key]

    def _note_overflow(self, layout: Layout, memory: LayoutMemory | None = None) -> None:
        """Remember a layout refused before its split (the model states, or `memory`'s floor, overflow) as a miss."""
        if memory is not None:  # the fullest rank at an even share, fully recomputed
            fixed, slope = memory.floor()
            share = math.ceil(self.setting.model.num_layers / layout.pp)
            excess = float((fixed + share * slope).max()) - self.setting.cluster.memory_bytes
        else:
            excess = self.overflow(layout) / layout.pp
        if self.miss is None or excess < self.miss[0]:
            self.miss = (excess, layout, (), ("full",) * layout.pp)

    def rank_tables(self, layout: Layout, memory: LayoutMemory | None = None):
        """Per pipeline rank, on its device group's hardware: (time of a layer per mode [pp, M], fixed memory
        [pp, M], a layer's model states [pp], a layer's activations [pp, M], capacity [pp], ends [pp]). `memory`:
        the layout's LayoutMemory on a uniform cluster, where the caller has it already."""
        s, pp = self.setting, layout.pp
        modes = tuple(RECOMPUTE_MODES)
        if not layout.stage_groups:  # a uniform cluster: the same hardware, and layer time, on every rank
            lc, ends = self.layer_cost(layout)
            fixed, states, acts = memory_table_parts(s, layout, modes, memory)
            time = np.array([lc.total + lc.recompute[m] for m in modes])
            return np.tile(time, (pp, 1)), fixed, states, acts, np.full(pp, s.cluster.memory_bytes), [ends] * pp
        groups = layout.stage_groups
        tables: dict = {}
        rows = []
        for r in range(pp):
            if groups[r] not in tables:
                at = s.at(layout, r)
                lc, ends = self.layer_cost(layout, groups[r])
                tables[groups[r]] = (lc, ends, memory_table_parts(at, layout, modes, memory), at.cluster.memory_bytes)
            lc, ends, (fixed, states, acts), cap = tables[groups[r]]
            time = [lc.total + lc.recompute[m] for m in modes]
            rows.append((time, fixed[r], states[r], acts[r], cap, ends))
        return (np.array([x[0] for x in rows]), np.array([x[1] for x in rows]), np.array([x[2] for x in rows]),
                np.array([x[3] for x in rows]), np.array([x[4] for x in rows]), [x[5] for x in rows])

    def split(self, layout: Layout, memory: LayoutMemory | None = None
              ) -> tuple[tuple[int, ...], tuple[str, ...], float, np.ndarray] | None:
        """(layers per virtual stage, recompute per rank, peak memory, each virtual stage's seconds a micro-batch as
        the split prices them) of the best split, or None."""
        s, pp, v = self.setting, layout.pp, layout.interleave
        rank_modes = self.modes(pp)
        all_modes = tuple(RECOMPUTE_MODES)
        per_layer, fixed_mem, layer_states, layer_act, cap, ends_of = self.rank_tables(layout, memory)
        layer_mem = layer_states[:, None] + layer_act
        stages = layout.num_stages
        ranks = stage_ranks(layout.schedule, pp, v)
        first, last = ends_of[ranks[0]], ends_of[ranks[-1]]
        fixed_time = np.zeros(stages)
        fixed_time[0] += first.embed_fwd + first.embed_bwd + first.embed_tp
        fixed_time[-1] += last.head_fwd + last.head_bwd + last.head_tp
        allowed = np.array([[m in modes for m in all_modes] for modes in rank_modes])
        if v > 1:
            choice = self._interleaved_modes(layout, fixed_mem, layer_mem, allowed, cap)
            if choice is None:
                return None
            allowed = np.zeros_like(allowed)
            allowed[np.arange(pp), choice] = True
        big = np.where(allowed[ranks], 0.0, np.inf)  # a mode not allowed on a rank never fits
        weights = block_weights(s.model, s.seq_len)
        if weights is None:
            split = min_max_split(s.model.num_layers, fixed_time, per_layer[ranks],
                                  fixed_mem[ranks] / v + big, layer_mem[ranks], cap[ranks] / v)
        else:  # blocks that differ: each stage's range of blocks, weighed
            split = min_max_split_weighted(weights.time, weights.params, weights.activations, fixed_time,
                                           per_layer[ranks], fixed_mem[ranks] / v + big,
                                           layer_states[ranks], layer_act[ranks], cap[ranks] / v)
        if split is None:
            self._note_miss(layout, fixed_mem, layer_mem, allowed, cap)
            return None
        chosen = np.array(split.modes) if v == 1 else np.argmax(allowed, axis=1)  # each rank's mode
        loads = np.array(block_loads(s.model, s.seq_len, split.layers))  # [stage, (time, params, activations)]
        # each rank's loads, its stages added in model order (plait.cost.layout.Layout.stages_of)
        held = [np.bincount(ranks, weights=loads[:, j], minlength=pp) for j in (1, 2)]
        on_rank = np.arange(pp)
        peak = float((fixed_mem[on_rank, chosen] + held[0] * layer_states + held[1] * layer_act[on_rank, chosen]).max())
        seconds = fixed_time + loads[:, 0] * per_layer[ranks, chosen[ranks]]
        return split.layers, tuple(all_modes[i] for i in chosen), peak, seconds

    def _interleaved_modes(self, layout, fixed_mem, layer_mem, allowed, cap) -> np.ndarray | None:
        """Interleaved ranks run one mode over all their chunks: the cheapest that fits an even share."""
        share = math.ceil(self.setting.model.num_layers / layout.pp)
        fits = (fixed_mem + share * layer_mem <= np.asarray(cap).reshape(-1, 1)) & allowed
        if not fits.any(axis=1).all():
            self._note_miss(layout, fixed_mem, layer_mem, allowed, cap)
            return None
        return np.argmax(fits, axis=1)  # modes are ordered none < selective < full

    def _note_miss(self, layout, fixed_mem, layer_mem, allowed, cap) -> None:
        """Remember by how much the most frugal allowed version of this layout misses memory."""
        share = math.ceil(self.setting.model.num_layers / layout.pp)
        need = np.where(allowed, fixed_mem + share * layer_mem, np.inf).min(axis=1)
        excess = float((need - np.asarray(cap)).max())
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
        plan = Plan(layout=layout, recompute=recompute, layers_per_stage=layers, model=s.model, train=s.train,
                    cluster=s.cluster)
        pred = predict_layout(s, plan.layout, plan.layers_per_stage, plan.recompute)
        return plan.replace(predicted=pred)

    def finish(self, top: int | None) -> list[Plan]:
        ranked = sorted(self.candidates, key=lambda c: c.estimate)  # stable: enumeration order breaks ties
        if top is not None:
            ranked = ranked[: EXACT_SHORTLIST * top]
        plans = [self.to_plan(c.layout, c.layers, c.recompute) for c in ranked]
        plans = [p for p in plans if all(used <= cap * (1 + 1e-9) for used, cap in
                                         zip(p.predicted.memory_per_stage, rank_capacities(self.setting, p.layout)))]
        # Ties in time (e.g. micro-batch sizes the model prices alike) go to the plan with less memory.
        plans.sort(key=lambda p: (round(p.predicted.step_time_s, 9), p.predicted.peak_memory_bytes))
        return plans[:top] if top is not None else plans


