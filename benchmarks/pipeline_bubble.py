"""How much of a pipeline step is idle? Measured against theory: the closed forms and plait's simulator.

A uniform GPT (equal layers per stage, a small embedding and output layer) is trained by
plait with pp = p ranks, m micro-batches, GPipe, 1F1B and the zero-bubble V schedules ZB-V
and DualPipeV (two stages per rank, each half the rank's layers). For each (schedule, m):

* T: the step time of the pipelined step (plait's ParallelModel.train_step);
* busy_r: the time rank r's pipeline stages spend in their forward, backward (input and
  weight gradients, split or not) during that step (see StageClock), as a fraction of T;
* measured bubble = 1 - mean_r(busy_r / T): everything that is not stage compute (schedule
  idle time, p2p transfers, the loss, launch overheads). Medians over the timed steps.

Theory with uniform stages, a backward twice the forward (F, B = 2F per stage):
* GPipe and 1F1B: (p - 1) / (m + p - 1) of the step (Narayanan et al. 2021 write it as
  (p - 1)/m relative to the ideal time; the same quantity).
* ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6) and DualPipeV (DeepSeek-V3's
  DualPipe folded onto p ranks, as torch's ScheduleDualPipeV runs it): the weight gradients fill
  every gap but the first forward's way down the V, (p - 1) chunk forwards of a step of
  m·2·(F + B) + (p - 1)·F per rank: (p - 1) / (6m + p - 1) (plait.cost.model.closed_form_makespan).
* sim: plait's own event simulation of the schedule's order (plait.cost.schedule.simulate),
  the figure the planner prices, on the same uniform stages.

    .venv/bin/python benchmarks/pipeline_bubble.py [--nproc 2] [--micro-batches 2 4 8 16] \
        [--schedules gpipe 1f1b interleaved zbv dualpipev] [--buffers pool torch]

`--buffers pool torch` times each configuration under both ways of holding the pipeline's receive buffers
(plait.execute.pipeline.PIPELINE_BUFFERS: plait's pool of what is in flight, torch's one per micro-batch), built
side by side in the same launch and stepped alternately (pool, torch, pool, ...), so that load on the machine
falls on both alike; a second table gives the ratio of their median step times.

On a machine with fewer cores than ranks the stages share cores while they run, which
stretches busy time and makes the bubble look smaller than it is; quote figures run with
--nproc no larger than the core count. Being a ratio within each step, the figure stands
up to other load on the machine better than absolute times do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

from _ranks import add_worker_flag, run_on_ranks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="pipeline degree p (one rank per stage)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "zbv", "dualpipev"])
    parser.add_argument("--layers-per-stage", type=int, default=2,
                        help="layers per rank (split in two stages of a V under zbv/dualpipev: keep it even)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--buffers", nargs="+", default=["pool"], choices=["pool", "torch"],
                        help="how the pipeline holds its receive buffers; both: timed alternately in one launch")
    add_worker_flag(parser)
    return parser.parse_args(argv)


def make_plan(args, schedule: str, num_micro_batches: int):
    from plait.plan import Plan
    from plait.spec import ModelSpec, TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    p, v = args.nproc, 2 if schedule in ("zbv", "dualpipev", "interleaved") else 1
    model = ModelSpec(name="uniform-gpt", arch="gpt", num_layers=args.layers_per_stage * p, hidden_size=args.hidden,
                      num_heads=args.hidden // 64, vocab_size=256, max_seq_len=args.seq_len)
    train = TrainSpec(global_batch=args.micro_batch * num_micro_batches, seq_len=args.seq_len, precision="fp32")
    return Plan.of(dp=1, tp=1, pp=p, micro_batch=args.micro_batch, num_micro_batches=num_micro_batches,
                schedule=schedule, interleave=v, layers_per_stage=(args.layers_per_stage // v,) * (p * v),
                model=model, train=train, cluster=CLUSTER_PRESETS["local-cpu"].with_devices(p))


class StageClock:
    """Sums the time this rank's PipelineStages spend computing inside the pipeline step: their forward, full
    backward, input-gradient and weight-gradient actions (torch's forward_one_chunk, backward_one_chunk,
    backward_weight_one_chunk, which every schedule calls; the transfers are separate actions), timed by
    wrapping them on the stage objects."""

    ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, schedule) -> None:
        self.busy = 0.0
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            for name in self.ACTIONS:
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, action):
        def run(*args, **kwargs):
            began = time.perf_counter()
            try:
                return action(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - began
        return run


def measure(models: list, tokens, targets, steps: int) -> list[tuple[float, float]]:
    """Per model, the median step time and median busy fraction of this rank over `steps` timed steps, the models
    stepped in turn."""
    import torch.distributed as dist

    clocks = [StageClock(model.schedule) for model in models]
    times: list[list[float]] = [[] for _ in models]
    fractions: list[list[float]] = [[] for _ in models]
    for i in range(steps + 1):  # the first step builds the schedule's buffers: not timed
        for model, clock, mine, busy in zip(models, clocks, times, fractions):
            dist.barrier()
            clock.busy = 0.0
            began = time.perf_counter()
            model.train_step(tokens, targets)
            elapsed = time.perf_counter() - began
            for p in model.parameters():
                p.grad = None
            if i:
                mine.append(elapsed)
                busy.append(clock.busy / elapsed)
    return [(statistics.median(t), statistics.median(f)) for t, f in zip(times, fractions)]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from plait import legality
    from plait.errors import ConfigError
    from plait.execute import parallelize
    from plait.runtime.launch import init_distributed

    # The first stage's inputs are token ids: its backward pre-hook fires at the output grads, as wanted.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    rank, world = init_distributed("gloo")
    rows = []
    for schedule in args.schedules:
        for m in args.micro_batches:
            plan = make_plan(args, schedule, m)
            try:
                legality.check(plan, world)  # e.g. 1F1B needs at least p micro-batches
            except ConfigError:
                continue
            models = [parallelize(plan, seed=0, device="cpu", pipeline_buffers=b) for b in args.buffers]
            tokens = torch.randint(0, 256, (args.micro_batch * m, args.seq_len),
                                   generator=torch.Generator().manual_seed(0))
            for buffers, (step, busy) in zip(args.buffers, measure(models, tokens, tokens.roll(-1, dims=1),
                                                                   args.steps)):
                gathered = [torch.zeros(2) for _ in range(world)]
                dist.all_gather(gathered, torch.tensor([step, busy]))
                rows.append((schedule, m, buffers, [tuple(t.tolist()) for t in gathered]))
            del models
    if rank == 0:
        report(args, rows)
    from plait.runtime.launch import shutdown_distributed

    shutdown_distributed()  # at a barrier: a rank closing its connections while another reads aborts it


def report(args: argparse.Namespace, rows) -> None:
    from rich.console import Console
    from rich.table import Table

    p = args.nproc
    table = Table(title=f"pipeline bubble: p={p}, {args.layers_per_stage} layers of h={args.hidden} per stage, "
                        f"micro-batch {args.micro_batch}x{args.seq_len}, median of {args.steps} steps")
    from plait.cost.schedule import simulate
    from plait.plan import V_SCHEDULES

    for column in ("schedule", "m", "buffers", "step T", "busy per rank", "measured bubble", "closed form", "sim",
                   "measured - closed form"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for schedule, m, buffers, per_rank in rows:
        step = statistics.median(t for t, _ in per_rank)
        busy = statistics.mean(b for _, b in per_rank)
        v = 2 if schedule in (*V_SCHEDULES, "interleaved") else 1
        if schedule in V_SCHEDULES:
            theory = (p - 1) / (6 * m + p - 1)
        else:  # GPipe and 1F1B (v = 1), interleaved with v chunks: (p - 1) / (v·m + p - 1)
            theory = (p - 1) / (v * m + p - 1)
        sim = simulate([1.0] * (p * v), [2.0] * (p * v), p, m, schedule).bubble_fraction
        table.add_row(schedule, str(m), buffers, f"{step * 1e3:.0f} ms", " ".join(f"{b:.0%}" for _, b in per_rank),
                      f"{1 - busy:.1%}", f"{theory:.1%}", f"{sim:.1%}", f"{(1 - busy) - theory:+.1%}")
    Console(width=150).print(table)
    if {"pool", "torch"} <= set(args.buffers):
        Console(width=150).print(buffers_table(rows))


def buffers_table(rows):
    """Per schedule and m: the median step time (the slowest rank's) under the pool and under torch's buffers."""
    from rich.table import Table

    steps = {(s, m, b): max(t for t, _ in per_rank) for s, m, b, per_rank in rows}
    table = Table(title="the pool against torch's buffers, same launch, stepped alternately (median step)")
    for column in ("schedule", "m", "pool", "torch", "pool / torch"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    ratios = []
    for (schedule, m, buffers), pool in steps.items():
        if buffers != "pool" or (schedule, m, "torch") not in steps:
            continue
        torch_step = steps[(schedule, m, "torch")]
        ratios.append(pool / torch_step)
        table.add_row(schedule, str(m), f"{pool * 1e3:.0f} ms", f"{torch_step * 1e3:.0f} ms",
                      f"{pool / torch_step:.3f}")
    if ratios:
        table.add_row("median", "", "", "", f"{statistics.median(ratios):.3f}")
    return table


def main() -> int:
    return run_on_ranks(parse_args(), worker, __file__)


if __name__ == "__main__":
    sys.exit(main())
