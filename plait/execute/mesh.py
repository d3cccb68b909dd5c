"""The device mesh: one DeviceMesh over the plan's axes (plait.axes), and the sub-meshes the executor uses.

The root mesh is ("pp", "edp", "ep", "cp", "tp"): plait.axes's order with the data-parallel axis split into
expert-data-parallel x expert-parallel (dp = edp · ep; ep = 1 for dense models). "tp" is innermost, so tensor-
parallel groups are adjacent ranks, inside a node on real clusters; "pp" outermost (plait.axes says why); an
expert-parallel group is the nearest data-parallel ranks, for its all-to-alls.

`Meshes` hands out named sub-meshes, so code says meshes["dp"] whatever the layout: "pp", "dp", "cp", "tp",
"ep", "edp", "dp_cp" (data parallelism's gradient reduction: dp, and cp whose ranks hold other tokens of the
same sequences), "edp_cp" (the reduction of an expert's copies) and "ep_tp" (where an expert's weights are split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait import legality
from plait.axes import Degrees

ROOT_AXES = ("pp", "edp", "ep", "cp", "tp")


@dataclass(frozen=True)
class Meshes:
    root: DeviceMesh
    named: dict[str, DeviceMesh]

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.named[name]


def _flat(root: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    return root[dims[0]] if len(dims) == 1 else root[dims]._flatten(name)


def rank_order(plan) -> list[int]:
    """On a mixed cluster, the global rank at each mesh position: pipeline rank r takes the next dp x cp x tp ranks
    of its device group (Plan.stage_groups; groups hold consecutive ranks in the cluster's order). [] on a
    uniform cluster (the mesh is the ranks in order)."""
    if not plan.stage_groups:
        return []
    block = plan.dp * plan.cp * plan.tp
    offsets, used, order = plan.cluster.group_offsets(), {}, []
    for group in plan.stage_groups:
        start = offsets[group] + used.get(group, 0) * block
        order += list(range(start, start + block))
        used[group] = used.get(group, 0) + 1
    return order


def pipeline_position(meshes: Meshes) -> int:
    """This rank's pipeline rank: its coordinate on "pp". Not meshes["pp"].get_local_rank(): that is the rank's
    number in the pp process group, which torch numbers in global-rank order whatever the mesh's order."""
    return meshes.root.get_coordinate()[0]


def _build(degrees: Degrees, device_type: str, order: tuple[int, ...] = ()) -> Meshes:
    shape = (degrees.pp, degrees.dp // degrees.ep, degrees.ep, degrees.cp, degrees.tp)
    if order:  # ranks placed as the plan's device groups say
        root = DeviceMesh(device_type, torch.tensor(order).reshape(shape), mesh_dim_names=ROOT_AXES)
    else:
        root = init_device_mesh(device_type, shape, mesh_dim_names=ROOT_AXES)
    named = {axis: root[axis] for axis in ROOT_AXES}
    named["dp"] = _flat(root, ("edp", "ep"), "dp")
    named["dp_cp"] = named["dp"] if degrees.cp == 1 else _flat(root, ("edp", "ep", "cp"), "dp_cp")
    named["edp_cp"] = named["edp"] if degrees.cp == 1 else _flat(root, ("edp", "cp"), "edp_cp")
    named["ep_tp"] = root["ep", "tp"]
    return Meshes(root, named)


_MESHES: dict[tuple, tuple[object, Meshes]] = {}


def build_mesh(degrees: Degrees, device_type: str, order: list[int] | tuple[int, ...] = ()) -> Meshes:
    """The meshes of `degrees` over the whole world (which must have degrees.world_size ranks).

    One set per shape and process group, reused by every plan of that shape in this process: each new mesh
    creates its process groups anew (on gloo, a few threads and a socket per peer each, never given back), and
    `plait tune` builds hundreds of plans in one process, whose steps slowed by half after 80 plans on 4 CPU
    ranks before the meshes were shared."""
    legality.check_world(degrees, dist.get_world_size())
    key = (device_type, (degrees.pp, degrees.dp, degrees.ep, degrees.cp, degrees.tp), tuple(order))
    world = dist.group.WORLD
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not world:
        cached = _MESHES[key] = (world, _build(degrees, device_type, tuple(order)))
    return cached[1]


def data_mesh(meshes: Meshes) -> DeviceMesh:
    """The ranks that share the data-parallel gradient reduction: "dp", and under context parallelism the cp ranks
    too (each holds other tokens of the same sequences: torchtitan's FSDP over dp x cp)."""
    return meshes["dp_cp"]


def forget_meshes() -> None:
    """Drop the cached meshes (and their groups): call when the process group they belong to is destroyed.

    DTensor's sharding propagation and redistribution planner cache their results by a mesh's layout, which
    a new mesh of the same shape in a new process group shares; their cached plans would name the dead
    group's collectives ("could not resolve the process group registered under the name 17"), so those
    caches go too."""
    _MESHES.clear()
    from plait.torch_internals import clear_sharding_caches

    clear_sharding_caches()
    from plait.execute.tied import forget_groups

    forget_groups()


def device_type_of(device: str | torch.device) -> str:
    return torch.device(device).type
