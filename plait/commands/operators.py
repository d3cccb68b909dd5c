"""`plait plan --batch ...`: per-operator sharding of a module of any shape (plait.operators.planner).

  plait plan --model module:mlp:build --batch mlp:batch --cluster local-cpu --devices 2 --tp 2 \\
             --global-batch 4 --seq-len 1 --pin ups.0.weight=S0 --json plan.json

The model is `package.module:factory` (an nn.Module whose forward takes the batch and returns the loss), the
batch `package.module:function` (function(batch_size, generator) -> tuple of tensors); --seq-len is not used.
--pp N cuts pipeline stages between the module's repeated blocks (plait.operators.pipeline), with --schedule
gpipe or 1f1b and --micro-batch (default: pp micro-batches per step). Without a pipeline --zero pins the ZeRO
stage, --recompute full recomputes every repeated block, --micro-batch accumulates gradients over the
micro-batches of a step; each is searched otherwise.
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


NOT_PER_OPERATOR = (
    ("cp", "context parallelism splits a decoder's sequences"),
    ("ep", "expert parallelism splits a mixture-of-experts decoder's experts"),
    ("context_parallel", "context parallelism splits a decoder's sequences"),
    ("interleave", "per-operator pipelines run one stage per pipeline rank"),
    ("sequence_parallel", "sequence parallelism splits a decoder's norms along its sequence"),
    ("router_imbalance", "it prices a mixture-of-experts decoder's router"),
    ("from_run", "it prices a mixture-of-experts decoder's router"),
    ("time_limit", "the per-operator search prices every shape"),
)
"""Flags of `plait plan` a per-operator plan (--batch) does not take, and why: refused, never ignored."""


def refuse_decoder_flags(args: argparse.Namespace) -> None:
    for name, why in NOT_PER_OPERATOR:
        if getattr(args, name, None) not in (None, False):
            raise ConfigError(f"--{name.replace('_', '-')} does not apply to a per-operator plan (--batch): {why}; "
                              f"leave it out")
    if getattr(args, "precision", None) not in (None, "fp32"):
        raise ConfigError(f"--precision {args.precision}: per-operator plans are priced and run in fp32; leave it out")
    if getattr(args, "solver", "auto") not in ("auto", "exact"):
        raise ConfigError(f"--solver {args.solver} searches decoders; per-operator plans take --operator-solver "
                          f"program or propagation")


def plan_operators(args: argparse.Namespace) -> int:
    from plait.operators.search import DegreePins, search
    from plait.spec.load import load_cluster

    refuse_decoder_flags(args)
    cluster = load_cluster(args.cluster)
    devices = args.devices or cluster.num_devices
    degrees = DegreePins(dp=args.dp, tp=args.tp, pp=args.pp, micro_batch=args.micro_batch, schedule=args.schedule,
                         zero=getattr(args, "zero", None), recompute=getattr(args, "recompute", None))
    result = search(args.model, args.batch, cluster, devices=devices, global_batch=args.global_batch,
                    degrees=degrees, pins=parse_pins(args.pin), solver=args.operator_solver,
                    memory_limit=_budget(args.memory_budget), table_optimizer=args.table_optimizer,
                    allow_cross_node_tp=bool(getattr(args, "allow_cross_node_tp", False)))
    print_search(result, args.top, devices, cluster)
    from plait.execute.module_dryrun import samples_note

    note = samples_note(result.plans[0])  # a loss over a call's own samples: how dp and micro-batches cut them
    if note:
        print(f"plait plan: note: {note}", file=sys.stderr)
    if args.json:
        from plait.execute.module_dryrun import runnable
        from plait.outputs import write_text

        written, failed = runnable(list(result.plans), args.top)  # a plan whose first step would crash: never written
        for reason in failed:
            print(f"plait plan: left out: {reason}", file=sys.stderr)
        document = {"plans": [plan.to_dict() for plan in written],
                    "search": {"candidates_evaluated": result.candidates_evaluated, "seconds": result.seconds}}
        write_text(args.json, json.dumps(document, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.report:
        from plait.report.operators import write_operator_report

        for png in write_operator_report(result, args.report):
            print(f"wrote {png}", file=sys.stderr)
    return 0


def print_search(result, top: int, devices: int, cluster) -> None:
    """The ranked plans, why #1 beats #2, #1's parts, the shapes that did not fit, then #1's placements."""
    from rich.text import Text

    from plait.report.console import output_console
    from plait.report.operators import operators_table, parts_line, ranked_table
    from plait.search.explain import explain

    console = output_console()
    plans = list(result.plans)
    best = plans[0]
    title = (f"{best.model.name} on {devices} x {cluster.name}, batch {best.train.global_batch}: top "
             f"{min(top, len(plans))} of {len(plans)} plans")
    console.print(ranked_table(plans[:top], title))
    if len(plans) >= 2:
        console.print(Text.assemble(("why #1 beats #2: ", "bold"), explain(plans[0], plans[1])))
    console.print(parts_line(best), highlight=False)
    if result.refused:
        shown = ", ".join(r.shape.describe() for r in result.refused[:4])
        more = f" and {len(result.refused) - 4} more" if len(result.refused) > 4 else ""
        console.print(f"{len(result.refused)} shapes refused ({shown}{more}): {result.refused[0].reason}",
                      highlight=False, style="dim")
    skipped = f", {result.dominated} pipeline shapes bounded out before their stages were solved" \
        if result.dominated else ""
    console.print(f"{result.candidates_evaluated} shapes priced per operator in {result.seconds:.1f} s "
                  f"({result.solver}{skipped})", highlight=False)
    console.print(operators_table(best))
