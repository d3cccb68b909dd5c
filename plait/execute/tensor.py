"""apply_tp: an adapter's tensor-parallel plan (data: module pattern -> style name) as PyTorch ParallelStyles,
with sequence parallelism, a vocabulary-parallel embedding and a loss-parallel output.

Layouts between modules (t = tensor degree, local tensors unless noted):

* without sequence parallelism, activations between blocks are full [b, s, h] and equal on every tensor
  rank; each block does one all-reduce after attention and one after the MLP (the row-wise projections),
  Megatron's f/g operators;
* with sequence parallelism (Korthikanti et al. 2022) they are [b, s/t, h] slices along the sequence:
  norms run on the slices, each "gather_input" module (attention, MLP) all-gathers its input, and each
  row-wise projection reduce-scatters its output back to slices;
* the token embedding is split over the vocabulary (row-wise: each rank looks up its rows, a reduction
  makes the sum; any vocabulary size: DTensor shards unevenly, so no padding changes the model's shapes),
  the output layer column-wise over the vocabulary, returning a vocab-sharded DTensor that
  `loss_parallel()` turns into the cross-entropy without ever gathering the [b, s, V] logits.

Norm weights stay whole on every tensor rank but become replicated DTensors, so every parameter is a
DTensor: FSDP, the optimizer and gradient clipping then see one kind of parameter. Hugging Face's GPT-2
uses `Conv1D` (weight [in, out]), which torch's styles do not take; `ProjectionParallel` shards it, and
fused projections (GPT-2's q|k|v) are split per projection (DTensor's _StridedShard: rank r holds the r-th
slice of each).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from plait.torch_internals import StridedShard

from plait.execute.lora import with_adapters
from plait.models.adapter import get_module


def _to_replicated(x: Any, mesh: DeviceMesh) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return x


class ReplicateParallel(ParallelStyle):
    """Keep a small module whole on every tensor rank, its parameters as replicated DTensors.

    Tensor inputs are taken as replicated; the output is redistributed to `output_layout` (Shard(d) just
    slices, no communication) and returned as a local tensor."""

    def __init__(self, output_layout: Placement | None = None) -> None:
        super().__init__()
        self.output_layout = output_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._input_fn, output_fn=self._output_fn)

    @staticmethod
    def _input_fn(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        return tuple(_to_replicated(x, device_mesh) for x in inputs)

    def _output_fn(self, module: nn.Module, output: DTensor, device_mesh: DeviceMesh):
        if isinstance(output, tuple):  # a router's (logits, weights, expert ids)
            return tuple(self._output_fn(module, item, device_mesh) for item in output)
        if not isinstance(output, DTensor):
            return output
        if output.placements != (self.output_layout,):
            output = output.redistribute(device_mesh, [self.output_layout])
        return output.to_local()


class HeadNormParallel(ParallelStyle):
    """A norm over head_dim applied to [b, s, heads/t, head_dim] slices of tensor-sharded heads (Qwen3's q_norm,
    k_norm): the weight is replicated, the input is a Shard over the heads dim, so the weight's gradient is
    summed over the tensor ranks (Hugging Face's 'replicated_with_grad_allreduce')."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._input_fn, output_fn=self._output_fn)

    @staticmethod
    def _input_fn(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        return (DTensor.from_local(x, device_mesh, [Shard(x.dim() - 2)], run_check=False), *inputs[1:])

    @staticmethod
    def _output_fn(module: nn.Module, output: DTensor, device_mesh: DeviceMesh):
        return output.to_local()


class GatherSequence(ParallelStyle):
    """Sequence parallelism's all-gather before a module that needs the whole sequence (attention, MLP): its
    hidden-state input (the first positional argument, or `hidden_states=`) goes from [b, s/t, h] slices to
    [b, s, h]; its gradient is reduce-scattered back."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x: torch.Tensor) -> torch.Tensor:
            if not isinstance(x, DTensor):  # a sequence-parallel norm may hand over a local slice or a DTensor
                x = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            return x.redistribute(device_mesh, [Replicate()]).to_local()

        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args and isinstance(args[0], torch.Tensor):
                return (gather(args[0]), *args[1:]), kwargs
            if isinstance(kwargs.get("hidden_states"), torch.Tensor):
                return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
            raise TypeError(f"{type(mod).__name__}: sequence parallelism found no hidden-state input to gather")

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class ProjectionParallel(ParallelStyle):
    """Column- or row-wise tensor parallelism for the projections torch's styles do not take: Hugging Face's
    Conv1D (y = x @ W + b, W [in, out]), and fused projections (q|k|v, gate|up) of `packed` parts, each split
    over tp on its own (DTensor's _StridedShard: rank r holds the r-th slice of every part). Row-wise sums
    the partial outputs (all-reduce, or reduce-scatter over the sequence under SP)."""

    def __init__(self, kind: str, packed: int = 1, output_layout: Placement | None = None,
                 transposed: bool = False) -> None:
        super().__init__()
        self.kind, self.packed, self.transposed = kind, packed, transposed
        self.output_layout = output_layout or Replicate()

    def _split(self, dim: int) -> Placement:
        return Shard(dim) if self.packed == 1 else StridedShard(dim, split_factor=self.packed)

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        out_dim, in_dim = (1, 0) if self.transposed else (0, 1)
        if self.kind == "colwise":
            placements = {"weight": self._split(out_dim), "bias": self._split(0)}
        else:
            placements = {"weight": Shard(in_dim), "bias": Replicate()}
        for pname, param in list(module.named_parameters(recurse=False)):
            shard = distribute_tensor(param, mesh, [placements[pname]])
            module.register_parameter(pname, nn.Parameter(shard, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        colwise = self.kind == "colwise"

        def input_fn(mod, inputs, mesh):
            x = inputs[0]
            layout = [Replicate()] if colwise else [Shard(x.dim() - 1)]
            return (DTensor.from_local(x, mesh, layout, run_check=False), *inputs[1:])

        def output_fn(mod, output, mesh):
            if not colwise and output.placements != (self.output_layout,):
                output = output.redistribute(mesh, [self.output_layout])
            return output.to_local()

        return distribute_module(module, device_mesh, self._partition, input_fn, output_fn)


class KeyValueParallel(ParallelStyle):
    """The key or value projection of attention with `num_kv_heads` heads. Where tp divides them, column-wise like
    any projection; where there are fewer than tp (multi-query and small-group attention), each kv head is kept
    whole on the tp / num_kv_heads ranks whose query heads read it (Megatron-LM's replication): the weight is
    replicated, every rank computes the projection and keeps its head's slice, and the weight's gradient is summed
    over the tensor ranks (each rank's query heads add their share)."""

    def __init__(self, num_kv_heads: int) -> None:
        super().__init__()
        self.num_kv_heads = num_kv_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        if self.num_kv_heads % tp == 0:
            return ColwiseParallel()._apply(module, device_mesh)
        head = device_mesh.get_local_rank() // (tp // self.num_kv_heads)  # the kv head this rank's queries read

        def output_fn(mod, output: DTensor, mesh):
            width = output.shape[-1] // self.num_kv_heads
            local = output.to_local(grad_placements=[Partial()])
            return local[..., head * width:(head + 1) * width]

        return distribute_module(module, device_mesh, input_fn=ReplicateParallel._input_fn, output_fn=output_fn)


class ShardedInputParallel(ParallelStyle):
    """A module with parameters of its own run on a column-wise projection's output (an activation with learned
    parameters after up_proj: Apertus' xIELU): its input is taken as split along the last dim, its parameters
    replicated; DTensor computes it exactly (gathering where an op needs the whole dim) and sums the parameters'
    gradients over the tensor ranks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            x = inputs[0]
            return (DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False), *inputs[1:])

        def output_fn(mod, output: DTensor, mesh):
            return output.redistribute(mesh, [Shard(output.dim() - 1)]).to_local()

        return distribute_module(module, device_mesh, input_fn=input_fn, output_fn=output_fn)


class LatentKeyValueParallel(ParallelStyle):
    """Multi-head latent attention's kv_a_proj_with_mqa (DeepSeek-V2, MiniCPM3; transformers' 'mla_kv_a_proj'):
    replicated on the whole input. Its output's first part feeds the column-wise kv_b_proj, whose input gradient
    is summed whole; its last `rope_dim` features (the rotary key shared by every head) go straight to the rank's
    heads, so their gradient is partial and is summed over the tensor ranks."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def output_fn(mod, output: DTensor, mesh):
            latent, rope = output.split([output.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
            return torch.cat([latent.to_local(), rope.to_local(grad_placements=[Partial()])], dim=-1)

        return distribute_module(module, device_mesh, input_fn=ReplicateParallel._input_fn, output_fn=output_fn)


def split_local_parameter(owner: nn.Module, name: str, mesh: DeviceMesh) -> None:
    """transformers' "local_params": a bare parameter of `owner` (attention sinks, one per head) split along its
    first dim over the tensor ranks, and read as the rank's local slice while `owner` runs (its heads are the
    rank's heads), its gradient flowing back to the slice."""
    param = owner._parameters[name]
    if not isinstance(param, DTensor):
        owner.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                                    requires_grad=param.requires_grad))
    split = owner.__dict__.setdefault("_plait_local_parameters", [])
    if split:  # the forward is wrapped once; it swaps every split parameter
        split.append(name)
        return
    split.append(name)
    original = owner.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        whole = {key: owner._parameters[key] for key in split}
        try:
            for key, value in whole.items():
                owner._parameters[key] = value.to_local()
            return original(*args, **kwargs)
        finally:
            owner._parameters.update(whole)

    owner.forward = forward


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


def block_style(style: str, module: nn.Module, sequence_parallel: bool) -> ParallelStyle | None:
    """The ParallelStyle of one style name for `module` inside a block; None where it does nothing."""
    name, _, arg = style.partition(":")
    between = Shard(1) if sequence_parallel else Replicate()
    if name in ("colwise", "colwise_packed"):
        packed = int(arg or 1) if name == "colwise_packed" else 1
        if packed > 1 or _is_conv1d(module):
            return ProjectionParallel("colwise", packed, transposed=_is_conv1d(module))
        return ColwiseParallel()
    if name == "colwise_kv":
        return KeyValueParallel(int(arg))
    if name == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise_split":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if name == "rowwise":
        if _is_conv1d(module):
            return ProjectionParallel("rowwise", output_layout=between, transposed=True)
        return RowwiseParallel(output_layouts=between)
    if name == "norm":  # local outputs: a norm may feed the residual sum (post-norms: Gemma 2, OLMo 2)
        return SequenceParallel(use_local_output=True) if sequence_parallel else ReplicateParallel()
    if name == "head_norm":
        return HeadNormParallel()
    if name == "gather_input":
        return GatherSequence() if sequence_parallel else None
    if name == "replicate":  # inside a block: a router, an MLA q_a_proj; run on local values (no DTensor rule needed
        # for its ops: Inkling's router takes log_sigmoid), on the input as it comes
        from plait.hf.replicate import ReplicatedModule

        return ReplicatedModule(sequence_parallel=False)
    if name == "sharded_input":
        return ShardedInputParallel()
    if name == "replicate_module":  # a module the class's plan leaves unplaced, whole on every rank (":Class": only
        # where it is of that class: layer_style)
        from plait.hf.replicate import ReplicatedModule

        return ReplicatedModule(sequence_parallel)
    if name == "mla_kv_a":
        return LatentKeyValueParallel(int(arg))
    if name == "experts":  # split over ep and tp with their MoE layer (execute/expert.py, hf/expert_parallel.py)
        return None
    if name == "moe_block":  # a pattern the class's dense layers share with its MoE blocks (their "mlp")
        from plait.hf.expert_parallel import MoeBlockParallel
        from plait.hf.experts import class_experts

        if class_experts(module):
            return MoeBlockParallel(sequence_parallel)
        return GatherSequence() if sequence_parallel else None
    raise ValueError(f"style {style!r} does not apply inside a block ({type(module).__name__})")


def root_style(style: str, module: nn.Module, sequence_parallel: bool) -> ParallelStyle:
    between = Shard(1) if sequence_parallel else Replicate()
    if style == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if style == "position_embedding":
        return ReplicateParallel(between)  # [1, s, h] rows: sliced along the sequence under SP
    if style == "final_norm":  # local: the class's own forward may reshape it with the local length (GPT-2's view)
        return SequenceParallel(use_local_output=True) if sequence_parallel else ReplicateParallel()
    if style == "output":  # logits stay a vocab-sharded DTensor for loss_parallel()
        return ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
    return block_style(style, module, sequence_parallel)


def apply_tp(stage: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Shard one Stage (plait.models.stage) over `tp_mesh` in place, as its adapter's plan says."""
    adapter = stage.adapter
    plan = adapter.tp_plan()
    root = {path: root_style(style, get_module(stage, path), sequence_parallel)
            for path, style in plan.root.items() if get_module(stage, path) is not None}
    parallelize_module(stage, tp_mesh, root)
    for block in stage.stage_blocks().values():
        styles, local = {}, []
        moe = _moe_blocks(block, plan.block)
        for pattern, style in plan.block.items():
            module = get_module(block, pattern)
            if module is None:
                continue
            if style == "local_param":
                local.append(pattern)
                continue
            style = layer_style(pattern, style, block, plan.block, moe)  # patterns a layer kind runs otherwise
            if style is None:
                continue
            # inside a MoE block activations are whole: its row-wise projections all-reduce, as its experts do
            inside = any(pattern.startswith(path + ".") for path in moe)
            parallel = with_adapters(block_style(style, module, sequence_parallel and not inside), module)
            if parallel is not None:
                styles[pattern] = parallel
        parallelize_module(block, tp_mesh, styles)
        for path in local:
            owner_path, _, leaf = path.rpartition(".")
            split_local_parameter(get_module(block, owner_path), leaf, tp_mesh)
        adapter.after_tensor_parallel(block, tp_mesh.size())
    stage.retie()  # distributing replaced the parameters, which unties an output layer from its embedding


def layer_style(pattern: str, style: str, block: nn.Module, block_plan: dict[str, str], moe: list[str]) -> str | None:
    """The style `pattern` takes in this layer, where layers differ: a "moe_block" pattern on a dense layer's MLP
    the plan places nothing of (AFMoE's first layer) runs whole ("replicate_module"); "replicate_module:Class" on a
    module of another class (a hybrid's full attention, where its linear attention is replicated: MiniMax) is what
    it would be without the mark (a gathered parent of its column-wise children, or nothing)."""
    from plait.hf.flow import whole_module

    def inside(parent_only: bool) -> list[str]:
        return [p for p, s in block_plan.items() if p.startswith(pattern + ".") and get_module(block, p) is not None
                and (not parent_only or (p.rpartition(".")[0] == pattern and s.startswith("colwise")))]

    name, _, owner = style.partition(":")
    if name == "moe_block" and pattern not in moe and not inside(False):
        return "replicate_module"
    if name == "replicate_module" and owner and whole_module(block, f"{pattern}:{owner}") is None:
        return "gather_input" if inside(True) else None
    return style


def _moe_blocks(block: nn.Module, block_plan: dict[str, str]) -> list[str]:
    """The paths of `block`'s modules of style "moe_block" that hold experts of a transformers class."""
    from plait.hf.experts import class_experts

    return [path for path, style in block_plan.items() if style == "moe_block"
            and (module := get_module(block, path)) is not None and class_experts(module)]
