"""Planner speed: GPT-3 175B (B = 1536, s = 2048) on 64 ... 16,384 a100-80g devices, full joint space; and Llama 3
405B (B = 2048, s = 8192: Meta's 16M-token batch) on 16,384 h100-80g devices, top 3. The joint space holds context
parallelism (both key/value exchanges), the zero-bubble V schedules and, for mixture-of-experts models, expert
parallelism.

    OMP_NUM_THREADS=1 python benchmarks/planner_speed.py [--top 10] [--repeat 3]

Prints, per row, the candidates priced and pruned, wall and CPU seconds (median of --repeat runs; CPU seconds are
what one core spends, robust to other load on the machine), the first run's CPU seconds (what one `plait plan`
call pays: the schedule tables the planner caches in the process are built then), and the best plan. `--top 0` asks for every feasible
plan (no bound pruning) in the GPT-3 rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from plait.search import plan_with_stats
from plait.spec import TrainSpec

GPT3_DEVICES = (64, 1024, 4096, 16384)
ROWS = [("gpt3-175b", "a100-80g", devices, TrainSpec(global_batch=1536, seq_len=2048), None) for devices in GPT3_DEVICES]
ROWS.append(("llama3-405b", "h100-80g", 16384, TrainSpec(global_batch=2048, seq_len=8192), 3))


def run(model: str, cluster: str, devices: int, train: TrainSpec, top: int | None) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = plan_with_stats(model, cluster, train, num_devices=devices, top=top)
    return time.perf_counter() - wall, time.process_time() - cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=10, help="plans kept in the GPT-3 rows (0: all feasible plans)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    table = Table(title="plait plan: planner speed (full joint space: dp, tp, pp, cp, ep, ZeRO, recompute, micro-batch, "
                        "schedule incl. ZB-V and DualPipeV)")
    for col in ("model", "cluster", "devices", "top", "priced", "pruned", "feasible kept", "wall s", "cpu s",
                "first cpu s", "best plan", "step s", "MFU"):
        table.add_column(col, justify="right")
    for model, cluster, devices, train, row_top in ROWS:
        top = row_top if row_top is not None else (args.top or None)
        runs = [run(model, cluster, devices, train, top) for _ in range(args.repeat)]
        result = runs[-1][2]
        best = result.plans[0]
        table.add_row(model, cluster, str(devices), str(top or "all"), str(result.candidates_evaluated),
                      str(result.candidates_pruned), str(len(result.plans)),
                      f"{statistics.median(r[0] for r in runs):.2f}", f"{statistics.median(r[1] for r in runs):.2f}",
                      f"{runs[0][1]:.2f}",
                      best.describe().split(" layers=")[0], f"{best.predicted.step_time_s:.2f}",
                      f"{best.predicted.mfu:.1%}")
    Console(width=250).print(table)


if __name__ == "__main__":
    main()
