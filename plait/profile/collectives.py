"""Time collectives over message sizes, group sizes and placements, on every rank at once.

Groups are placed the way plans place them: `intra_node` groups are contiguous ranks of one node
(tensor-parallel style), `inter_node` groups take one rank from each of several nodes (data- and
pipeline-parallel style, the same local index on each node). Every group of a size runs at the same
time, so the figures include the contention a real plan meets (all tensor groups talk at once; on
CPU, all processes share the cores and the memory bus).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.distributed as dist

from plait.profile.devices import Device, time_op
from plait.profile.fit import Collective, CommSample

Level = Literal["intra_node", "inter_node"]

# Newer torch names these *_single; older ones only have the *_into_tensor / *_tensor spelling.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Which global ranks share a node, in rank order (torchrun numbers a node's ranks contiguously)."""

    nodes: tuple[tuple[int, ...], ...]

    @property
    def devices_per_node(self) -> int:
        return min(len(n) for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def groups(self, level: Level, size: int) -> list[tuple[int, ...]]:
        """Disjoint groups of `size` ranks covering every rank, placed inside or across nodes."""
        if level == "intra_node":
            return [node[i:i + size] for node in self.nodes for i in range(0, len(node), size)]
        per_node = self.devices_per_node
        return [tuple(self.nodes[n][local] for n in range(start, start + size))
                for start in range(0, self.num_nodes, size) for local in range(per_node)]

    def group_sizes(self, level: Level, quick: bool) -> list[int]:
        """Sizes that tile the level exactly (the degrees plans use): 2 .. ranks per node (or nodes)."""
        span = self.devices_per_node if level == "intra_node" else self.num_nodes
        sizes = [p for p in range(2, span + 1) if span % p == 0]
        if quick and len(sizes) > 2:
            sizes = [sizes[0], sizes[-1]]
        return sizes


def discover_topology() -> Topology:
    """Group ranks by host name (all ranks of one host are one node)."""
    hosts: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    order: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        order.setdefault(host, []).append(rank)
    return Topology(nodes=tuple(tuple(ranks) for ranks in order.values()))


def message_sizes(quick: bool) -> list[int]:
    """Bytes per message: 4 KiB (latency-bound) to 32 MiB (bandwidth-bound)."""
    if quick:
        return [2**12, 2**16, 2**20, 2**22]
    return [2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**25]


@dataclass(frozen=True)
class GroupSet:
    """The process groups of one (level, size), and the one this rank belongs to."""

    level: Level
    size: int
    members: tuple[int, ...]
    group: dist.ProcessGroup


def build_groups(topology: Topology, level: Level, size: int) -> GroupSet:
    """Create every group of this placement (new_group must be called by all ranks, in the same order)."""
    rank = dist.get_rank()
    mine: GroupSet | None = None
    for members in topology.groups(level, size):
        group = dist.new_group(list(members))
        if rank in members:
            mine = GroupSet(level, size, tuple(members), group)
    assert mine is not None, f"rank {rank} is in no {level} group of size {size}: {topology}"
    return mine


def measure(collective: Collective, groups: GroupSet, num_bytes: int, device: Device, target_s: float) -> CommSample:
    """Median seconds of one call, the slowest group's (a step waits for its slowest group)."""
    call = _make_call(collective, groups, num_bytes, device)
    seconds = time_op(call, device, target_s, max_reps=100)
    if collective == "p2p":
        seconds /= 2  # a ping-pong round trip carries the message twice; one clock cannot time one way
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return CommSample(collective=collective, group_size=groups.size, num_bytes=_rounded_bytes(num_bytes, groups.size,
                      device), seconds=float(slowest.item()))


def _rounded_bytes(num_bytes: int, size: int, device: Device) -> int:
    return _num_elements(num_bytes, size, device) * torch.empty((), dtype=device.dtype).element_size()


def _num_elements(num_bytes: int, size: int, device: Device) -> int:
    """Elements of the full message, a multiple of the group size so it splits evenly."""
    per_element = torch.empty((), dtype=device.dtype).element_size()
    return max(size, (num_bytes // per_element) // size * size)


def _make_call(collective: Collective, groups: GroupSet, num_bytes: int, device: Device) -> Callable[[], None]:
    n = _num_elements(num_bytes, groups.size, device)
    full = torch.ones(n, dtype=device.dtype, device=device.device)
    part = torch.ones(n // groups.size, dtype=device.dtype, device=device.device)
    group = groups.group
    if collective == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if collective == "all_gather":
        return lambda: _all_gather(full, part, group=group)
    if collective == "reduce_scatter":
        return lambda: _reduce_scatter(part, full, group=group)
    if collective == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    if collective == "p2p":
        return _ping_pong(groups.members, full)
    raise ValueError(f"unknown collective {collective!r}")


def _ping_pong(members: tuple[int, ...], buffer: torch.Tensor) -> Callable[[], None]:
    """Pipeline-style send/recv between the first two ranks of the group: one round trip per call."""
    rank = dist.get_rank()
    first, second = members[0], members[1]
    if rank == first:
        def call() -> None:
            dist.send(buffer, second)
            dist.recv(buffer, second)
    elif rank == second:
        def call() -> None:
            dist.recv(buffer, first)
            dist.send(buffer, first)
    else:  # ranks beyond a pair idle; p2p is measured on groups of 2 only
        def call() -> None:
            return None
    return call

