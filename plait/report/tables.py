"""Rich tables of ranked plans, and the compact cell formats a person can scan.

Shared by `plait plan`, `plait tune` and the demo; nothing here imports torch.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table

from plait.plan import Plan

GIB = 2**30
RECOMPUTE_SHORT = {"none": "none", "selective": "sel", "full": "full"}


def run_length(values: Sequence[object], sep: str = "|") -> str:
    """[12, 12, 12, 11] -> '12×3|11'; short runs are written out: [3, 3, 2] -> '3|3|2'."""
    runs: list[tuple[object, int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    cells = []
    for value, count in runs:
        cells.extend([str(value)] * count if count <= 2 else [f"{value}×{count}"])
    return sep.join(cells)


def layers_cell(plan: Plan) -> str:
    """Layers per virtual stage in model order: '[3]' is a stage of 3 layers, '[4]×12' twelve such stages in a
    row: [3]×15 [4]×12 [3]. (The bare '3×15' read as well as fifteen stages of 3 as three of 15.)
    On a mixed cluster each stage is prefixed by its device group: slow[1] fast[3]."""
    groups = [plan.stage_groups[plan.rank_of_stage(k)] if plan.stage_groups else ""
              for k in range(len(plan.layers_per_stage))]
    runs: list[list] = []
    for group, layers in zip(groups, plan.layers_per_stage):
        if runs and runs[-1][:2] == [group, layers]:
            runs[-1][2] += 1
        else:
            runs.append([group, layers, 1])
    cells = []
    for group, layers, count in runs:
        cells.extend([f"{group}[{layers}]"] * count if count <= 2 else [f"{group}[{layers}]×{count}"])
    return " ".join(cells)


LAYERS_LEGEND = "layers/stage: [n] is a pipeline stage of n layers, [n]×k is k such stages in a row"
GROUPS_LEGEND = "group[n]: a stage of n layers on that device group"


def stages_table(rows: Sequence, title: str) -> Table:
    """Per pipeline stage (plait.search.explain.stage_rows): rank, device group, layers, time, memory."""
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for name in ("stage", "rank", "group", "layers", "ms / micro-batch", "memory GiB", "of GiB"):
        table.add_column(name, justify="left" if name == "group" else "right")
    for row in rows:
        table.add_row(str(row.stage), str(row.rank), row.group or "-", str(row.layers), f"{row.seconds * 1e3:.3g}",
                      gib_cell(row.memory_bytes), gib_cell(row.capacity_bytes))
    return table


def recompute_cell(plan: Plan) -> str:
    """One mode when every pipeline rank agrees, else the per-rank modes run-length compressed."""
    modes = [RECOMPUTE_SHORT[m] for m in plan.recompute]
    return modes[0] if len(set(modes)) == 1 else run_length(modes, sep=",")


def schedule_cell(plan: Plan) -> str:
    if plan.pp == 1:
        return "-"
    return f"{plan.schedule} v{plan.interleave}" if plan.schedule == "interleaved" else plan.schedule


def human_count(value: float) -> str:
    """1234567 -> '1.23M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


CONTEXT_SHORT = {"all_gather": "ag", "all_to_all": "a2a"}


def degrees_cell(plan: Plan) -> str:
    """'16×2×16' over dp×tp×pp, with context parallelism and its key/value exchange ('cp4/a2a') and expert
    parallelism ('ep8') where above 1."""
    cell = f"{plan.dp}×{plan.tp}×{plan.pp}"
    if plan.cp > 1:
        cell += f" cp{plan.cp}/{CONTEXT_SHORT[plan.context_parallel]}"
    if plan.ep > 1:
        cell += f" ep{plan.ep}"
    return cell


def degrees_legend(plans: Sequence[Plan]) -> str:
    """A line explaining the cp/ep marks of `plans`' degrees cells ('' where none has them)."""
    notes = []
    if any(p.cp > 1 for p in plans):
        notes.append("cpN: context parallel over N ranks, keys and values all-gathered (/ag) or swapped for heads by "
                     "all-to-all (/a2a, Ulysses)")
    if any(p.ep > 1 for p in plans):
        notes.append("epN: experts split over N ranks of each data-parallel group")
    return "; ".join(notes)


def human_bytes(value: float) -> str:
    """1536 -> '1.5 KiB'."""
    for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {suffix}"
    return f"{value:.0f} B"


def seconds_cell(seconds: float) -> str:
    """Three significant figures, in ms below one second."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def plans_table(plans: Sequence[Plan], title: str | None = None, width: int | None = None) -> RenderableType:
    """The ranked plans: degrees, choices, and what the cost model predicts for each.

    One table when it fits `width` columns (None: any width). Narrower, it folds into two tables -- the
    choices, then the predictions, both keyed by '#' -- in a compact frame, where a long stage list wraps between
    its stages, so that no cell is ever cut ('19.…') or left blank."""
    table = _table(plans, title, range(len(_COLUMNS)))
    if width is None or _width(table) <= width:
        return table
    split = len(_PLAN_COLUMNS)
    predictions = _table(plans, "predicted (the cost model)", [0, *range(split, len(_COLUMNS))], compact=True)
    choices = _table(plans, title, range(split), compact=True)
    if _width(choices) <= width:
        return Group(choices, predictions)
    # still too wide (long per-rank recompute or stage lists): the degrees and choices, then how the layers are split
    stages = [0, *(i for i in range(split) if _COLUMNS[i][0] in _STAGE_COLUMNS)]
    rest = [i for i in range(split) if i not in stages[1:]]
    return Group(_table(plans, title, rest, compact=True),
                 _table(plans, "stages", stages, compact=True), predictions)


def _table(plans: Sequence[Plan], title: str | None, columns: Sequence[int], compact: bool = False) -> Table:
    table = Table(title=title, header_style="bold", title_justify="left",
                  **({"box": box.SIMPLE_HEAD, "pad_edge": False, "collapse_padding": True} if compact else {}))
    for index in columns:
        name, justify = _COLUMNS[index]
        # only the stage list may wrap (between stages, at its spaces), and only where the table must fold
        table.add_column(name, justify=justify, no_wrap=not (compact and name == "layers/stage"))
    for rank, plan in enumerate(plans, start=1):
        cells = plan_row(rank, plan)
        table.add_row(*(cells[i] for i in columns), style="bold green" if rank == 1 else None)
    return table


def _width(renderable: RenderableType) -> int:
    """Columns `renderable` takes when nothing is folded."""
    console = Console(width=10_000)
    return console.measure(renderable).maximum


_PLAN_COLUMNS: tuple[tuple[str, str], ...] = (
    ("#", "right"), ("dp×tp×pp", "left"), ("SP", "center"), ("ZeRO", "center"), ("recompute", "left"),
    ("mb×n", "left"), ("schedule", "left"), ("layers/stage", "left"),
)
_STAGE_COLUMNS = ("recompute", "layers/stage")
"""The choices per pipeline rank or stage, which can run long: a table of their own when one would not fit."""
_PREDICTION_COLUMNS: tuple[tuple[str, str], ...] = (
    ("step", "right"), ("tokens/s", "right"), ("TFLOP/s/dev", "right"), ("MFU", "right"), ("bubble", "right"),
    ("peak GiB", "right"),
)
_COLUMNS = _PLAN_COLUMNS + _PREDICTION_COLUMNS
COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _ in _COLUMNS)


def plan_row(rank: int, plan: Plan) -> list[str]:
    cells = [
        str(rank),
        degrees_cell(plan),
        "yes" if plan.sequence_parallel and plan.tp > 1 else "-",
        str(plan.zero),
        recompute_cell(plan),
        f"{plan.micro_batch}×{plan.num_micro_batches}",
        schedule_cell(plan),
        layers_cell(plan),
    ]
    return cells + _prediction_cells(plan)


def _prediction_cells(plan: Plan) -> list[str]:
    p = plan.predicted
    if p is None:
        return ["?"] * 6
    return [
        seconds_cell(p.step_time_s),
        human_count(p.tokens_per_s),
        f"{p.model_tflops_per_device:.3g}",
        f"{p.mfu:.1%}",
        f"{p.bubble_fraction:.1%}" if plan.pp > 1 else "-",
        gib_cell(p.peak_memory_bytes),
    ]


def gib_cell(nbytes: float) -> str:
    """GiB with one decimal, or three significant figures below 10 GiB (CPU plans use megabytes)."""
    gib = nbytes / GIB
    return f"{gib:.1f}" if gib >= 10 else f"{gib:.3g}"


def search_stats_line(candidates_evaluated: int, seconds: float, num_feasible: int | None = None) -> str:
    feasible = f", {num_feasible:,} feasible" if num_feasible is not None else ""
    return f"searched {candidates_evaluated:,} candidates{feasible} in {seconds:.2f} s"


def parts_table(parts: dict[str, float], title: str, unit: str, scale: float = 1.0) -> Table:
    """A two-column breakdown (e.g. step time or memory by part) with each part's share."""
    table = Table(title=title, header_style="bold", title_justify="left")
    table.add_column("part")
    table.add_column(unit, justify="right")
    table.add_column("share", justify="right")
    total = sum(parts.values()) or 1.0
    for name, value in _largest_first(parts.items()):
        table.add_row(name, f"{value / scale:.3g}", f"{value / total:.0%}")
    return table


def _largest_first(items: Iterable[tuple[str, float]]) -> list[tuple[str, float]]:
    return sorted(items, key=lambda kv: -kv[1])


def dry_run_table(plan: Plan, reports: Sequence) -> Table:
    """`plait check --dry-run`: per pipeline rank, what one of its ranks holds and the collectives of a step."""
    table = Table(title=f"dry run: {plan.describe()} on {plan.num_devices:,} ranks", header_style="bold",
                  title_justify="left")
    for name, justify in (("pp rank", "right"), ("stages", "left"), ("blocks", "left"), ("params", "right"),
                          ("shard", "right"), ("of full", "right"), ("collectives per step", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for r in reports:
        blocks = f"{r.blocks[0]}-{r.blocks[-1]} ({len(r.blocks)})" if r.blocks else "-"
        share = f"{r.local_bytes / r.full_bytes:.1%}" if r.full_bytes else "-"
        comms = ", ".join(f"{k} x{v}" for k, v in sorted(r.collectives.items())) or "none"
        table.add_row(str(r.pp_rank), ",".join(map(str, r.stages)), blocks, str(r.params),
                      human_bytes(r.local_bytes), share, comms)
    return table
