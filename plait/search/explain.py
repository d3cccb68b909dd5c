"""Why a plan: one line on why the best plan beats the runner-up (the step-time parts that differ most), and,
per pipeline stage, its device group, layers, time and memory (how a mixed cluster's split balances them)."""

from __future__ import annotations

from dataclasses import dataclass

from plait.cost.layout import Setting

from plait.cost.model import peak_memory, pipeline_stage_times, predict_layout, rank_capacities
from plait.plan import Plan

PART_LABELS = {
    "compute": "compute", "recompute": "recompute", "tp_comm": "tp comm", "pp_comm": "pp comm",
    "bubble": "bubble", "dp_comm": "exposed dp comm", "optimizer": "optimizer step", "cp_comm": "cp comm",
    "ep_comm": "ep comm", "loss": "loss", "island_link": "exposed exchange between islands",
}


def _changes(best: Plan, other: Plan) -> str:
    """What differs between the two plans, as 'pp 8->4, zero 1->0'."""
    fields = [("dp", "dp"), ("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("ep", "ep"), ("zero", "zero"),
              ("micro_batch", "mb"), ("schedule", "schedule"), ("interleave", "v"), ("sequence_parallel", "sp")]
    if best.cp > 1 and other.cp > 1:  # the key/value exchange means something only under context parallelism
        fields.append(("context_parallel", "context"))
    out = [f"{label} {getattr(other, name)}->{getattr(best, name)}" for name, label in fields
           if getattr(best, name) != getattr(other, name)]
    if _modes(best) != _modes(other):
        out.append(f"recompute {_modes(other)}->{_modes(best)}")
    if not out and best.layers_per_stage != other.layers_per_stage:
        out.append("layers " + "|".join(map(str, other.layers_per_stage)) + "->" + "|".join(map(str, best.layers_per_stage)))
    return ", ".join(out) or "same choices"


def _modes(plan: Plan) -> str:
    modes = sorted(set(plan.recompute))
    return modes[0] if len(modes) == 1 else ",".join(plan.recompute)


def explain(best: Plan, runner_up: Plan | None) -> str:
    """E.g. 'best by 4.1%: less bubble (-0.31 s) outweighs +12% tp comm (+0.08 s) [pp 8->4, tp 4->8]'."""
    if runner_up is None:
        return "the only feasible plan"
    a, b = best.predicted, runner_up.predicted
    if a is None or b is None:
        raise ValueError("explain() needs plans with predictions (from plait.plan)")
    gap = (b.step_time_s - a.step_time_s) / b.step_time_s
    if gap <= 1e-9 and a.peak_memory_bytes <= b.peak_memory_bytes:
        return (f"ties with the runner-up on step time ({a.step_time_s:.4g} s); ranked first for less peak memory "
                f"({a.peak_memory_bytes / 2**30:.2f} vs {b.peak_memory_bytes / 2**30:.2f} GiB) "
                f"[{_changes(best, runner_up)}]")
    diffs = {k: a.step_time_parts.get(k, 0.0) - b.step_time_parts.get(k, 0.0)
             for k in sorted(set(a.step_time_parts) | set(b.step_time_parts))}
    gains = sorted((k for k in diffs if diffs[k] < 0), key=diffs.get)
    costs = sorted((k for k in diffs if diffs[k] > 0), key=diffs.get, reverse=True)
    paid = sum(diffs[k] for k in costs)
    named, saved = [], 0.0
    for k in gains:  # name the savings that, together, outweigh everything the best plan pays extra
        named.append(f"less {PART_LABELS.get(k, k)} ({diffs[k]:+.3g} s)")
        saved -= diffs[k]
        if saved > paid or len(named) == 3:
            break
    head = f"best by {gap:.2%}: " + " and ".join(named or ["the same parts"])
    if costs and diffs[costs[0]] > 1e-12 * a.step_time_s:
        worst = costs[0]
        base = b.step_time_parts.get(worst, 0.0)
        rel = f"+{diffs[worst] / base:.0%} " if base > 0 else "more "
        verb = "outweighs" if len(named) == 1 else "outweigh"
        head += f" {verb} {rel}{PART_LABELS.get(worst, worst)} ({diffs[worst]:+.3g} s)"
        if len(costs) > 1:
            head += f" and {len(costs) - 1} smaller cost{'s' if len(costs) > 2 else ''}"
    return f"{head} [{_changes(best, runner_up)}]"


@dataclass(frozen=True)
class StageRow:
    """One virtual pipeline stage of a plan, as the cost model sees it."""

    stage: int
    rank: int
    """The pipeline rank that runs it."""
    group: str
    """Its device group ("" on a uniform cluster)."""
    layers: int
    seconds: float
    """Forward + backward of one micro-batch."""
    memory_bytes: float
    """Peak memory of its pipeline rank's devices."""
    capacity_bytes: float


def stage_rows(plan: Plan) -> list[StageRow]:
    """Per virtual stage: its rank, device group, layers, time per micro-batch and its rank's memory."""
    setting, layout = Setting(plan.model, plan.cluster, plan.train), plan.layout
    st, _ = pipeline_stage_times(setting, layout, plan.layers_per_stage, plan.recompute)
    memory, _ = peak_memory(setting, layout, plan.layers_per_stage, plan.recompute)
    capacity = rank_capacities(setting, layout)
    rows = []
    for k, layers in enumerate(plan.layers_per_stage):
        r = plan.rank_of_stage(k)
        rows.append(StageRow(stage=k, rank=r, group=plan.stage_groups[r] if plan.stage_groups else "",
                             layers=layers, seconds=st.fwd[k] + st.bwd[k], memory_bytes=memory[r],
                             capacity_bytes=capacity[r]))
    return rows


def even_split(num_layers: int, num_stages: int) -> tuple[int, ...] | None:
    """The even split of the layers over the stages (the first stages take the remainder); None if impossible."""
    if num_stages > num_layers:
        return None
    q, rest = divmod(num_layers, num_stages)
    return tuple(q + (1 if k < rest else 0) for k in range(num_stages))


def balance_note(plan: Plan) -> str:
    """Why a mixed-cluster plan splits its layers as it does: against the even split of the same plan. E.g.
    'layers by device group slow[1] fast[3]: stage times 52|50 ms per micro-batch; the even split 2|2 would
    take 0.267 s (+17.6%)'."""
    rows = stage_rows(plan)
    times = "|".join(f"{row.seconds * 1e3:.3g}" for row in rows)
    groups = " ".join(f"{row.group or 'stage'}[{row.layers}]" for row in rows)
    head = f"layers by device group {groups}: stage times {times} ms per micro-batch"
    even = even_split(sum(plan.layers_per_stage), plan.num_stages)
    if even is None or even == plan.layers_per_stage or plan.predicted is None:
        return head
    setting, layout = Setting(plan.model, plan.cluster, plan.train), plan.layout
    other = predict_layout(setting, layout, even, plan.recompute)
    capacity = rank_capacities(setting, layout)
    even_cell = "|".join(map(str, even))
    over = [r for r, (m, c) in enumerate(zip(other.memory_per_stage, capacity)) if m > c]
    if over:
        r = over[0]
        return (f"{head}; the even split {even_cell} does not fit: pipeline rank {r} would need "
                f"{other.memory_per_stage[r] / 2**30:.3g} GiB of {capacity[r] / 2**30:.3g}")
    gain = other.step_time_s / plan.predicted.step_time_s - 1
    return f"{head}; the even split {even_cell} would take {other.step_time_s:.3g} s ({gain:+.1%})"
