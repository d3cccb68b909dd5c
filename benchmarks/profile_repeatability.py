"""How well does a `plait profile` describe this machine? Profile twice per process count and print
each run's fits, and how well run A's fitted link predicts run B's measurements (a hold-out check:
a fit that only explains its own noise would fail it).

    .venv/bin/python benchmarks/profile_repeatability.py [--nproc 2 4] [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from plait.profile.calibrate import calibrate, measurements_from_json
from plait.profile.fit import evaluate_link


def profile_once(nproc: int, quick: bool, folder: Path, tag: str):
    out, samples = folder / f"{tag}.yaml", folder / f"{tag}.json"
    command = [sys.executable, "-m", "plait", "profile", "--nproc", str(nproc), "--out", str(out),
               "--samples", str(samples)] + (["--quick"] if quick else [])
    subprocess.run(command, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    m = measurements_from_json(samples.read_text())
    return m, calibrate(m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    console = Console()
    table = Table(title="plait profile, twice per world size: in-sample fit and hold-out prediction")
    for column in ("ranks", "run", "secs", "peak GFLOP/s", "half_dim", "overhead", "latency us", "bw GB/s", "R²",
                   "max rel resid", "hold-out median err", "hold-out max err"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nproc:
            runs = []
            for tag in ("A", "B"):
                console.print(f"profiling {nproc} ranks, run {tag} ...")
                runs.append(profile_once(nproc, args.quick, Path(tmp), f"{nproc}{tag}"))
            for (tag, (m, cal)), (_, (other_m, _)) in zip(zip("AB", runs), zip("BA", reversed(runs))):
                link, fit, c = cal.cluster.intra_node, cal.links["intra_node"], cal.cluster
                held_out = evaluate_link(other_m.comm["intra_node"], link.latency_s, link.bandwidth)
                table.add_row(str(nproc), tag, f"{m.seconds:.0f}", f"{c.peak_flops / 1e9:.1f}",
                              f"{c.efficiency.matmul_half_dim:.0f}", f"{c.efficiency.overhead:.2f}",
                              f"{link.latency_s * 1e6:.0f}", f"{link.bandwidth / 1e9:.2f}", f"{fit.r2:.2f}",
                              f"{fit.max_rel_residual:.0%}", f"{held_out.median_rel_residual:.0%}",
                              f"{held_out.max_rel_residual:.0%}")
    console.print(table)


if __name__ == "__main__":
    main()
