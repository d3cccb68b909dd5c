"""How right is plait's cost model on this machine? For tiny-gpt on 2 and 4 local CPU ranks:

1. calibrate with `plait profile` (compute, links, and the host time of a few small probe plans; or reuse
   a cluster file per world size; --quick-profile for the seconds-long version);
2. enumerate every feasible plan plait can express (the search with an unbounded top: degrees,
   ZeRO stage, recompute, micro-batches, schedule, interleaving);
3. time all of them in one launch (`python -m plait.profile.tune`), --batch plans stepped round-robin
   so that a burst of load from elsewhere on the machine hits every plan rather than a few;
4. print the median and worst relative error of the predicted step time, Kendall's tau between
   predicted and measured order, and the regret (measured step of plait's choice / measured best - 1),
   first with the profiled cluster, then after `plait tune`'s correction fitted on the --tune-top plans
   `plait tune --top K` would run, for each K of --tune-top (the best of each layout first, then a second
   micro-batch count per layout; the others are out of sample).

    .venv/bin/python benchmarks/local_accuracy.py [--nproc 2 4] [--cluster-2 FILE] [--cluster-4 FILE] [--quick-profile]
        [--global-batch 8] [--seq-len 128] [--steps 3] [--warmup 1] [--rounds 2] [--batch 32]
        [--tune-top 6 12] [--json FILE] [--plot-dir DIR]

Targets (issue 4): median error <= 15%, tau >= 0.7, regret <= 10%.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from plait.plan import Plan
from plait.profile.terms import Observation, fit_terms, kendall_tau, predicted_step, regret, relative_error
from plait.profile.clusterfile import validate_cluster_for_world
from plait.profile.tune import Measured, layouts_first, read_results, write_plans
from plait.spec import ClusterSpec, TrainSpec
from plait.spec.load import load_model

TARGETS = {"median": 0.15, "tau": 0.7, "regret": 0.10}


@dataclass(frozen=True)
class Scores:
    median_error: float
    worst_error: float
    tau: float
    regret: float
    best: str
    chosen: str


def profile(nproc: int, folder: Path, quick: bool) -> Path:
    out = folder / f"cluster-{nproc}.yaml"
    command = [sys.executable, "-m", "plait", "profile", "--nproc", str(nproc), "--out", str(out)]
    subprocess.run(command + (["--quick"] if quick else []), check=True, capture_output=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    return out


def feasible_plans(model_name: str, cluster: ClusterSpec, train: TrainSpec, nproc: int) -> list[Plan]:
    """Every plan the search can express, once per recompute mode (left to itself, the search recomputes
    only where memory is tight, which it never is for a tiny model)."""
    from plait.search import plan as search

    by_mode = [search(load_model(model_name), cluster, train, num_devices=nproc, recompute=mode)
               for mode in ("none", "selective", "full")]
    plans = {}
    for row in itertools.zip_longest(*by_mode):  # modes interleaved: each timing batch holds all three
        for plan in row:
            if plan is not None:
                plans.setdefault(plan.describe(), plan)
    return list(plans.values())


def time_all(plans: list[Plan], nproc: int, args: argparse.Namespace, folder: Path) -> list[Measured]:
    """All plans, --rounds times over, in one launch; each plan's steps of every round pooled."""
    from plait.runtime.launch import run_local

    plans_file, results_file = folder / f"plans-{nproc}.json", folder / f"results-{nproc}.json"
    write_plans(plans * args.rounds, plans_file)
    argv = [str(plans_file), str(results_file), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch", str(args.batch)]
    code = run_local(nproc, argv, module="plait.profile.tune", timeout_s=3600)
    if code != 0:
        raise SystemExit(f"timing {len(plans)} plans on {nproc} ranks failed (exit code {code})")
    rows = read_results(results_file)
    pooled = []
    for i, plan in enumerate(plans):
        runs = rows[i::len(plans)]
        pooled.append(Measured(label=plan.describe(), step_times_s=tuple(t for r in runs for t in r.step_times_s),
                               error=runs[0].error))
    return pooled


def score(plans: list[Plan], measured: list[float], cluster: ClusterSpec) -> Scores:
    predicted = [predicted_step(p, cluster) for p in plans]
    errors = [relative_error(p, m) for p, m in zip(predicted, measured)]
    chosen = min(range(len(plans)), key=lambda i: predicted[i])
    best = min(range(len(plans)), key=lambda i: measured[i])
    return Scores(median_error=statistics.median(errors), worst_error=max(errors),
                  tau=kendall_tau(predicted, measured), regret=regret(predicted, measured),
                  best=plans[best].describe(), chosen=plans[chosen].describe())


def run_world(nproc: int, args: argparse.Namespace, folder: Path, console: Console) -> dict:
    source = getattr(args, f"cluster_{nproc}", None)
    started = time.perf_counter()
    if source is None:
        console.print(f"[{nproc} ranks] plait profile{' --quick' * args.quick_profile} ...")
        source = profile(nproc, folder, quick=args.quick_profile)
    cluster = validate_cluster_for_world(source, nproc)
    train = TrainSpec(global_batch=args.global_batch, seq_len=args.seq_len, precision="fp32")
    plans = feasible_plans(args.model, cluster, train, nproc)
    console.print(f"[{nproc} ranks] timing {len(plans)} feasible plans x {args.rounds} round(s) ...")
    results = time_all(plans, nproc, args, folder)
    timed = [(p, r) for p, r in zip(plans, results) if r.median_s is not None]
    for plan, result in zip(plans, results):
        if result.error:
            console.print(f"  not timed: {plan.describe()}: {result.error}")
    plans, measured = [p for p, _ in timed], [r.median_s for _, r in timed]
    # what `plait tune --top K` runs: the best plan of each layout first
    by_plan = {id(p): m for p, m in zip(plans, measured)}
    scores, tuned = {"profile": score(plans, measured, cluster)}, cluster
    for k in args.tune_top:
        top = [Observation(plan=p, measured_s=by_plan[id(p)]) for p in layouts_first(plans)[:k]]
        tuned = fit_terms(top, cluster).cluster
        scores[f"profile + tune (top {k})"] = score(plans, measured, tuned)
    return {"nproc": nproc, "plans": plans, "measured": measured, "profiled": cluster, "tuned": tuned,
            "scores": scores, "seconds": time.perf_counter() - started}


def print_table(worlds: list[dict], args: argparse.Namespace, console: Console) -> None:
    table = Table(title=f"{args.model}, batch {args.global_batch}x{args.seq_len}: predicted vs measured step time "
                        "(targets: median <= 15%, tau >= 0.7, regret <= 10%)", title_justify="left")
    for name in ("ranks", "plans", "cluster", "median err", "worst err", "Kendall tau", "regret", "secs"):
        table.add_column(name, justify="right")
    for world in worlds:
        for label, s in world["scores"].items():
            table.add_row(str(world["nproc"]), str(len(world["plans"])), label, _mark(s.median_error, "median"),
                          f"{s.worst_error:.0%}", _mark(s.tau, "tau"), _mark(s.regret, "regret"),
                          f"{world['seconds']:.0f}")
    console.print(table)
    for world in worlds:
        s = world["scores"]["profile"]
        console.print(f"{world['nproc']} ranks: measured best {s.best}; plait chose {s.chosen}", highlight=False)


def _mark(value: float, target: str) -> str:
    met = value >= TARGETS[target] if target == "tau" else value <= TARGETS[target]
    text = f"{value:.2f}" if target == "tau" else f"{value:.1%}"
    return f"[green]{text}[/]" if met else f"[red]{text}[/]"


def write_outputs(worlds: list[dict], args: argparse.Namespace) -> None:
    if args.json:
        rows = [{"nproc": w["nproc"], "plans": [
            {"plan": p.describe(), "measured_s": m, "predicted_s": predicted_step(p, w["profiled"]),
             "tuned_s": predicted_step(p, w["tuned"])} for p, m in zip(w["plans"], w["measured"])],
            "scores": {k: vars(v) for k, v in w["scores"].items()},
            "clusters": {"profiled": w["profiled"].to_dict(), "tuned": w["tuned"].to_dict()}} for w in worlds]
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot_dir:
        from plait.report import plot_predicted_vs_measured

        for w in worlds:
            for key, suffix in (("profiled", ""), ("tuned", "_tuned")):
                rows = [("", predicted_step(p, w[key]), m) for p, m in zip(w["plans"], w["measured"])]
                path = Path(args.plot_dir) / f"local_accuracy_{w['nproc']}{suffix}.png"
                plot_predicted_vs_measured(rows, path, title=f"{w['nproc']} ranks, {key} cluster: "
                                           f"{len(rows)} plans")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="tiny-gpt")
    parser.add_argument("--cluster-2", dest="cluster_2", help="cluster file for 2 ranks (default: profile now)")
    parser.add_argument("--cluster-4", dest="cluster_4", help="cluster file for 4 ranks (default: profile now)")
    parser.add_argument("--quick-profile", action="store_true", help="profile with --quick (seconds, noisier)")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="passes over all plans, each building every plan anew; "
                        "a plan's steps of all rounds are pooled (default: 2)")
    parser.add_argument("--batch", type=int, default=32, help="plans stepped round-robin together (default: 32)")
    parser.add_argument("--tune-top", type=int, nargs="+", default=[6, 12],
                        help="plans `plait tune --top K` would run and fit on, one fit per K; the plots and --json "
                             "use the last (default: 6 12; 6 is one per layout at 4 ranks)")
    parser.add_argument("--json", help="write every plan's predicted and measured step time here")
    parser.add_argument("--plot-dir", help="write local_accuracy_<N>.png (and _tuned.png) here")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 140))
    with tempfile.TemporaryDirectory(prefix="plait-accuracy-") as tmp:
        worlds = [run_world(n, args, Path(tmp), console) for n in args.nproc]
    print_table(worlds, args, console)
    write_outputs(worlds, args)


if __name__ == "__main__":
    main()
