"""The per-operator plan as a person reads it: placements, the costliest operators and their communication."""

from __future__ import annotations

from typing import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from plait.plan import Plan
from plait.report.tables import human_bytes, seconds_cell


def operators_table(plan: Plan) -> RenderableType:
    ops = plan.operators
    split = {name: p for name, p in ops.params.items() if p != "R"}
    mesh = f"dp{plan.dp} x tp{plan.tp}" + (f" x pp{plan.pp}" if plan.pp > 1 else "")
    accumulated = f" ({plan.num_micro_batches} micro-batches of {plan.micro_batch}, gradients accumulated)" \
        if plan.num_micro_batches > 1 else ""
    step = f"per step{accumulated}" if plan.pp == 1 else \
        f"per step ({plan.schedule}, {plan.num_micro_batches} micro-batches of {plan.micro_batch})"
    header = Text(f"{plan.model.name}: {mesh}, {ops.describe()}; predicted "
                  f"{seconds_cell(ops.step_time_s)} {step} vs {seconds_cell(ops.data_parallel_step_time_s)} "
                  f"with data parallelism alone ({ops.data_parallel_step_time_s / max(ops.step_time_s, 1e-30):.2f}x); "
                  f"{human_bytes(ops.comm_bytes)} on tp per step ({_counts(ops.comm_counts)}); peak "
                  f"{human_bytes(ops.peak_memory_bytes)} per device; {ops.solver} solved in {ops.solve_time_s:.2f} s, "
                  f"{solve_status(ops)}")
    params = Table(title="split parameters (the rest replicated)")
    params.add_column("parameter")
    params.add_column("placement on tp")
    for name, placement in split.items():
        params.add_row(name, placement)
    costly = Table(title="costliest operators")
    for column in ("operator", "placements", "compute", "communication", "collectives"):
        costly.add_column(column, justify="right" if column in ("compute", "communication") else "left")
    for op in ops.costliest:
        costly.add_row(op.name, op.placements, seconds_cell(op.compute_s), seconds_cell(op.comm_s), op.comm or "-")
    parts: list[RenderableType] = [header, params, costly]
    if ops.tensor_plan_step_time_s is not None:
        parts.append(Text(f"the decoder's own tensor plan (Megatron's pattern, as its class declares it) prices "
                          f"{seconds_cell(ops.tensor_plan_step_time_s)} as a candidate of the same program; this "
                          f"plan {seconds_cell(ops.step_time_s)}"))
    if ops.stages:
        parts.append(_stages_table(plan))
    if ops.replicated_ops:
        parts.append(Text(f"no DTensor rule, run replicated ({len(ops.replicated_ops)}): "
                          + ", ".join(ops.replicated_ops[:8]) + " (add one with register_sharding)"))
    if ops.fused_tables:
        parts.append(Text("fused row-wise optimizer (weights alone, no gradient or optimizer state): "
                          + ", ".join(f"{k} {v}" for k, v in ops.fused_tables.items())))
    if ops.table_sample:
        parts.append(Text(f"lookups priced by the {ops.table_sample}"))
    if any(p.startswith("T") for p in ops.params.values()):
        parts.append(Text("table-wise (T<rank>: the whole table on that tensor-parallel rank, bin-packed): "
                          + ", ".join(f"{k} on {v[1:]}" for k, v in ops.params.items() if v.startswith("T"))))
    if ops.pins:
        parts.append(Text("pins honoured: " + ", ".join(f"{k}={v}" for k, v in ops.pins.items())))
    return Group(*parts)


def solve_status(ops) -> str:
    """What the solve proved, in words: "proven optimal", "optimal among plans that place every copy of a repeated
    block alike, proven within 5.5% of any plan", "stopped at the time limit, proven within 2.1%", ..."""
    gap = f"{ops.proven_gap:.2%}" if ops.proven_gap is not None else None
    proven = f", proven within {gap} of any placement" if gap is not None else ", no bound proven"
    if ops.solver_status == "optimal":
        return f"proven optimal (gap {gap})" if gap is not None else "proven optimal"
    if ops.solver_status == "forced":
        return "one placement left (over one rank, or by the pins)"
    if ops.solver_status == "tied":
        return "optimal among placements that treat every copy of a repeated block alike" + proven
    if ops.solver_status == "time limit":
        return "stopped at the time limit with the best placement found" + proven
    if ops.solver_status == "heuristic":
        return "heuristic (propagation)" + proven
    return "status not recorded"


def ranked_table(plans: Sequence[Plan], title: str) -> Table:
    """The ranked per-operator plans of a search: mesh, micro-batches, step, memory, communication."""
    table = Table(title=title, title_justify="left", header_style="bold")
    for column in ("#", "dp×tp×pp", "ZeRO", "recompute", "mb×n", "schedule", "blocks/stage", "step", "vs dp alone",
                   "tp comm", "peak", "split params", "solve"):
        table.add_column(column, justify="right" if column in ("#", "step", "vs dp alone", "tp comm", "peak")
                         else "left")
    for rank, plan in enumerate(plans, start=1):
        ops = plan.operators
        split = sum(1 for p in ops.params.values() if p != "R")
        table.add_row(str(rank), f"{plan.dp}×{plan.tp}×{plan.pp}", str(plan.zero),
                      ",".join(sorted(set(plan.recompute))),
                      f"{plan.micro_batch}×{plan.num_micro_batches}", plan.schedule if plan.pp > 1 else "-",
                      "|".join(map(str, plan.layers_per_stage)) or "-", seconds_cell(ops.step_time_s),
                      f"{ops.data_parallel_step_time_s / max(ops.step_time_s, 1e-30):.2f}x",
                      human_bytes(ops.comm_bytes), human_bytes(ops.peak_memory_bytes), f"{split}/{len(ops.params)}",
                      ops.solver_status or "-", style="bold green" if rank == 1 else None)
    return table


def parts_line(plan: Plan) -> str:
    """'#1 step 3.1 ms = compute 2.0 + tp comm 0.8 + ...; peak 12 MiB = params 8 + activations 4 + ...'."""
    from plait.search.explain import PART_LABELS

    predicted = plan.predicted
    times = " + ".join(f"{PART_LABELS.get(k, k)} {seconds_cell(v)}" for k, v in predicted.step_time_parts.items()
                       if v > 0)
    memory = " + ".join(f"{k} {human_bytes(v)}" for k, v in predicted.memory_parts.items() if v > 0)
    return (f"#1 step {seconds_cell(predicted.step_time_s)} = {times or '?'}; peak "
            f"{human_bytes(predicted.peak_memory_bytes)} per device = {memory or '?'}")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "no collectives"


def _stages_table(plan: Plan) -> Table:
    """One row per pipeline stage: its blocks, its time per micro-batch, its communication and memory."""
    ops = plan.operators
    table = Table(title=f"pipeline stages ({ops.blocks}; bubble {plan.predicted.bubble_fraction:.1%})"
                  if plan.predicted else f"pipeline stages ({ops.blocks})")
    for column in ("stage", "blocks", "per micro-batch", "tp collectives", "peak memory", "split parameters"):
        table.add_column(column, justify="left" if column in ("blocks", "tp collectives") else "right")
    for s, stage in enumerate(ops.stages):
        blocks = plan.stage_layers(s)
        split = sum(1 for p in stage.params.values() if p != "R")
        table.add_row(str(s), f"{blocks.start}-{blocks.stop - 1}", seconds_cell(stage.step_time_s),
                      _counts(stage.comm_counts), human_bytes(stage.peak_memory_bytes), f"{split}/{len(stage.params)}")
    return table


def write_operator_report(result, directory) -> list:
    """`plait plan --batch ... --report DIR`: candidates.png (every shape that fits: step against peak memory, #1
    starred), memory.png (#1's memory per pipeline rank by part) and, for a pipeline, timeline.png (#1's schedule
    as the cost model simulates it from its stages' times). Returns the paths written."""
    from pathlib import Path

    from plait.report.plots import Candidate, plot_candidates, plot_memory_per_stage

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    plans = list(result.plans)
    best = plans[0]
    limit = best.cluster.memory_bytes
    points = [Candidate(step_time_s=p.predicted.step_time_s, peak_memory_bytes=p.predicted.peak_memory_bytes,
                        group="plans that fit") for p in plans]
    star = Candidate(step_time_s=best.predicted.step_time_s, peak_memory_bytes=best.predicted.peak_memory_bytes,
                     label=f"#1 dp{best.dp} tp{best.tp} pp{best.pp} mb{best.micro_batch}x{best.num_micro_batches}")
    written = [plot_candidates(points, out / "candidates.png", best=star, title=(
        f"{len(plans)} shapes of {best.model.name} that fit, on {best.num_devices} x {best.cluster.name}"))]
    stages = best.operators.stages or (best.operators,)
    written.append(plot_memory_per_stage([dict(st.memory_parts) for st in stages], out / "memory.png",
                                         memory_limit_bytes=limit, title=f"#1 memory per pipeline rank "
                                                                         f"(dp{best.dp} x tp{best.tp} x pp{best.pp})"))
    if best.pp > 1:
        written.append(_timeline_png(best, out / "timeline.png"))
    return written


def _timeline_png(plan: Plan, path):
    """#1's pipeline schedule from its stages' times per micro-batch (forward 1/3 of each, as the planner prices a
    call's backward at twice its forward), simulated as plait.cost.operators.pipeline_step does."""
    from plait.cost import operators as price
    from plait.cost import schedule as timeline
    from plait.report.plots import TimelineEvent, plot_timeline

    ops = plan.operators
    stage = [st.step_time_s - st.time_parts.get("dp_comm", 0.0) for st in ops.stages]
    fwd = [t / (1 + price.BACKWARD_FLOPS) for t in stage]
    bwd = [t - f for t, f in zip(stage, fwd)]
    run = timeline.simulate(fwd, bwd, plan.pp, plan.num_micro_batches, plan.schedule, 0.0, keep_events=True)
    events = [TimelineEvent(rank=r, kind=kind, micro_batch=mb, chunk=0, start_s=start, end_s=end)
              for r, kind, _, mb, start, end in run.events]
    return plot_timeline(events, path, title=f"#1 {plan.schedule}, {plan.num_micro_batches} micro-batches, bubble "
                                               f"{plan.predicted.bubble_fraction:.1%}", num_ranks=plan.pp)
