"""Tied embeddings across pipeline stages: the first stage holds the embedding, the last the output layer, two
copies of one weight. Both start from the same value; after every backward their gradients are summed across
the two (an all-reduce over a {first, last} pipeline-rank group per data/context/tensor coordinate), so both
copies take the same optimizer steps and stay equal -- Megatron's scheme. Gradient clipping counts the
weight once (the alias is left out of the norm).

With one pipeline rank both names are one Parameter, and nothing is needed.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from plait.axes import AXES

_GROUPS: dict[tuple, object] = {}


def forget_groups() -> None:
    _GROUPS.clear()


def _end_group(mesh: DeviceMesh) -> object:
    """This rank's {pipeline rank 0, pipeline rank pp-1} group; every rank creates all of them (collective).
    `mesh` is the root mesh, "pp" its first axis."""
    shape = tuple(mesh.size(i) for i in range(mesh.ndim))
    key = shape
    if key not in _GROUPS:
        ranks = mesh.mesh.reshape(shape[0], -1)  # [pp, dp·cp·tp] global ranks
        mine = None
        for column in range(ranks.shape[1]):
            members = [int(ranks[0, column]), int(ranks[-1, column])]
            group = dist.new_group(members)
            if dist.get_rank() in members:
                mine = group
        _GROUPS[key] = mine
    return _GROUPS[key]


class TiedGradients:
    def __init__(self, parts: list[nn.Module], tied: dict[str, str], meshes) -> None:
        from plait.execute.state import plain_named_parameters

        mesh = meshes.root
        assert mesh.mesh_dim_names[0] == AXES[0] == "pp"
        names = {name: param for part in parts for name, param in plain_named_parameters(part)}
        shared = set(tied) | set(tied.values())
        # in the canonical name's order, the same on both ends of each group
        ends = sorted((tied.get(name, name), param) for name, param in names.items() if name in shared
                      and not (name in tied and tied[name] in names))
        self.params = [param for _, param in ends]
        self.aliases = {id(param) for name, param in names.items() if name in tied and tied[name] not in names}
        self.group = _end_group(mesh) if meshes["pp"].size() > 1 and tied else None

    def sync(self) -> None:
        """Sum the tied weight's gradients over its two copies (call after backward, before clipping)."""
        if self.group is None:
            return
        for param in self.params:
            if param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                dist.all_reduce(grad, group=self.group)

    def counts_in_norm(self, param: nn.Parameter) -> bool:
        return id(param) not in self.aliases


class ReplicatedGradients:
    """Gradients of parameters kept outside fully_shard, averaged by plait after backward as fully_shard's
    reduce-scatter averages the others': `attribute` names them on each stage. Summed over `group_mesh` and
    divided by `divisor` -- the data-parallel ranks for parameters fully_shard cannot shard (data.unshardable);
    for experts, their copies on the expert-data ranks, divided by all data-parallel ranks, since each copy
    already holds the tokens of its whole expert-parallel group (plait/execute/expert.py)."""

    def __init__(self, parts: list[nn.Module], attribute: str, group_mesh: DeviceMesh, divisor: int) -> None:
        from plait.execute.state import clean_name

        self.params = [p for part in parts for name, p in sorted(part.named_parameters())
                       if clean_name(name) in getattr(getattr(part, "module", part), attribute, ())]
        self.group = group_mesh.get_group() if self.params and group_mesh.size() > 1 else None
        self.divisor = divisor if self.params else 1

    def sync(self) -> None:
        for param in self.params:
            if param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                if self.group is not None:
                    dist.all_reduce(grad, group=self.group)
                if self.divisor != 1:
                    grad.div_(self.divisor)
