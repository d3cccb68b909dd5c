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


_GROUPS: dict[tuple, object] = {}


def forget_groups() -> None:
    _GROUPS.clear()


def _end_group(mesh: DeviceMesh, first: int, last: int) -> object:
    """This rank's {pipeline rank `first`, pipeline rank `last`} group; every rank creates all of them (collective).
    `mesh` is the root mesh, "pp" its first axis."""
    shape = tuple(mesh.size(i) for i in range(mesh.ndim))
    key = (shape, first, last)
    if key not in _GROUPS:
        ranks = mesh.mesh.reshape(shape[0], -1)  # [pp, dp·cp·tp] global ranks
        mine = None
        for column in range(ranks.shape[1]):
            members = [int(ranks[first, column]), int(ranks[last, column])]
            group = dist.new_group(members)
            if dist.get_rank() in members:
                mine = group
        _GROUPS[key] = mine
    return _GROUPS[key]


class TiedGradients:
    """Keep the two copies of a tied weight in step (see the module docstring)."""

    def __init__(self, parts: list[nn.Module], tied: dict[str, str], meshes, plan) -> None:
        from plait.execute.state import plain_named_parameters

        names = {name: param for part in parts for name, param in plain_named_parameters(part)}
        # both copies on this rank but in two stage modules (a V schedule puts stage 0 and the last on rank 0)
        self.local_pairs = [(names[a], names[c]) for a, c in tied.items()
                            if a in names and c in names and names[a] is not names[c]]
        # one copy here, the other on another pipeline rank; in the canonical name's order on both ends
        partner = {**tied, **{canonical: alias for alias, canonical in tied.items()}}
        remote = sorted((tied.get(n, n), p) for n, p in names.items() if n in partner and partner[n] not in names)
        self.params = [param for _, param in remote]
        self.aliases = {id(names[a]) for a, c in tied.items() if a in names and (c not in names or names[c] is not names[a])}
        first, last = plan.rank_of_stage(0), plan.rank_of_stage(plan.num_stages - 1)
        self.group = _end_group(meshes.root, first, last) if tied and first != last else None

    def sync(self) -> None:
        """Sum the tied weight's gradients over its two copies (call after backward, before clipping)."""
        for alias, canonical in self.local_pairs:
            if alias.grad is not None and canonical.grad is not None:
                total = alias.grad + canonical.grad
                alias.grad.copy_(total)
                canonical.grad.copy_(total)
        if self.group is None:
            return
        for param in self.params:
            if param.grad is None:
                continue
            if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
                # the vocabulary-parallel embedding's gradient comes back replicated, the output layer's sharded:
                # pair the two ends' shards (slicing a replicated gradient is local)
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)
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
