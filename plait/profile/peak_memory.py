"""A plan's peak memory per rank, by part, as PyTorch itself measures it: the measuring half of
benchmarks/memory_accuracy.py.

On CPU there is no allocator to ask, so the tensors are counted: `torch.distributed._tools`'
`MemTracker` (and `FSDPMemTracker` where data parallelism rides on fully_shard) follows every tensor
storage the step creates or touches and keeps the peak of their sum, by kind (parameters, gradients,
optimizer states, activations, temporaries, buffers). On CUDA the allocator's own
`torch.cuda.max_memory_allocated` gives the total and the tracker the parts.

What a tracker cannot see it is told about (`track_external`): tensors made before it started and
not reached through a module or the optimizer -- DDP's gradient buckets (read through a comm hook
that forwards to DDP's default all-reduce) and torch.distributed.pipelining's receive buffers, one
per micro-batch and direction, kept from the first step on.

The step measured is the third: the first creates the optimizer states and the schedules' buffers, and
DDP rebuilds its buckets in the second (a steady step holds all of them). Between micro-batches (gradient accumulation, or a pipeline schedule's
calls of its stage) the tracker's per-module statistics are reset, as MemTracker asks
("reset_mod_stats" between iterations); its global peak is not.

    python -m plait.profile.peak_memory PLANS.json RESULTS.json    # under torchrun / run_local
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from plait.plan import Plan

WARMUP_STEPS = 2
"""Steps before the measured one: the first creates the optimizer states and the pipeline schedules' buffers, and
DDP rebuilds its gradient buckets in the second (in the order gradients arrived in the first)."""
PARTS = ("params", "grads", "optimizer", "activations", "temporaries", "buffers")
"""The parts reported, each a sum of the trackers' reference types (TRACKER_PARTS)."""
TRACKER_PARTS = {
    "Parameter": "params", "Sharded Param": "params", "Unsharded Param": "params",
    "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "grads",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Inputs": "activations",
    "Temp": "temporaries", "All Gather": "temporaries", "Reduce Scatter": "temporaries",
    "Buffer": "buffers", "Other": "buffers",
}


@dataclass(frozen=True, kw_only=True)
class RankPeak:
    """One rank's peak: total bytes and the parts at that moment."""

    rank: int
    pp_rank: int
    total: float
    parts: dict[str, float] = field(default_factory=dict)


def _parts(snapshot: dict) -> tuple[float, dict[str, float]]:
    parts = dict.fromkeys(PARTS, 0.0)
    total = 0.0
    for device_snapshot in snapshot.values():
        for key, value in device_snapshot.items():
            name = str(getattr(key, "value", key))
            if name == "Total":
                total += value
            else:
                parts[TRACKER_PARTS.get(name, "buffers")] += value
    return total, parts


class _NoHook:
    """The hook handle of a parameter that has no hook (what the tracker removes when it exits)."""

    def remove(self) -> None:
        pass


def _tracker_class(fsdp: bool):
    """MemTracker (or FSDPMemTracker) that allows a module to be called again in one step: a schedule calls
    its stage once per micro-batch, and MemTracker refuses a second top-level call of a module it tracks
    unless its statistics are reset (they are per call; the global peak is kept)."""
    from plait.torch_internals import FSDPMemTracker, MemTracker

    base = FSDPMemTracker if fsdp else MemTracker

    class Tracker(base):
        def _forget_if_called_again(self, module) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]

        def _pre_fw_hook(self, module, inputs):  # MemTracker
            self._forget_if_called_again(module)
            return super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):  # MemTracker
            # a frozen parameter (a LoRA base) takes no gradient hook, and torch's tracker would install one
            for param in module.parameters():
                if not param.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(param, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _fsdp_state_pre_forward(self, fsdp_mod, orig):  # FSDPMemTracker
            wrapped = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def inner(*args, **kwargs):
                self._forget_if_called_again(fsdp_mod)
                return wrapped(*args, **kwargs)

            return inner

    return Tracker


def _root(parts):
    """One module over this rank's stages (FSDPMemTracker instruments the fully_shard units below a root)."""
    from torch import nn

    return parts[0] if len(parts) == 1 else nn.ModuleList(parts)


class _Buckets:
    """DDP's gradient buckets, read through a comm hook that does what DDP does without one."""

    def __init__(self) -> None:
        self.tensors: list = []

    def hook(self, group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if not any(t is bucket.buffer() for t in self.tensors):
            self.tensors.append(bucket.buffer())
        return allreduce_hook(group, bucket)


def _pipeline_buffers(model) -> list:
    """The pipeline's receive buffers: activations in and gradients in -- the pool's (plait/execute/buffers.py), or
    torch's own per micro-batch."""
    from plait.torch_internals import schedule_stages

    stages = schedule_stages(model.schedule) if model.schedule else []
    pools = getattr(model.schedule, "buffer_pools", None)
    out = pools.tensors() if pools is not None else []
    for stage in stages:
        for infos in list(stage.args_recv_info.values()) + list(stage.grad_recv_info.values()):
            out += [info.buffer for info in infos if getattr(info, "buffer", None) is not None]
    return out


def measure(plan: Plan, seed: int = 0) -> RankPeak:
    """Collective: build `plan`, run one step, then measure the peak of the second on this rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from plait.execute.batches import batch_for_step, dp_shard
    from plait.execute.parallelize import parallelize

    model = parallelize(plan, seed=seed)
    optimizer = model.make_optimizer(lr=1e-4)
    buckets = _Buckets()
    for part in model.model_parts:
        if isinstance(part, DistributedDataParallel):
            part.register_comm_hook(part.process_group, buckets.hook)

    def step(index: int) -> None:
        tokens, targets = batch_for_step(plan, seed, index)
        rank = model.dp_rank
        model.train_step(dp_shard(plan, tokens, rank), dp_shard(plan, targets, rank))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for index in range(WARMUP_STEPS):
        buckets.tensors.clear()  # DDP rebuilds its buckets in the second step's forward: keep the last ones
        step(index)
    gc.collect()
    fsdp = any(isinstance(p, FSDPModule) for p in model.model_parts)
    cuda = model.device.type == "cuda"
    tracker = _tracker_class(fsdp)(_root(model.model_parts), optimizer) if fsdp else _tracker_class(False)()
    if not fsdp:
        # ZeroRedundancyOptimizer keeps its shard's states in the optimizer it wraps
        tracker.track_external(*model.model_parts, optimizer, getattr(optimizer, "optim", None))
    for tensor in buckets.tensors + _pipeline_buffers(model):
        # not reached through a module or the optimizer: told about as buffers (MemTracker's "Other")
        tracker._update_and_maybe_create_winfos(tensor, tracker._ref_class.BUFFER)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(model.device)
    dist.barrier()
    with tracker:
        step(WARMUP_STEPS)
    total, parts = _parts(tracker.get_tracker_snapshot("peak"))
    if cuda:
        total = float(torch.cuda.max_memory_allocated(model.device))
    result = RankPeak(rank=dist.get_rank(), pp_rank=model.pp_rank, total=total, parts=parts)
    model = optimizer = tracker = None  # free them before the next measurement
    gc.collect()
    return result


def measure_all(plans: list[Plan], progress: bool = False) -> list[list[RankPeak]]:
    """Collective: every plan's peak on every rank (each rank returns the same nested list)."""
    import torch.distributed as dist

    out = []
    for i, plan in enumerate(plans):
        if progress and dist.get_rank() == 0:
            print(f"memory [{i + 1}/{len(plans)}] {plan.describe()} s={plan.train.seq_len}", file=sys.stderr, flush=True)
        mine = measure(plan)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, asdict(mine))
        out.append([RankPeak(**row) for row in gathered])
    return out


def worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plait.profile.peak_memory")
    parser.add_argument("plans", help="JSON file of plans ({'plans': [...]})")
    parser.add_argument("results", help="JSON file rank 0 writes the peaks to")
    args = parser.parse_args(argv)

    from plait.runtime.launch import ending_together, init_distributed
    from plait.profile.tune import read_plans

    rank, _ = init_distributed()
    with ending_together():
        results = measure_all(read_plans(args.plans), progress=True)
        if rank == 0:
            rows = [[asdict(r) for r in per_plan] for per_plan in results]
            Path(args.results).write_text(json.dumps({"results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    from plait.runtime.launch import exit_rank

    exit_rank(worker_main())
