"""The executor's side of LoRA (plait.models.lora): adapters placed by tensor parallelism, started from the seed over
a pretrained base, and the parameters the optimizer steps.

Tensor parallelism places each adapter with its projection, exactly and with no collective of its own:

* a column-wise projection (W split over its output features, input whole on every rank): A [r, in] replicated,
  B [out, r] split like W (Shard(0)); every rank computes the r-wide A·x whole and its slice of B·(A·x), so the
  output is split as W's is. A's gradient is the sum of every rank's share (DTensor reduces it, r x in);
* a row-wise projection (W split over its input features, the input split likewise): A split like W (Shard(1)),
  B replicated; A·x is then a partial sum, and so is B·(A·x), which joins W·x's partial sum in the projection's
  one all-reduce (or reduce-scatter under sequence parallelism);
* a projection kept whole (replicated; a router run on local values): A and B whole too, run as it runs.

Both follow from DTensor's rules on the DTensors the projection's own style makes, so the numbers are those of
one process (`plait check`: tests/dist/test_lora_runs.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from plait.errors import ConfigError
from plait.models.lora import ADAPTERS, LoraLinear, is_adapter


class LoraParallel(ParallelStyle):
    """`base` (the projection's own style) with its adapters placed as the module docstring says."""

    def __init__(self, base: ParallelStyle) -> None:
        super().__init__()
        self.base = base

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from plait.hf.replicate import ReplicatedModule

        if isinstance(self.base, ReplicatedModule):  # whole on every rank, its subtree (the adapters) with it
            return self.base._apply(module, device_mesh)
        # the base style distributes every parameter its module holds (torch's Colwise/RowwiseParallel would take
        # lora_A.weight for the projection's own): it sees the projection alone, then the adapters come back
        children = {name: module._modules.pop(name) for name in (*ADAPTERS, "lora_dropout")}
        try:
            self.base._apply(module, device_mesh)
        finally:
            module._modules.update(children)
        a, b = adapter_placements(module.weight, type(self.base).__name__, module)
        for child, placement in ((module.lora_A, a), (module.lora_B, b)):
            weight = child.weight
            child.register_parameter("weight", nn.Parameter(distribute_tensor(weight, device_mesh, [placement]),
                                                            requires_grad=weight.requires_grad))
        return module


def adapter_placements(weight: torch.Tensor, style: str, module: nn.Module) -> tuple:
    """(A's, B's) placement for a projection whose weight [out, in] tensor parallelism placed as `weight`."""
    placements = weight.placements if isinstance(weight, DTensor) else None
    if placements == (Shard(0),):
        return Replicate(), Shard(0)
    if placements == (Shard(1),):
        return Shard(1), Replicate()
    if placements == (Replicate(),):
        return Replicate(), Replicate()
    raise ConfigError(f"model.lora: a {type(module).__name__} placed by {style} ({placements}) has no adapter "
                      f"placement in plait; leave it out of lora.targets or use tp=1")


def with_adapters(style: ParallelStyle | None, module: nn.Module) -> ParallelStyle | None:
    """The style tensor parallelism applies to `module`: `style`, or LoraParallel(style) where `module` carries
    adapters."""
    if style is None or not isinstance(module, LoraLinear):
        return style
    return LoraParallel(style)


def trainable(parameters) -> list[nn.Parameter]:
    """The parameters the optimizer steps: all of them, or only the adapters of a frozen base."""
    return [p for p in parameters if p.requires_grad]


def adapter_names(names) -> list[str]:
    return [name for name in names if is_adapter(name)]
