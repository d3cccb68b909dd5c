"""ClusterSpec: the devices and links a plan runs on.

Hardware facts (memory, peak FLOP/s, link latency and bandwidth) come from public
specifications or from `plait profile`; the few `Efficiency` constants are fitted
(see plait/spec/clusters.py for which published rows each was fitted on). `HostOverheads`
holds what plait's executor costs the host per layer pass, parameter, stage pass and step:
properties of the software on a device type, kept apart from the hardware's figures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from plait.errors import ConfigError
from plait.spec._dict import from_dict, to_dict


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
"""The collectives plans use, each of which a link level may price on its own line (LinkSpec)."""


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """How far one collective's implementation runs from its link level's line: its latency per ring
    step and its bus bandwidth, as multiples of the level's. NCCL's rings need none; gloo runs its
    all-gather and reduce-scatter at about a quarter of its all-reduce's bus bandwidth on CPU processes,
    and its point-to-point sends at twice it (measured and written by `plait profile`)."""

    latency: float = 1.0
    bandwidth: float = 1.0

    def __post_init__(self) -> None:
        if not (self.latency >= 0) or not (self.bandwidth > 0):
            raise ValueError(f"latency={self.latency!r} must be >= 0 and bandwidth={self.bandwidth!r} > 0 "
                             "(multiples of the link level's)")


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """Alpha-beta cost of one link level: a message of n bytes takes latency_s + n / bandwidth.

    A collective with its own `Algorithm` (`all_reduce`, `all_gather`, `reduce_scatter`, `p2p`; may be
    left out) runs on the level's line scaled by it; `line(collective)` gives the result."""

    latency_s: float
    """Per-message (per ring step) latency, seconds."""
    bandwidth: float
    """Bytes per second one device can push through this level (ring bus bandwidth)."""
    all_reduce: Algorithm | None = None
    all_gather: Algorithm | None = None
    reduce_scatter: Algorithm | None = None
    p2p: Algorithm | None = None

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0):
            raise ValueError(f"latency_s={self.latency_s!r} must be >= 0")
        if not (self.bandwidth > 0):
            raise ValueError(f"bandwidth={self.bandwidth!r} must be > 0 (bytes per second)")

    def line(self, collective: str) -> tuple[float, float]:
        """(latency per ring step, bus bandwidth) of `collective` on this level."""
        if collective not in COLLECTIVES:
            raise ValueError(f"collective={collective!r} is not one of {', '.join(COLLECTIVES)}")
        algorithm = getattr(self, collective)
        if algorithm is None:
            return self.latency_s, self.bandwidth
        return self.latency_s * algorithm.latency, self.bandwidth * algorithm.bandwidth

    def scaled(self, latency: float = 1.0, bandwidth: float = 1.0) -> "LinkSpec":
        """This level with its latency and bandwidth times these factors, every collective alike."""
        return dataclasses.replace(self, latency_s=self.latency_s * latency, bandwidth=self.bandwidth * bandwidth)


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Achieved fractions of the hardware's peak: the cost model's fitted constants (three per device type).

    GEMM rate = peak_flops · matmul · h / (h + matmul_half_dim) for a model of hidden size h; a
    layer's other work costs `overhead` times its GEMM time (plait/cost/compute.py). Presets and
    the rows they were fitted on: plait/spec/clusters.py."""

    matmul: float = 0.5
    """Fraction of peak FLOP/s reached by large matrix multiplications."""
    matmul_half_dim: float = 0.0
    """Model hidden size at which the achieved fraction is half of `matmul`; 0 = no size effect."""
    overhead: float = 0.0
    """Non-GEMM work (norms, softmax, elementwise, launch), as a fraction of GEMM time."""
    memory_balance: float = 0.0
    """Peak FLOP/s over the memory bandwidth the optimizer's memory-bound step achieves (bytes/s); 0: the device
    type's public-spec default (plait.cost.compute.MACHINE_BALANCE)."""

    def __post_init__(self) -> None:
        if not (self.matmul > 0):
            raise ValueError(f"matmul={self.matmul!r} must be > 0 (a fraction of peak)")
        for name in ("matmul_half_dim", "overhead", "memory_balance"):
            if not (getattr(self, name) >= 0):
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class DeviceGroup:
    """Like devices of a mixed cluster (a few A100 nodes beside H100 nodes, or slower stragglers): their own
    hardware figures and the links among them. A plan puts every pipeline rank on one group
    (Plan.stage_groups)."""

    name: str
    num_devices: int
    devices_per_node: int = 8
    memory_bytes: float
    peak_flops: float
    efficiency: Efficiency = field(default_factory=Efficiency)
    intra_node: LinkSpec
    inter_node: LinkSpec | None = None
    """Between this group's nodes; None: the cluster's inter_node."""
    slowdown: float = 1.0
    """Emulation only (a CPU machine standing in for a mixed cluster): the executor throttles this group's ranks to
    this many times their compute time (plait/runtime/throttle.py). 1 on real hardware."""

    def __post_init__(self) -> None:
        if isinstance(self.num_devices, bool) or not isinstance(self.num_devices, int) or self.num_devices <= 0:
            raise ValueError(f"group {self.name!r}: num_devices={self.num_devices!r} must be a positive integer")
        if not (self.memory_bytes > 0 and self.peak_flops > 0):
            raise ValueError(f"group {self.name!r}: memory_bytes and peak_flops must be > 0")
        if not self.slowdown >= 1.0:
            raise ValueError(f"group {self.name!r}: slowdown={self.slowdown!r} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Islands:
    """A cluster made of islands: equal groups of nodes (clusters, data centres, cloud regions) joined by a link
    one to three orders of magnitude slower than the links inside each (plait/cost/islands.py prices it, docs/islands.md).
    Island i holds the devices [i·n, (i+1)·n) of the cluster's num_devices, n = num_devices / count."""

    count: int
    """How many islands; they split the cluster's devices evenly."""
    link: LinkSpec
    """The link between islands: latency_s per message, and bandwidth, the bytes per second one island as a whole
    (all its devices together) can push to the others."""
    emulate: bool = False
    """Emulation only (one machine standing in for islands): the executor holds each exchange over the link for
    the time `link` gives it (plait/train/islands.py's _LinkWork). False on real links."""

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 2:
            raise ValueError(f"islands.count={self.count!r} must be an integer >= 2 (one island is a plain cluster: "
                             "drop `islands`)")


@dataclass(frozen=True, kw_only=True)
class Failures:
    """How often the cluster's hardware fails and what a failure costs (plait/cost/failures.py prices it into each
    plan's expected goodput). The times default to what plait's own runs measured (docs/islands.md)."""

    mtbf_hours: float
    """Mean time between failures of one unit (`per`), hours."""
    per: Literal["device", "node"] = "node"
    """What `mtbf_hours` is counted per: one device, or one node."""
    restart_s: float = 0.0
    """Seconds a whole-job restart costs beyond the lost work (stop every rank, start them, rebuild, load the last
    checkpoint); 0: the figure benchmarks/islands.py measured (plait.cost.failures.MEASURED_RESTART_S)."""
    recovery_s: float = 0.0
    """Seconds an island that failed needs to rejoin and take the weights from a peer while the others train on;
    0: the measured figure (plait.cost.failures.MEASURED_RECOVERY_S)."""
    save_s: float = 0.0
    """Seconds one checkpoint write stalls training; 0: the measured figure (plait.cost.failures.MEASURED_SAVE_S)."""

    def __post_init__(self) -> None:
        if not self.mtbf_hours > 0:
            raise ValueError(f"failures.mtbf_hours={self.mtbf_hours!r} must be > 0 (hours between failures)")
        for name in ("restart_s", "recovery_s", "save_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"failures.{name}={getattr(self, name)!r} must be >= 0 (seconds; 0: measured)")


@dataclass(frozen=True, kw_only=True)
class HostOverheads:
    """Host time of plait's executor on a device type, beyond what FLOPs and bytes take: properties of the
    software (Python, autograd, DTensor's dispatch, fully_shard's hooks, the pipeline schedule), not of the
    hardware. On CPU processes dispatch runs on the computing core, so host time adds to compute time
    (measured by `plait profile`, corrected by `plait tune`); on GPUs kernels run while the host launches the
    next ones, so a layer pass takes the longer of its kernels and its host time (plait.cost.compute.pass_time;
    the GPU presets' figures come from benchmarks/gpu_check.py's grid, plait/spec/clusters.py)."""

    layer_overhead_s: float = 0.0
    """Fixed host time of one layer's forward pass over one micro-batch, whatever its size (framework
    dispatch of its ops, kernel launches), seconds; backward costs twice it. Why micro-batches are not
    free: on CPU processes dispatch runs on the computing core, so 8 micro-batches of 1 take far longer
    than 1 of 8."""
    tp_layer_overhead_s: float = 0.0
    """What tensor parallelism adds to that host time per layer pass: DTensor's sharding propagation and
    redistribution bookkeeping on every op of the layer."""
    dtensor_param_overhead_s: float = 0.0
    """Host time per parameter tensor per step where a rank's parameters are DTensors (tensor parallelism,
    or data parallelism on fully_shard): DTensor's dispatch of every optimizer op, and fully_shard's copies
    in and out of its flat buffers."""
    tp_param_overhead_s: float = 0.0
    """What tensor parallelism adds to that per parameter tensor and step: the optimizer's DTensor ops over
    parameters of mixed placements (sharded by row, by column, replicated)."""
    fsdp_layer_overhead_s: float = 0.0
    """Host time fully_shard adds to each layer pass (forward 1x, backward 2x) where data parallelism rides on
    it: its hooks before and after every unit's forward and backward."""
    pipeline_overhead_s: float = 0.0
    """Host time of one pipeline stage's forward or backward of one micro-batch beyond its layers': the
    schedule's bookkeeping, posting its sends and receives and waiting on them."""
    step_overhead_s: float = 0.0
    """Fixed host time of a step, whatever the plan: launching the optimizer, zeroing the gradients,
    averaging the loss over ranks."""
    recompute_layer_overhead_s: float = 0.0
    """Host time a recomputed layer pass takes beyond a forward's: the checkpoint's saved-tensor hooks that
    trigger the rerun and hand its tensors to the backward."""
    selective_layer_overhead_s: float = 0.0
    """Host time the selective policy adds to each forward and each recompute of a layer: a Python decision
    per operator (torch.utils.checkpoint's selective checkpointing runs as a dispatch mode)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not (getattr(self, f.name) >= 0):
                raise ValueError(f"host.{f.name}={getattr(self, f.name)!r} must be >= 0 (seconds)")


HOST_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(HostOverheads))
"""Keys that cluster files written before HostOverheads held under `efficiency` (read there still)."""


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    name: str = "custom"
    num_devices: int = 8
    """Devices in the cluster (the planner may be asked to plan for any count)."""
    devices_per_node: int = 8
    """Devices that share the fast intra-node link."""
    memory_bytes: float
    """Usable memory per device, bytes."""
    peak_flops: float
    """Peak dense 16-bit FLOP/s per device (fp32 peak on CPUs)."""
    efficiency: Efficiency = field(default_factory=Efficiency)
    """Achieved fractions of the hardware's peak (fitted)."""
    host: HostOverheads = field(default_factory=HostOverheads)
    """Host time of plait's executor on this device type (software, not hardware)."""
    intra_node: LinkSpec
    """Links between devices of one node (NVLink/NVSwitch; shared memory for CPU processes)."""
    inter_node: LinkSpec
    """Links between nodes (InfiniBand; per device)."""
    device_type: Literal["cuda", "cpu"] = "cuda"
    backend: Literal["nccl", "gloo"] = "nccl"
    oversubscription: float = 1.0
    """Threads the ranks of a node run over the cores it has (ranks x threads per rank / cores), where
    above 1: CPU processes sharing cores. `peak_flops` is then the rate each rank gets while all of them
    compute (what `plait profile` measures), and a rank computing while others wait runs up to this many
    times faster: a pipeline's idle stages lend their cores to the busy ones. 1 on GPUs."""
    groups: tuple[DeviceGroup, ...] = ()
    """A mixed cluster's device groups, in rank order (group 0 holds the first ranks); () for a uniform cluster,
    which the fields above describe. With groups, num_devices is their sum and the fields above are the first
    group's."""
    between_groups: LinkSpec | None = None
    """Links between devices of different groups; None: inter_node."""
    islands: Islands | None = None
    """Islands of nodes joined by a slower link (two clusters in one region, small clusters over a wide-area
    link); None: one island. The fields above describe the devices and links inside each island."""
    failures: Failures | None = None
    """How often the hardware fails (mean time between failures) and what a failure costs; None: not priced."""

    def __post_init__(self) -> None:
        if self.islands is not None:
            self._check_islands(self.islands)
        if self.groups:
            names = [g.name for g in self.groups]
            if len(set(names)) != len(names):
                raise ValueError(f"device group names {names} must differ")
            total = sum(g.num_devices for g in self.groups)
            if self.num_devices != total:
                raise ValueError(f"num_devices={self.num_devices} must equal the groups' {total} devices")
        if not (self.oversubscription >= 1.0):
            raise ValueError(f"oversubscription={self.oversubscription!r} must be >= 1 (1: no core is shared)")
        for name in ("num_devices", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name in ("memory_bytes", "peak_flops"):
            if not (getattr(self, name) > 0):
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")

    def _check_islands(self, islands: Islands) -> None:
        if self.groups:
            raise ValueError("islands and device groups together are not planned yet: give one of them")
        if self.num_devices % islands.count:
            raise ValueError(f"num_devices={self.num_devices} does not split into islands.count={islands.count} "
                             f"equal islands; give a count that divides it")
        if (self.num_devices // islands.count) % self.devices_per_node and self.num_devices // islands.count > self.devices_per_node:
            raise ValueError(f"an island of {self.num_devices // islands.count} devices is not a whole number of "
                             f"nodes of devices_per_node={self.devices_per_node}")
        fast = self.inter_node if self.num_devices // islands.count > self.devices_per_node else self.intra_node
        if islands.link.bandwidth > fast.bandwidth * (self.num_devices // islands.count):
            raise ValueError(f"islands.link.bandwidth={islands.link.bandwidth:.4g} B/s is faster than the links "
                             f"inside an island ({fast.bandwidth:.4g} B/s per device x "
                             f"{self.num_devices // islands.count} devices): the link between islands is the slow "
                             "one; give its real bandwidth, or drop `islands` for one cluster")

    @property
    def island_devices(self) -> int:
        """Devices of one island (all of them without islands)."""
        return self.num_devices // self.islands.count if self.islands else self.num_devices

    def island_view(self) -> "ClusterSpec":
        """The uniform cluster of one island: what its inner plan is priced and run on."""
        if self.islands is None:
            return self
        return dataclasses.replace(self, name=f"{self.name}/island", num_devices=self.island_devices, islands=None)

    @property
    def num_nodes(self) -> int:
        return -(-self.num_devices // self.devices_per_node)

    @property
    def mixed(self) -> bool:
        return len(self.groups) > 1

    def group(self, name: str) -> DeviceGroup:
        for group in self.groups:
            if group.name == name:
                return group
        raise ValueError(f"cluster {self.name!r} has no device group {name!r}; groups: "
                         f"{', '.join(g.name for g in self.groups) or 'none'}")

    def view(self, name: str) -> "ClusterSpec":
        """The uniform cluster of one device group (what the cost model prices a pipeline rank on)."""
        g = self.group(name)
        return dataclasses.replace(self, name=f"{self.name}/{g.name}", num_devices=g.num_devices,
                                   devices_per_node=g.devices_per_node, memory_bytes=g.memory_bytes,
                                   peak_flops=g.peak_flops, efficiency=g.efficiency, intra_node=g.intra_node,
                                   inter_node=g.inter_node or self.inter_node, groups=(), between_groups=None)

    def group_offsets(self) -> dict[str, int]:
        """First global rank of each group (groups hold consecutive ranks, in order)."""
        out, start = {}, 0
        for g in self.groups:
            out[g.name] = start
            start += g.num_devices
        return out

    def with_devices(self, num_devices: int) -> "ClusterSpec":
        if self.groups and num_devices != self.num_devices:
            raise ValueError(f"a mixed cluster is planned whole: {self.num_devices} devices "
                             f"({', '.join(f'{g.name} {g.num_devices}' for g in self.groups)}), not {num_devices}")
        return dataclasses.replace(self, num_devices=num_devices)

    def replace(self, **changes: Any) -> "ClusterSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ClusterSpec":
        return from_dict(cls, data, "cluster")

    @classmethod
    def upgrade_dict(cls, data: Any) -> Any:
        """A cluster mapping of an older plait: the host-time keys it held under `efficiency`
        (efficiency.layer_overhead_s, ...) move to `host` under the same names."""
        if not isinstance(data, dict) or not isinstance(data.get("efficiency"), dict):
            return data
        old = {k: v for k, v in data["efficiency"].items() if k in HOST_FIELDS}
        if not old:
            return data
        host = data.get("host") if isinstance(data.get("host"), dict) else {}
        both = sorted(set(old) & set(host))
        if both:
            raise ConfigError(f"cluster: {both[0]!r} is given both under efficiency (the old place) and under host; "
                              f"keep it under host only")
        upgraded = dict(data)
        upgraded["efficiency"] = {k: v for k, v in data["efficiency"].items() if k not in HOST_FIELDS}
        upgraded["host"] = {**host, **old}
        return upgraded
