"""Plots of measurements: the training loss curve and predicted against measured step time.

Used by `plait train` / `plait demo` (loss curve) and `plait tune` (predicted vs measured).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from plait.errors import ConfigError
from plait.report.plots import _figure, _save

LOSS_KEYS = ("loss", "train_loss")
EXTRA_LOSS_KEYS = ("val_loss", "eval_loss")


def read_metrics(metrics_jsonl: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSON-lines file; blank lines skipped, a bad line named."""
    path = Path(metrics_jsonl)
    if not path.is_file():
        raise ConfigError(f"metrics file {str(path)!r} does not exist")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: line {number} is not valid JSON ({e.msg})") from None
    return records


def plot_loss_curve(metrics_jsonl: str | Path, out_png: str | Path, *, title: str = "") -> Path:
    """Loss against step from a metrics JSON-lines file (keys `step` and `loss`; `val_loss` if present).

    A light raw line with a smoothed line on top: per-step loss on small batches is noisy.
    """
    records = read_metrics(metrics_jsonl)
    steps, losses = _series(records, LOSS_KEYS)
    if not steps:
        raise ConfigError(f"{metrics_jsonl}: no records with a 'step' and a 'loss' to plot")
    fig = _figure(7, 4)
    ax = fig.add_subplot()
    ax.plot(steps, losses, color="#4C72B0", alpha=0.35, linewidth=1, label="loss")
    if len(losses) >= 8:
        ax.plot(steps, _centered_mean(losses, half_window=max(1, len(losses) // 40)), color="#4C72B0",
                linewidth=2, label="loss (smoothed)")
    for key in EXTRA_LOSS_KEYS:
        extra_steps, extra = _series(records, (key,))
        if extra_steps:
            ax.plot(extra_steps, extra, "o-", color="#C44E52", markersize=3, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or f"training loss ({len(steps)} steps, last {losses[-1]:.3f})", loc="left")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out_png)


def _series(records: Iterable[Mapping[str, Any]], keys: Sequence[str]) -> tuple[list[float], list[float]]:
    """(steps, values) in step order. A step logged twice (a file from a resumed run of an older plait, which
    kept the interrupted run's lines) keeps its last value, so the line never runs back in time."""
    by_step: dict[float, float] = {}
    for i, record in enumerate(records):
        value = next((record[k] for k in keys if isinstance(record.get(k), (int, float))), None)
        step = record.get("step", i)
        if value is None or not math.isfinite(value) or not isinstance(step, (int, float)):
            continue
        by_step.pop(step, None)
        by_step[step] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[step] for step in steps]


def _centered_mean(values: Sequence[float], half_window: int) -> list[float]:
    """Mean over a window centred on each point (shrunk at the ends): smooths without the lag of an EMA."""
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half_window): i + half_window + 1]
        out.append(sum(window) / len(window))
    return out


# ---- predicted vs measured ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PredictedMeasured:
    """One plan's predicted and measured value (step time in seconds, or bytes)."""

    label: str = ""
    predicted: float
    measured: float


def as_predicted_measured(row: Any) -> PredictedMeasured:
    """Accept a PredictedMeasured, a mapping (predicted/measured or predicted_s/measured_s, label), or a tuple
    (label, predicted, measured) / (predicted, measured)."""
    if isinstance(row, PredictedMeasured):
        return row
    if isinstance(row, Mapping):
        predicted = row.get("predicted", row.get("predicted_s"))
        measured = row.get("measured", row.get("measured_s"))
        if predicted is None or measured is None:
            raise ConfigError(f"row {dict(row)!r} needs 'predicted' and 'measured' (or *_s) values")
        return PredictedMeasured(label=str(row.get("label", "")), predicted=float(predicted), measured=float(measured))
    if isinstance(row, (tuple, list)) and len(row) in (2, 3):
        label = str(row[0]) if len(row) == 3 else ""
        return PredictedMeasured(label=label, predicted=float(row[-2]), measured=float(row[-1]))
    raise ConfigError(f"cannot read {row!r} as a (label, predicted, measured) row")


def plot_predicted_vs_measured(rows: Sequence[Any], out_png: str | Path, *, quantity: str = "step time (s)",
                               title: str = "", best_label: str | None = None,
                               before: Sequence[float] | None = None) -> Path:
    """Scatter of measured against predicted with the y = x line and a ±15% band; points labelled.

    The title carries the median and worst relative error |predicted - measured| / measured. `before`
    (one predicted value per row, e.g. of an untuned model) adds them as hollow marks joined to the points.
    """
    points = [as_predicted_measured(r) for r in rows]
    if not points:
        raise ConfigError("no rows to plot: give at least one (label, predicted, measured) row")
    fig = _figure(6, 5.5)
    ax = fig.add_subplot()
    earlier = [PredictedMeasured(label=p.label, predicted=b, measured=p.measured) for p, b in zip(points, before or ())]
    low, high = _bounds(points + earlier)
    for old, new in zip(earlier, points):
        ax.plot([old.predicted, new.predicted], [old.measured, new.measured], color="grey", linewidth=0.8, zorder=2)
    if earlier:
        ax.scatter([p.predicted for p in earlier], [p.measured for p in earlier], s=30, facecolors="none",
                   edgecolors="#4C72B0", zorder=3, label="before tuning")
    line = [low, high]
    ax.plot(line, line, color="black", linewidth=1, label="predicted = measured")
    ax.fill_between(line, [x * 0.85 for x in line], [x * 1.15 for x in line], color="grey", alpha=0.15,
                    label="±15%")
    ax.scatter([p.predicted for p in points], [p.measured for p in points], s=30, color="#4C72B0", zorder=3,
               label="after tuning" if earlier else None)
    for p in points:
        _annotate(ax, p, highlight=best_label is not None and p.label == best_label)
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel(f"predicted {quantity}")
    ax.set_ylabel(f"measured {quantity}")
    ax.set_title(title or _error_title(points), loc="left", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return _save(fig, out_png)


def relative_errors(points: Sequence[PredictedMeasured]) -> list[float]:
    return [abs(p.predicted - p.measured) / p.measured for p in points if p.measured > 0]


def _error_title(points: Sequence[PredictedMeasured]) -> str:
    errors = relative_errors(points)
    if not errors:
        return "predicted vs measured"
    median = statistics.median(errors)
    errors.sort()
    return f"predicted vs measured: {len(points)} plans, median error {median:.1%}, worst {errors[-1]:.1%}"


def _bounds(points: Sequence[PredictedMeasured]) -> tuple[float, float]:
    values = [v for p in points for v in (p.predicted, p.measured)]
    span = max(values) - min(values)
    pad = 0.08 * (span if span > 0 else max(abs(max(values)), 1e-9))
    return max(0.0, min(values) - pad), max(values) + pad


def _annotate(ax, p: PredictedMeasured, highlight: bool) -> None:
    if not p.label:
        return
    ax.annotate(p.label, (p.predicted, p.measured), xytext=(4, 4), textcoords="offset points",
                fontsize=7, color="crimson" if highlight else "#333333",
                fontweight="bold" if highlight else "normal")
