"""Plots of a plan a person would rather look at than read: the pipeline timeline, the memory per
stage, and every feasible candidate as step time against peak memory.

Each function takes plain data (no cost-model objects), writes one PNG and returns its path.
matplotlib is imported lazily and used through `Figure` (no pyplot global state, no display).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

GIB = 2**30
FORWARD_COLOR = "#4C72B0"
BACKWARD_COLOR = "#DD8452"
TAIL_COLOR = "#B0B0B0"
# Memory parts get a fixed colour each so two plots of different plans read the same way.
PART_COLORS = {
    "params": "#4C72B0", "parameters": "#4C72B0", "grads": "#55A868", "gradients": "#55A868",
    "optimizer": "#C44E52", "activations": "#DD8452", "temporaries": "#8172B3", "embedding": "#937860",
    "buffers": "#DA8BC3", "comm_buffers": "#DA8BC3", "reserve": "#8C8C8C",
}
GROUP_COLORS = ("#8DA0CB", "#E78AC3", "#66C2A5", "#FC8D62")
OTHER_COLORS = ("#CCB974", "#64B5CD", "#8C613C", "#A1C9F4", "#FFB482")


@dataclass(frozen=True, kw_only=True)
class TimelineEvent:
    """One forward or backward pass of one micro-batch of one model chunk on one pipeline rank."""

    rank: int
    """Pipeline rank (row of the Gantt chart)."""
    kind: str
    """"F" (forward) or "B" (backward, recompute included)."""
    micro_batch: int
    chunk: int = 0
    """Model chunk on this rank (interleaved schedule), 0 otherwise."""
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One feasible plan as a point of the candidates scatter."""

    step_time_s: float
    peak_memory_bytes: float
    group: str = "feasible plans"
    """Legend entry; points of one group share a colour."""
    label: str = ""


def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # lazy: keeps `plait --help` and the planner torch- and mpl-free

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _save(fig, out_png: str | Path) -> Path:
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


# ---- pipeline timeline ----------------------------------------------------------------------
def plot_timeline(events: Sequence[TimelineEvent], out_png: str | Path, *, title: str = "",
                  num_ranks: int | None = None, tail_s: float = 0.0, tail_label: str = "after the pipeline") -> Path:
    """Gantt chart: one row per pipeline rank, forward blue and backward orange, labelled by micro-batch.

    Interleaved chunks are shaded lighter for later chunks so a person can follow one chunk's work.
    `tail_s` draws a grey box after the last event (e.g. exposed data-parallel communication and the
    optimizer step) so the chart spans the whole predicted step.
    """
    num_ranks = num_ranks or (max(e.rank for e in events) + 1 if events else 1)
    pipeline_end = max((e.end_s for e in events), default=1.0)
    end = pipeline_end + tail_s
    scale, unit = _time_unit(end)
    fig = _figure(11, 1.2 + 0.55 * num_ranks)
    ax = fig.add_subplot()
    num_chunks = max((e.chunk for e in events), default=0) + 1
    for rank in range(num_ranks):
        _draw_rank(ax, [e for e in events if e.rank == rank], rank, scale, num_chunks)
    if tail_s > 0:
        ax.broken_barh([(pipeline_end * scale, tail_s * scale)], (-0.45, num_ranks - 0.1), facecolors=TAIL_COLOR,
                       edgecolors="white")
    busy = [sum(e.end_s - e.start_s for e in events if e.rank == r) for r in range(num_ranks)]
    ax.set_yticks(range(num_ranks), [f"rank {r}\n{1 - b / pipeline_end:.0%} idle" for r, b in enumerate(busy)])
    ax.set_ylim(num_ranks - 0.5, -0.5)  # rank 0 on top, as in the papers' figures
    ax.set_xlim(0, end * scale)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or "pipeline timeline (one step)", loc="left")
    _timeline_legend(ax, num_chunks, tail_label if tail_s > 0 else "")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, out_png)


def _draw_rank(ax, events: Sequence[TimelineEvent], rank: int, scale: float, num_chunks: int) -> None:
    """One row of boxes as a single collection (one artist per box is ~100x slower for long schedules)."""
    if not events:
        return
    spans = [(e.start_s * scale, (e.end_s - e.start_s) * scale) for e in events]
    colors = [_event_color(e, num_chunks) for e in events]
    ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=colors, edgecolors="white", linewidths=0.5)
    if len(events) <= 64:  # micro-batch numbers only while the boxes can hold them
        for e, (start, width) in zip(events, spans):
            ax.text(start + width / 2, rank, str(e.micro_batch), ha="center", va="center", fontsize=7,
                    color="white", clip_on=True)


def _event_color(e: TimelineEvent, num_chunks: int) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    base = to_rgb(FORWARD_COLOR if e.kind.upper().startswith("F") else BACKWARD_COLOR)
    lighten = 0.45 * e.chunk / max(num_chunks - 1, 1)
    return tuple(c + (1 - c) * lighten for c in base)


def _timeline_legend(ax, num_chunks: int, tail_label: str) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=FORWARD_COLOR, label="forward"), Patch(color=BACKWARD_COLOR, label="backward")]
    if tail_label:
        handles.append(Patch(color=TAIL_COLOR, label=tail_label))
    if num_chunks > 1:
        handles.append(Patch(color="#BBBBBB", label=f"lighter = later chunk (v={num_chunks})"))
    # Below the figure: inside the axes it would hide rank 0's boxes, above it collides with the title.
    ax.figure.legend(handles=handles, loc="outside lower center", fontsize=8, ncols=len(handles), frameon=False)


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


# ---- memory per stage -----------------------------------------------------------------------
def plot_memory_per_stage(stage_parts: Sequence[Mapping[str, float]], out_png: str | Path, *,
                          memory_limit_bytes: float | None = None, title: str = "") -> Path:
    """Stacked bars: one bar per pipeline rank, one segment per memory part, in GiB; a line at the limit."""
    names = _part_order(stage_parts)
    fig = _figure(max(7.0, 2.5 + 0.6 * len(stage_parts)), 4.2)
    ax = fig.add_subplot()
    ranks = list(range(len(stage_parts)))
    bottom = [0.0] * len(stage_parts)
    for i, name in enumerate(names):
        heights = [parts.get(name, 0.0) / GIB for parts in stage_parts]
        ax.bar(ranks, heights, bottom=bottom, color=_part_color(name, i), label=name, width=0.7)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if memory_limit_bytes:
        ax.axhline(memory_limit_bytes / GIB, color="black", linestyle="--", linewidth=1,
                   label=f"device memory ({memory_limit_bytes / GIB:.3g} GiB)")
    ax.set_xticks(ranks, [f"rank {r}" for r in ranks] if len(ranks) <= 8 else [str(r) for r in ranks])
    if len(ranks) < 4:  # keep a lone bar from filling the whole axes
        ax.set_xlim(-1.5, len(ranks) + 0.5)
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("memory per device (GiB)")
    ax.set_title(title or "memory per pipeline rank", loc="left")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out_png)


def _part_order(stage_parts: Sequence[Mapping[str, float]]) -> list[str]:
    """Parts by total size, largest at the bottom of each bar."""
    totals: dict[str, float] = {}
    for parts in stage_parts:
        for name, value in parts.items():
            totals[name] = totals.get(name, 0.0) + value
    return [n for n, v in sorted(totals.items(), key=lambda kv: -kv[1]) if v > 0]


def _part_color(name: str, index: int) -> str:
    return PART_COLORS.get(name, OTHER_COLORS[index % len(OTHER_COLORS)])


# ---- candidates -----------------------------------------------------------------------------
def plot_candidates(candidates: Sequence[Candidate], out_png: str | Path, *, best: Candidate | None = None,
                    memory_limit_bytes: float | None = None, title: str = "") -> Path:
    """Scatter of feasible plans: step time against peak memory, one colour per group, best starred."""
    fig = _figure(8, 5)
    ax = fig.add_subplot()
    groups: dict[str, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault(c.group, []).append(c)
    for i, (name, group) in enumerate(groups.items()):
        ax.scatter([c.peak_memory_bytes / GIB for c in group], [c.step_time_s for c in group],
                   s=12 if i == 0 else 30, alpha=0.5 if i == 0 else 0.9, color=GROUP_COLORS[i % len(GROUP_COLORS)],
                   label=name, edgecolors="none")
    if best is not None:
        ax.scatter([best.peak_memory_bytes / GIB], [best.step_time_s], s=220, marker="*", color="crimson",
                   edgecolors="black", linewidths=0.8, zorder=5, label=best.label or "best plan")
    if memory_limit_bytes:
        _memory_limit_line(ax, memory_limit_bytes, max((c.peak_memory_bytes for c in candidates), default=0.0))
    _log_if_wide(ax, [c.step_time_s for c in candidates])
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(title or f"{len(candidates):,} feasible candidates", loc="left")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    return _save(fig, out_png)


def _memory_limit_line(ax, limit_bytes: float, largest_bytes: float) -> None:
    """A dashed line at the device's memory, unless every point is far below it (it would squash them)."""
    label = f"device memory ({limit_bytes / GIB:.3g} GiB)"
    if largest_bytes >= 0.4 * limit_bytes:
        ax.axvline(limit_bytes / GIB, color="black", linestyle="--", linewidth=1, label=label)
    else:
        ax.plot([], [], color="black", linestyle="--", linewidth=1, label=label + ", off the scale")


def _log_if_wide(ax, times: Sequence[float]) -> None:
    """Step times across a search span decades; a log axis keeps the fast end readable."""
    positive = [t for t in times if t > 0]
    if positive and max(positive) / min(positive) > 20:
        ax.set_yscale("log")
