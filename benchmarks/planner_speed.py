"""Planner speed: GPT-3 175B (B = 1536, s = 2048) on 64 ... 16,384 a100-80g devices, full joint space.

    OMP_NUM_THREADS=1 python benchmarks/planner_speed.py [--top 10] [--repeat 3]

Prints, per device count, the candidates priced and pruned, wall and CPU seconds (median of
--repeat runs; CPU seconds are what one core spends, robust to other load on the machine),
and the best plan. `--top 0` asks for every feasible plan (no bound pruning).
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from plait.search import plan_with_stats
from plait.spec import TrainSpec

DEVICES = (64, 1024, 4096, 16384)


def run(devices: int, top: int | None) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = plan_with_stats("gpt3-175b", "a100-80g", TrainSpec(global_batch=1536, seq_len=2048),
                             num_devices=devices, top=top)
    return time.perf_counter() - wall, time.process_time() - cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=10, help="plans kept (0: all feasible plans)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    top = args.top or None
    table = Table(title=f"plait plan gpt3-175b on a100-80g, B=1536, s=2048, top={top or 'all'}")
    for col in ("devices", "priced", "pruned", "feasible kept", "wall s", "cpu s", "best plan", "step s", "MFU"):
        table.add_column(col, justify="right")
    for devices in DEVICES:
        runs = [run(devices, top) for _ in range(args.repeat)]
        result = runs[-1][2]
        best = result.plans[0]
        table.add_row(str(devices), str(result.candidates_evaluated), str(result.candidates_pruned),
                      str(len(result.plans)), f"{statistics.median(r[0] for r in runs):.2f}",
                      f"{statistics.median(r[1] for r in runs):.2f}", best.describe().split(" layers=")[0],
                      f"{best.predicted.step_time_s:.2f}", f"{best.predicted.mfu:.1%}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
