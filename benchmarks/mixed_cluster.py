"""Does planning for a mixed cluster pay, measured? CPU processes stand in for examples/clusters/mixed-local.yaml,
one per core (`--nproc`, 2 by default): the first half is the "fast" group, the second half the "slow" one,
throttled to `--factor` (2) times their compute time (plait/runtime/throttle.py: a sleep after each block's
forward and backward as long as (factor - 1) times it).

One process per core matters: with more processes than cores, a sleeping slow rank hands its core to a fast one,
every plan then costs the same total CPU time, and the split no longer decides the step (measured: 4 processes on
2 cores ranked the even split first, though the balanced one is faster when every rank owns its core).

Three plans run on that same machine, in one launch, one step each per round in rotating order:

* balanced: plait's best plan for the mixed cluster (device groups placed, layers split by their speeds);
* even: the same plan with its layers split evenly (what a device-type-blind split does);
* blind: plait's best plan for a uniform cluster of the fast group's devices, run on the mixed machine.

The table gives the median step time (the slowest rank's, per step), the cost model's prediction, and each plan
against the balanced one, measured and predicted.

    .venv/bin/python benchmarks/mixed_cluster.py [--rounds 20] [--factor 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

from _ranks import add_worker_flag, run_on_ranks

CLUSTER = "examples/clusters/mixed-local.yaml"
WARMUP_STEPS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes, half fast and half slow (one per core)")
    parser.add_argument("--rounds", type=int, default=20, help="timed steps of each plan (one per round)")
    parser.add_argument("--factor", type=float, default=2.0, help="how many times slower the slow group computes")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    add_worker_flag(parser)
    return parser.parse_args(argv)


def plans(args: argparse.Namespace) -> dict[str, object]:
    from plait.search import plan as search
    from plait.search.explain import even_split
    from plait.spec import TrainSpec
    from plait.spec.load import load_cluster, load_model

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    mixed = load_cluster(os.path.join(root, CLUSTER))
    slow = mixed.group("slow")
    fast = mixed.group("fast")
    half = args.nproc // 2
    mixed = mixed.replace(groups=(dataclasses.replace(fast, num_devices=half),
                                  dataclasses.replace(slow, num_devices=half, slowdown=args.factor,
                                                      peak_flops=fast.peak_flops / args.factor)),
                          num_devices=args.nproc, oversubscription=max(1.0, args.nproc / (os.cpu_count() or 1)))
    model = load_model("tiny-gpt").replace(name="gpt-8x256", num_layers=args.layers, hidden_size=args.hidden,
                                           ffn_hidden_size=4 * args.hidden, num_heads=args.hidden // 64,
                                           num_kv_heads=args.hidden // 64, max_seq_len=args.seq_len)
    train = TrainSpec(global_batch=args.global_batch, seq_len=args.seq_len, precision="fp32")
    balanced = search(model, mixed, train, top=1)[0]
    out = {"balanced": balanced}
    even = even_split(model.num_layers, balanced.num_stages)
    if balanced.pp > 1 and even != balanced.layers_per_stage:
        out["even"] = balanced.replace(layers_per_stage=even, predicted=None)
    uniform = mixed.view("fast").with_devices(mixed.num_devices)
    blind = search(model, uniform, train, top=1)[0]
    if blind.pp > 1:  # its pipeline ranks in torchrun's order: the first half fast, the second slow
        block = mixed.num_devices // blind.pp
        ranks = [mixed.group_offsets()["slow"] <= r * block for r in range(blind.pp)]
        out["blind"] = blind.replace(cluster=mixed, stage_groups=tuple("slow" if s else "fast" for s in ranks),
                                     predicted=None)
    else:  # data or tensor parallelism over both groups: every step waits for the slow ranks
        out["blind"] = blind.replace(cluster=mixed.view("slow").with_devices(mixed.num_devices), predicted=None)
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from plait.cost import predict
    from plait.execute import batch_for_step, dp_shard, parallelize
    from plait.runtime.launch import init_distributed, shutdown_distributed

    rank, _ = init_distributed("gloo")
    chosen = plans(args)
    loops = {}
    for name, plan in chosen.items():
        model = parallelize(plan, seed=0, device="cpu")
        loops[name] = (plan, model, model.make_optimizer(lr=1e-3))
    batches = [batch_for_step(chosen["balanced"], 0, i) for i in range(4)]

    def step(name: str, i: int) -> None:
        plan, model, optimizer = loops[name]
        tokens, targets = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        model.train_step(dp_shard(plan, tokens, model.dp_rank), dp_shard(plan, targets, model.dp_rank))
        optimizer.step()

    for name in loops:
        for i in range(WARMUP_STEPS):
            step(name, i)
    times: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            dist.barrier()
            began = time.perf_counter()
            step(name, r)
            times[name].append(time.perf_counter() - began)
    for name, values in times.items():
        tensor = torch.tensor(values)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        times[name] = tensor.tolist()
    if rank == 0:
        report(args, {name: (plan, predict(plan).step_time_s) for name, plan in chosen.items()}, times)
    shutdown_distributed()


def report(args: argparse.Namespace, priced: dict[str, tuple], times: dict[str, list[float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from plait.report.tables import layers_cell

    measured = {name: statistics.median(values) for name, values in times.items()}
    half = args.nproc // 2
    table = Table(title=f"mixed cluster on {args.nproc} CPU processes (ranks {half}-{args.nproc - 1} throttled "
                        f"{args.factor:g}x), "
                        f"{args.layers}x{args.hidden} GPT, {args.global_batch}x{args.seq_len} tokens/step, "
                        f"{args.rounds} rounds, median of the slowest rank")
    for column in ("plan", "degrees", "layers/stage", "predicted", "measured", "vs balanced (predicted)",
                   "vs balanced (measured)"):
        table.add_column(column, justify="left" if column in ("plan", "degrees", "layers/stage") else "right")
    base_p, base_m = priced["balanced"][1], measured["balanced"]
    for name, (plan, predicted) in priced.items():
        table.add_row(name, f"dp{plan.dp} tp{plan.tp} pp{plan.pp} {plan.schedule if plan.pp > 1 else ''}".strip(),
                      layers_cell(plan), f"{predicted * 1e3:.0f} ms", f"{measured[name] * 1e3:.0f} ms",
                      f"{predicted / base_p:.2f}x", f"{measured[name] / base_m:.2f}x")
    Console(width=160).print(table)


def main() -> int:
    args = parse_args()
    if not args.worker and (args.nproc < 2 or args.nproc % 2):
        print(f"--nproc {args.nproc}: give an even number >= 2 (half fast, half slow)", file=sys.stderr)
        return 2
    if not args.worker:
        # the blind plan has no device groups: the throttle then comes from PLAIT_THROTTLE, on the slow group's ranks
        slow = ",".join(str(r) for r in range(args.nproc // 2, args.nproc))
        os.environ["PLAIT_THROTTLE"] = f"rank={slow}:factor={args.factor:g}"
    return run_on_ranks(args, worker, __file__)


if __name__ == "__main__":
    sys.exit(main())
