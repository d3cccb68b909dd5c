"""Collective costs: hierarchical alpha-beta, one small function per collective.

Device order (the executor's mesh, plait.axes): tp fastest, then cp, then dp (split into edp x ep),
then pp, i.e. ``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``. A tp group is
contiguous (stride 1), a cp group has stride tp, an ep group (the nearest data-parallel ranks) stride
cp*tp, the data-parallel reduction over dp x cp stride tp, a pp group stride dp*cp*tp (`axis_group`).

A ring over a group that spans nodes runs at the slower of the intra-node link and
the members' network adapters in one node working side by side (NCCL builds one ring
per adapter): with k members per node, bus bandwidth = min(intra, k * inter). With all
8 GPUs of a DGX A100 in the group that is min(230, 8 * 24) = 192 GB/s, the nccl-tests
figure between nodes (docs/published-runs.md, section 5).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.spec.cluster import ClusterSpec


@dataclass(frozen=True)
class Group:
    """`size` devices, `stride` apart in the device order."""

    size: int
    stride: int = 1


def members_per_node(group: Group, devices_per_node: int) -> int:
    """How many members of the group share one node (1 when the stride jumps whole nodes)."""
    if group.stride >= devices_per_node:
        return 1
    return max(1, min(group.size, devices_per_node // group.stride))


def bus(group: Group, cluster: ClusterSpec, collective: str = "all_reduce") -> tuple[float, float]:
    """(latency term per ring step, bus bandwidth) of `collective` on a ring over `group`; latency is averaged
    over the ring. Each link level prices the collective on its own line (LinkSpec.line)."""
    k = members_per_node(group, cluster.devices_per_node)
    intra_latency, intra_bandwidth = cluster.intra_node.line(collective)
    if k >= group.size:
        return intra_latency, intra_bandwidth
    inter_latency, inter_bandwidth = cluster.inter_node.line(collective)
    bandwidth = min(intra_bandwidth, k * inter_bandwidth)
    # Of the ring's `size` hops, size/k cross nodes; the rest stay inside one.
    crossing = 1.0 / k
    return crossing * inter_latency + (1 - crossing) * intra_latency, bandwidth


def all_reduce(nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    """Ring all-reduce of a `nbytes` buffer: 2(n-1)/n of it crosses each link, in 2(n-1) steps."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    latency, bandwidth = bus(group, cluster, "all_reduce")
    return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth


def all_gather(nbytes: float, group: Group, cluster: ClusterSpec, collective: str = "all_gather") -> float:
    """Ring all-gather producing a `nbytes` buffer (each member holds nbytes/n): (n-1)/n of it per link."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    latency, bandwidth = bus(group, cluster, collective)
    return (n - 1) * latency + (n - 1) / n * nbytes / bandwidth


def reduce_scatter(nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    """Ring reduce-scatter of a `nbytes` input buffer: the mirror image of all_gather, on its own line."""
    return all_gather(nbytes, group, cluster, "reduce_scatter")


def all_to_all(nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    """All-to-all of a `nbytes` buffer per member (each sends 1/n of it to every other member).

    Every member sends (n-1)/n of its buffer in n-1 messages. Between nodes the pairwise exchange has no ring to
    spread over the node's adapters: a member's share for other nodes, (n-k)/n of its buffer with k members per
    node, leaves through its own adapter, while the (k-1)/n for its node's members crosses NVLink at the same
    time; the slower of the two bounds the exchange (DeepSpeed-MoE's and Megatron's reading of all-to-all cost:
    inter-node all-to-all runs at the per-GPU network bandwidth). Priced on the all-gather line, whose bus
    bandwidth nccl-tests defines as all-to-all's, (n-1)/n of the buffer per member."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    k = members_per_node(group, cluster.devices_per_node)
    intra_latency, intra_bandwidth = cluster.intra_node.line("all_gather")
    if k >= n:
        return (n - 1) * intra_latency + (n - 1) / n * nbytes / intra_bandwidth
    inter_latency, inter_bandwidth = cluster.inter_node.line("all_gather")
    local = (k - 1) / n * nbytes / intra_bandwidth
    remote = (n - k) / n * nbytes / inter_bandwidth
    return (k - 1) * intra_latency + (n - k) * inter_latency + max(local, remote)


def broadcast(nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    """Pipelined ring broadcast of a `nbytes` buffer from one member to the others: each link carries the whole
    buffer once (in chunks, so the n-1 hops overlap), after n-1 latency steps."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    latency, bandwidth = bus(group, cluster, "all_gather")
    return (n - 1) * latency + nbytes / bandwidth


def p2p(nbytes: float, crosses_node: bool, cluster: ClusterSpec) -> float:
    """One point-to-point send of `nbytes` (pipeline activations or gradients)."""
    if nbytes <= 0:
        return 0.0
    latency, bandwidth = (cluster.inter_node if crosses_node else cluster.intra_node).line("p2p")
    return latency + nbytes / bandwidth


def spans_nodes(group: Group, devices_per_node: int) -> bool:
    return members_per_node(group, devices_per_node) < group.size


def axis_group(degrees, axis: str) -> Group:
    """The group of a mesh axis of `degrees` (plait.axes.Degrees) as ranks lie on the executor's mesh (pp, edp, ep,
    cp, tp, outermost first; plait/execute/mesh.py): "tp", "cp", "ep", "pp", "dp_cp" (the dense weights'
    data-parallel reduction over dp x cp, contiguous above tp) and "edp_cp" (an expert's copies: the data-parallel
    ranks outside its ep group, and cp). With ep > 1 and cp > 1 edp_cp is two strided runs (cp at stride tp, edp at
    ep·cp·tp); as one run at stride ep·tp it shares a node with as many members as the two do where a node holds
    whole cp runs."""
    tp, cp, ep, dp = degrees["tp"], degrees["cp"], degrees["ep"], degrees["dp"]
    groups = {
        "tp": Group(tp, 1),
        "cp": Group(cp, tp),
        "ep": Group(ep, cp * tp),
        "dp_cp": Group(dp * cp, tp),
        "edp_cp": Group(dp // ep * cp, ep * tp),
        "pp": Group(degrees["pp"], dp * cp * tp),
    }
    return groups[axis]
