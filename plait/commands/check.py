"""Prove that a plan computes what one process computes -- or, with --dry-run, that the executor can build it.

Runs K AdamW steps of the plan on its dp·cp·tp·pp local ranks (or as a worker under torchrun), then the same K
steps on one process from the same weights and data, and prints per-step losses, the worst gradient and the
worst update. Exit code 0 when EQUAL, 1 when DIFFERENT, 2 for a plan that cannot run.

The verdict: both sides run float64 (--dtype), where the different order of a parallel run's sums leaves
~1e-15 of noise instead of fp32's ~1e-7, which AdamW magnifies into lr-sized differences wherever a gradient
is tiny. Compared: each step's loss (relative, --loss-tol), each parameter's gradient after the first
backward (relative to its norm, floored at a millionth of the whole gradient's, --grad-tol: a missing or
doubled reduction shows here as ~1e-1), and each parameter after K steps (in units of AdamW's full step,
lr per element per step, --update-tol). A correct plan measures ~1e-14 on plait's models and at most
~1e-7 on Hugging Face models (which compute norms in fp32 whatever the dtype).

--dry-run builds the plan without starting ranks, at any size: the legality rules, then the executor's
construction of one rank of every pipeline stage on `meta` under a fake process group of the plan's world
size; it prints each stage's parameter shards and the collectives of a step (traced for tensor parallelism,
counted for the rest). Exit 0 or 2.

    plait plan --model tiny-gpt --cluster local-cpu --devices 4 --global-batch 8 --seq-len 64 --json plan.json
    plait check --plan plan.json --steps 3
    plait check --plan plan.json --dry-run
    torchrun --nproc-per-node 4 -m plait check --plan plan.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from plait.errors import ConfigError, PlaitError
from plait.outputs import write_text

MAX_CHECK_PARAMS = 200_000_000
"""Largest model check will run: every rank (and the reference) holds full float64 copies on this machine."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, metavar="FILE",
                        help="plan JSON (from `plait plan --json`, its best plan, or hand-written)")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the plan on meta under a fake process group instead of running it (any size)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data (default 0)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                        help="also clip gradients to this global norm each step")
    parser.add_argument("--chat", action="store_true",
                        help="mask the targets as chat training does (prompt spans untrained, one window with no "
                             "answer), rows packing several conversations kept apart where the model does: proves "
                             "the loss is the step's token mean under the plan, and the documents' attention")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                        help="dtype of both runs (default float64, which makes the verdict decisive)")
    parser.add_argument("--loss-tol", type=float, default=None, help="largest relative loss difference "
                        "(default 1e-9 in float64, 1e-5 in float32)")
    parser.add_argument("--grad-tol", type=float, default=None, help="largest relative gradient difference per "
                        "parameter after step 1 (default 1e-5 in float64)")
    parser.add_argument("--update-tol", type=float, default=None, help="largest parameter difference after the "
                        "last step, in AdamW steps (lr per element per step; default 1e-5 in float64)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="local processes to start (default and only accepted value: the plan's device count)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are stopped")
    parser.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="also write the result as JSON")
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)  # parent <- rank 0
    parser.add_argument("--island", type=int, default=None, help=argparse.SUPPRESS)  # an island plan's island


def main(args: argparse.Namespace) -> int:
    from plait.runtime.launch import in_torchrun

    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be at least 1")
    if args.json_out:
        from plait.outputs import output_file

        output_file(args.json_out, "--json", "check.json")
    if args.dry_run:
        return _dry_run(args)
    if args.chat and _load(args, size_limit=False).operators is not None:
        raise ConfigError("--chat masks a decoder's token targets; a per-operator plan's model computes its own loss "
                          "from its own batch: drop --chat")
    if in_torchrun():
        return _worker(args)
    return _launch(args)


def _tolerance(args: argparse.Namespace):
    from plait.execute.equivalence import Tolerance

    base = Tolerance.for_dtype(args.dtype)
    return Tolerance(loss=args.loss_tol if args.loss_tol is not None else base.loss,
                     grad=args.grad_tol if args.grad_tol is not None else base.grad,
                     update=args.update_tol if args.update_tol is not None else base.update)


def _load(args: argparse.Namespace, size_limit: bool = True):
    from plait import legality
    from plait.plan import Plan

    plan = Plan.from_json(args.plan)
    if plan.operators is None:  # a per-operator plan's placements were checked by its solver, not these rules
        legality.check(plan.island_plan())  # across islands: what each island runs
    else:
        from plait.models.factory import use_import_roots

        plan.operators.check_stages(plan.pp)
        use_import_roots(plan.operators.import_paths)  # the module and batches, from any working directory
    if size_limit and plan.model.num_params > MAX_CHECK_PARAMS:
        raise PlaitError(
            f"model {plan.model.name!r} has {plan.model.num_params / 1e6:,.0f}M parameters, too big to check on "
            f"this machine (limit {MAX_CHECK_PARAMS / 1e6:,.0f}M: every rank and the reference hold full float64 "
            "copies); check the same plan shape with a small model such as tiny-gpt, or use --dry-run"
        )
    return plan


def _dry_run(args: argparse.Namespace) -> int:
    plan = _load(args, size_limit=False)  # before torch is imported: a malformed plan is refused at once
    if plan.operators is not None:
        return _dry_run_module(plan, args)
    from plait.execute.dryrun import dry_run
    from plait.report.console import output_console
    from plait.report.tables import dry_run_table

    reports = dry_run(plan.island_plan())  # across islands: what each island builds
    console = output_console()
    console.print(dry_run_table(plan, reports))
    console.print(f"[green]BUILDS[/green]: {plan.describe()} on {plan.num_devices:,} ranks "
                  f"(legality rules and the executor's construction of {len(reports)} pipeline rank(s) on meta)")
    if args.json_out:
        write_text(args.json_out, json.dumps({"plan": plan.describe(), "builds": True, "ranks": [
            {"pp_rank": r.pp_rank, "rank": r.rank, "stages": r.stages, "blocks": r.blocks, "params": r.params,
             "local_bytes": r.local_bytes, "full_bytes": r.full_bytes, "collectives": r.collectives}
            for r in reports]}, indent=2))
    return 0


def _dry_run_module(plan, args: argparse.Namespace) -> int:
    """A per-operator plan's first step, on the first rank of every pipeline stage, in this process
    (plait.execute.module_dryrun)."""
    from rich.table import Table

    from plait.execute.module_dryrun import dry_run_module
    from plait.report.console import output_console

    reports = dry_run_module(plan)
    console = output_console()
    table = Table(title=f"plait check --dry-run: {plan.describe()} per operator ({plan.operators.describe()})")
    for column in ("pipeline rank", "rank", "parameters", "local MiB", "whole MiB", "collectives of a micro-batch",
                   "tensors"):
        table.add_column(column, justify="right")
    for r in reports:
        table.add_row(str(r.pp_rank), str(r.rank), str(r.params), f"{r.local_bytes / 2**20:.2f}",
                      f"{r.full_bytes / 2**20:.2f}", ", ".join(f"{k} {v}" for k, v in sorted(r.collectives.items()))
                      or "none", r.device)
    console.print(table)
    console.print(f"[green]BUILDS[/green]: {plan.describe()} on {plan.num_devices:,} ranks (the executor's construction "
                  f"and one micro-batch's forward and backward, per pipeline rank, under a fake process group)")
    if args.json_out:
        write_text(args.json_out, json.dumps({"plan": plan.describe(), "builds": True, "ranks": [
            {"pp_rank": r.pp_rank, "rank": r.rank, "params": r.params, "local_bytes": r.local_bytes,
             "full_bytes": r.full_bytes, "collectives": r.collectives, "tensors": r.device} for r in reports]},
            indent=2))
    return 0


def _launch(args: argparse.Namespace) -> int:
    from plait.runtime.launch import run_local

    plan = _load(args)
    if plan.operators is not None:  # a plan whose first step would crash stops here, in one line
        import sys

        from plait.execute.module_dryrun import dry_run_module, refuse_off_cpu, samples_note

        refuse_off_cpu(plan)
        dry_run_module(plan)
        note = samples_note(plan)
        if note:
            print(f"plait check: note: {note}", file=sys.stderr, flush=True)
    if args.nproc is not None and args.nproc != plan.num_devices:
        raise ConfigError(f"--nproc {args.nproc} does not match the plan's {plan.degrees.describe()} = "
                          f"{plan.num_devices} devices; drop --nproc or plan for {args.nproc}")
    if plan.islands is not None:  # torchft across islands, one launch each (plait/train/islands_check.py)
        from plait.train.islands_check import island_launcher, launch_check

        if args.island is not None:
            return island_launcher(args, plan, _worker_argv)
        result = launch_check(args, plan, _worker_argv)
        return _report(plan, {**result.to_dict(), "failures": result.failures(_tolerance(args))}, args)
    with tempfile.TemporaryDirectory(prefix="plait-check-") as tmp:
        result_file = Path(tmp) / "result.json"
        code = run_local(plan.num_devices, _worker_argv(args, result_file), timeout_s=args.timeout)
        if code != 0:
            raise PlaitError(f"the parallel run of {plan.describe()!r} failed (exit code {code}); see the ranks' "
                             "messages above")
        if not result_file.exists():
            raise PlaitError("the ranks wrote no result")
        result = json.loads(result_file.read_text())
    return _report(plan, result, args)


def _worker_argv(args: argparse.Namespace, result_file: Path) -> list[str]:
    argv = ["check", "--plan", str(Path(args.plan).resolve()) if Path(args.plan).exists() else args.plan,
            "--steps", str(args.steps), "--seed", str(args.seed), "--lr", repr(args.lr), "--dtype", args.dtype,
            "--result-file", str(result_file)] + (["--chat"] if args.chat else [])
    for flag, value in (("--clip", args.clip), ("--loss-tol", args.loss_tol), ("--grad-tol", args.grad_tol),
                        ("--update-tol", args.update_tol)):
        if value is not None:
            argv += [flag, repr(value)]
    return argv


def _worker(args: argparse.Namespace) -> int:
    from plait.execute.equivalence import CheckSettings, check_plan
    from plait.runtime.launch import ending_together, init_distributed

    plan = _load(args)
    if plan.islands is not None:
        from plait.train.islands_check import island_worker

        return island_worker(args, plan)
    if plan.operators is not None:
        from plait.execute.operators import check_plan
    init_distributed(timeout_s=args.timeout)
    settings = CheckSettings(steps=args.steps, seed=args.seed, lr=args.lr, max_norm=args.clip, dtype=args.dtype,
                             chat=args.chat)
    with ending_together():
        result = check_plan(plan, settings)
    if result is None:
        return 0
    payload = {**result.to_dict(), "failures": result.failures(_tolerance(args))}
    if args.result_file:  # started by `plait check` itself: the parent prints the report
        Path(args.result_file).write_text(json.dumps(payload))
        return 0
    return _report(plan, payload, args)  # under torchrun: rank 0 prints, and its exit code says the verdict


def _report(plan, result: dict, args: argparse.Namespace) -> int:
    from rich.table import Table

    from plait.report.console import output_console

    tol = _tolerance(args)
    console = output_console()
    table = Table(title=f"plait check: {result['plan']}  ({plan.num_devices} ranks vs 1 process, {args.dtype}, "
                        f"seed {args.seed}, lr {args.lr:g}{', chat-masked targets' if args.chat else ''})")
    for column in ("step", "loss (parallel)", "loss (1 process)", "relative diff"):
        table.add_column(column, justify="right")
    for step, (ours, ref, rel) in enumerate(zip(result["losses"], result["reference_losses"],
                                                result["loss_rel_diffs"]), start=1):
        table.add_row(str(step), f"{ours:.12f}", f"{ref:.12f}", f"{rel:.1e}")
    console.print(table)
    grad_name, grad = result["worst_grad"]
    update_name, update = result["worst_update"]
    console.print(f"worst gradient after step 1: {grad:.1e} relative ({grad_name}); tolerance {tol.grad:g}",
                  highlight=False)
    console.print(f"worst parameter after step {args.steps}: {update:.1e} AdamW steps ({update_name}); "
                  f"tolerance {tol.update:g}", highlight=False)
    if result.get("runtime", {}).get("islands"):
        from plait.train.islands_check import describe_link

        console.print(describe_link(result, args), highlight=False)
    failures = result["failures"]
    verdict = "[green]EQUAL[/green]" if not failures else "[red]DIFFERENT[/red]: " + "; ".join(failures)
    console.print(verdict)
    if args.json_out:
        write_text(args.json_out, json.dumps({**result, "passed": not failures}, indent=2))
    return 0 if not failures else 1
