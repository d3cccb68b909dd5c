"""The device mesh: a named ("pp", "dp", "tp") DeviceMesh built from a plan's degrees.

Axis order decides which ranks share an axis: "tp" is innermost, so tensor-parallel
groups are adjacent ranks (inside a node on real clusters, where its per-layer
collectives need the fast links); "pp" is outermost, since its point-to-point traffic
is the lightest and tolerates the slow inter-node links.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait.errors import ConfigError

MESH_AXES: tuple[str, str, str] = ("pp", "dp", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of the three mesh axes; their product must equal the world size."""

    pp_degree: int
    dp_degree: int
    tp_degree: int

    @property
    def world_size(self) -> int:
        return self.pp_degree * self.dp_degree * self.tp_degree

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ConfigError(
                f"the plan needs pp={self.pp_degree} x dp={self.dp_degree} x tp={self.tp_degree} = "
                f"{self.world_size} ranks but the world has {world_size}; launch {self.world_size} processes "
                f"(--nproc {self.world_size}) or plan for {world_size} devices"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Every axis is kept, even of size 1, so code can always say mesh["dp"].

        One mesh per shape and process group, reused by every plan of that shape in this process:
        each new mesh creates its process groups anew (on gloo, a few threads and a socket per peer
        each, never given back), and `plait tune` builds hundreds of plans in one process, whose
        steps slowed by half after 80 plans on 4 CPU ranks before the meshes were shared."""
        import torch.distributed as dist

        shape = (self.pp_degree, self.dp_degree, self.tp_degree)
        key = (device_type, shape)
        world = dist.group.WORLD
        cached = _MESHES.get(key)
        if cached is None or cached[0] is not world:
            cached = _MESHES[key] = (world, init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES))
        return cached[1]


_MESHES: dict[tuple[str, tuple[int, int, int]], tuple[object, DeviceMesh]] = {}


def device_type_of(device: str | torch.device) -> str:
    return torch.device(device).type
