"""How much of a pipeline step is idle? Measured against the textbook (p - 1) / (m + p - 1).

A uniform GPT (equal layers per stage, a small embedding and output layer) is trained by
plait with pp = p ranks, m micro-batches, GPipe and 1F1B. For each (schedule, m):

* T: the median step time of the pipelined step (plait's ParallelModel.train_step);
* t_r: the median time of rank r's stage alone, forward + backward of one micro-batch,
  measured with the ranks taking turns (so no stage shares a core with another while timed);
* busy fraction = m · mean_r(t_r) / T; measured bubble = 1 - busy, which counts everything
  that is not stage compute (schedule idle time, p2p transfers, launch overheads).

Theory for GPipe and 1F1B with uniform stages: bubble = (p - 1) / (m + p - 1) of the step
(Narayanan et al. 2021 write it as (p - 1)/m relative to the ideal time; the same quantity).

    .venv/bin/python benchmarks/pipeline_bubble.py [--nproc 2] [--micro-batches 2 4 8 16]

On a machine with fewer cores than ranks the stages share cores while they run, which
stretches busy time inside the pipeline and makes the bubble look smaller than it is; run
with --nproc no larger than the core count for figures to quote.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="pipeline degree p (one rank per stage)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_plan(args, schedule: str, num_micro_batches: int):
    from plait.plan import Plan
    from plait.spec import ModelSpec, TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    p = args.nproc
    model = ModelSpec(name="uniform-gpt", arch="gpt", num_layers=args.layers_per_stage * p, hidden_size=args.hidden,
                      num_heads=args.hidden // 64, vocab_size=256, max_seq_len=args.seq_len)
    train = TrainSpec(global_batch=args.micro_batch * num_micro_batches, seq_len=args.seq_len, precision="fp32")
    return Plan(dp=1, tp=1, pp=p, micro_batch=args.micro_batch, num_micro_batches=num_micro_batches,
                schedule=schedule, layers_per_stage=(args.layers_per_stage,) * p, model=model, train=train,
                cluster=CLUSTER_PRESETS["local-cpu"].with_devices(p))


def median_step_time(model, tokens, targets, steps: int) -> float:
    import torch.distributed as dist

    times = []
    for i in range(steps + 1):  # the first step builds the schedule's buffers: not timed
        dist.barrier()
        began = time.perf_counter()
        model.train_step(tokens, targets)
        for p in model.parameters():
            p.grad = None
        if i:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def stage_time(model, args, reps: int = 5) -> float:
    """Forward + backward of this rank's stage on one micro-batch, alone (the ranks take turns)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    stage = model.model_parts[0]
    b, s, h = args.micro_batch, args.seq_len, args.hidden
    if model.has_first_stage:
        make_input = lambda: torch.randint(0, 256, (b, s))  # noqa: E731
    else:
        make_input = lambda: torch.randn(b, s, h, requires_grad=True)  # noqa: E731 (input grads are computed too)
    targets = torch.randint(0, 256, (b, s))
    mine = 0.0
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn != dist.get_rank():
            continue
        times = []
        for _ in range(reps + 1):
            x = make_input()
            began = time.perf_counter()
            out = stage(x)
            loss = F.cross_entropy(out.flatten(0, 1), targets.flatten()) if model.has_last_stage else out.square().mean()
            loss.backward()
            times.append(time.perf_counter() - began)
        for p in stage.parameters():
            p.grad = None
        mine = statistics.median(times[1:])
    dist.barrier()
    return mine


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from plait.execute import parallelize
    from plait.launch import init_distributed

    rank, world = init_distributed("gloo")
    rows = []
    for schedule in args.schedules:
        for m in args.micro_batches:
            if schedule == "1f1b" and m < world:
                continue  # 1F1B needs at least p micro-batches
            plan = make_plan(args, schedule, m)
            model = parallelize(plan, seed=0, device="cpu")
            tokens = torch.randint(0, 256, (args.micro_batch * m, args.seq_len), generator=torch.Generator().manual_seed(0))
            step = median_step_time(model, tokens, tokens.roll(-1, dims=1), args.steps)
            stage = torch.tensor([stage_time(model, args)])
            gathered = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(gathered, stage)
            rows.append((schedule, m, step, [t.item() for t in gathered]))
    if rank == 0:
        report(args, rows)
    dist.destroy_process_group()


def report(args: argparse.Namespace, rows) -> None:
    from rich.console import Console
    from rich.table import Table

    p = args.nproc
    table = Table(title=f"pipeline bubble: p={p}, {args.layers_per_stage} layers of h={args.hidden} per stage, "
                        f"micro-batch {args.micro_batch}x{args.seq_len}")
    for column in ("schedule", "m", "step T", "stage fwd+bwd t (per rank)", "busy m·t/T",
                   "measured bubble", "(p-1)/(m+p-1)", "difference"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for schedule, m, step, stage_times in rows:
        busy = m * statistics.mean(stage_times) / step
        theory = (p - 1) / (m + p - 1)
        table.add_row(schedule, str(m), f"{step * 1e3:.0f} ms", " ".join(f"{t * 1e3:.0f}" for t in stage_times) + " ms",
                      f"{busy:.1%}", f"{1 - busy:.1%}", f"{theory:.1%}", f"{(1 - busy) - theory:+.1%}")
    Console(width=140).print(table)


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    from plait.launch import run_local

    return run_local(args.nproc, [os.path.abspath(__file__), "--worker", *sys.argv[1:]], module=None)


if __name__ == "__main__":
    sys.exit(main())
