"""Dynamic load balancing (`[plan] adapt = true`, `plait train --adapt`): re-plan from what the run measures.

Every WINDOW_STEPS steps (after WARMUP_STEPS of each plan) every rank's timings are gathered
(plait/train/measure.py) and rank 0 decides, from the medians over the last WINDOW_STEPS steps:

1. **Is anything off?** Each rank's compute over what the cost model predicted for it, against the median rank's:
   a rank more than ADAPT_MARGIN above it is a straggler (below it, a rank the plan gives too little work); its
   speed is updated by that factor. The step as a whole (less the ranks' wait for a core: Segment.measured)
   departing from the prediction by more than ADAPT_MARGIN also triggers a re-plan (until the constants were refitted once). Otherwise: keep.
2. **Refit.** The cost model's constants are refitted from the median rank's compute and optimizer parts
   (plait.profile.terms.fit_terms, only where that predicts held-out timings better), once, on the first plan.
3. **Re-plan** with the mixed-cluster planner: for every block size b dividing the world, a cluster whose device
   groups are runs of b consecutive ranks at the speed of their slowest member (a straggler's group is slower by
   its measured factor; `speed_view`). The planner then gives a slow group fewer layers (an uneven pipeline
   split) or puts it where it costs least, or keeps another plan altogether; the best prediction over the views
   wins. The current plan is priced on the same speeds, and the ratio of its measured to its predicted step
   corrects the new plan's prediction.
4. **Switch if it pays**: when the new plan is predicted faster by at least MIN_GAIN and the time it saves over
   the steps left exceeds the switch's cost (a checkpoint save and load, two builds, a warm-up: `switch_cost`),
   the loop checkpoints, builds the new plan, loads the checkpoint into it (resharding, as a resume does) and goes
   on with the same data order: the losses are those of a run that never switched, to the layouts' rounding.

Every decision is logged with its reason and figures: a line on rank 0's stderr and LOG_DIR/adapt.jsonl.
At most MAX_SWITCHES switches per run. A slow rank is emulated on one machine with PLAIT_THROTTLE
(plait/runtime/throttle.py), which follows the global rank whatever the plan.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from plait.train.measure import WARMUP_STEPS, Segment, measured_router_imbalance

ADAPT_MARGIN = 0.25
"""A rank computing more than this much slower than the median rank (each against its own prediction) is a
straggler; a step this much off its prediction (either way) calls for a refit."""
WINDOW_STEPS = 4
"""Steps a decision looks at (their medians): one slow step is noise, a slow window is a straggler."""
MIN_GAIN = 0.05
"""A new plan must be predicted this much faster than the measured step to be worth a switch at all."""
MAX_SWITCHES = 2
ADAPT_FILE = "adapt.jsonl"
SWITCH_COST_ENV = "PLAIT_ADAPT_SWITCH_S"
"""Seconds a switch is assumed to cost, where set (tests and demos: 0 switches whenever a plan is predicted
MIN_GAIN faster); unset, `switch_cost` estimates it from the run's own build time and steps."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One check of the run against its plan: what was decided, why, and the figures behind it."""

    step: int
    action: str
    """"keep" (within the margins), "stay" (re-planned; no plan pays for the switch), "switch"."""
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)
    plan: dict | None = None
    """The plan switched to (Plan.to_dict()), for "switch"."""

    def line(self) -> str:
        return f"plait: adapt at step {self.step}: {self.action}: {self.reason}"


def rank_speeds(segment: Segment, planned: list[float], window: int = WINDOW_STEPS) -> tuple[list[float], float]:
    """(each rank's compute over what it should take at the speed the plan was made for, relative to the median
    rank's; the median rank's ratio to the prediction) over the last `window` steps, in global rank order.

    The cost model prices a pipeline rank at the speed of its slowest rank (`planned`: 1 = the median rank's, 3 =
    three times as slow), so a rank that shares a block with a slower one is expected at its own speed."""
    from plait.execute.mesh import rank_order
    from plait.plan import Plan

    plan = Plan.from_dict(segment.plan)
    block = plan.dp * plan.cp * plan.tp
    order = rank_order(plan) or list(range(plan.num_devices))
    slowest = [max(planned[g] for g in order[p * block:(p + 1) * block]) for p in range(plan.pp)]
    ratios = []
    for record in sorted(segment.ranks, key=lambda r: r.rank):
        expected = segment.predicted_rank_compute[record.pp_rank] * planned[record.rank] / slowest[record.pp_rank]
        measured = statistics.median(record.compute_s[-window:])
        ratios.append(measured / expected if expected > 0 else 1.0)
    typical = statistics.median(ratios)
    return [r / typical for r in ratios], typical


def beyond_margin(ratio: float, margin: float = ADAPT_MARGIN) -> bool:
    """Whether `ratio` (measured over expected) is more than `margin` off, either way."""
    return abs(math.log(ratio)) > math.log(1.0 + margin)


def slowed_peak(cluster: Any, plan: Any, factor: float) -> float:
    """The peak_flops at which one layer pass of `plan` takes `factor` times as long on `cluster`: its host time
    does not scale with peak_flops, but a slow rank is slow at all of it (the throttle stretches the whole block).

    Solved on the cost model's own layer time (plait.cost.compute.layer_cost), so how a pass's kernels and host time
    add up stays its rule (`pass_time`: the sum on CPU processes, the longer of the two on a GPU): the pass time
    grows with 1/peak_flops, monotonically, and is bisected for."""
    from plait.cost.compute import layer_cost
    from plait.cost.layout import Setting

    if factor <= 1.0:
        return cluster.peak_flops / factor
    dtype_bytes = Setting(plan.model, cluster, plan.train).dtype_bytes

    def layer_time(slowdown: float) -> float:  # one layer pass with the kernels `slowdown` times as slow
        lc = layer_cost(plan.model, cluster.replace(peak_flops=cluster.peak_flops / slowdown), plan.train.seq_len,
                        plan.micro_batch, plan.tp, plan.sequence_parallel, dtype_bytes)
        return lc.fwd + lc.bwd

    target = factor * layer_time(1.0)
    low, high = 1.0, factor
    while layer_time(high) < target:  # the host part does not stretch: the kernels must stretch more
        low, high = high, 2.0 * high
        if high > 1e12 * factor:  # a pass with no kernel time cannot be slowed by the peak
            return cluster.peak_flops / factor
    for _ in range(200):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        low, high = (middle, high) if layer_time(middle) < target else (low, middle)
    return cluster.peak_flops / high


def speed_view(base: Any, plan: Any, speeds: list[float], blocks: list[tuple[int, int]]) -> Any:
    """`base` with a device group per run of consecutive `blocks` ((first rank, size)) of equal speed, each at the
    speed of its slowest rank; a uniform cluster when every block has the same."""
    from plait.spec.cluster import DeviceGroup

    per_block = [max(speeds[first:first + size]) for first, size in blocks]
    if len(set(per_block)) == 1:
        return base.replace(peak_flops=slowed_peak(base, plan, per_block[0])) if per_block[0] > 1 else base
    groups, start = [], 0
    while start < len(blocks):
        end = start
        while end + 1 < len(blocks) and per_block[end + 1] == per_block[start]:
            end += 1
        first, last = blocks[start][0], blocks[end][0] + blocks[end][1] - 1
        groups.append(DeviceGroup(
            name=f"ranks{first}-{last}" if last > first else f"rank{first}", num_devices=last - first + 1,
            devices_per_node=base.devices_per_node, memory_bytes=base.memory_bytes,
            peak_flops=slowed_peak(base, plan, per_block[start]), efficiency=base.efficiency,
            intra_node=base.intra_node, inter_node=base.inter_node))
        start = end + 1
    return base.replace(groups=tuple(groups), between_groups=base.intra_node)


def current_on_speeds(plan: Any, base: Any, speeds: list[float]) -> Any:
    """`plan` priced as it runs: each pipeline rank on a group of its own ranks' (rank_order) slowest speed."""
    from plait.execute.mesh import rank_order

    block, world = plan.dp * plan.cp * plan.tp, plan.num_devices
    order = rank_order(plan) or list(range(world))
    firsts = [order[r * block] for r in range(plan.pp)]
    uniform = plan.replace(stage_groups=(), cluster=base)
    view = speed_view(base, uniform, speeds, sorted((f, block) for f in firsts))
    if not view.groups:
        return uniform.replace(cluster=view, predicted=None)
    offsets = view.group_offsets()
    group_of = {first: max((g for g in offsets if offsets[g] <= first), key=offsets.get) for first in firsts}
    return plan.replace(cluster=view, stage_groups=tuple(group_of[f] for f in firsts), predicted=None)


def replan(plan: Any, base: Any, speeds: list[float], pins: dict[str, Any]) -> Any | None:
    """The best plan over the speed views of every block size (see the module docstring), None if none fits."""
    from plait.errors import PlaitError
    from plait.search import plan as search
    from plait.search.space import divisors

    world = plan.num_devices
    uniform = plan.replace(stage_groups=(), cluster=base)
    best = None
    for size in divisors(world):
        view = speed_view(base, uniform, speeds, [(first, size) for first in range(0, world, size)])
        try:
            found = search(plan.model, view, plan.train, num_devices=world, top=1, **pins)
        except PlaitError:
            continue
        if found and (best is None or found[0].predicted.step_time_s < best.predicted.step_time_s):
            best = found[0]
    return best


def with_measured_router(plan: Any, segment: Segment) -> Any:
    """`plan` with its model priced at the router balance this run measured (plait.train.measure.router_figure),
    so that a re-plan weighs expert parallelism as the run found it; unchanged for a dense model."""
    router = measured_router_imbalance([segment]) if plan.model.num_experts else None
    return plan if router is None else plan.replace(model=plan.model.replace(router_imbalance=router[0]))


def switch_cost(build_s: float, step_s: float) -> float:
    """Seconds a switch costs: a checkpoint save and load and the new plan's build (each about one build of the
    model as measured at the start, plus one step), and its warm-up steps; PLAIT_ADAPT_SWITCH_S where set."""
    import os

    if os.environ.get(SWITCH_COST_ENV):
        return float(os.environ[SWITCH_COST_ENV])
    return 2 * build_s + (2 + WARMUP_STEPS) * step_s


def refit(base: Any, segment: Segment, rank: int) -> tuple[Any, str]:
    """`base` with the constants that rank `rank`'s measured compute and optimizer parts identify (the median
    rank: the others are stragglers or wait for them), and what was fitted."""
    from plait.plan import Plan
    from plait.profile.terms import Observation, fit_terms, refusal

    plan = Plan.from_dict(segment.plan).replace(cluster=base, predicted=None)
    record = next(r for r in segment.ranks if r.rank == rank)
    one = Segment(plan=segment.plan, predicted=segment.predicted, predicted_rank_compute=segment.predicted_rank_compute,
                  ranks=[record])
    observations = [Observation(plan=plan, measured_s=getattr(parts, part), part=part)
                    for parts in one.measured_chunks(2) for part in ("compute", "optimizer") if getattr(parts, part) > 0]
    if len(observations) < 2:
        return base, "nothing (too few steps)"
    fit = fit_terms(observations, base)
    if refusal(fit):
        return base, f"nothing ({refusal(fit)})"
    return fit.cluster, ", ".join(f"{t} x{fit.factors[t]:.2f}" if not math.isnan(fit.factors[t]) else
                                  f"{t} {fit.after[t]:.3g}" for t in fit.fitted)


class Adaptation:
    """The loop's hook: `check` after every step (collective); returns the plan to switch to, or None."""

    def __init__(self, config: Any, plan: Any, log_dir: str | Path, build_s: float, rank: int) -> None:
        self.config, self.build_s, self.rank = config, build_s, rank
        self.base = plan.cluster
        self.speeds = [1.0] * plan.num_devices
        """Each rank's speed factor (1: the median rank's; 3: three times as slow) the current plan was made for."""
        self.refitted = bool(plan.cluster.groups)  # a mixed cluster's constants are its groups': not refitted
        self.switches = 0
        self.since = 0  # the step the current plan started at
        self.last_check = 0
        self.stayed_at: list[float] | None = None  # the speeds a re-plan found no switch for
        self.path = Path(log_dir) / ADAPT_FILE
        if self.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def check(self, step: int, total: int, measured: Any) -> Any | None:
        """Collective: every rank calls it after each step with the same `step`."""
        import torch.distributed as dist

        from plait.plan import Plan

        if self.switches >= MAX_SWITCHES or step - self.since < WARMUP_STEPS + WINDOW_STEPS \
                or step - self.last_check < WINDOW_STEPS or step >= total:
            return None
        self.last_check = step
        segment = measured.gathered()
        box = [self.decide(segment, step, total) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        decision, speeds, self.base = box[0]
        if self.rank == 0:
            print(decision.line(), file=sys.stderr, flush=True)
            with self.path.open("a") as f:
                f.write(json.dumps(asdict(decision)) + "\n")
        if decision.action != "switch":
            return None
        self.switches += 1
        self.since, self.speeds = step, speeds
        return Plan.from_dict(decision.plan)

    def decide(self, segment: Segment, step: int, total: int) -> tuple[Decision, list[float], Any]:
        """Rank 0's decision (see the module docstring), the speeds it found, and the refitted cluster."""
        from plait.plan import Plan

        plan = with_measured_router(Plan.from_dict(segment.plan), segment)
        relative, typical = rank_speeds(segment, self.speeds)
        speeds = [round(s * r, 1) if beyond_margin(r) else s for s, r in zip(self.speeds, relative)]
        measured = statistics.median([max(v) for v in zip(*(r.step_s[-WINDOW_STEPS:] for r in segment.ranks))])
        # whether the step departs from its prediction: read less the ranks' wait for a core (Segment.measured), as
        # the refit reads it; what a switch saves stays in the wall clock's seconds
        steps = min(len(r.steps) for r in segment.ranks)
        less_wait = segment.measured(warmup=max(0, steps - WINDOW_STEPS)).step
        off = less_wait / segment.predicted.step
        figures = {"measured_step_s": round(measured, 5), "measured_step_less_wait_s": round(less_wait, 5),
                   "predicted_step_s": round(segment.predicted.step, 5),
                   "rank_compute_vs_median": [round(r, 3) for r in relative], "speeds": speeds}
        slow = [rank for rank, r in enumerate(relative) if beyond_margin(r)]
        departs = beyond_margin(off) and not self.refitted
        if not slow and not departs:
            return Decision(step=step, action="keep", reason=(
                f"every rank within {ADAPT_MARGIN:.0%} of the median rank's compute, step {less_wait:.4f} s against "
                f"{segment.predicted.step:.4f} s predicted"), figures=figures), self.speeds, self.base
        if self.stayed_at is not None and not any(beyond_margin(a / b) for a, b in zip(speeds, self.stayed_at)):
            return Decision(step=step, action="keep", reason=(
                f"speeds {speeds} within {ADAPT_MARGIN:.0%} of those of the last re-plan, which found no plan worth "
                f"a switch"), figures=figures), speeds, self.base
        base, what = self.base, "nothing (a refit runs once, on the first plan)"
        if not self.refitted:
            typical_rank = min(range(len(relative)), key=lambda r: abs(relative[r] - 1.0))
            base, what = refit(self.base, segment, typical_rank)
            self.refitted = True
        why = (", ".join(f"rank {r} computes {relative[r]:.2f}x the median rank" for r in slow) if slow
               else f"the step is {off:.2f}x its prediction")
        figures.update(refitted=what, typical_compute_vs_predicted=round(typical, 3), build_s=round(self.build_s, 3))
        if plan.model.num_experts and (router := measured_router_imbalance([segment])):
            figures.update(router_imbalance=router[0])
            why += f"; router balance {router[1]}"
        new = replan(plan, base, speeds, dict(self.config.plan.pins))
        current = current_on_speeds(plan, base, speeds)
        from plait.cost import predict

        scale = measured / predict(current).step_time_s
        if new is None:
            return Decision(step=step, action="stay", reason=f"{why}; no plan fits the measured speeds",
                            figures=figures), speeds, base
        expected = new.predicted.step_time_s * scale
        cost = switch_cost(self.build_s, max(measured, expected))
        saved = (measured - expected) * (total - step)
        figures.update(new_plan=new.describe(), new_expected_step_s=round(expected, 5),
                       saved_s=round(saved, 3), switch_cost_s=round(cost, 3))
        if new.describe() == plan.describe() or expected > measured * (1 - MIN_GAIN) or saved <= cost:
            self.stayed_at = speeds
            return Decision(step=step, action="stay", reason=(
                f"{why}; the best plan for the measured speeds ({new.describe()}) is expected at {expected:.4f} s "
                f"against {measured:.4f} s now: saves {saved:.2f} s over {total - step} steps, the switch costs "
                f"~{cost:.2f} s"), figures=figures), speeds, base
        return Decision(step=step, action="switch", reason=(
            f"{why}; switching to {new.describe()}: expected {expected:.4f} s per step against {measured:.4f} s now, "
            f"saves ~{saved:.2f} s over {total - step} steps for a switch of ~{cost:.2f} s"), figures=figures,
            plan=new.to_dict()), speeds, base


def switch_plan(state: Any, plan: Any, build: Any, hooks: Any) -> float:
    """Collective: go on under `plan` exactly where the run is: checkpoint (the step's own checkpoint when one was
    just saved), build `plan` (`build(plan) -> (model, optimizer, loader)`), load the checkpoint into it (DCP
    reshards), and make `plan` the run's plan (LOG_DIR/plan.json: a restart after a crash resumes under it).
    Without [checkpoint] dir the checkpoint goes to LOG_DIR/adapt-checkpoint and is removed after. Returns the
    seconds it took."""
    import gc
    import shutil
    import time

    import torch.distributed as dist

    from plait.train.checkpoint import load_checkpoint, save_checkpoint, step_dir
    from plait.train.resolve import write_plan

    began = time.perf_counter()
    config = state.config
    own = config.checkpoint.dir is None
    root = Path(config.log.dir) / "adapt-checkpoint" if own else Path(config.checkpoint.dir)
    if getattr(hooks, "last_saved", None) == state.step:
        path = step_dir(root, state.step)
    else:
        path = save_checkpoint(root, state, keep=1 if own else config.checkpoint.keep)
        if hasattr(hooks, "last_saved"):
            hooks.last_saved = state.step
    state.model = state.optimizer = state.loader = None
    gc.collect()
    state.model, state.optimizer, state.loader = build(plan)
    state.plan = plan
    load_checkpoint(path, state)
    dist.barrier()  # every rank has read the checkpoint
    if dist.get_rank() == 0:
        write_plan(plan, config.log.dir)
        if own:
            shutil.rmtree(root, ignore_errors=True)
    seconds = time.perf_counter() - began
    if dist.get_rank() == 0:
        print(f"plait: adapt: switched to {plan.describe()} at step {state.step} in {seconds:.2f} s",
              file=sys.stderr, flush=True)
    return seconds
