"""Tables (rich) and plots (matplotlib, imported lazily) of plans and measurements.

* tables: `plans_table(plans)`, `parts_table(...)`, compact cell formats;
* plots: `plot_timeline`, `plot_memory_per_stage`, `plot_candidates` (the `plait plan --report` trio);
* curves: `plot_loss_curve(metrics_jsonl, out_png)`, `plot_predicted_vs_measured(rows, out_png)`.
"""

from plait.report.curves import PredictedMeasured, plot_loss_curve, plot_predicted_vs_measured, read_metrics
from plait.report.plots import Candidate, TimelineEvent, plot_candidates, plot_memory_per_stage, plot_timeline
from plait.report.tables import parts_table, plans_table, search_stats_line

__all__ = [
    "Candidate", "PredictedMeasured", "TimelineEvent", "parts_table", "plans_table", "plot_candidates",
    "plot_loss_curve", "plot_memory_per_stage", "plot_predicted_vs_measured", "plot_timeline", "read_metrics",
    "search_stats_line",
]
