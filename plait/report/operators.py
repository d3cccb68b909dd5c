"""The per-operator plan as a person reads it: placements, the costliest operators and their communication."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from plait.plan import Plan
from plait.report.tables import human_bytes, seconds_cell


def operators_table(plan: Plan) -> RenderableType:
    ops = plan.operators
    split = {name: p for name, p in ops.params.items() if p != "R"}
    mesh = f"dp{plan.dp} x tp{plan.tp}" + (f" x pp{plan.pp}" if plan.pp > 1 else "")
    step = "per micro-batch step" if plan.pp == 1 else \
        f"per step ({plan.schedule}, {plan.num_micro_batches} micro-batches of {plan.micro_batch})"
    header = Text(f"{plan.model.name}: {mesh}, {ops.describe()}; predicted "
                  f"{seconds_cell(ops.step_time_s)} {step} vs {seconds_cell(ops.data_parallel_step_time_s)} "
                  f"with data parallelism alone ({ops.data_parallel_step_time_s / max(ops.step_time_s, 1e-30):.2f}x); "
                  f"{human_bytes(ops.comm_bytes)} on tp per step ({_counts(ops.comm_counts)}); peak "
                  f"{human_bytes(ops.peak_memory_bytes)} per device; {ops.solver} solved in {ops.solve_time_s:.2f} s")
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
    if ops.stages:
        parts.append(_stages_table(plan))
    if ops.replicated_ops:
        parts.append(Text(f"no DTensor rule, run replicated ({len(ops.replicated_ops)}): "
                          + ", ".join(ops.replicated_ops[:8]) + " (add one with register_sharding)"))
    if ops.fused_tables:
        parts.append(Text("fused row-wise optimizer (weights alone, no gradient or optimizer state): "
                          + ", ".join(f"{k} {v}" for k, v in ops.fused_tables.items())))
    if ops.pins:
        parts.append(Text("pins honoured: " + ", ".join(f"{k}={v}" for k, v in ops.pins.items())))
    return Group(*parts)


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
