"""`plait plan --report DIR`: three PNGs about the best plan and the space it was chosen from.

* timeline.png: the best plan's pipeline schedule as the cost model simulates it (one step);
* memory.png: the best plan's memory per pipeline rank, stacked by part;
* candidates.png: every feasible candidate, predicted step time against peak memory, best starred.

The numbers come from plait.cost (the same stage times, schedule simulation and memory moments `predict`
uses), so the pictures show exactly what the ranking was based on: the timeline's makespan is the predicted
step time's pipeline part (tests/unit/test_report.py holds that).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from plait.plan import Plan
from plait.report.tables import layers_cell, recompute_cell
from plait.report.plots import Candidate, TimelineEvent, plot_candidates, plot_memory_per_stage, plot_timeline

MAX_EVENTS_PER_RANK = 160
"""Beyond this many boxes per row a Gantt chart is unreadable (and slow): show the first micro-batches only."""


def write_plan_report(plans: Sequence[Plan], directory: str | Path,
                      points: Sequence[tuple[float, float]] | None = None) -> list[Path]:
    """Write the three PNGs for `plans` (ranked, best first, each with `predicted`); return their paths.

    `points` are (step time s, peak memory bytes) of every feasible candidate the search priced
    (SearchResult.points); without them the scatter shows `plans` only.
    """
    if not plans:
        return []
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    best = plans[0]
    return [
        _timeline_png(best, out / "timeline.png"),
        _memory_png(best, out / "memory.png"),
        _candidates_png(plans, points, out / "candidates.png"),
    ]


# ---- timeline -------------------------------------------------------------------------------
def timeline_events(plan: Plan, max_events_per_rank: int = MAX_EVENTS_PER_RANK) -> tuple[list[TimelineEvent], int]:
    """Simulated (rank, F/B, micro-batch) boxes of one step of `plan`, and how many micro-batches they cover.

    The boxes are the cost model's own stage times (plait.cost.model.pipeline_stage_times: compute, recompute,
    tensor-parallel collectives, fully_shard's hooks, the schedule's host time) run through its own schedule
    simulation, cores shared where CPU ranks share them (plait.cost.schedule.simulate_shared): with every
    micro-batch shown, the drawn makespan is the predicted step time's pipeline part."""
    from plait.cost.layout import Setting
    from plait.cost.model import p2p_time, pipeline_stage_times
    from plait.cost.schedule import simulate_shared

    setting, layout = Setting(plan.model, plan.cluster, plan.train), plan.layout
    st, _ = pipeline_stage_times(setting, layout, plan.layers_per_stage, plan.recompute)
    shown = _micro_batches_shown(plan, max_events_per_rank)
    over = plan.cluster.oversubscription if plan.pp > 1 else 1.0
    timeline = simulate_shared(st.fwd, st.bwd, plan.pp, shown, layout.schedule, p2p_time(setting, layout), over,
                               keep_events=True)
    events = [TimelineEvent(rank=r, kind=kind, micro_batch=mb, chunk=stage // plan.pp, start_s=start, end_s=end)
              for r, kind, stage, mb, start, end in timeline.events]
    return events, shown


def _micro_batches_shown(plan: Plan, max_events_per_rank: int) -> int:
    """All micro-batches when they fit; else the largest multiple of pp that does (interleaving needs it)."""
    m = plan.num_micro_batches
    per_micro_batch = 2 * plan.interleave  # one forward and one backward per chunk on every rank
    if m * per_micro_batch <= max_events_per_rank:
        return m
    return max(plan.pp, (max_events_per_rank // per_micro_batch) // plan.pp * plan.pp)


def _timeline_png(plan: Plan, path: Path) -> Path:
    events, shown = timeline_events(plan)
    m = plan.num_micro_batches
    cover = f"{m} micro-batches" if shown == m else f"first {shown} of {m} micro-batches"
    schedule = (plan.schedule + (f" v={plan.interleave}" if plan.interleave > 1 else "")) if plan.pp > 1 else "no pipeline (gradient accumulation)"
    bubble = plan.predicted.bubble_fraction if plan.predicted else 0.0
    title = f"#1 {short_describe(plan)}\n{schedule}, {cover}, predicted bubble {bubble:.1%}"
    parts = plan.predicted.step_time_parts if plan.predicted else {}
    tail = parts.get("dp_comm", 0.0) + parts.get("optimizer", 0.0) if shown == m else 0.0
    return plot_timeline(events, path, title=title, num_ranks=plan.pp, tail_s=tail,
                         tail_label="exposed DP comm + optimizer")


def short_describe(plan: Plan) -> str:
    """Plan.describe() with run-length layers and recompute, so a 96-stage plan still fits a title."""
    parts = [f"dp{plan.dp} tp{plan.tp} pp{plan.pp}", f"cp{plan.cp} {plan.context_parallel}" if plan.cp > 1 else "",
             f"ep{plan.ep}" if plan.ep > 1 else "", "sp" if plan.sequence_parallel and plan.tp > 1 else "",
             f"zero{plan.zero}", f"mb{plan.micro_batch}x{plan.num_micro_batches}",
             f"recompute={recompute_cell(plan)}", f"layers={layers_cell(plan)}" if plan.num_stages > 1 else ""]
    return " ".join(p for p in parts if p)


# ---- memory ---------------------------------------------------------------------------------
def memory_by_rank(plan: Plan) -> list[dict[str, float]]:
    """Bytes per part on every pipeline rank of `plan` (the peak rank's parts equal predicted.memory_parts)."""
    from plait.cost.layout import Setting
    from plait.cost.model import memory_parts_per_rank

    setting, layout = Setting(plan.model, plan.cluster, plan.train), plan.layout
    return memory_parts_per_rank(setting, layout, plan.layers_per_stage, plan.recompute)


def _memory_png(plan: Plan, path: Path) -> Path:
    limit = plan.cluster.memory_bytes
    title = f"#1 memory per pipeline rank (ZeRO-{plan.zero}, recompute {recompute_cell(plan)})"
    return plot_memory_per_stage(memory_by_rank(plan), path, memory_limit_bytes=limit, title=title)


# ---- candidates -----------------------------------------------------------------------------
def _candidates_png(plans: Sequence[Plan], points: Sequence[tuple[float, float]] | None, path: Path) -> Path:
    ranked = [p for p in plans if p.predicted is not None]
    others = [Candidate(step_time_s=t, peak_memory_bytes=m) for t, m in (points or ())]
    top = [Candidate(step_time_s=p.predicted.step_time_s, peak_memory_bytes=p.predicted.peak_memory_bytes,
                     group=f"top {len(ranked)} (exact schedule)") for p in ranked]
    best = top[0] if top else None
    if best is not None:
        best = Candidate(step_time_s=best.step_time_s, peak_memory_bytes=best.peak_memory_bytes,
                         label=f"#1 {short_describe(ranked[0])}")
    model, count = plans[0].model.name, plans[0].num_devices
    title = (f"{len(others) or len(top):,} feasible plans of {model} on {count:,} × {plans[0].cluster.name}"
             + (" (closed-form estimates)" if others else ""))
    return plot_candidates(others + top, path, best=best, memory_limit_bytes=plans[0].cluster.memory_bytes,
                           title=title)
