"""How much of a pipeline step is idle? Measured against the textbook (p - 1) / (m + p - 1).

A uniform GPT (equal layers per stage, a small embedding and output layer) is trained by
plait with pp = p ranks, m micro-batches, GPipe and 1F1B. For each (schedule, m):

* T: the step time of the pipelined step (plait's ParallelModel.train_step);
* busy_r: the time rank r's stage module spends in its forward and backward during that
  step (module hooks, see BusyClock), as a fraction of T;
* measured bubble = 1 - mean_r(busy_r / T): everything that is not stage compute (schedule
  idle time, p2p transfers, the loss, launch overheads). Medians over the timed steps.

Theory for GPipe and 1F1B with uniform stages: bubble = (p - 1) / (m + p - 1) of the step
(Narayanan et al. 2021 write it as (p - 1)/m relative to the ideal time; the same quantity).

    .venv/bin/python benchmarks/pipeline_bubble.py [--nproc 2] [--micro-batches 2 4 8 16]

On a machine with fewer cores than ranks the stages share cores while they run, which
stretches busy time and makes the bubble look smaller than it is; quote figures run with
--nproc no larger than the core count. Being a ratio within each step, the figure stands
up to other load on the machine better than absolute times do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="pipeline degree p (one rank per stage)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
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
    return Plan.of(dp=1, tp=1, pp=p, micro_batch=args.micro_batch, num_micro_batches=num_micro_batches,
                schedule=schedule, layers_per_stage=(args.layers_per_stage,) * p, model=model, train=train,
                cluster=CLUSTER_PRESETS["local-cpu"].with_devices(p))


class BusyClock:
    """Sums the time this rank's stage spends computing inside the pipeline step.

    Forward: forward pre-hook to forward hook of the stage module. Backward: from the
    module's backward pre-hook (gradients of its outputs arrived) to the gradient of its
    first parameter being accumulated (the last one backward reaches); the small input-grad
    tail of a middle stage is not counted."""

    def __init__(self, stage) -> None:
        self.busy = 0.0
        self._began = 0.0
        first = next(p for p in stage.parameters())
        stage.register_forward_pre_hook(lambda *_: self._start())
        stage.register_forward_hook(lambda *_: self._stop())
        stage.register_full_backward_pre_hook(lambda *_: self._start())
        first.register_post_accumulate_grad_hook(lambda *_: self._stop())

    def _start(self) -> None:
        self._began = time.perf_counter()

    def _stop(self) -> None:
        self.busy += time.perf_counter() - self._began


def measure(model, tokens, targets, steps: int) -> tuple[float, float]:
    """Median step time and median busy fraction of this rank over `steps` timed steps."""
    import torch.distributed as dist

    clock = BusyClock(model.model_parts[0])
    times, fractions = [], []
    for i in range(steps + 1):  # the first step builds the schedule's buffers: not timed
        dist.barrier()
        clock.busy = 0.0
        began = time.perf_counter()
        model.train_step(tokens, targets)
        elapsed = time.perf_counter() - began
        for p in model.parameters():
            p.grad = None
        if i:
            times.append(elapsed)
            fractions.append(clock.busy / elapsed)
    return statistics.median(times), statistics.median(fractions)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from plait.execute import parallelize
    from plait.launch import init_distributed

    # The first stage's inputs are token ids: its backward pre-hook fires at the output grads, as wanted.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    rank, world = init_distributed("gloo")
    rows = []
    for schedule in args.schedules:
        for m in args.micro_batches:
            if schedule == "1f1b" and m < world:
                continue  # 1F1B needs at least p micro-batches
            plan = make_plan(args, schedule, m)
            model = parallelize(plan, seed=0, device="cpu")
            tokens = torch.randint(0, 256, (args.micro_batch * m, args.seq_len),
                                   generator=torch.Generator().manual_seed(0))
            step, busy = measure(model, tokens, tokens.roll(-1, dims=1), args.steps)
            gathered = [torch.zeros(2) for _ in range(world)]
            dist.all_gather(gathered, torch.tensor([step, busy]))
            rows.append((schedule, m, [tuple(t.tolist()) for t in gathered]))
    if rank == 0:
        report(args, rows)
    dist.destroy_process_group()


def report(args: argparse.Namespace, rows) -> None:
    from rich.console import Console
    from rich.table import Table

    p = args.nproc
    table = Table(title=f"pipeline bubble: p={p}, {args.layers_per_stage} layers of h={args.hidden} per stage, "
                        f"micro-batch {args.micro_batch}x{args.seq_len}, median of {args.steps} steps")
    for column in ("schedule", "m", "step T", "busy per rank", "measured bubble", "(p-1)/(m+p-1)", "difference"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for schedule, m, per_rank in rows:
        step = statistics.median(t for t, _ in per_rank)
        busy = statistics.mean(b for _, b in per_rank)
        theory = (p - 1) / (m + p - 1)
        table.add_row(schedule, str(m), f"{step * 1e3:.0f} ms", " ".join(f"{b:.0%}" for _, b in per_rank),
                      f"{1 - busy:.1%}", f"{theory:.1%}", f"{(1 - busy) - theory:+.1%}")
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
