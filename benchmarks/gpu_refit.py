"""The GPU presets' fitted constants, refit from the saved runs in the repository (benchmarks/results/gpu/), with
in-sample and held-out errors beside each other.

plait/spec/clusters.py ships, for every GPU preset, plait's host time per layer pass, per recomputed layer, per
selective pass and per step (`GPU_HOST`: software figures, one set for every GPU), and each measured GPU's optimizer
bandwidth (`memory_balance`). This script fits them again from the saved grids of benchmarks/gpu_check.py, each run
priced by this tree's cost model against the preset it was compared with:

* memory_balance, per GPU kind: the preset's, scaled by the median of measured over predicted optimizer step;
* the host times, once for every run together: robust least squares (soft L1 on log(predicted / measured), 5%
  scale) of the step times, every run at its kind's refit balance.

It prints each refit figure beside the shipped one (`--check`: exit 1 where they differ by more than CHECK_WITHIN),
and with --held-out the median |step-time error| in-sample, leave-one-shape-out (fit on every other micro-batch x
sequence shape, price the one left out) and leave-one-GPU-out (fit on the other kinds' runs, price this kind's).

    python benchmarks/gpu_refit.py [--runs DIR ...] [--held-out] [--check]

No GPU is needed; the figures quoted in plait/spec/clusters.py come from
`python benchmarks/gpu_refit.py --held-out` (saved: benchmarks/results/gpu_refit.txt).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import BadInput, reprice, saved_grid  # noqa: E402

from plait.spec.cluster import ClusterSpec, HostOverheads  # noqa: E402
from plait.spec.clusters import CLUSTER_PRESETS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"
HOST_FIELDS = ("layer_overhead", "recompute_layer_overhead", "selective_layer_overhead", "step_overhead")
"""The GPU host-time fields (plait.spec.clusters.GPU_HOST), fitted in milliseconds."""
START_MS = (1.0, 1.0, 2.0, 20.0)
CHECK_WITHIN = 0.02
"""How far a shipped constant may lie from its refit (they are rounded to 2-3 significant digits)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One saved grid: its folder, measured rows and the preset it was compared with."""

    folder: Path
    rows: tuple[dict, ...]
    preset: str

    @property
    def kind(self) -> str:
        return self.preset

    @classmethod
    def load(cls, folder: Path) -> "Run":
        header, rows = saved_grid(folder)
        return cls(folder, tuple(rows), header["preset"])


def refit_balance(runs: list[Run]) -> dict[str, float]:
    """memory_balance per GPU kind: the preset's times the median measured / predicted optimizer step."""
    out = {}
    for kind in sorted({r.kind for r in runs}):
        cluster = CLUSTER_PRESETS[kind].replace(host=HostOverheads())
        ratios = [row["optimizer_s"] / row["predicted_step_time_parts"]["optimizer"]
                  for run in runs if run.kind == kind for row in reprice(list(run.rows), cluster)]
        out[kind] = float(round(cluster.efficiency.memory_balance * statistics.median(ratios)))
    return out


def with_constants(kind: str, balance: dict[str, float], host_ms) -> ClusterSpec:  # noqa: ANN001
    cluster = CLUSTER_PRESETS[kind]
    efficiency = dataclasses.replace(cluster.efficiency, memory_balance=balance.get(kind, cluster.efficiency.memory_balance))
    host = HostOverheads(**{f"{field}_s": ms * 1e-3 for field, ms in zip(HOST_FIELDS, host_ms)})
    return cluster.replace(efficiency=efficiency, host=host)


def fit_host_ms(parts: list[tuple[list[dict], str]], balance: dict[str, float]) -> np.ndarray:
    """The host times (ms, HOST_FIELDS) that best explain the step times of `parts` (rows, GPU kind) together."""
    from scipy.optimize import least_squares

    measured = np.concatenate([[row["step_time_s"] for row in rows] for rows, _ in parts])

    def residuals(ms) -> np.ndarray:  # noqa: ANN001
        predicted = np.concatenate([[row["predicted_step_time_s"]
                                     for row in reprice(rows, with_constants(kind, balance, ms))]
                                    for rows, kind in parts])
        return np.log(predicted / measured)

    fit = least_squares(residuals, START_MS, bounds=([0.0] * 4, [100.0] * 4), loss="soft_l1", f_scale=0.05,
                        diff_step=0.01)
    return fit.x


def median_error(rows: list[dict], cluster: ClusterSpec) -> float:
    return statistics.median(abs(r["step_time_error"]) for r in reprice(rows, cluster))


def shipped(kinds: list[str]) -> dict[str, float]:
    """The constants plait/spec/clusters.py ships, named as `refit` names them."""
    host = CLUSTER_PRESETS[kinds[0]].host
    out = {f"{field}_ms": getattr(host, f"{field}_s") * 1e3 for field in HOST_FIELDS}
    out.update({f"memory_balance {kind}": CLUSTER_PRESETS[kind].efficiency.memory_balance for kind in kinds})
    return out


def refit(runs: list[Run]) -> tuple[dict[str, float], dict[str, float], np.ndarray]:
    """(the refit constants as `shipped` names them, the balance per kind, the host times in ms)."""
    balance = refit_balance(runs)
    host_ms = fit_host_ms([(list(run.rows), run.kind) for run in runs], balance)
    figures = {f"{field}_ms": float(ms) for field, ms in zip(HOST_FIELDS, host_ms)}
    figures.update({f"memory_balance {kind}": value for kind, value in balance.items()})
    return figures, balance, host_ms


def constants_table(figures: dict[str, float], ship: dict[str, float]) -> Table:
    table = Table(title="GPU constants: refit from the saved runs vs shipped (plait/spec/clusters.py)")
    for column in ("constant", "refit", "shipped", "apart"):
        table.add_column(column, justify="right")
    for name, value in figures.items():
        apart = ship[name] / value - 1 if value else 0.0
        colour = "green" if abs(apart) <= CHECK_WITHIN else "red"
        table.add_row(name, f"{value:.4g}", f"{ship[name]:.4g}", f"[{colour}]{apart:+.1%}[/]")
    return table


def held_out_table(runs: list[Run], balance: dict[str, float], host_ms: np.ndarray) -> Table:
    """Median |step-time error| per run: in-sample, leave-one-shape-out, leave-one-GPU-out."""
    table = Table(title="host times: median |step-time error| in-sample vs held out")
    for column in ("run", "rows", "shipped constants", "in-sample (refit)", "leave-one-shape-out",
                   "leave-one-GPU-out"):
        table.add_column(column, justify="right")
    shapes = sorted({(row["micro_batch"], row["seq_len"]) for run in runs for row in run.rows})
    by_shape: dict[Path, list[float]] = {run.folder: [] for run in runs}
    for shape in shapes:
        train = [([r for r in run.rows if (r["micro_batch"], r["seq_len"]) != shape], run.kind) for run in runs]
        held = fit_host_ms(train, balance)
        for run in runs:
            test = [r for r in run.rows if (r["micro_batch"], r["seq_len"]) == shape]
            if test:
                by_shape[run.folder] += [abs(r["step_time_error"])
                                         for r in reprice(test, with_constants(run.kind, balance, held))]
    kinds = sorted({run.kind for run in runs})
    other_kind = {kind: fit_host_ms([(list(r.rows), r.kind) for r in runs if r.kind != kind], balance)
                  for kind in kinds if len(kinds) > 1}
    for run in runs:
        rows = list(run.rows)
        across = (f"{median_error(rows, with_constants(run.kind, balance, other_kind[run.kind])):.1%}"
                  if run.kind in other_kind else "-")
        table.add_row(f"{run.folder.name} ({run.kind})", str(len(rows)),
                      f"{median_error(rows, CLUSTER_PRESETS[run.kind]):.1%}",
                      f"{median_error(rows, with_constants(run.kind, balance, host_ms)):.1%}",
                      f"{statistics.median(by_shape[run.folder]):.1%}", across)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="*", type=Path, default=None,
                        help="saved gpu_check folders (default: every one under benchmarks/results/gpu)")
    parser.add_argument("--held-out", action="store_true", help="in-sample vs held-out errors (slower: a fit per "
                                                                "shape and per GPU kind)")
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 where a shipped constant lies more than {CHECK_WITHIN * 100:.0f}%% from its refit")
    args = parser.parse_args(argv)
    folders = args.runs if args.runs else sorted(p.parent for p in RESULTS.glob("*/gpu_check.json"))
    try:
        runs = [Run.load(folder) for folder in folders]
    except BadInput as error:
        print(f"gpu_refit: {str(error).replace('--reprice', '--runs')}", file=sys.stderr)
        return 2
    unknown = sorted({run.preset for run in runs} - set(CLUSTER_PRESETS))
    if unknown:
        print(f"gpu_refit: runs compared with {', '.join(unknown)}, which is no preset of this tree; give runs of "
              f"{', '.join(p for p in CLUSTER_PRESETS if p.startswith(('h1', 'h2', 'a1')))}", file=sys.stderr)
        return 2
    console = Console(width=160)
    console.print("runs: " + ", ".join(f"{run.folder.name} ({run.kind}, {len(run.rows)} rows)" for run in runs))
    figures, balance, host_ms = refit(runs)
    ship = shipped(sorted({run.kind for run in runs}))
    console.print(constants_table(figures, ship))
    if args.held_out:
        console.print(held_out_table(runs, balance, host_ms))
    apart = [name for name, value in figures.items() if abs(ship[name] / value - 1) > CHECK_WITHIN]
    if args.check and apart:
        console.print(f"shipped constants apart from their refit: {', '.join(apart)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
