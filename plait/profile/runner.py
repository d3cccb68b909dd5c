"""Run a whole profile on the initialized process group: compute, memory, links, then host time.

Every rank runs the same list of steps in the same order (each step is a collective affair: rank
counts are agreed and groups are created by all ranks), rank 0 shows the progress bar, and every
rank returns the same `Measurements`.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import torch
import torch.distributed as dist

from plait.runtime.launch import usable_cores
from plait.profile import collectives, devices
from plait.profile.calibrate import GEMM_NAMES, HostSample, Measurements
from plait.profile.collectives import GroupSet, Level, Topology
from plait.profile.fit import COLLECTIVES, CommSample, ComputeSample


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    quick: bool = False
    """A few shapes and sizes, short timings: for tests and a first look (seconds, not minutes)."""

    @property
    def compute_target_s(self) -> float:
        """Time to spend repeating one compute measurement (more repetitions, steadier median)."""
        return 0.02 if self.quick else 0.5

    @property
    def comm_target_s(self) -> float:
        return 0.02 if self.quick else 0.25


@dataclass(frozen=True)
class Step:
    """One measurement: a label for the progress bar and what to run."""

    label: str
    run: Callable[[], None]


def run_profile(options: ProfileOptions, progress: Callable[[str, int], None] | None = None) -> Measurements:
    """Measure this rank's device and the links of the whole world; `progress(label, total)` per step."""
    device = devices.local_device()
    topology = collectives.discover_topology()
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    start = time.perf_counter()
    compute: list[ComputeSample] = []
    comm: dict[str, list[CommSample]] = {}
    host: list[HostSample] = []
    steps = (compute_steps(device, options, compute) + comm_steps(device, topology, options, comm)
             + host_steps(options, host))
    for step in steps:
        if progress is not None:
            progress(step.label, len(steps))
        step.run()
    return Measurements(
        world_size=dist.get_world_size(),
        devices_per_node=topology.devices_per_node,
        num_nodes=topology.num_nodes,
        device_type="cuda" if device.is_cuda else "cpu",
        device_name=_device_name(device),
        dtype=str(device.dtype).removeprefix("torch."),
        backend="nccl" if dist.get_backend() == "nccl" else "gloo",
        datasheet_peak_flops=devices.datasheet_peak_flops(device),
        memory_bytes=_min_over_ranks(devices.available_memory_bytes(device, topology.devices_per_node), device),
        compute=tuple(compute),
        comm={level: tuple(samples) for level, samples in comm.items()},
        oversubscription=oversubscription(device, topology.devices_per_node),
        host_steps=tuple(host),
        host=socket.gethostname(),
        torch_version=torch.__version__,
        started_at=started_at,
        seconds=time.perf_counter() - start,
    )


def oversubscription(device: devices.Device, ranks_per_node: int) -> float:
    """Threads this node's ranks run over the cores they may use (>= 1); 1 on GPUs, whose compute is not
    shared. Assumes every rank of the node runs as many threads as this one (run_local and torchrun do)."""
    if device.is_cuda:
        return 1.0
    return max(1.0, ranks_per_node * torch.get_num_threads() / usable_cores())


def compute_steps(device: devices.Device, options: ProfileOptions, out: list[ComputeSample]) -> list[Step]:
    """GEMMs, attention and a whole block per width; each rank's rate is the slowest rank's."""
    steps = []
    target = options.compute_target_s
    for shape in devices.compute_shapes(device, options.quick):
        h = shape.hidden_size
        for name in GEMM_NAMES:
            steps.append(Step(f"compute h={h} {name}", _appender(
                out, lambda s=shape, n=name: devices.measure_gemm(s, n, device, target), device)))
        steps.append(Step(f"compute h={h} attention", _appender(
            out, lambda s=shape: devices.measure_attention(s, device, target), device)))
        steps.append(Step(f"compute h={h} block", _appender(
            out, lambda s=shape: devices.measure_block(s, device, target), device)))
    return steps


def _appender(out: list[ComputeSample], measure: Callable[[], ComputeSample],
              device: devices.Device) -> Callable[[], None]:
    def run() -> None:
        sample = measure()
        # A synchronous step runs at the pace of its slowest rank, so that rank's time is the rate.
        seconds = _max_over_ranks(sample.seconds, device)
        out.append(ComputeSample(name=sample.name, hidden_size=sample.hidden_size, flops=sample.flops,
                                 seconds=seconds))
    return run


def comm_steps(device: devices.Device, topology: Topology, options: ProfileOptions,
               out: dict[str, list[CommSample]]) -> list[Step]:
    """Every collective x group size x message size, per link level that this world has."""
    levels: list[Level] = ["intra_node"] + (["inter_node"] if topology.num_nodes > 1 else [])
    steps = []
    for level in levels:
        sizes = topology.group_sizes(level, options.quick)
        for size in sizes:
            holder: dict[str, GroupSet] = {}
            steps.append(Step(f"{level} groups of {size}", _group_builder(holder, topology, level, size)))
            # p2p is a pair's business: time it once, on the smallest groups.
            names = [c for c in COLLECTIVES if c != "p2p" or size == sizes[0]]
            for name in names:
                for num_bytes in collectives.message_sizes(options.quick):
                    steps.append(Step(f"{level} {name} x{size} {_human_bytes(num_bytes)}", _comm_measure(
                        out.setdefault(level, []), holder, name, num_bytes, device, options.comm_target_s)))
    return steps


HOST_TIMING = {True: dict(steps=9, warmup=2), False: dict(steps=12, warmup=2)}
"""Timed and warm-up steps of each probe plan (quick profile: True). The host fit reads the probes' differences
(one micro-batch against four, DDP against fully_shard): with 3 steps a probe, timed one probe after another, a
burst of other work on the cores landed on one probe and the fit followed it (0.8 ms per DTensor parameter in one
quick profile, 14 ms per TP layer pass and 35 ms per step in the next, on the same machine)."""


def host_steps(options: ProfileOptions, out: list[HostSample]) -> list[Step]:
    """Time the probe plans of plait/profile/host.py end to end, all together, stepped round-robin (one step of each
    in turn, plait.profile.tune.time_plans): other work on the cores then lands on every probe of a round alike,
    and each probe's time is read against the others within the rounds (plait.profile.host.steady_probe_times), so
    their differences, which the host fit reads, hold."""
    from plait.profile.host import probe_plans, steady_probe_times
    from plait.profile.tune import TimingOptions, time_plans

    plans = probe_plans(dist.get_world_size())
    timing = TimingOptions(**HOST_TIMING[options.quick], batch=len(plans))

    def run() -> None:
        results = time_plans(plans, timing)
        for plan, result in zip(plans, results):
            if result.median_s is None:  # the executor refused it: a bug in probe_plans, not the user's input
                raise RuntimeError(f"probe plan {plan.describe()} was not timed: {result.error}")
        steady = steady_probe_times([list(r.step_times_s) for r in results])
        out.extend(HostSample(plan=plan.to_dict(), seconds=seconds, step_times=result.step_times_s)
                   for plan, result, seconds in zip(plans, results, steady))

    return [Step(f"host: {len(plans)} probe plans, round-robin", run)]


def _group_builder(holder: dict[str, GroupSet], topology: Topology, level: Level, size: int) -> Callable[[], None]:
    def run() -> None:
        holder["groups"] = collectives.build_groups(topology, level, size)
    return run


def _comm_measure(out: list[CommSample], holder: dict[str, GroupSet], name: str, num_bytes: int,
                  device: devices.Device, target_s: float) -> Callable[[], None]:
    def run() -> None:
        out.append(collectives.measure(name, holder["groups"], num_bytes, device, target_s))  # type: ignore[arg-type]
    return run


def _max_over_ranks(value: float, device: devices.Device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _min_over_ranks(value: float, device: devices.Device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def _device_name(device: devices.Device) -> str:
    if device.is_cuda:
        return torch.cuda.get_device_name(device.device)
    return f"CPU x{torch.get_num_threads()} thread(s)"


def _human_bytes(num_bytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g} {unit}"
    return f"{num_bytes} B"
