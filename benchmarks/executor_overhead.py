"""Does plait's executor cost anything over plain PyTorch? Step time of the same model, data and
steps under plait's data parallelism (DDP, ZeRO-0) and a hand-written DistributedDataParallel
loop, and under plait's FSDP (ZeRO-3) and a hand-written `fully_shard` loop.

The four runs alternate inside one launch, one step each per round, so that the noise of a
shared machine hits all of them alike; the table gives per-step medians over all rounds (the
slowest rank's time of each step) and the ratios plait / plain (target: within 5%, i.e.
ratio <= 1.05), and the same ratio of the fastest tenth of the steps.

    .venv/bin/python benchmarks/executor_overhead.py [--nproc 2] [--rounds 40]

Every step of every loop is the same work: forward + backward over the rank's rows in
`micro-batches` accumulation steps (gradient sync on the last only), global-norm clip, AdamW.
The plain loops clip as torchtitan does (`get_total_norm`, one reduction, `clip_grads_with_norm_`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _ranks import add_worker_flag, run_on_ranks

WARMUP_STEPS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40, help="timed steps of each run (one per round)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=2, help="accumulation steps per rank")
    parser.add_argument("--json", help="also write the medians to this file")
    add_worker_flag(parser)
    return parser.parse_args(argv)


# ---- the four loops (run inside each rank) ---------------------------------------------
def make_plan(args, zero: int):
    from plait.plan import Plan
    from plait.spec import ModelSpec, TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    model = ModelSpec(name="bench-gpt", arch="gpt", num_layers=args.layers, hidden_size=args.hidden,
                      num_heads=args.hidden // 64, vocab_size=256, max_seq_len=args.seq_len)
    train = TrainSpec(global_batch=args.global_batch, seq_len=args.seq_len, precision="fp32")
    rows = args.global_batch // args.nproc
    return Plan.of(dp=args.nproc, tp=1, pp=1, zero=zero, micro_batch=rows // args.micro_batches,
                num_micro_batches=args.micro_batches, model=model, train=train,
                cluster=CLUSTER_PRESETS["local-cpu"].with_devices(args.nproc))


class PlaitLoop:
    def __init__(self, plan, seed: int = 0) -> None:
        from plait.execute import parallelize

        self.model = parallelize(plan, seed=seed, device="cpu")
        self.optimizer = self.model.make_optimizer(lr=1e-3, weight_decay=0.1)

    def step(self, tokens, targets) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train_step(tokens, targets)
        self.model.clip_grad_norm_(1.0)
        self.optimizer.step()


class PlainLoop:
    """What a person writes by hand: the model wrapped by DDP or fully_shard, accumulation, clip, AdamW."""

    def __init__(self, plan, kind: str, seed: int = 0) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        from plait.models import build_model

        model = build_model(plan.model, device="cpu", seed=seed)
        if kind == "ddp":
            self.model = DistributedDataParallel(model)
        else:
            mesh = init_device_mesh("cpu", (plan.dp,))
            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
        self.kind, self.count = kind, plan.num_micro_batches
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)

    def step(self, tokens, targets) -> None:
        import torch
        import torch.nn.functional as F

        self.optimizer.zero_grad(set_to_none=True)
        for index, (tok, tgt) in enumerate(zip(tokens.chunk(self.count), targets.chunk(self.count))):
            last = index == self.count - 1
            if self.kind == "fsdp":
                self.model.set_requires_gradient_sync(last)
                context = torch.enable_grad()
            else:
                context = torch.enable_grad() if last else self.model.no_sync()
            with context:
                loss = F.cross_entropy(self.model(tok).flatten(0, 1), tgt.flatten()) / self.count
                loss.backward()
        clip_grad_norm(list(self.model.parameters()), 1.0)
        self.optimizer.step()


def clip_grad_norm(params, max_norm: float) -> None:
    """torchtitan's way: the total norm of (possibly sharded) gradients, one all-reduce, then scale."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    grads = [p.grad for p in params if p.grad is not None]
    total = get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # sums the shards' squared norms over the dp group
    clip_grads_with_norm_(params, max_norm, total)


def time_step(loop, batch) -> float:
    import torch.distributed as dist

    dist.barrier()  # every run starts its step together: no rank's lag is billed to the next run
    began = time.perf_counter()
    loop.step(*batch)
    return time.perf_counter() - began


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from plait.runtime.launch import init_distributed
    from plait.train.data import BatchLoader, load_tokens

    rank, world = init_distributed("gloo")
    torch.manual_seed(0)
    loader = BatchLoader(load_tokens("shipped"), global_batch=args.global_batch, seq_len=args.seq_len,
                         dp_rank=rank, dp_degree=world)
    batches = [loader.next_batch() for _ in range(4)]
    ddp_plan, fsdp_plan = make_plan(args, zero=0), make_plan(args, zero=3)
    loops = {"plait DP": PlaitLoop(ddp_plan), "plain DDP": PlainLoop(ddp_plan, "ddp"),
             "plait FSDP": PlaitLoop(fsdp_plan), "plain fully_shard": PlainLoop(fsdp_plan, "fsdp")}
    for name, loop in loops.items():
        for i in range(WARMUP_STEPS):
            time_step(loop, batches[i % len(batches)])
    times: dict[str, list[float]] = {name: [] for name in loops}
    # One step of each run per round, the order rotating: a burst of load from elsewhere on the
    # machine falls on all four runs alike instead of on whichever ran during it.
    names = list(loops)
    for round_index in range(args.rounds):
        batch = batches[round_index % len(batches)]
        for k in range(len(names)):
            name = names[(round_index + k) % len(names)]
            times[name].append(time_step(loops[name], batch))
    # The slowest rank sets the pace: take the max over ranks of each step.
    for name, values in times.items():
        tensor = torch.tensor(values)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        times[name] = tensor.tolist()
    if rank == 0:
        report(args, times)
    from plait.runtime.launch import shutdown_distributed

    shutdown_distributed()  # at a barrier: a rank closing its connections while another reads aborts it


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    medians = {name: statistics.median(values) for name, values in times.items()}
    table = Table(title=f"executor overhead: {args.nproc} ranks, gpt {args.layers}x{args.hidden}, "
                        f"{args.global_batch}x{args.seq_len} tokens/step, {args.micro_batches} micro-batches, "
                        f"{args.rounds} rounds")
    for column in ("run", "median step", "p10", "p90", "median ratio plait / plain", "p10 ratio"):
        table.add_column(column, justify="right" if column != "run" else "left")
    pairs = {"plait DP": "plain DDP", "plait FSDP": "plain fully_shard"}
    for name, values in times.items():
        deciles = statistics.quantiles(values, n=10)
        ratio = f"{medians[name] / medians[pairs[name]]:.3f}" if name in pairs else ""
        low_ratio = ""
        if name in pairs:  # the fastest tenth: the steps least disturbed by other load on the machine
            low_ratio = f"{deciles[0] / statistics.quantiles(times[pairs[name]], n=10)[0]:.3f}"
        table.add_row(name, f"{medians[name] * 1e3:.1f} ms", f"{deciles[0] * 1e3:.1f} ms",
                      f"{deciles[-1] * 1e3:.1f} ms", ratio, low_ratio)
    Console(width=120).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"medians_s": medians, "args": vars(args)}, indent=2))


def main() -> int:
    return run_on_ranks(parse_args(), worker, __file__)


if __name__ == "__main__":
    sys.exit(main())
