"""A module of a Hugging Face block run whole on every tensor rank (style "replicate_module": an attention or
linear-attention layer the class's tensor-parallel plan leaves unplaced; why it is exact: plait.hf.flow).

Its parameters, its whole subtree's, become replicated DTensors (so FSDP, the optimizer and clipping see one kind
of parameter), but it runs on their local values: every rank computes the same thing on the same whole input, so
no collective is needed inside it and ops DTensor has no rule for (a delta rule's scan, a short convolution) run
as the class wrote them. Its buffers stay plain tensors. Under sequence parallelism its hidden-state input is
all-gathered over the sequence first (backward: the rank's slice of the whole, identical gradient) and its output
(the first tensor of what it returns) is cut back to the rank's part of the sequence (backward: an all-gather).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from plait.hf.flow import hidden_input


def _gathered(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if not isinstance(x, DTensor):  # a sequence-parallel norm hands over its local slice
        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    return x.redistribute(mesh, [Replicate()]).to_local()


def _sliced(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(1)]).to_local()


class ReplicatedModule(ParallelStyle):
    """Run a module whole on every tensor rank, on local values of its replicated parameters (module docstring)."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        owners = []
        for sub in module.modules():
            for name, param in list(sub.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    sub.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Replicate()]),
                                                              requires_grad=param.requires_grad))
            if sub._parameters:
                owners.append(sub)
        original = module.forward
        sequence_parallel = self.sequence_parallel

        def forward(*args: Any, **kwargs: Any) -> Any:
            if sequence_parallel:
                where, x = hidden_input(args, kwargs)
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"{type(module).__name__}: sequence parallelism found no hidden-state input to "
                                    f"gather")
                if isinstance(where, int):
                    args = (_gathered(x, device_mesh), *args[1:])
                else:
                    kwargs = {**kwargs, where: _gathered(x, device_mesh)}
            # the parameters as FSDP holds them now (unsharded during the forward), read as their local values; the
            # gradient flows back to them as a replicated DTensor, identical on every rank
            saved = [(owner, dict(owner._parameters)) for owner in owners]
            try:
                for owner, params in saved:
                    for name, param in params.items():
                        if isinstance(param, DTensor):
                            owner._parameters[name] = param.to_local()
                out = original(*args, **kwargs)
            finally:
                for owner, params in saved:
                    owner._parameters.update(params)
            if not sequence_parallel:
                return out
            if isinstance(out, tuple):
                return (_sliced(out[0], device_mesh), *out[1:])
            return _sliced(out, device_mesh)

        module.forward = forward
        return module
