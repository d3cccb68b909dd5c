"""apply_dp: data parallelism over the mesh's data-parallel ranks -- DDP, ZeRO-1, ZeRO-2, ZeRO-3/FSDP.

Which PyTorch building block carries each ZeRO stage (Rajbhandari et al. 2020); the choice itself is
one rule, plait.legality.data_parallel_mode, which the cost model reads too:

* zero 0: `DistributedDataParallel` (bucketed gradient all-reduce overlapped with backward);
* zero 1: DDP plus `ZeroRedundancyOptimizer` (each dp rank keeps and updates the AdamW states of its
  share of the parameters, then broadcasts them);
* zero 2: `fully_shard(reshard_after_forward=False)`: gradients and optimizer states sharded
  (reduce-scatter), parameters gathered once per step and kept through backward;
* zero 3: `fully_shard(reshard_after_forward=True)`: parameters too are re-gathered for backward --
  except under pipelining (see the rule).

Where DDP cannot carry zero 0/1 (tensor or context parallelism, a pipeline) they ride on
`fully_shard(reshard_after_forward=False)`: the same numerics, memory at least as low. Wrapping is per
block and then the stage root, so each block's parameters are gathered (or its gradients reduced) as
one unit, overlapping with the neighbours.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Shard
from plait.torch_internals import StridedShard
from torch.nn.parallel import DistributedDataParallel

from plait.execute.lora import trainable
from plait.legality import DataParallelMode


def unshardable(stage: nn.Module) -> set[nn.Parameter]:
    """Parameters fully_shard cannot shard further: a packed projection's bias split over tp (GPT-2's q|k|v,
    an _StridedShard on dim 0, which fully_shard's dim-0 shard would compose with into a layout DTensor cannot
    place). They stay whole on every dp rank; ReplicatedGradients averages their gradients."""
    from plait.execute.state import clean_name

    experts = getattr(stage, "expert_params", set())  # their own units (apply_fsdp)
    return {p for name, p in stage.named_parameters() if isinstance(p, DTensor) and clean_name(name) not in experts
            and any(isinstance(pl, StridedShard) and pl.dim == 0 for pl in p.placements)}


def apply_fsdp(stage: nn.Module, dp_mesh: DeviceMesh, *, reshard_after_forward: bool,
               mp_policy: MixedPrecisionPolicy | None, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """fully_shard every block, then the stage root, over `dp_mesh`. Experts split by expert or tensor parallelism
    (plait/execute/expert.py) are their own units over `expert_mesh`, the ranks holding copies of the same experts
    (torchtitan's FSDP over "dp_mod_ep"): sharded along their hidden width, the one dimension expert and tensor
    parallelism leave whole, and their reduce-scatter divided by all of `dp_mesh`, whose every rank's tokens each
    copy has seen. Where `expert_mesh` has one rank they stay out (ReplicatedGradients divides them)."""
    from plait.execute.state import clean_name

    ignored = unshardable(stage) | other_dtype(stage)
    # names, not objects: to_empty replaces the parameter objects
    stage.dp_replicated = {clean_name(name) for name, p in stage.named_parameters() if p in ignored}
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    experts = getattr(stage, "expert_params", set())
    stage.experts_replicated = set()
    if experts and expert_mesh is not None and expert_mesh.size() > 1:
        for module in stage.expert_modules:
            fully_shard(module, mesh=expert_mesh, shard_placement_fn=_hidden_width(module), **kwargs)
            module.set_gradient_divide_factor(float(dp_mesh.size()))
            # a sum, then the division: the factor would otherwise ride on PREMUL_SUM, which gloo does not have
            module.set_force_sum_reduction_for_comms(True)
    elif experts:
        stage.experts_replicated = set(experts)
        ignored |= {p for name, p in stage.named_parameters() if clean_name(name) in experts}
    for block in stage.stage_blocks().values():
        fully_shard(block, mesh=dp_mesh, ignored_params=ignored or None, **kwargs)
    fully_shard(stage, mesh=dp_mesh, ignored_params=ignored or None, **kwargs)
    return stage


def other_dtype(stage: nn.Module) -> set[nn.Parameter]:
    """Parameters of a block whose dtype is not most of the block's (transformers' routers, attention sinks and
    routing biases kept in float32 whatever the model's dtype: DeepSeek-V3, GPT-OSS-like sinks, AFMoE): fully_shard
    wants one dtype per unit, so they stay whole on every dp rank; ReplicatedGradients averages their gradients."""
    out: set[nn.Parameter] = set()
    for block in stage.stage_blocks().values():
        dtypes = [p.dtype for p in block.parameters()]
        if len(set(dtypes)) > 1:
            main = max(set(dtypes), key=dtypes.count)
            out |= {p for p in block.parameters() if p.dtype != main}
    return out


def _hidden_width(experts: nn.Module):
    """fully_shard's placement for each expert weight: along its width h (plait.models.moe.Experts.HIDDEN_DIM)."""
    dims = {id(param): experts.HIDDEN_DIM[name] for name, param in experts.named_parameters(recurse=False)}
    return lambda param: Shard(dims[id(param)])


def apply_ddp(module: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    # init_sync=False: every rank already holds the same initial weights (plait loads them
    # from the same seed), so the initial broadcast would only cost time.
    return DistributedDataParallel(module, process_group=dp_mesh.get_group(), init_sync=False)


def apply_fully_shard(stage: nn.Module, dp_mesh: DeviceMesh, mode: DataParallelMode,
                      mp_policy: MixedPrecisionPolicy | None = None, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard one meta stage for data parallelism when its mode rides on fully_shard (before materializing)."""
    if mode.carrier != "fully_shard" or dp_mesh.size() == 1 or not any(True for _ in stage.parameters()):
        return stage
    return apply_fsdp(stage, dp_mesh, reshard_after_forward=mode.reshard_after_forward, mp_policy=mp_policy,
                      expert_mesh=expert_mesh)


def apply_ddp_if(stage: nn.Module, dp_mesh: DeviceMesh, mode: DataParallelMode) -> nn.Module:
    """Wrap one materialized stage in DDP when its mode rides on DDP (after materializing: DDP needs real tensors)."""
    if mode.carrier != "ddp" or dp_mesh.size() == 1 or not any(True for _ in stage.parameters()):
        return stage
    return apply_ddp(stage, dp_mesh)


def build_optimizer(parts: list[nn.Module], *, zero: int, dp_mesh: DeviceMesh, lr: float, weight_decay: float,
                    betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """AdamW over the parameters of this rank's stage modules that train (a frozen base's adapters only: plait/execute/
    lora.py); ZeRO-1 over DDP shards its states."""
    params = trainable(p for part in parts for p in part.parameters())
    on_ddp = any(isinstance(p, DistributedDataParallel) for p in parts)
    return adamw(params, zero=zero, dp_mesh=dp_mesh, on_ddp=on_ddp, lr=lr, weight_decay=weight_decay, betas=betas,
                 eps=eps, **_kernel(params))


def adamw(params: list[torch.Tensor], *, zero: int, dp_mesh: DeviceMesh, on_ddp: bool, **kwargs
          ) -> torch.optim.Optimizer:
    """AdamW over `params`; ZeRO-1 over DDP (`on_ddp`) shards its states over dp (ZeroRedundancyOptimizer). On
    fully_shard the parameters are shards already, and so are their states."""
    if zero == 1 and dp_mesh.size() > 1 and on_ddp:
        # bucket views: each rank broadcasts its updated shard in one message, not one per parameter
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=True,
                                       process_group=dp_mesh.get_group(), **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def _kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """AdamW's fused kernel where it runs: one call for all parameters instead of a dozen foreach ops.

    On DTensor parameters each op is a dispatch through sharding propagation, so the step's host
    time is mostly per op: measured on 2 CPU ranks for tiny-gpt (69 parameters), foreach took
    26 ms under fully_shard and 124 ms under tensor parallelism, fused 4 ms and 30 ms. The fused
    kernel and foreach both need every parameter of one kind (all DTensors, or none); a mix steps
    one parameter at a time."""
    kinds = {isinstance(p, DTensor) for p in params}
    if len(kinds) > 1:
        return {"foreach": False}
    devices = {p.device.type for p in params}
    if devices <= {"cpu", "cuda"} and all(p.dtype in FUSED_DTYPES for p in params):
        return {"fused": True}
    return {}


FUSED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@contextmanager
def gradient_sync(parts: list[nn.Module], enabled: bool, keep_gathered: bool = False, last: bool | None = None
                  ) -> Iterator[None]:
    """Reduce the data-parallel gradients of this accumulation micro-batch where `enabled` (the last one; every one
    under Plan.grad_sync "micro_batch": fully_shard then accumulates its reduce-scattered shards), skip it elsewhere.

    `keep_gathered` (ZeRO 0-2 on fully_shard, whose parameters are not sharded between forward and
    backward anyway): keep the gathered parameters until the `last` micro-batch's backward (default: the one
    `enabled`), so the step gathers each unit once instead of once per micro-batch (as torch's pipeline schedules
    do)."""
    saved = []
    last = enabled if last is None else last
    for part in parts:
        if isinstance(part, FSDPModule):
            part.set_requires_gradient_sync(enabled)
            part.set_reshard_after_backward(last or not keep_gathered)
        elif isinstance(part, DistributedDataParallel) and not enabled:
            context = part.no_sync()
            context.__enter__()
            saved.append(context)
    try:
        yield
    finally:
        for context in saved:
            context.__exit__(None, None, None)
        for part in parts:
            if isinstance(part, FSDPModule):
                part.set_requires_gradient_sync(True)
                part.set_reshard_after_backward(True)
