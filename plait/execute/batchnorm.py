"""BatchNorm with its statistics over the whole batch that the data-parallel ranks split, for per-operator plans
(the executor's DTensors on the tensor-parallel axis, CPU included: torch's SyncBatchNorm runs on accelerators
only).

In training, each BatchNorm's per-channel mean and variance are sums over the samples of every data-parallel rank:
the local sums go through torch.distributed.nn's all_reduce, whose backward all-reduces their gradients, so the
forward and backward are one process's BatchNorm over the whole batch (the running statistics too, updated with
the unbiased whole-batch variance). Two passes (mean, then the squared deviations), as torch's own kernel, so the
result matches one process to rounding. Evaluation uses the running statistics, as nn.BatchNorm does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce
from torch.distributed.tensor import DTensor

from plait.torch_internals import BatchNormBase


def synchronise_batch_norms(model: nn.Module, names: tuple[str, ...], dp_group) -> None:
    """The BatchNorms `names` (plan.operators.synchronised_norms) compute their training statistics over
    `dp_group`'s whole batch."""
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, BatchNormBase):
            raise ValueError(f"{name} is a {type(module).__name__}, not a BatchNorm: the plan was made for another "
                             "model")
        module.forward = _synchronised_forward(module, dp_group)


def _synchronised_forward(norm: BatchNormBase, group):
    original = norm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not norm.training and norm.running_mean is not None:  # evaluation: the running statistics
            return original(x)
        dims = [0] + list(range(2, x.ndim))
        shape = [1, -1] + [1] * (x.ndim - 2)
        count = x.numel() // x.shape[1] * dist.get_world_size(group)
        mean = _sum_over(x.sum(dims), group) / count
        centred = x - mean.reshape(shape)
        var = _sum_over((centred * centred).sum(dims), group) / count
        y = centred * torch.rsqrt(var + norm.eps).reshape(shape)
        if norm.affine:
            y = y * norm.weight.reshape(shape) + norm.bias.reshape(shape)
        if norm.training and norm.track_running_stats:
            _update_running(norm, mean.detach(), var.detach() * count / max(count - 1, 1))
        return y
    return forward


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    """Sum of `t` over the data-parallel ranks, differentiable (a DTensor's local values, its placement kept)."""
    if isinstance(t, DTensor):
        return DTensor.from_local(all_reduce(t.to_local(), group=group), t.device_mesh, t.placements,
                                  run_check=False)
    return all_reduce(t, group=group)


@torch.no_grad()
def _update_running(norm: BatchNormBase, mean: torch.Tensor, var: torch.Tensor) -> None:
    norm.num_batches_tracked.add_(1)
    momentum = norm.momentum if norm.momentum is not None else 1.0 / float(_plain(norm.num_batches_tracked))
    _assign(norm.running_mean, (1 - momentum) * norm.running_mean + momentum * _like(mean, norm.running_mean))
    _assign(norm.running_var, (1 - momentum) * norm.running_var + momentum * _like(var, norm.running_var))


def _like(value: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    if isinstance(buffer, DTensor) and isinstance(value, DTensor):
        return value.redistribute(buffer.device_mesh, buffer.placements)
    return value


def _assign(buffer: torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(buffer, DTensor):
        buffer._local_tensor.copy_(value.to_local() if isinstance(value, DTensor) else value)
    else:
        buffer.copy_(value)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
