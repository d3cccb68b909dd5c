"""`plait check` of a plan across islands: the islands' run (torchft, a lighthouse, one launch per island) against
one process, by the same verdict as any plan (plait.execute.equivalence).

What is equal, and why only that: under "sync" the islands average every step's gradients, so any optimizer
(AdamW here, as for every plan) matches one process. Under "diloco" with H = 1, an outer SGD of learning rate 1 and no
momentum, the outer step sets the weights to the islands' average after one inner step each; that is one step on
the averaged gradient only for an inner optimizer linear in the gradient, so the check runs the inner steps with
SGD on both sides (AdamW's division by each island's own second moment is not linear: DiLoCo at H = 1 with AdamW
is not synchronous AdamW, and is not claimed to be). H > 1 differs from synchronous training by design:
benchmarks/islands.py measures how far.

The parent averages the islands' losses and first gradients (each over its own rows, equal in number): the
global batch's. The weights after the last step are island 0's (every island holds the same after an exchange).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any, Callable

from plait.errors import ConfigError, PlaitError
from plait.plan import Plan

ISLAND_RESULT = "island{}.pt"
WorkerArgv = Callable[[argparse.Namespace, Path], list[str]]
"""The check command's arguments for one rank writing its result to a file (plait.commands.check._worker_argv)."""


def refuse_unequal(plan: Plan, args: argparse.Namespace) -> None:
    islands = plan.islands
    if islands.method == "diloco" and islands.inner_steps != 1:
        raise ConfigError(f"the plan has H={islands.inner_steps}: `plait check` proves island plans at H = 1 (equal "
                          "to synchronous training); H > 1 differs by design, and benchmarks/islands.py measures how "
                          "far. Check the same plan with islands.inner_steps = 1")
    if islands.precision != "fp32":
        raise ConfigError(f"the plan sends {islands.precision} pseudo-gradients, which round them: check it with "
                          "islands.precision = \"fp32\"")
    if args.clip is not None and islands.method == "diloco":
        raise ConfigError("--clip: under DiLoCo each island clips its own gradient, which is not clipping their "
                          "average; check DiLoCo plans without it (sync plans clip the average)")


def launch_check(args: argparse.Namespace, plan: Plan, worker_argv: WorkerArgv) -> Any:
    """Start the lighthouse and the islands, run the reference here: the CheckResult of the comparison.
    `worker_argv(args, result_file)`: the check command's own arguments for a rank (plait.commands.check)."""
    import torch

    from plait.execute.equivalence import CheckSettings, ParallelRun, compare
    from plait.train.islands_launch import start_islands

    refuse_unequal(plan, args)
    with tempfile.TemporaryDirectory(prefix="plait-check-islands-") as tmp, start_islands() as islands:
        for island in range(plan.islands.count):
            islands.start(island, island_argv(args, island, Path(tmp), worker_argv))
        code = islands.wait(args.timeout)
        if code != 0:
            raise PlaitError(f"the islands' run of {plan.describe()!r} failed (exit code {code}); see the ranks' "
                             "messages above")
        results = [torch.load(Path(tmp) / ISLAND_RESULT.format(i), weights_only=True)
                   for i in range(plan.islands.count)]
    count = len(results)
    losses = [sum(r["losses"][k] for r in results) / count for k in range(args.steps)]
    grads = {name: sum(r["first_grads"][name] for r in results) / count for name in results[0]["first_grads"]}
    run = ParallelRun(losses, results[0]["norms"], grads, results[0]["params"],
                      {"islands": [r["link"] for r in results]})
    settings = CheckSettings(steps=args.steps, seed=args.seed, lr=args.lr, dtype=args.dtype, max_norm=args.clip,
                             optimizer=inner_optimizer(plan))
    return compare(plan, settings, run)


def inner_optimizer(plan: Plan) -> str:
    return "sgd" if plan.islands.method == "diloco" else "adamw"


def island_argv(args: argparse.Namespace, island: int, folder: Path, worker_argv: WorkerArgv) -> list[str]:
    return worker_argv(args, folder / ISLAND_RESULT.format(island)) + ["--island", str(island),
                                                                        "--timeout", repr(args.timeout)]


def island_launcher(args: argparse.Namespace, plan: Plan, worker_argv: WorkerArgv) -> int:
    """An island's own launcher: its ranks, on this machine."""
    from plait.runtime.launch import run_local

    argv = island_argv(args, args.island, Path(args.result_file).parent, worker_argv)
    return run_local(plan.island_plan().num_devices, argv, timeout_s=args.timeout)


def island_worker(args: argparse.Namespace, plan: Plan) -> int:
    """One rank of one island: the plan's inner steps with the exchange, then rank 0 writes what it saw."""
    import torch

    from plait.execute.batches import batch_for_step, dp_shard
    from plait.execute.equivalence import DTYPES
    from plait.execute.parallelize import parallelize
    from plait.runtime.launch import ending_together, init_distributed
    from plait.train.islands import IslandExchange, OuterSettings

    inner = plan.island_plan()
    init_distributed(inner.cluster.backend, timeout_s=args.timeout)
    with ending_together():
        model = parallelize(inner, seed=args.seed, precision="fp32", dtype=DTYPES[args.dtype])
        if inner_optimizer(plan) == "sgd":
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        else:
            optimizer = model.make_optimizer(lr=args.lr)
        exchange = IslandExchange(plan, args.island, model, optimizer,
                                  OuterSettings(lr=1.0, momentum=0.0, nesterov=False), timeout_s=args.timeout)
        losses: list[float] = []
        norms: list[float] = []
        first: dict[str, torch.Tensor] = {}
        rows = inner.train.global_batch
        for step in range(args.steps):
            tokens, targets = batch_for_step(plan, args.seed, step)
            mine = slice(args.island * rows, (args.island + 1) * rows)
            tokens, targets = (dp_shard(inner, t[mine], model.dp_rank) for t in (tokens, targets))

            def train_step(tokens=tokens, targets=targets, step=step) -> float:
                loss = model.train_step(tokens, targets)
                if step == 0:
                    first.update(model.full_gradients())
                return loss

            clip = (lambda: norms.append(float(model.clip_grad_norm_(args.clip)))) if args.clip else None
            loss, counted = exchange.step(train_step, clip=clip)
            if not counted:
                raise PlaitError(f"island {args.island}: step {step + 1} was not committed across islands")
            optimizer.zero_grad()
            losses.append(loss)
        params = model.full_state_dict()
        link = {"bytes_sent": exchange.counter.bytes_sent, "exchanges": exchange.counter.exchanges}
        exchange.close()
    if _rank() == 0:
        torch.save({"losses": losses, "norms": norms, "first_grads": {k: v.detach().cpu() for k, v in first.items()},
                    "params": {k: v.detach().cpu() for k, v in params.items()}, "link": link}, args.result_file)
    return 0


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


def describe_link(result: dict, args: argparse.Namespace) -> str:
    """What crossed the islands' link, and what the verdict means for an island plan."""
    islands = result["runtime"]["islands"]
    sent = sum(island["bytes_sent"] for island in islands)
    inner = "SGD" if "diloco" in result["plan"] else "AdamW"
    return (f"across {len(islands)} islands (torchft, one launch each): {sent / 1e6:.3g} MB sent by the islands' "
            f"rank 0 over {islands[0]['exchanges']} exchanges each; inner steps by {inner} on both sides"
            + (", the outer step SGD of lr 1 without momentum" if inner == "SGD" else ""))
