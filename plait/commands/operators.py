"""`plait plan --batch ...`: per-operator sharding of a module of any shape (plait.operators.planner).

  plait plan --model module:mlp:build --batch mlp:batch --cluster local-cpu --devices 2 --tp 2 \\
             --global-batch 4 --seq-len 1 --pin ups.0.weight=S0 --json plan.json

The model is `package.module:factory` (an nn.Module whose forward takes the batch and returns the loss), the
batch `package.module:function` (function(batch_size, generator) -> tuple of tensors); --seq-len is not used.
--pp N cuts pipeline stages between the module's repeated blocks (plait.operators.pipeline), with --schedule
gpipe or 1f1b and --micro-batch (default: pp micro-batches per step).
Prints the placements, the costliest operators with the communication they cause, and the prediction against
data parallelism alone; --json writes the plan that `plait check` runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from plait.errors import ConfigError
from plait.operators.solution import FUSED_OPTIMIZERS


def add_operator_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("per-operator sharding (a module of any shape)")
    group.add_argument("--batch", metavar="PKG.MOD:FN", default=None,
                       help="the module's batch factory, FN(batch_size, generator) -> tensors; with a "
                            "module:factory --model whose forward returns the loss, plans per operator")
    group.add_argument("--pin", action="append", default=[], metavar="NAME=PLACEMENT",
                       help="pin a parameter's or module output's placement on tp (R, S0, S1, ...; repeatable)")
    group.add_argument("--memory-budget", type=float, default=None, metavar="MIB",
                       help="bytes per device the plan may use, in MiB (default: the cluster's device memory)")
    group.add_argument("--table-optimizer", choices=FUSED_OPTIMIZERS, default=None,
                       help="train every nn.Embedding with this fused row-wise optimizer (its lookup's backward "
                            "updates the rows it touched: the table costs its weights alone); default: AdamW")
    group.add_argument("--operator-solver", choices=("program", "propagation"), default="program",
                       help="the integer program (default) or the propagation heuristic")


def parse_pins(items: list[str]) -> dict[str, str]:
    pins = {}
    for item in items:
        name, sep, placement = item.partition("=")
        if not sep or not name or not placement:
            raise ConfigError(f"--pin {item!r} must look like NAME=PLACEMENT, e.g. ups.0.weight=S0")
        name, placement = name.strip(), placement.strip()
        if pins.get(name, placement) != placement:
            raise ConfigError(f"pin {name!r} is given twice, as {pins[name]} and {placement}: they contradict; keep one")
        pins[name] = placement
    return pins


def _budget(mib: float | None) -> float | None:
    if mib is None:
        return None
    if not mib > 0:
        raise ConfigError(f"--memory-budget {mib:g} must be a positive number of MiB")
    return mib * 2**20


def plan_operators(args: argparse.Namespace) -> int:
    from plait.outputs import write_text
    from plait.report.console import output_console
    from plait.operators.planner import auto_plan
    from plait.spec.load import load_cluster

    cluster = load_cluster(args.cluster)
    devices = args.devices or cluster.num_devices
    tp, pp = args.tp or 1, args.pp or 1
    if devices % (tp * pp):
        raise ConfigError(f"--tp {tp} x --pp {pp} must divide --devices {devices}")
    dp = args.dp or devices // (tp * pp)
    if dp * tp * pp != devices:
        raise ConfigError(f"--dp {dp} x --tp {tp} x --pp {pp} = {dp * tp * pp} must equal --devices {devices}")
    micro_batches = None
    if args.micro_batch:
        if args.global_batch % (dp * args.micro_batch):
            raise ConfigError(f"--micro-batch {args.micro_batch} x dp {dp} must divide --global-batch "
                              f"{args.global_batch}")
        micro_batches = args.global_batch // (dp * args.micro_batch)
    plan = auto_plan(args.model, args.batch, cluster, global_batch=args.global_batch, dp=dp, tp=tp,
                     pins=parse_pins(args.pin), solver=args.operator_solver,
                     memory_limit=_budget(args.memory_budget), table_optimizer=args.table_optimizer, pp=pp,
                     num_micro_batches=micro_batches, schedule=args.schedule or "1f1b")
    console = output_console()
    from plait.report.operators import operators_table

    console.print(operators_table(plan))
    if args.json:
        from plait.execute.module_dryrun import dry_run_module

        dry_run_module(plan)  # a plan whose first step would crash is refused, never written
        write_text(args.json, json.dumps({"plans": [plan.to_dict()]}, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
