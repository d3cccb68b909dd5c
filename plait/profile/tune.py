"""Time candidate plans on the ranks in hand: the measuring half of `plait tune` (and of
benchmarks/local_accuracy.py).

Every rank runs the same plans in the same order, in one process group: one launch for all
candidates, since starting ranks costs seconds and a plan only a few steps. A plan's step is
forward + backward over the global batch + the optimizer step, timed from a barrier on every
rank; the step's time is the slowest rank's (a synchronous step goes at its pace), and the plan's
time the median over the timed steps after warm-up. Memory is the device's own peak
(CUDA max_memory_allocated) where it reports one; CPU processes share one allocator-less heap
whose resident size says little about one plan, so there it is not measured.

    python -m plait.profile.tune PLANS.json RESULTS.json [--steps 5] [--warmup 2]   # under torchrun / run_local
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from plait.plan import Plan


@dataclass(frozen=True, kw_only=True)
class TimingOptions:
    steps: int = 5
    """Timed steps per plan (the median is reported)."""
    warmup: int = 2
    """Untimed steps first: allocator, autograd graph and gloo connections warm up."""
    seed: int = 0
    lr: float = 1e-3
    batch: int = 8
    """Plans built and stepped round-robin together (see time_plans); 1 = one after another. On CUDA
    the measured memory peak of a batch covers all of its plans, so `plait tune` uses 1 there."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup < 0 or self.batch < 1:
            raise ValueError(f"steps={self.steps} and batch={self.batch} must be >= 1, warmup={self.warmup} >= 0")


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What one plan did on the ranks in hand."""

    label: str
    """plan.describe()"""
    step_times_s: tuple[float, ...] = ()
    """Each timed step, slowest rank."""
    peak_memory_bytes: float | None = None
    """Largest peak allocated memory of any rank (None where the device does not report it)."""
    error: str = ""
    """Why the plan was not timed ("" when it was)."""

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None


def time_plans(plans: Sequence[Plan], options: TimingOptions,
               progress: Callable[[int, Plan], None] | None = None) -> list[Measured]:
    """Collective: time every plan on this process group; every rank returns the same list.

    Plans are built `options.batch` at a time and stepped round-robin (one step of each in
    turn, `warmup + steps` times over): load from elsewhere on the machine then lands on all
    plans of a batch alike instead of on whichever plan happened to run during it, so their
    ratios stay right on a busy machine. A plan the executor refuses (ConfigError from its pure
    checks, the same on every rank) is reported with its reason instead of being timed; any
    other failure stops the run, as a half-failed collective would leave the other ranks waiting."""
    results: list[Measured | None] = [None] * len(plans)
    for start in range(0, len(plans), options.batch):
        indices = range(start, min(start + options.batch, len(plans)))
        runners = {}
        for i in indices:
            if progress is not None:
                progress(i, plans[i])
            problem = _refusal(plans[i])
            if problem:
                results[i] = Measured(label=plans[i].describe(), error=problem)
            else:
                runners[i] = _Runner(plans[i], options)
        for step in range(options.warmup, options.warmup + options.steps):
            for runner in runners.values():
                runner.step(step, timed=True)
        for i, runner in runners.items():
            results[i] = runner.finish()
        runners.clear()
        gc.collect()
    return [r for r in results if r is not None]


def _refusal(plan: Plan) -> str:
    import torch.distributed as dist

    from plait.errors import ConfigError
    from plait import legality

    try:
        legality.check(plan, dist.get_world_size())
    except ConfigError as e:
        return str(e)
    return ""


class _Runner:
    """One built plan: its model shard and optimizer on this rank, and the steps timed so far."""

    def __init__(self, plan: Plan, options: TimingOptions) -> None:
        import torch

        from plait.execute.parallelize import parallelize

        self.plan, self.options = plan, options
        self.model = parallelize(plan, seed=options.seed)
        self.optimizer = self.model.make_optimizer(lr=options.lr)
        self.cuda = self.model.device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.model.device)
        self.times: list[float] = []
        # Warm up at once, alone: first steps build DDP's buckets and autograd's caches, which
        # must not interleave with another plan's first steps.
        for step in range(options.warmup):
            self.step(step, timed=False)

    def step(self, step: int, timed: bool) -> None:
        from plait.execute.batches import batch_for_step, dp_shard

        plan, rank = self.plan, self.model.dp_rank
        tokens, targets = batch_for_step(plan, self.options.seed, step)
        seconds = _timed_step(self.model, self.optimizer, dp_shard(plan, tokens, rank), dp_shard(plan, targets, rank),
                              self.cuda)
        if timed:
            self.times.append(seconds)

    def finish(self) -> Measured:
        """Agree on the timings (slowest rank per step), read the memory peak, free the plan."""
        import torch

        device = self.model.device
        slowest = _max_over_ranks(self.times, device)
        memory = None
        if self.cuda:
            # with several plans alive the peak covers them all: a bound, reported as such by callers
            memory = _max_over_ranks([float(torch.cuda.max_memory_allocated(device))], device)[0]
        # The mesh and its process groups stay: plait.execute.mesh hands them to the next plan of the
        # same shape, so their number stays bounded by the shapes timed.
        del self.model, self.optimizer
        return Measured(label=self.plan.describe(), step_times_s=tuple(slowest), peak_memory_bytes=memory)


def time_plan(plan: Plan, options: TimingOptions) -> Measured:
    """Collective: build `plan`, run warm-up and timed steps, free it again."""
    return time_plans([plan], dataclasses.replace(options, batch=1))[0]


def _timed_step(model, optimizer, tokens, targets, cuda: bool) -> float:  # noqa: ANN001 (torch types: lazy)
    import torch
    import torch.distributed as dist

    dist.barrier()  # every rank starts the step together: the slowest rank's time is the step's
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.train_step(tokens, targets)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _max_over_ranks(values: list[float], device) -> list[float]:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def layouts_first(plans: Sequence[Plan]) -> list[Plan]:
    """`plans` (best first) reordered for `plait tune --top K`: the best of each (dp, tp, pp) layout,
    then the best of each (layout, micro-batch count) not yet taken, then the rest, each in rank order.

    Plans that differ only in ZeRO stage exercise the same cost terms, so the top K alone often
    cannot tell compute from communication; one per layout can, and a second micro-batch count per
    layout tells what every micro-batch costs (host time per layer pass) from what a step costs once."""
    keys = (lambda p: (p.dp, p.tp, p.pp), lambda p: (p.dp, p.tp, p.pp, p.num_micro_batches))
    chosen: list[Plan] = []
    taken: set[int] = set()
    for key in keys:
        seen = {key(p) for p in chosen}
        for plan in plans:
            if key(plan) not in seen and id(plan) not in taken:
                chosen.append(plan)
                seen.add(key(plan))
                taken.add(id(plan))
    return chosen + [p for p in plans if id(p) not in taken]


# ---- files between the launcher and the ranks -------------------------------------------------

def write_plans(plans: Sequence[Plan], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps({"plans": [p.to_dict() for p in plans]}))
    return path


def read_plans(path: str | Path) -> list[Plan]:
    return [Plan.from_dict(data) for data in json.loads(Path(path).read_text())["plans"]]


def write_results(results: Sequence[Measured], path: str | Path) -> Path:
    path = Path(path)
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps({"results": [dataclasses.asdict(r) for r in results]}, indent=1))
    temp.replace(path)
    return path


def read_results(path: str | Path) -> list[Measured]:
    rows = json.loads(Path(path).read_text())["results"]
    return [Measured(label=r["label"], step_times_s=tuple(r["step_times_s"]), peak_memory_bytes=r["peak_memory_bytes"],
                     error=r["error"]) for r in rows]


# ---- one rank of a timing run ------------------------------------------------------------------

def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of each rank (`python -m plait.profile.tune ...` under run_local or torchrun)."""
    parser = argparse.ArgumentParser(prog="python -m plait.profile.tune")
    parser.add_argument("plans", help="JSON file of plans to time ({'plans': [...]})")
    parser.add_argument("results", help="JSON file rank 0 writes the timings to")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=TimingOptions.batch, help="plans stepped round-robin together")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)

    from plait.runtime.launch import ending_together, init_distributed

    rank, _ = init_distributed(timeout_s=args.timeout)
    plans = read_plans(args.plans)
    with ending_together():
        results = time_plans(plans, TimingOptions(steps=args.steps, warmup=args.warmup, batch=args.batch),
                             progress=_printer(len(plans)) if rank == 0 else None)
        if rank == 0:
            write_results(results, args.results)
    return 0


def _printer(total: int) -> Callable[[int, Plan], None]:
    def show(index: int, plan: Plan) -> None:
        print(f"tune [{index + 1}/{total}] {plan.describe()}", file=sys.stderr, flush=True)
    return show


if __name__ == "__main__":
    from plait.runtime.launch import exit_rank

    exit_rank(worker_main())
