"""The device mesh: one named DeviceMesh over the plan's axes (plait.axes.AXES: "pp", "dp", "cp", "tp").

Axis order decides which ranks share an axis (plait.axes says why): "tp" innermost, so tensor-parallel
groups are adjacent ranks, inside a node on real clusters; "pp" outermost. Every axis is kept, even of
size 1, so code can always say mesh["dp"].
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait import legality
from plait.axes import AXES, Degrees

_MESHES: dict[tuple[str, tuple[int, ...]], tuple[object, DeviceMesh]] = {}


def build_mesh(degrees: Degrees, device_type: str) -> DeviceMesh:
    """The mesh of `degrees` over the whole world (which must have degrees.world_size ranks).

    One mesh per shape and process group, reused by every plan of that shape in this process: each new
    mesh creates its process groups anew (on gloo, a few threads and a socket per peer each, never given
    back), and `plait tune` builds hundreds of plans in one process, whose steps slowed by half after 80
    plans on 4 CPU ranks before the meshes were shared."""
    legality.check_world(degrees, dist.get_world_size())
    key = (device_type, degrees.mesh_shape)
    world = dist.group.WORLD
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not world:
        cached = _MESHES[key] = (world, init_device_mesh(device_type, degrees.mesh_shape, mesh_dim_names=AXES))
    return cached[1]


def forget_meshes() -> None:
    """Drop the cached meshes (and their groups): call when the process group they belong to is destroyed.

    DTensor's sharding propagation and redistribution planner cache their results by a mesh's layout, which
    a new mesh of the same shape in a new process group shares; their cached plans would name the dead
    group's collectives ("could not resolve the process group registered under the name 17"), so those
    caches go too."""
    _MESHES.clear()
    from torch.distributed.tensor import DTensor, _redistribute

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's own copy
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    from plait.execute.tied import forget_groups

    forget_groups()


def device_type_of(device: str | torch.device) -> str:
    return torch.device(device).type
