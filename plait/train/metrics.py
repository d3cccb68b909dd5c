"""What a training run reports: model FLOPs and MFU, JSON-lines metrics, and the rank-0 progress display."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from plait.cost.compute import model_flops_per_step
from plait.spec import ModelSpec


def model_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Model FLOPs (forward + backward, no recompute) per trained token, as the cost model counts them.

    GEMMs only, as in Narayanan et al. (2021) and Korthikanti et al. (2022): for a GPT with
    ffn = 4h, 72·L·s·h²·(1 + s/(6h) + V/(12·h·L)) per sequence. One definition for the planner's
    predicted MFU and the trainer's measured MFU, so the two can be compared.
    """
    return model_flops_per_step(spec, 1, seq_len) / seq_len


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """One line of metrics.jsonl."""

    step: int
    """Optimizer steps done (1 after the first)."""
    loss: float
    """Mean loss over the global batch."""
    lr: float
    grad_norm: float | None
    """Global gradient norm before clipping (None without clipping)."""
    step_time_s: float
    tokens_per_s: float
    """Global tokens per second of this step."""
    mfu: float
    """Model FLOP/s over the peak of every device in the plan (the cluster spec's peak_flops)."""
    tokens: int
    """Tokens trained on so far."""
    elapsed_s: float
    precision: str = "fp32"
    """The dtype the step computed in ("bf16": autocast, on CPU too; "fp32"), as the plan says."""

    def to_json(self) -> str:
        return json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()})


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """Turns a step time into tokens/s and MFU for one run's fixed batch and devices."""

    tokens_per_step: int
    flops_per_step: float
    peak_flops_total: float

    def tokens_per_s(self, step_time_s: float) -> float:
        return self.tokens_per_step / step_time_s

    def mfu(self, step_time_s: float) -> float:
        return self.flops_per_step / step_time_s / self.peak_flops_total


class MetricsLog:
    """Appends StepMetrics as JSON lines (rank 0 only; other ranks pass `enabled=False`).

    A run resumed at step k (`resumed_at=k`) continues the file after dropping what the interrupted run
    logged past its last checkpoint (steps > k, and a line cut short by a kill): those steps are trained
    again, and each step must appear once, in order, for the loss plot and for anyone reading the file."""

    def __init__(self, path: Path, enabled: bool, resumed_at: int = 0) -> None:
        self.path = path
        self._file: IO[str] | None = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            if resumed_at > 0:
                keep_steps_up_to(path, resumed_at)
            self._file = path.open("a" if resumed_at > 0 else "w")

    def write(self, metrics: StepMetrics) -> None:
        self._append(metrics.to_json())

    def write_record(self, record: dict[str, Any]) -> None:
        """Any other line keyed by step (an evaluation's, in eval.jsonl)."""
        self._append(json.dumps(record))

    def _append(self, line: str) -> None:
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()  # a crashed run keeps every step it finished

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def keep_steps_up_to(path: Path, step: int) -> int:
    """Rewrite metrics.jsonl (atomically) with only its whole lines of steps <= `step`; returns how many it dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines(keepends=True):
        try:
            record = json.loads(line)
            whole = line.endswith("\n") and isinstance(record, dict) and int(record.get("step", 0)) <= step
        except (ValueError, TypeError):
            whole = False
        if whole:
            kept.append(line)
        elif line.strip():
            dropped += 1
    if dropped:
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(kept))
        os.replace(temporary, path)
    return dropped


class ProgressDisplay:
    """A rich progress bar with loss, tokens/s and MFU on a terminal; a line every `every` steps otherwise."""

    def __init__(self, total_steps: int, *, enabled: bool, every: int, console: Console | None = None,
                 max_seconds: float = 0.0) -> None:
        self.console = console or Console()
        self.enabled, self.every = enabled, max(1, every)
        self.live = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("{task.fields[speed]} tok/s"),
                TextColumn("MFU {task.fields[mfu]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=self.console,
            )
            # With a time limit the run may stop early: say so, the bar's ETA counts all steps.
            label = f"train (at most {max_seconds:g} s)" if max_seconds > 0 else "train"
            self._task = self._progress.add_task(label, total=total_steps, loss="-", speed="-", mfu="-")
        self.total_steps = total_steps

    def __enter__(self) -> "ProgressDisplay":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=m.step, loss=f"{m.loss:.4f}",
                                  speed=f"{m.tokens_per_s:,.0f}", mfu=f"{m.mfu:.1%}")
        elif m.step % self.every == 0 or m.step == self.total_steps or m.step == 1:
            self.console.print(
                f"step {m.step:>5}/{self.total_steps}  loss {m.loss:.4f}  lr {m.lr:.2e}  "
                f"{m.tokens_per_s:,.0f} tok/s  MFU {m.mfu:.1%}  {m.step_time_s * 1e3:.0f} ms/step",
                highlight=False,
            )
