"""Expert and tensor parallelism of transformers' own experts modules, run as the class wrote them (what they are:
plait.hf.experts). The checkpoint's tensors stay the class's: nothing is mapped onto plait's MoE.

* Weights: DTensors on the ("ep", "tp") mesh, as plait's own experts (plait/execute/expert.py): Shard(0) over ep
  (rank j of an ep group holds experts j·E/ep ...), each expert's inner width over tp (gate|up each split on its own,
  a _StridedShard; down by rows). The class's plan names these `grouped_gemm` (ep) and `packed_colwise` / `rowwise`
  or `packed_rowwise` / `colwise` (tp, as it stores them): the split is the same.
* Forward (`ClassExpertsParallel`, in place of the module's): under tp, Megatron's f on the hidden states and on the
  routing weights (each tensor rank's experts give partial sums, so the gradients of what meets them are partial
  too) and g after (an all-reduce: inside a MoE block activations stay whole, `MoeBlockParallel`); under ep, the
  routed (token, expert) slots sorted by expert and exchanged by plait's `ExpertParallelDispatch` (`ep_dispatch_experts`
  in the class's plan), the class's own forward running this rank's experts on the slots it receives (local expert
  ids, unit weights), the routing weights applied on the sender after the return trip, in the single process's
  order of experts.
* The class's forward sees this rank's local weights (`to_local` views, whose gradients land in the DTensors) and
  `num_experts` = its local count for the call only; the module keeps the global count (RouterLoad reads it).
* The router and the other modules of a MoE block the class's tensor plan places nowhere run whole on every tensor
  rank (plait.hf.experts.MOE_REPLICATE); under sequence parallelism the MoE block gathers the sequence at
  its input and hands on its slice of the (whole) output.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from plait.torch_internals import StridedShard

from plait.execute.expert import ExpertParallelDispatch, _copy_to_tensor_ranks, _reduce_from_tensor_ranks
from plait.execute.tensor import GatherSequence
from plait.hf.experts import class_experts, hidden_dim, inner_dim, packed_parts


@contextlib.contextmanager
def local_weights(experts: nn.Module) -> Iterator[None]:
    """The experts module holding this rank's pieces of its weights, and their expert count, for one call."""
    originals = {name: p for name, p in experts.named_parameters(recurse=False) if isinstance(p, DTensor)}
    locals_ = {name: p.to_local() for name, p in originals.items()}
    count = experts.num_experts
    experts._parameters.update(locals_)
    if locals_:
        experts.num_experts = next(iter(locals_.values())).shape[0]
    try:
        yield
    finally:
        experts._parameters.update(originals)
        experts.num_experts = count


class ClassExpertsParallel:
    """The forward of a transformers experts module split over ep and tp (see the module docstring)."""

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> None:
        self.experts = experts
        self.own_forward = experts.forward  # the class's (transformers dispatches it on _experts_implementation)
        self.num_experts = experts.num_experts
        self.dispatch = ExpertParallelDispatch(ep_mesh) if ep_mesh.size() > 1 else None
        tensor = tp_mesh.size() > 1
        self.enter = _copy_to_tensor_ranks(tp_mesh) if tensor else None
        self.leave = _reduce_from_tensor_ranks(tp_mesh, Replicate()) if tensor else None

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                 ) -> torch.Tensor:
        if self.enter is not None:
            hidden_states, top_k_weights = self.enter(hidden_states), self.enter(top_k_weights)
        if self.dispatch is None:
            out = self._run(hidden_states, top_k_index, top_k_weights)
        else:
            out = self._dispatched(hidden_states, top_k_index, top_k_weights)
        return self.leave(out) if self.leave is not None else out

    def _run(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        with local_weights(self.experts):
            if hidden.is_meta:  # tracing shapes (plait check --dry-run): the class's batched form runs on meta
                from transformers.integrations.moe import batched_mm_experts_forward

                return batched_mm_experts_forward(self.experts, hidden, index, weights)
            return self.own_forward(hidden, index, weights)

    def _dispatched(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, h], index and weights [T, k] (global expert ids) -> Σ_k weight · expert(token), [T, h]."""
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens in order within each
        token_of = order // index.shape[-1]
        if flat.is_meta:  # tracing shapes (plait check --dry-run): no routing to exchange by
            return self._run(hidden, index.remainder(1), weights)
        counts = torch.bincount(flat, minlength=self.num_experts)
        out = self.dispatch(self._grouped, hidden[token_of], counts)  # [T·k, h], in `order`
        slot_weights = weights.reshape(-1)[order, None].to(out.dtype)
        return torch.zeros_like(hidden).index_add(0, token_of, out * slot_weights)

    def _grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on `rows` grouped by local expert (counts[e] rows for expert e), unweighted."""
        if rows.shape[0] == 0:  # keep the (empty) result on the graph: the reverse exchange must run on every rank
            one = rows.sum(0, keepdim=True)
            return self._run(one, torch.zeros(1, 1, dtype=torch.long, device=rows.device), one.new_ones(1, 1))[:0]
        ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))[:, None].to(rows.device)
        return self._run(rows, ids, rows.new_ones(rows.shape[0], 1))


def _placement(experts: nn.Module, name: str) -> Placement:
    dim = inner_dim(experts, name)
    if dim is None:
        return Replicate()
    parts = packed_parts(experts, name)
    return Shard(dim) if parts == 1 else StridedShard(dim, split_factor=parts)


def apply_class_experts(stage: nn.Module, meshes, names: set[str], modules: list[nn.Module]) -> None:
    """Split every transformers experts module of a Stage over ep and tp (on meta, before FSDP); add their weights'
    names to `names` and the modules to `modules` (the experts' own data-parallel units: plait/execute/data.py)."""
    ep, tp = meshes["ep"].size(), meshes["tp"].size()
    if ep == 1 and tp == 1:
        return
    for block_name, block in stage.stage_blocks().items():
        for path, experts in class_experts(block):
            if tp > 1 and any(inner_dim(experts, n) is None for n, _ in experts.named_parameters(recurse=False)):
                raise NotImplementedError(f"{type(experts).__name__}: a bias on the experts' output under tensor "
                                          f"parallelism would be added once per tensor rank; use tp=1")
            for name, param in list(experts.named_parameters(recurse=False)):
                shard = distribute_tensor(param, meshes["ep_tp"], [Shard(0), _placement(experts, name)])
                experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
                names.add(f"{stage.adapter.blocks_path}.{block_name}.{path}.{name}")
            # fully_shard over the expert-data ranks splits each weight along h (plait.execute.data._hidden_width)
            experts.HIDDEN_DIM = {name: hidden_dim(experts, name) for name, _ in experts.named_parameters(recurse=False)}
            experts.forward = ClassExpertsParallel(experts, meshes["ep"], meshes["tp"])
            modules.append(experts)


class MoeBlockParallel(ParallelStyle):
    """A module holding class experts. Its own parameters (AFMoE's routing bias) are kept whole on every tensor rank,
    replicated DTensors its forward sees as local tensors (everything in the block is whole: their gradients are
    too). Under sequence parallelism its input is gathered over the sequence (it routes whole tokens, its experts'
    outputs are summed whole), and its output -- whole and equal on every tensor rank -- handed on as this rank's
    slice of the sequence (no communication; the backward gathers the slices' gradients)."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._replicate_own(module, device_mesh)
        if self.sequence_parallel:
            self._slice_sequence(module, device_mesh)
        return module

    @staticmethod
    def _replicate_own(module: nn.Module, device_mesh: DeviceMesh) -> None:
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if not own:
            return
        for name in own:
            param = module._parameters[name]
            whole = distribute_tensor(param, device_mesh, [Replicate()])
            module.register_parameter(name, nn.Parameter(whole, requires_grad=param.requires_grad))
        saved: dict[str, torch.Tensor] = {}

        def to_local(mod: nn.Module, args: tuple) -> None:
            for name in own:
                saved[name] = mod._parameters[name]
                if isinstance(saved[name], DTensor):
                    mod._parameters[name] = saved[name].to_local()

        def restore(mod: nn.Module, args: tuple, output):
            mod._parameters.update(saved)
            return output

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore)

    @staticmethod
    def _slice_sequence(module: nn.Module, device_mesh: DeviceMesh) -> None:
        GatherSequence()._apply(module, device_mesh)

        def slice_output(mod: nn.Module, args: tuple, output):
            hidden = output[0] if isinstance(output, tuple) else output
            local = DTensor.from_local(hidden, device_mesh, [Replicate()], run_check=False).redistribute(
                device_mesh, [Shard(1)]).to_local()
            return (local, *output[1:]) if isinstance(output, tuple) else local

        module.register_forward_hook(slice_output)
