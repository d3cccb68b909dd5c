"""apply_tp: Megatron-style tensor parallelism, sequence parallelism, vocabulary-parallel
embedding and loss-parallel output, as `parallelize_module` plans (dicts of ParallelStyle).

Layouts between modules (t = tensor degree, local tensors unless noted):

* without sequence parallelism, activations between blocks are full [b, s, h] and equal
  on every tensor rank; each block does one all-reduce after attention (wo, row-wise)
  and one after the MLP (w2, row-wise), Megatron's f/g operators;
* with sequence parallelism (Korthikanti et al. 2022) they are [b, s/t, h] slices along
  the sequence; norms run on the slices, and each all-reduce becomes an all-gather before
  the column-wise projections plus a reduce-scatter after the row-wise ones;
* the token embedding is split over the vocabulary (row-wise: each rank looks up its
  rows, a reduction makes the sum), the output layer column-wise over the vocabulary and
  returns a vocab-sharded DTensor that `loss_parallel()` turns into the cross-entropy
  without ever gathering the [b, s, V] logits.

Norm weights and the position table stay whole on every tensor rank but become
replicated DTensors, so that every parameter is a DTensor: FSDP, the optimizer (foreach)
and gradient clipping then see one kind of parameter.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class ReplicateParallel(ParallelStyle):
    """Keep a small module whole on every tensor rank, its parameters as replicated DTensors.

    Floating inputs are taken as replicated; the output is redistributed to `output_layout`
    (Shard(d) just slices, no communication) and returned as a local tensor."""

    def __init__(self, output_layout: Placement | None = None) -> None:
        super().__init__()
        self.output_layout = output_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._input_fn, output_fn=self._output_fn)

    @staticmethod
    def _input_fn(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            if hasattr(x, "is_floating_point") and x.is_floating_point() and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def _output_fn(self, module: nn.Module, output: DTensor, device_mesh: DeviceMesh):
        if output.placements != (self.output_layout,):
            output = output.redistribute(device_mesh, [self.output_layout])
        return output.to_local()


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan for one TransformerBlock (module names relative to the block)."""
    if not sequence_parallel:
        return {
            "attention_norm": ReplicateParallel(),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "ffn_norm": ReplicateParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
    gather_sequence = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(**gather_sequence),  # all-gather the sequence before q/k/v
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter back to sequence slices
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(**gather_sequence),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def root_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan for the embeddings, final norm and output layer (those a stage has)."""
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks),
        # the [s, h] position table: sliced along the sequence (dim 0) to match the token slices
        "pos_embeddings": ReplicateParallel(Shard(0) if sequence_parallel else Replicate()),
        "norm": SequenceParallel() if sequence_parallel else ReplicateParallel(),
        # logits stay a vocab-sharded DTensor for loss_parallel()
        "output": ColwiseParallel(input_layouts=between_blocks, output_layouts=Shard(-1), use_local_output=False),
    }


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Shard one stage module (a Transformer, possibly missing parts) over `tp_mesh`, in place."""
    root = {name: style for name, style in root_plan(sequence_parallel).items() if getattr(module, name) is not None}
    parallelize_module(module, tp_mesh, root)
    for block in module.layers.values():
        plan = block_plan(sequence_parallel)
        if block.feed_forward.w3 is None:
            del plan["feed_forward.w3"]
        parallelize_module(block, tp_mesh, plan)
