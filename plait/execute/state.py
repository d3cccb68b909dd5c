"""Full (unsharded) state dicts of a parallel model, keyed like the single-process model's.

Built on torch.distributed.checkpoint.state_dict, which knows how to gather DTensor /
FSDP shards and strips the wrapper prefixes (DDP's `module.`, checkpoint_wrapper's
`_checkpoint_wrapped_module.`). Pipeline stages hold disjoint keys; an all-gather of
objects over the "pp" axis merges them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

FULL = StateDictOptions(full_state_dict=True)


def local_full_state_dict(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Full tensors of this rank's stages (collective over dp and tp)."""
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        state = get_model_state_dict(part, options=FULL)
        # clone: a replicated DTensor's "full" tensor (and a plain parameter) is the live
        # parameter storage; a snapshot must not change when training goes on
        merged.update({name: tensor.detach().cpu().clone() for name, tensor in state.items()})
    return merged


def gather_full_state_dict(parts: list[nn.Module], pp_mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """The whole model's full tensors, on every rank."""
    local = local_full_state_dict(parts)
    if pp_mesh.size() == 1:
        return local
    gathered: list = [None] * pp_mesh.size()
    dist.all_gather_object(gathered, local, group=pp_mesh.get_group())
    return {name: tensor for piece in gathered for name, tensor in piece.items()}


def load_full_state_dict(parts: list[nn.Module], state: dict[str, torch.Tensor]) -> None:
    """Load full tensors into this rank's (sharded) stages; every rank passes the same values."""
    for part in parts:
        # a list, not a set: loading is collective (shards are scattered) and must visit
        # the parameters in the same order on every rank
        wanted = [name for name, _ in _plain_names(part)]
        missing = set(wanted) - state.keys()
        if missing:
            raise KeyError(f"state dict lacks {sorted(missing)[:3]}")
        set_model_state_dict(part, {name: state[name] for name in wanted}, options=FULL)


def _plain_names(part: nn.Module):
    """Parameter names without wrapper prefixes, as the single-process model names them."""
    for name, param in part.named_parameters():
        yield _clean(name), param


_WRAPPER_SEGMENTS = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}


def _clean(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "module":  # DDP
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_SEGMENTS)
