"""Planner speed: GPT-3 175B (B = 1536, s = 2048) on 64 ... 16,384 a100-80g devices, full joint space; and Llama 3
405B (B = 2048, s = 8192: Meta's 16M-token batch) on 16,384 h100-80g devices, top 3. The joint space holds context
parallelism (both key/value exchanges), the zero-bubble V schedules and, for mixture-of-experts models, expert
parallelism.

    OMP_NUM_THREADS=1 python benchmarks/planner_speed.py [--top 10] [--repeat 3] [--baseline REV_OR_DIR]

Each row runs in a fresh Python process (what one `plait plan` call pays: nothing cached yet). Prints, per row, the
candidates priced and pruned, wall and CPU seconds (median of --repeat runs in that process: the later ones find the
schedule tables the first built; CPU seconds are what one core spends, robust to other load on the machine), the
first run's CPU seconds, and the best plan. `--top 0` asks for every feasible plan (no bound pruning) in the GPT-3
rows.

`--baseline` times another plait against this one in the same run: a git revision of this repository (its `plait/`
is extracted with `git archive` into a temporary folder) or a folder holding a `plait/` package. Every row then runs
in both, one after the other, and the table adds the baseline's CPU seconds, the ratios (this / baseline) and
whether the two ranked lists are the same (every plan's description, step time and peak memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT3_DEVICES = (64, 1024, 4096, 16384)
ROWS = [("gpt3-175b", "a100-80g", devices, 1536, 2048, None) for devices in GPT3_DEVICES]
ROWS.append(("llama3-405b", "h100-80g", 16384, 2048, 8192, 3))
"""(model, cluster, devices, global batch, sequence length, top: None for the --top argument)."""


def run_row(index: int, top: int | None, repeat: int) -> dict:
    """Plan row `index` `repeat` times in this process (the worker's side)."""
    from plait.search import plan_with_stats
    from plait.spec import TrainSpec

    model, cluster, devices, batch, seq, _ = ROWS[index]
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        result = plan_with_stats(model, cluster, TrainSpec(global_batch=batch, seq_len=seq), num_devices=devices,
                                 top=top)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    best = result.plans[0]
    return {"wall": walls, "cpu": cpus, "priced": result.candidates_evaluated, "pruned": result.candidates_pruned,
            "kept": len(result.plans), "best": best.describe().split(" layers=")[0],
            "step": best.predicted.step_time_s, "mfu": best.predicted.mfu,
            "plans": [(p.describe(), p.predicted.step_time_s, p.predicted.peak_memory_bytes) for p in result.plans]}


def in_process(tree: Path, index: int, top: int | None, repeat: int) -> dict:
    """Row `index` in a fresh interpreter importing the plait of `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(index), "--repeat", str(repeat),
               "--top", str(top or 0)]
    out = subprocess.run(command, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"planner_speed: row {index} failed under {tree}:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_plans(mine: list, theirs: list) -> bool:
    """The same ranked plans: descriptions equal, step time and peak memory within 1e-12 of each other."""
    return len(mine) == len(theirs) and all(
        a[0] == b[0] and all(abs(x - y) <= 1e-12 * abs(y) for x, y in zip(a[1:], b[1:])) for a, b in zip(mine, theirs))


def baseline_tree(baseline: str, scratch: Path) -> Path:
    """A folder holding the baseline's `plait/`: `baseline` itself, or revision `baseline` extracted there."""
    if (Path(baseline) / "plait" / "__init__.py").is_file():
        return Path(baseline).resolve()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", baseline, "plait"], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"planner_speed: --baseline {baseline!r} is neither a folder with plait/ nor a git revision "
                         f"of {ROOT} ({archive.stderr.decode().strip()})")
    subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive.stdout, check=True)
    return scratch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=10, help="plans kept in the GPT-3 rows (0: all feasible plans)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", help="a git revision, or a folder with a plait/ package, to time beside this one")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # one row, in this process, as JSON
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat} must be at least 1")
    if args.worker is not None:
        row_top = ROWS[args.worker][5]
        print(json.dumps(run_row(args.worker, row_top if row_top is not None else (args.top or None), args.repeat)))
        return
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory() as scratch:
        base = baseline_tree(args.baseline, Path(scratch)) if args.baseline else None
        table = Table(title="plait plan: planner speed (full joint space: dp, tp, pp, cp, ep, ZeRO, recompute, "
                            "micro-batch, schedule incl. ZB-V and DualPipeV)")
        columns = ["model", "cluster", "devices", "top", "priced", "pruned", "feasible kept", "wall s", "cpu s",
                   "first cpu s"]
        if base is not None:
            columns += ["base cpu s", "base first cpu s", "cpu ratio", "first ratio", "same plans"]
        for col in columns + ["best plan", "step s", "MFU"]:
            table.add_column(col, justify="right")
        for index, (model, cluster, devices, _, _, row_top) in enumerate(ROWS):
            top = row_top if row_top is not None else (args.top or None)
            mine = in_process(ROOT, index, top, args.repeat)
            cells = [model, cluster, str(devices), str(top or "all"), str(mine["priced"]), str(mine["pruned"]),
                     str(mine["kept"]), f"{statistics.median(mine['wall']):.2f}",
                     f"{statistics.median(mine['cpu']):.2f}", f"{mine['cpu'][0]:.2f}"]
            if base is not None:
                theirs = in_process(base, index, top, args.repeat)
                cpu, base_cpu = statistics.median(mine["cpu"]), statistics.median(theirs["cpu"])
                cells += [f"{base_cpu:.2f}", f"{theirs['cpu'][0]:.2f}", f"{cpu / base_cpu:.2f}x",
                          f"{mine['cpu'][0] / theirs['cpu'][0]:.2f}x", "yes" if same_plans(mine["plans"], theirs["plans"]) else "NO"]
            table.add_row(*cells, mine["best"], f"{mine['step']:.2f}", f"{mine['mfu']:.1%}")
        Console(width=300).print(table)


if __name__ == "__main__":
    main()
