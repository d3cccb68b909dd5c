"""Prove that a plan computes what one process computes.

Runs K AdamW steps of the plan on plan.num_devices local ranks (or as a worker under
torchrun), then the same K steps on one process from the same seed and data, and prints
the per-step losses, their relative difference and the largest parameter difference.
Exit code 0 when both are within tolerance, 1 when not, 2 for a plan that cannot run here.

    plait plan --model tiny-gpt --cluster local-cpu --devices 4 --global-batch 8 --seq-len 64 --json plan.json
    plait check --plan plan.json --steps 3
    torchrun --nproc-per-node 4 -m plait check --plan plan.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from plait.errors import ConfigError, PlaitError

MAX_CHECK_PARAMS = 200_000_000
"""Largest model check will run: every rank (and the reference) holds full fp32 copies on this machine."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, metavar="FILE",
                        help="plan JSON (from `plait plan --json`, its best plan, or hand-written)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data (default 0)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                        help="also clip gradients to this global norm each step")
    parser.add_argument("--tol", type=float, default=1e-5,
                        help="largest relative loss difference accepted (default 1e-5, fp32)")
    parser.add_argument("--param-tol", type=float, default=5e-5,
                        help="largest absolute parameter difference accepted (default 5e-5)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="local processes to start (default and only accepted value: the plan's device count)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are stopped")
    parser.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="also write the result as JSON")
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)  # parent <- rank 0


def main(args: argparse.Namespace) -> int:
    from plait.launch import in_torchrun

    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be at least 1")
    if in_torchrun():
        return _worker(args)
    return _launch(args)


def _load(args: argparse.Namespace):
    from plait.plan import Plan

    plan = Plan.from_json(args.plan)
    if plan.model.num_params > MAX_CHECK_PARAMS:
        raise PlaitError(
            f"model {plan.model.name!r} has {plan.model.num_params / 1e6:,.0f}M parameters, too big to check on "
            f"this machine (limit {MAX_CHECK_PARAMS / 1e6:,.0f}M: every rank and the reference hold full fp32 "
            "copies); check the same plan shape with a small model such as tiny-gpt"
        )
    return plan


def _launch(args: argparse.Namespace) -> int:
    from plait.execute.parallelize import validate_plan
    from plait.launch import run_local

    plan = _load(args)
    if args.nproc is not None and args.nproc != plan.num_devices:
        raise ConfigError(f"--nproc {args.nproc} does not match the plan's dp={plan.dp} x tp={plan.tp} x "
                          f"pp={plan.pp} = {plan.num_devices} devices; drop --nproc or plan for {args.nproc}")
    validate_plan(plan, plan.num_devices)
    with tempfile.TemporaryDirectory(prefix="plait-check-") as tmp:
        result_file = Path(tmp) / "result.json"
        argv = _worker_argv(args, result_file)
        code = run_local(plan.num_devices, argv, timeout_s=args.timeout)
        if code != 0 or not result_file.exists():
            raise PlaitError(f"the parallel run of {plan.describe()!r} failed (exit code {code}); see the ranks' "
                             "messages above") if code != 0 else PlaitError("the ranks wrote no result")
        result = json.loads(result_file.read_text())
    return _report(plan, result, args)


def _worker_argv(args: argparse.Namespace, result_file: Path) -> list[str]:
    argv = ["check", "--plan", str(Path(args.plan).resolve()) if Path(args.plan).exists() else args.plan,
            "--steps", str(args.steps), "--seed", str(args.seed), "--lr", repr(args.lr),
            "--tol", repr(args.tol), "--param-tol", repr(args.param_tol), "--result-file", str(result_file)]
    if args.clip is not None:
        argv += ["--clip", repr(args.clip)]
    return argv


def _worker(args: argparse.Namespace) -> int:
    from plait.execute.equivalence import CheckSettings, check_plan
    from plait.launch import init_distributed, shutdown_distributed

    plan = _load(args)
    init_distributed(timeout_s=args.timeout)
    settings = CheckSettings(steps=args.steps, seed=args.seed, lr=args.lr, max_norm=args.clip)
    try:
        result = check_plan(plan, settings)
    finally:
        shutdown_distributed()
    if result is None:
        return 0
    payload = {"plan": result.plan, "losses": result.losses, "reference_losses": result.reference_losses,
               "loss_rel_diffs": result.loss_rel_diffs, "max_param_diff": result.max_param_diff,
               "worst_param": result.worst_param}
    if args.result_file:  # started by `plait check` itself: the parent prints the report
        Path(args.result_file).write_text(json.dumps(payload))
        return 0
    return _report(plan, payload, args)  # under torchrun: rank 0 prints, and its exit code says the verdict


def _report(plan, result: dict, args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"plait check: {result['plan']}  ({plan.num_devices} ranks vs 1 process, "
                        f"seed {args.seed}, lr {args.lr:g})")
    for column in ("step", "loss (parallel)", "loss (1 process)", "relative diff"):
        table.add_column(column, justify="right")
    for step, (ours, ref, rel) in enumerate(zip(result["losses"], result["reference_losses"],
                                                result["loss_rel_diffs"]), start=1):
        table.add_row(str(step), f"{ours:.7f}", f"{ref:.7f}", f"{rel:.2e}")
    console.print(table)
    max_rel = max(result["loss_rel_diffs"])
    console.print(f"largest parameter difference: {result['max_param_diff']:.2e} ({result['worst_param']})")
    ok = max_rel <= args.tol and result["max_param_diff"] <= args.param_tol
    verdict = "[green]EQUAL[/green]" if ok else "[red]DIFFERENT[/red]"
    console.print(f"{verdict}: loss diff {max_rel:.2e} (tol {args.tol:g}), "
                  f"parameter diff {result['max_param_diff']:.2e} (tol {args.param_tol:g})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**result, "passed": ok}, indent=2))
    return 0 if ok else 1
