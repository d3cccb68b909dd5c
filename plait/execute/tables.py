"""Embedding tables trained by a fused row-wise optimizer (TorchRec's manner): the lookup's backward updates the
rows it touched in place and leaves the table no gradient, so a table costs its weights alone (no dense
gradient, no optimizer state), split over the tensor-parallel axis as the plan placed it. The planner prices it so
(plait.cost.operators.FUSED_TABLE_COPIES) when a plan names the table in `operators.fused_tables`.

The optimizer is SGD without momentum or weight decay: the only row-wise update that is exact under any split
(rows, columns or whole) and equal to one process's dense SGD on the same table, which the check compares with.
Over data-parallel ranks each rank's touched rows and their gradients are all-gathered (the row-wise exchange,
kilobytes), so every rank applies the same update; the table is left out of fully_shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from plait.operators.solution import FUSED_OPTIMIZERS as OPTIMIZERS


class FusedTables:
    """The fused tables of one model: their learning rate (set by the training loop each step) and the
    data-parallel group whose ranks exchange their rows."""

    def __init__(self, lr: float, dp_group=None) -> None:
        self.lr = lr
        self.dp_group = dp_group
        self.modules: list[str] = []

    def apply(self, model: nn.Module, fused: dict[str, str]) -> None:
        """Route every nn.Embedding whose weight `fused` names through the fused lookup."""
        for name, module in model.named_modules():
            weight = f"{name}.weight" if name else "weight"
            if weight not in fused:
                continue
            if not isinstance(module, nn.Embedding) or fused[weight] not in OPTIMIZERS:
                raise ValueError(f"fused table {weight!r}: only nn.Embedding with {', '.join(OPTIMIZERS)} runs fused "
                                 f"(got {type(module).__name__}, {fused[weight]!r})")
            module.forward = _fused_forward(module, self)
            self.modules.append(name)

    def parameters(self, model: nn.Module) -> set[nn.Parameter]:
        return {model.get_submodule(name).weight for name in self.modules}


def _fused_forward(module: nn.Embedding, tables: FusedTables):
    def forward(ids: torch.Tensor) -> torch.Tensor:
        return _FusedSGDLookup.apply(ids, module.weight, module, tables)
    return forward


class _FusedSGDLookup(torch.autograd.Function):
    """F.embedding forward; backward applies SGD to the touched rows of this rank's shard in place and returns
    no gradient for the table."""

    @staticmethod
    def forward(ctx, ids, weight, module, tables):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.tables = weight, tables
        return F.embedding(ids, weight, module.padding_idx, module.max_norm, module.norm_type,
                           module.scale_grad_by_freq, module.sparse)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        _update_rows(ctx.weight, ids, grad_out, ctx.tables)
        return None, None, None, None


def _update_rows(weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, tables: FusedTables) -> None:
    """weight[ids] -= lr * grad, on this rank's shard: all rows of its columns (split by columns), its rows
    (split by rows), or the whole table."""
    local, placement, ids, grad = _local_view(weight, ids, grad)
    dim = local.shape[1]
    ids, grad = ids.reshape(-1), grad.reshape(-1, dim)
    lr = tables.lr
    if tables.dp_group is not None and dist.get_world_size(tables.dp_group) > 1:
        ids, grad = _gather(ids, tables.dp_group), _gather(grad, tables.dp_group)
        lr /= dist.get_world_size(tables.dp_group)  # each rank's loss is its share's mean: average, as fully_shard
    if isinstance(placement, Shard) and placement.dim == 0:  # this rank holds rows [first, first + len)
        first = _first_row(weight)
        mine = (ids >= first) & (ids < first + local.shape[0])
        ids, grad = ids[mine] - first, grad[mine]
    with torch.no_grad():
        local.index_add_(0, ids, grad.to(local.dtype), alpha=-lr)


def _local_view(weight, ids, grad):
    """(this rank's table shard, its placement, the ids in full, the gradient of this shard's columns)."""
    if not isinstance(weight, DTensor):
        return weight.data, Replicate(), ids, grad
    placement = weight.placements[0]
    mesh = weight.device_mesh
    wanted = Shard(grad.ndim - 1) if isinstance(placement, Shard) and placement.dim == 1 else Replicate()
    if isinstance(grad, DTensor):
        grad = grad.redistribute(mesh, [wanted]).to_local()
    if isinstance(ids, DTensor):
        ids = ids.redistribute(mesh, [Replicate()]).to_local()
    return weight._local_tensor, placement, ids, grad


def _first_row(weight: DTensor) -> int:
    """This rank's first row: Shard(0) splits as torch.chunk does, ceil(rows / ranks) rows a rank (the last ranks
    fewer, or none, where the rows do not divide)."""
    rows = weight.shape[0]
    ranks = weight.device_mesh.size(0)
    return min(rows, weight.device_mesh.get_local_rank(0) * -(-rows // ranks))


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out
