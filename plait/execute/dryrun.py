"""`plait check --dry-run`: validate a plan of any size against the executor without starting ranks.

The legality rules first (plait.legality); then, for one rank of every pipeline stage, the executor's
real construction in this one process: a `fake` process group of the plan's world size (torch builds
meshes of any size on it), the model built on `meta` by its adapter, the pipeline split, then
`parallelize`'s own shard_stage (tensor parallelism, activation checkpointing, fully_shard: one order for
both). A per-operator plan's dry run is plait.execute.module_dryrun. One
micro-batch's forward and backward through the tensor-parallel stage is traced on `meta` under
`CollectiveCounter`, which counts the collectives DTensor issues; what fully_shard, DDP and the pipeline
schedule add is one message per unit per step (or per micro-batch) and is counted from the plan.

Nothing is materialized: a 175B-parameter model on 1,024 ranks checks in seconds.
"""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from plait.torch_internals import HigherOrderOperator, TorchDispatchMode

from plait import legality
from plait.cost.operators import COLLECTIVES
from plait.plan import Plan

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = COLLECTIVES
COLLECTIVE_NAMES = {
    "all_reduce": ALL_REDUCE, "allreduce_": ALL_REDUCE, "all_reduce_coalesced": ALL_REDUCE,
    "allreduce_coalesced_": ALL_REDUCE,
    "all_gather_into_tensor": ALL_GATHER, "_allgather_base_": ALL_GATHER, "allgather_": ALL_GATHER,
    "all_gather_into_tensor_coalesced": ALL_GATHER,
    "reduce_scatter_tensor": REDUCE_SCATTER, "_reduce_scatter_base_": REDUCE_SCATTER, "reduce_scatter_": REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": REDUCE_SCATTER,
    "all_to_all_single": ALL_TO_ALL, "alltoall_base_": ALL_TO_ALL, "alltoall_": ALL_TO_ALL,
    "shard_dim_alltoall": ALL_TO_ALL,
    "broadcast": "broadcast", "broadcast_": "broadcast",
}
"""torch's collective operators -> their kind, named as the cost model names what plans count
(plait.cost.operators.COLLECTIVES), and broadcast."""
COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d", "_dtensor")
"""Where torch's collectives live as operators (functional, autograd-functional, in-place c10d, DTensor's own)."""


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives DTensor issues while active (its redistributions, forward and backward, explicit or
    inside its op dispatch), by kind (COLLECTIVE_NAMES, operators of COLLECTIVE_NAMESPACES), and their
    bytes: the whole tensor a collective produces (all-gather) or reduces (a shard for all-to-all). The dry run's
    and the per-operator executor's counts both come from here. torch's CommDebugMode counts the same but also
    tracks modules, and its tracker fails (an empty parent list) on a Hugging Face stage, whose class forward runs
    stub layers; counting needs no module tracking."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.nbytes = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower the call into local ops and collectives first
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        kind = COLLECTIVE_NAMES.get(name)
        if kind is not None and func.namespace in COLLECTIVE_NAMESPACES:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            tensor = out if "gather" in name else args[0]
            if kind == "broadcast" and isinstance(tensor, (list, tuple)) and tensor:  # c10d's in-place form
                tensor = tensor[0]
            if isinstance(tensor, torch.Tensor):
                self.nbytes += tensor.numel() * tensor.element_size()
        return out


@dataclass
class StageReport:
    """What one rank of pipeline rank `pp_rank` holds and sends."""

    pp_rank: int
    rank: int
    stages: list[int]
    blocks: list[int]
    params: int = 0
    """Parameter tensors."""
    local_bytes: float = 0.0
    """Bytes of this rank's parameter shards (the plan's dtype)."""
    full_bytes: float = 0.0
    """Bytes of the same parameters unsharded."""
    shards: list[tuple[str, tuple[int, ...], tuple[int, ...], str]] = field(default_factory=list)
    """(name, global shape, local shape, placements) of every parameter."""
    collectives: dict[str, int] = field(default_factory=dict)
    """Per step: "tp all_gather": count, ... (traced for tensor parallelism, counted for the rest)."""


def _trace_tensor_parallel(plan: Plan, parts: list, pp_rank: int) -> dict[str, int]:
    """Collectives of one micro-batch's forward and backward through this rank's stages (meta tensors)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    counts: dict[str, int] = {}
    if plan.tp == 1:
        return counts
    b, s, h = plan.micro_batch, plan.train.seq_len // plan.cp, plan.model.hidden_size
    for part in parts:
        if part.first:
            x = torch.zeros(b, s, dtype=torch.long, device="meta")
        else:
            x = torch.zeros(b, s // plan.tp if plan.sequence_parallel else s, h, device="meta", requires_grad=True)
        with CollectiveCounter() as comm, (loss_parallel() if part.last else nullcontext()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a first stage's token input has no gradient: backward hooks say so
            out = part(x)
            if part.last:
                targets = torch.zeros(b, s, dtype=torch.long, device="meta")
                loss = part.adapter.loss(out, targets)
            else:
                loss = (out.to_local() if isinstance(out, DTensor) else out).sum()
            loss.backward()
        for name, n in comm.counts.items():
            counts[f"tp {name}"] = counts.get(f"tp {name}", 0) + n * plan.num_micro_batches
    return counts


def _counted(plan: Plan, report: StageReport) -> dict[str, int]:
    """Collectives the plan implies beyond tensor parallelism, per step."""
    out: dict[str, int] = {}
    mode, m = plan.dp_mode, plan.num_micro_batches
    units = len(report.blocks) + len(report.stages)  # one fully_shard unit per block and one per stage root
    if mode.carrier == "fully_shard":
        gathers = units * (2 * m if mode.reshard_after_forward else 1)
        out["dp all_gather"] = gathers
        out["dp reduce_scatter"] = units
    elif mode.carrier == "ddp":
        out["dp all_reduce (DDP buckets)"] = max(1, math.ceil(report.full_bytes / (25 * 2**20)))
        if plan.zero == 1:
            out["dp broadcast (ZeRO-1 shards)"] = plan.dp
    if plan.pp > 1:
        sends = 2 * m * len(report.stages)
        out["pp send/recv"] = sends - (m if 0 in report.stages else 0) - (m if plan.num_stages - 1 in report.stages else 0)
        if plan.model.tied_embeddings and (0 in report.stages or plan.num_stages - 1 in report.stages):
            out["pp all_reduce (tied embedding)"] = 1
    return out


def dry_run(plan: Plan, pp_ranks: list[int] | None = None) -> list[StageReport]:
    """Construct the plan's stages as rank (pp, 0, 0, 0) of each pipeline rank sees them; raises IllegalPlan
    (a ConfigError) for a plan that breaks a rule, and whatever the executor raises for one it cannot build."""
    from plait.torch_internals import FakeStore

    from plait.execute.mesh import build_mesh, forget_meshes
    from plait.execute.parallelize import default_dtype, shard_stage
    from plait.execute.pipeline import split_model
    from plait.execute.state import plain_named_parameters
    from plait.models import adapter_for

    legality.check(plan)
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group (it starts a fake one)")
    adapter = adapter_for(plan.model)
    dtype = torch.float32 if plan.train.precision == "fp32" else torch.bfloat16
    reports = []
    for pp_rank in (range(plan.pp) if pp_ranks is None else pp_ranks):
        rank = pp_rank * plan.degrees.stride("pp")
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.num_devices)
        try:
            mesh = build_mesh(plan.degrees, "cpu")
            with default_dtype(dtype):
                stage_ids, parts = split_model(adapter, adapter.build_adapted("meta"), plan, pp_rank)
            report = StageReport(pp_rank=pp_rank, rank=rank, stages=stage_ids,
                                 blocks=[i for part in parts for i in part.block_ids])

            def trace(part, report=report, pp_rank=pp_rank) -> None:  # the stage's TP collectives, before fully_shard
                for name, n in _trace_tensor_parallel(plan, [part], pp_rank).items():
                    report.collectives[name] = report.collectives.get(name, 0) + n

            # the executor's own order of techniques (parallelize.shard_stage), traced in between
            parts = [shard_stage(part, plan, mesh, pp_rank, None, before_data_parallel=trace) for part in parts]
            for part in parts:
                for name, param in plain_named_parameters(part):
                    local = param.to_local() if hasattr(param, "to_local") else param
                    placements = ",".join(str(p) for p in getattr(param, "placements", ())) or "whole"
                    report.shards.append((name, tuple(param.shape), tuple(local.shape), placements))
                    report.params += 1
                    report.local_bytes += local.numel() * local.element_size()
                    report.full_bytes += param.numel() * local.element_size()
            report.collectives.update(_counted(plan, report))
            reports.append(report)
        finally:
            dist.destroy_process_group()
            forget_meshes()
    return reports
