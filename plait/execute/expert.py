"""Expert parallelism: the experts of every mixture-of-experts layer split over the "ep" ranks of each data-
parallel group (DeepSpeed-MoE's and Megatron's layout: ep divides dp), tokens exchanged with all-to-alls.

* Each expert's stacked weights [E, ...] are DTensors on the ("ep", "tp") mesh: Shard(0) over ep (rank j of
  an ep group holds experts j·E/ep ...), and their inner width split over tp like a column- then row-wise
  MLP (w1, w3 Shard(1); w2 Shard(2)).
* Dispatch (dropless): every rank sorts its routed token slots by expert, tells each peer how many it sends
  (an all-to-all of counts), and sends them (`all_to_all_single_autograd`, uneven splits; its backward is the
  reverse all-to-all); the received tokens are regrouped by local expert, run, and sent back the same way.
* Under tensor parallelism each tensor rank holds 1/tp of every expert's width: Megatron's f operator before
  the experts (identity forward; all-reduce of the input gradient) and g after (all-reduce, or reduce-scatter
  along the sequence under sequence parallelism).
* Data parallelism: an expert's copies live on the ranks of "edp" (the data-parallel ranks outside its ep group)
  and "cp". Where the plan's data parallelism rides on fully_shard, each MoE layer's experts are a unit of their
  own over edp x cp (torchtitan's "dp_mod_ep"; Megatron's distributed optimizer shards expert state the same
  way), sharded along their hidden width with the plan's ZeRO stage; each copy already sums the tokens of its
  whole ep group, so their reduce-scatter divides by all dp x cp ranks (plait/execute/data.py). Where edp x cp
  is one rank they stay whole and their gradients are divided the same way (ReplicatedGradients in tied.py).
"""

from __future__ import annotations

import torch
from torch import nn
from plait.torch_internals import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from plait.models.moe import Experts


class ExpertParallelDispatch:
    """Send each routed token slot to the ep rank holding its expert, run the local experts, send results back."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.mesh = ep_mesh

    def __call__(self, experts: Experts, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if routed.is_meta:  # tracing shapes (plait check --dry-run): as many tokens come back as go out
            return experts(routed, [])
        ep = self.mesh.size()
        local = counts.numel() // ep
        send = counts.reshape(ep, local)  # [destination rank, its expert]: slots this rank sends
        recv = all_to_all_single(send.flatten().contiguous(), None, None, self.mesh).wait().reshape(ep, local)
        send_sizes, recv_sizes = send.sum(1).tolist(), recv.sum(1).tolist()
        received = all_to_all_single_autograd(routed.contiguous(), recv_sizes, send_sizes, self.mesh)
        # received: grouped by source rank, then local expert; the experts want it grouped by expert
        by_source = recv.flatten().tolist()
        chunks = list(received.split(by_source))
        order = [s * local + e for e in range(local) for s in range(ep)]
        grouped = torch.cat([chunks[i] for i in order]) if chunks else received
        out = experts(grouped, recv.sum(0).tolist())
        out_chunks = list(out.split([by_source[i] for i in order]))
        back = [None] * len(order)
        for position, i in enumerate(order):
            back[i] = out_chunks[position]
        returned = torch.cat(back) if back else out
        return all_to_all_single_autograd(returned, send_sizes, recv_sizes, self.mesh)


def _copy_to_tensor_ranks(tp_mesh: DeviceMesh):
    """Megatron's f: identity forward; backward all-reduces the input's gradient over tp (each rank's experts see
    1/tp of their width, so each gradient is a partial sum)."""

    def enter(x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

    return enter


def _reduce_from_tensor_ranks(tp_mesh: DeviceMesh, layout: Placement):
    """Megatron's g: sum the experts' partial outputs over tp (reduce-scatter to sequence slices under SP)."""

    def leave(x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, tp_mesh, [Partial()], run_check=False).redistribute(tp_mesh, [layout]).to_local()

    return leave


def apply_experts(stage: nn.Module, meshes, *, sequence_parallel: bool) -> None:
    """Split every MoE layer of a Stage over ep and tp, as the module docstring says (on meta, before FSDP)."""
    ep, tp, cp = meshes["ep"].size(), meshes["tp"].size(), meshes["cp"].size()
    names, modules = set(), []
    for block_name, block in stage.stage_blocks().items():
        for path, moe in stage.adapter.moe_modules(block):
            if cp > 1:
                moe.sequence_group = meshes["cp"].get_group()
            if ep == 1 and tp == 1:
                continue
            mesh = meshes["ep_tp"]
            for weight, inner in (("w1", 1), ("w3", 1), ("w2", 2)):
                param = getattr(moe.experts, weight)
                if param is None:
                    continue
                shard = distribute_tensor(param, mesh, [Shard(0), Shard(inner)])
                moe.experts.register_parameter(weight, nn.Parameter(shard, requires_grad=param.requires_grad))
                names.add(f"{stage.adapter.blocks_path}.{block_name}.{path}.experts.{weight}")
            modules.append(moe.experts)
            if ep > 1:
                moe.dispatch = ExpertParallelDispatch(meshes["ep"])
            if tp > 1:
                moe.enter = _copy_to_tensor_ranks(meshes["tp"])
                moe.leave = _reduce_from_tensor_ranks(meshes["tp"], Shard(1) if sequence_parallel else Replicate())
    from plait.hf.expert_parallel import apply_class_experts  # transformers' own experts modules

    apply_class_experts(stage, meshes, names, modules)
    stage.expert_params, stage.expert_modules = names, modules
