"""Does `plait train --adapt` find its way around a slow rank? On 4 local ranks with rank 3 throttled by a stated
factor (PLAIT_THROTTLE, plait/runtime/throttle.py: every block of that rank takes FACTOR times as long):

* **even**: the plan the planner makes for 4 equal ranks, trained without adaptation: its measured step;
* **adapted**: the same run with --adapt: the step after plait switched plans (and the switch's step and cost);
* **best static**: the fastest of the candidate plans for the throttled machine, timed one after another in one
  launch under the same throttle (the even plan, the adapted plan, and the planner's best plans for every grouping
  of the ranks at their true speeds).

Target: adapted within 10% of the best static plan, both timed in the same candidates' launch (the train runs'
own steps are shown too), and the adapted run's losses equal to the even run's, step by step (the switch is
exact, like a resume). Each run is repeated --rounds times in one go; the table gives medians.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/adapt.py [--factor 3] [--steps 60] [--rounds 2] [--switch-cost S]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from plait.train.config import toml_text

NPROC = 4
SLOW_RANK = 3
MODEL = {"name": "adapt-gpt", "arch": "gpt", "num_layers": 8, "hidden_size": 128, "num_heads": 4,
         "vocab_size": 256, "max_seq_len": 128}
TIMED_WARMUP, TIMED_STEPS = 2, 6
WARMUP = 2
"""Steps of each plan left out of a train run's median (plait.train.measure.WARMUP_STEPS)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factor", type=float, default=3.0, help="rank 3's slow-down (default: 3)")
    parser.add_argument("--steps", type=int, default=60, help="steps of each train run (default: 60)")
    parser.add_argument("--rounds", type=int, default=2, help="times each run is repeated (default: 2)")
    parser.add_argument("--cluster", default="local-cpu", help="what the plans are made for (a preset or a file "
                                                                "from `plait profile --nproc 4`)")
    parser.add_argument("--switch-cost", type=float, default=None, metavar="S",
                        help="seconds a switch is taken to cost (PLAIT_ADAPT_SWITCH_S; default: plait's estimate "
                             "from the run's first build, which on a busy host can exceed what a short run saves)")
    parser.add_argument("--json", help="also write the figures to this file")
    return parser.parse_args(argv)


def write_config(root: Path, name: str, args: argparse.Namespace) -> Path:
    (root / "model.json").write_text(json.dumps(MODEL))
    config = root / f"{name}.toml"
    config.write_text(toml_text({
        "model": {"file": str(root / "model.json")},
        "train": {"steps": args.steps, "global_batch": 16, "seq_len": 64, "seed": 3},
        "optimizer": {"warmup": 3},
        "plan": {"file": "auto", "cluster": args.cluster, "devices": NPROC},
        "log": {"dir": str(root / name), "progress": False, "every": 1000}}))
    return config


def train(config: Path, adapt: bool) -> int:
    from plait.commands.train import launch
    from plait.train.config import load_config

    overrides = ["plan.adapt=true"] if adapt else []
    return launch(str(config), load_config(config, overrides), overrides, nproc=NPROC, timeout_s=900)


def run_figures(log_dir: Path) -> dict:
    """The run's losses, the plan of each segment and the median step after each segment's warm-up."""
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    adapt = log_dir / "adapt.jsonl"
    switches = [json.loads(line) for line in adapt.read_text().splitlines()] if adapt.exists() else []
    switches = [d for d in switches if d["action"] == "switch"]
    start = (switches[-1]["step"] if switches else 0) + WARMUP
    steps = [r["step_time_s"] for r in rows if r["step"] > start]
    return {"losses": [r["loss"] for r in rows], "step_s": statistics.median(steps),
            "switch_step": switches[-1]["step"] if switches else None,
            "plan": json.loads((log_dir / "plan.json").read_text())}


def candidates(even: dict, adapted: dict, factor: float) -> list:
    """The plans to time: the even and adapted plans, and the planner's 3 best for every grouping of the ranks at
    their true speeds (plait.train.adapt.speed_view)."""
    from plait.plan import Plan
    from plait.search import plan as search
    from plait.search.space import divisors
    from plait.train.adapt import speed_view

    first, second = Plan.from_dict(even["plan"]), Plan.from_dict(adapted["plan"])
    speeds = [1.0] * NPROC
    speeds[SLOW_RANK] = factor
    found = [first, second]
    for size in divisors(NPROC):
        view = speed_view(first.cluster, first, speeds, [(r, size) for r in range(0, NPROC, size)])
        found += search(first.model, view, first.train, num_devices=NPROC, top=3)
    unique = {}
    for plan in found:
        unique.setdefault(plan.describe(), plan)
    return list(unique.values())


def time_candidates(plans: list, root: Path) -> list:
    from plait.runtime.launch import run_local
    from plait.profile.tune import read_results, write_plans

    plans_file, results_file = root / "candidates.json", root / "timed.json"
    write_plans(plans, plans_file)
    # one plan at a time (batch 1): a plan's step is its own, the slow rank's sleeps do not overlap another's
    code = run_local(NPROC, [str(plans_file), str(results_file), "--steps", str(TIMED_STEPS), "--warmup",
                             str(TIMED_WARMUP), "--batch", "1"], module="plait.profile.tune", timeout_s=1800)
    if code != 0:
        raise SystemExit(f"timing the candidates failed (exit {code})")
    return read_results(results_file)


def main(argv: list[str] | None = None) -> int:
    from rich.table import Table

    from plait.report.console import output_console

    args = parse_args(argv)
    os.environ["PLAIT_THROTTLE"] = f"rank={SLOW_RANK}:factor={args.factor:g}"
    os.environ.setdefault("PLAIT_OMP_THREADS", "1")
    if args.switch_cost is not None:
        os.environ["PLAIT_ADAPT_SWITCH_S"] = f"{args.switch_cost:g}"
    root = Path(tempfile.mkdtemp(prefix="plait-adapt-bench-"))
    runs = {"even": [], "adapted": []}
    timed: dict[str, list[float]] = {}
    plans = None
    for round_ in range(args.rounds):
        for name, adapt in (("even", False), ("adapted", True)):
            config = write_config(root, f"{name}-{round_}", args)
            if train(config, adapt) != 0:
                raise SystemExit(f"the {name} run failed")
            runs[name].append(run_figures(root / f"{name}-{round_}"))
        plans = plans or candidates(runs["even"][0], runs["adapted"][0], args.factor)
        for plan, result in zip(plans, time_candidates(plans, root)):
            timed.setdefault(plan.describe(), []).extend(result.step_times_s)

    medians = {label: statistics.median(times) for label, times in timed.items() if times}
    best = min(medians, key=medians.get)
    from plait.plan import Plan

    even_plan = Plan.from_dict(runs["even"][0]["plan"]).describe()
    adapted_plans = {Plan.from_dict(r["plan"]).describe() for r in runs["adapted"]}
    adapted_plan = Plan.from_dict(runs["adapted"][0]["plan"]).describe()
    differences = [max(abs(a - b) / abs(b) for a, b in zip(x["losses"], y["losses"]))
                   for x, y in zip(runs["adapted"], runs["even"])]

    console = output_console()
    table = Table(title=f"4 local ranks, rank {SLOW_RANK} throttled x{args.factor:g}; medians over {args.rounds} "
                        f"round(s) (a shared machine)", title_justify="left")
    for column in ("run", "plan", "train step s", "timed step s", "timed / best static"):
        table.add_column(column, justify="left" if column in ("run", "plan") else "right")
    switch_steps = [r["switch_step"] for r in runs["adapted"]]
    rows = [("even plan, no adaptation", even_plan, statistics.median(r["step_s"] for r in runs["even"])),
            (f"adapted (switched at step {', '.join(map(str, switch_steps))})", adapted_plan,
             statistics.median(r["step_s"] for r in runs["adapted"])),
            (f"best static (fastest of {len(medians)} timed)", best, None)]
    for run, label, train_step in rows:
        table.add_row(run, label, "-" if train_step is None else f"{train_step:.3f}", f"{medians[label]:.3f}",
                      f"{medians[label] / medians[best]:.2f}")
    console.print(table)
    listing = Table(title="every candidate, timed in one launch per round", title_justify="left")
    for column in ("plan", "timed step s"):
        listing.add_column(column, justify="left" if column == "plan" else "right")
    for label in sorted(medians, key=medians.get):
        listing.add_row(label, f"{medians[label]:.3f}")
    console.print(listing)
    ratio = medians[adapted_plan] / medians[best]
    print(f"adapted / best static = {ratio:.2f} (target <= 1.10: {'met' if ratio <= 1.10 else 'missed'}); adapted "
          f"plans over the rounds: {', '.join(sorted(adapted_plans))}")
    print(f"losses of the adapted runs against the runs without adaptation: largest relative difference "
          f"{max(differences):.1e} over {args.steps} steps")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": medians, "best": best, "even": even_plan,
                                               "adapted": adapted_plan, "ratio": ratio, "loss_differences": differences,
                                               "runs": {k: [{x: y for x, y in r.items() if x != "losses"} for r in v]
                                                        for k, v in runs.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
