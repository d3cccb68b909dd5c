"""Full (unsharded) state dicts of a parallel model, keyed like the single-process model's.

Built on torch.distributed.checkpoint.state_dict, which knows how to gather DTensor / FSDP shards and
strips the wrapper prefixes (DDP's `module.`, checkpoint_wrapper's `_checkpoint_wrapped_module.`).
Pipeline stages hold disjoint keys; an all-gather of objects over the "pp" axis merges them. A tied
output layer on a stage without the embedding is an alias (ModelAdapter.tied): it loads the embedding's
value and is left out of the full state dict, as the single-process model's named_parameters leave it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from plait.torch_internals import StridedShard

FULL = StateDictOptions(full_state_dict=True)


def local_full_state_dict(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Full tensors of this rank's stages (collective over dp, cp and tp), aliases left out."""
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        wanted = {name for name, _ in plain_named_parameters(part)}
        state = get_model_state_dict(part, options=FULL)
        # clone: a replicated DTensor's "full" tensor (and a plain parameter) is the live
        # parameter storage; a snapshot must not change when training goes on
        merged.update({name: tensor.detach().cpu().clone() for name, tensor in state.items() if name in wanted})
    return merged


def gather_full_state_dict(parts: list[nn.Module], pp_mesh: DeviceMesh, tied: dict[str, str]) -> dict[str, torch.Tensor]:
    """The whole model's full tensors, on every rank."""
    local = local_full_state_dict(parts)
    if pp_mesh.size() > 1:
        gathered: list = [None] * pp_mesh.size()
        dist.all_gather_object(gathered, local, group=pp_mesh.get_group())
        local = {name: tensor for piece in gathered for name, tensor in piece.items()}
    return {name: tensor for name, tensor in local.items() if not (name in tied and tied[name] in local)}


def load_full_state_dict(parts: list[nn.Module], state: dict[str, torch.Tensor], tied: dict[str, str],
                         only: set[str] | None = None) -> None:
    """Load full tensors into this rank's (sharded) stages; every rank passes the same values, and each copies its
    own shard (no communication). A tied alias takes its canonical parameter's value. `only`: these names alone
    (LoRA's adapters over a base loaded otherwise)."""
    for part in parts:
        for name, param in plain_named_parameters(part, remove_duplicate=False):
            if only is not None and name not in only:
                continue
            value = state.get(name, state.get(tied.get(name, name)))
            if value is None:
                raise KeyError(f"state dict lacks {name!r}")
            with torch.no_grad():
                if isinstance(param, DTensor):
                    param.to_local().copy_(local_shard(value, param.device_mesh, param.placements))
                else:
                    param.copy_(value)


def local_shard(full: torch.Tensor, mesh: DeviceMesh, placements) -> torch.Tensor:
    """This rank's piece of `full` under `placements` (what distribute_tensor would scatter, computed locally).

    Written out because distribute_tensor refuses the layouts plait makes where a dimension does not split
    evenly: fully_shard over a tensor-parallel shard of a vocabulary tp does not divide (placements
    (StridedShard(0, sf=tp), Shard(0))). Mesh dims apply right to left: a _StridedShard whose split factor
    is the count of shards to its right on the same dim (fully_shard's over tensor parallelism) then just
    chunks what they left; one with none to its right is a packed projection (q|k|v), each part chunked."""
    coordinate = mesh.get_coordinate()
    local = full
    for dim in reversed(range(mesh.ndim)):
        placement, n, index = placements[dim], mesh.size(dim), coordinate[dim]
        if placement.is_replicate() or placement.is_partial():
            continue
        tensor_dim = placement.dim
        right = 1
        for later in range(dim + 1, mesh.ndim):
            other = placements[later]
            if isinstance(other, (Shard, StridedShard)) and other.dim == tensor_dim:
                right *= mesh.size(later)
        if isinstance(placement, StridedShard) and placement.split_factor != right:
            parts = local.chunk(placement.split_factor, dim=tensor_dim)
            local = torch.cat([_chunk(p, n, index, tensor_dim) for p in parts], dim=tensor_dim)
        else:
            local = _chunk(local, n, index, tensor_dim)
    return local


def _chunk(tensor: torch.Tensor, n: int, index: int, dim: int) -> torch.Tensor:
    """torch.chunk's index-th piece (DTensor's uneven Shard), empty past the last piece."""
    pieces = tensor.chunk(n, dim=dim)
    if index < len(pieces):
        return pieces[index]
    shape = list(tensor.shape)
    shape[dim] = 0
    return tensor.new_empty(shape)


def plain_named_parameters(part: nn.Module, remove_duplicate: bool = True):
    """(name, parameter) without wrapper prefixes, as the single-process model names them."""
    for name, param in part.named_parameters(remove_duplicate=remove_duplicate):
        yield clean_name(name), param


_WRAPPER_SEGMENTS = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}


def clean_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "module":  # DDP
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_SEGMENTS)
