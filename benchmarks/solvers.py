"""Which solver to use: solve time and gap to the best known plan, on problem families held out from training.

Families (plait.search.training, seeds and size ranges the learned solver never saw):

* uniform: wider and deeper decoders (40-96 layers, 40-96 heads), 128-512 devices of one public part, longer
  sequences; the reference is exact search's optimum;
* mixed: two or three device groups (public parts, or a part beside its stragglers at 40-70% speed), 64 devices
  or more; the reference is exact search's optimum where it finishes within its time limit, else the best plan
  any solver found (the learned solver also runs with a long budget: 4x the proposals, 8x the placements).

For each problem and solver: the best plan's predicted step time against the reference (the gap), and the solve
time. Targets (issue 14): learned within 2% of the optimum (median) and 5% (worst 10%), and at least 10x faster
than exact on mixed clusters of 64+ devices.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/solvers.py [--uniform 12] [--mixed 8] [--limit 60]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

SOLVERS = ("exact", "dichotomy", "learned")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uniform", type=int, default=12, help="held-out uniform problems")
    parser.add_argument("--mixed", type=int, default=8, help="held-out mixed-cluster problems")
    parser.add_argument("--limit", type=float, default=60.0,
                        help="time limit of each exact and dichotomy search, seconds")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--json", help="also write the per-problem results here")
    return parser.parse_args()


def problems(args: argparse.Namespace) -> list[tuple[str, object, object, object, int]]:
    from plait.search.training import mixed_cluster, random_problem
    from plait.spec.clusters import CLUSTER_PRESETS

    rng = random.Random(args.seed)
    out = []
    while len([p for p in out if p[0] == "uniform"]) < args.uniform:
        model, cluster, train, devices = random_problem(rng, "held-out")
        out.append(("uniform", model, CLUSTER_PRESETS[cluster].with_devices(devices), train, devices))
    while len([p for p in out if p[0] == "mixed"]) < args.mixed:
        model, _, train, _ = random_problem(rng, "held-out")
        cluster = mixed_cluster(rng, "held-out")
        if cluster.num_devices >= 64 and cluster.num_devices % 8 == 0:
            out.append(("mixed", model, cluster, train.__class__(global_batch=cluster.num_devices * 2,
                                                                 seq_len=train.seq_len), cluster.num_devices))
    return out


def solve(model, cluster, train, devices: int, solver: str, limit: float | None, **extra):
    from plait.search import plan_with_stats
    from plait.search.learned import LearnedSolver
    from plait.search import solvers

    began = time.perf_counter()
    if extra:  # the long-budget learned solver
        original = solvers.get_solver
        solvers.get_solver = lambda name: LearnedSolver(**extra)
    try:
        result = plan_with_stats(model, cluster, train, num_devices=devices, top=1, solver=solver,
                                 explain_infeasible=False, time_limit_s=limit)
    except Exception as error:  # e.g. no layout at all: the row says so
        return {"time": math.inf, "seconds": time.perf_counter() - began, "complete": False, "error": str(error)}
    finally:
        if extra:
            solvers.get_solver = original
    best = result.plans[0].predicted.step_time_s if result.plans else math.inf
    return {"time": best, "seconds": time.perf_counter() - began, "complete": result.complete,
            "evaluated": result.candidates_evaluated}


def main() -> None:
    args = parse_args()
    rows = []
    for family, model, cluster, train, devices in problems(args):
        # exact and dichotomy price every placement of a mixed cluster: both run under the time limit
        runs = {s: solve(model, cluster, train, devices, s, None if s == "learned" else args.limit) for s in SOLVERS}
        if family == "mixed" and not runs["exact"]["complete"]:
            runs["learned-long"] = solve(model, cluster, train, devices, "learned", None, proposals=96, orderings=32)
        exact_done = runs["exact"]["complete"] and math.isfinite(runs["exact"]["time"])
        reference = runs["exact"]["time"] if exact_done else min(r["time"] for r in runs.values())
        if not math.isfinite(reference):
            continue
        rows.append({"family": family, "model": model.name, "devices": devices, "exact_finished": exact_done,
                     "reference": reference, **{s: r for s, r in runs.items()}})
        print(f"{family:8s} {devices:5d} devices, {model.num_layers} layers h={model.hidden_size}: " + ", ".join(
            f"{s} {r['seconds']:.2f}s gap {r['time'] / reference - 1:+.2%}" for s, r in runs.items()), flush=True)
    report(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


def report(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="solvers on held-out problems (gap: predicted step time against the best known plan)")
    for column in ("family", "solver", "problems", "exact finished", "median solve", "median gap", "90th pct gap",
                   "worst gap", "speed-up vs exact"):
        table.add_column(column, justify="left" if column in ("family", "solver") else "right")
    for family in ("uniform", "mixed"):
        mine = [r for r in rows if r["family"] == family]
        if not mine:
            continue
        for solver in SOLVERS:
            gaps = [r[solver]["time"] / r["reference"] - 1 for r in mine]
            seconds = [r[solver]["seconds"] for r in mine]
            speedup = statistics.median(r["exact"]["seconds"] / max(r[solver]["seconds"], 1e-9) for r in mine)
            finite = [g for g in gaps if math.isfinite(g)]
            table.add_row(family, solver, str(len(mine)), str(sum(r["exact_finished"] for r in mine)),
                          f"{statistics.median(seconds):.3f} s",
                          f"{statistics.median(finite):.2%}" if finite else "-",
                          f"{sorted(finite)[int(0.9 * (len(finite) - 1))]:.2%}" if finite else "-",
                          f"{max(gaps):.2%}", f"{speedup:.1f}x")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
