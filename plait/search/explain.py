"""One line on why the best plan beats the runner-up: the step-time parts that differ most."""

from __future__ import annotations

from plait.plan import Plan

PART_LABELS = {
    "compute": "compute", "recompute": "recompute", "tp_comm": "tp comm", "pp_comm": "pp comm",
    "bubble": "bubble", "dp_comm": "exposed dp comm", "optimizer": "optimizer step", "cp_comm": "cp comm",
    "ep_comm": "ep comm",
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
