"""Turn what `plait profile` measured into a ClusterSpec (pure: numbers in, spec out; no torch).

`calibrate` fits the GEMMs, blocks and collectives, then the host time of the probe plans through the cost model
itself (plait.profile.terms.fit_terms, which `plait tune` uses on whole plans too).

Conventions are the cost model's (see plait/profile/fit.py for the formulas):
* `peak_flops`: the datasheet's dense 16-bit peak for a known GPU. A CPU has no figure plait can
  trust, so there the fitted large-GEMM asymptote of the rate each rank gets while every rank
  computes stands in for the peak (efficiency.matmul is then 1 and MFU is against that rate).
* `efficiency.matmul`, `efficiency.matmul_half_dim`: the fitted size curve of GEMM rates.
* `efficiency.overhead`: a whole block's time beyond its GEMMs', as a fraction of them.
* `intra_node`, `inter_node`: alpha-beta fits over every collective, group size and message size
  of groups placed inside a node / across nodes. On one node no link crosses nodes, so
  inter_node = intra_node (a plan for this machine never uses it).
* `memory_bytes`: the smallest free memory any rank reported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from plait.profile.fit import (
    CommSample, ComputeSample, LinkFit, MatmulFit, fit_link, fit_matmul_efficiency, fit_overhead,
)
from plait.profile.terms import HOST_TERMS, Observation, TermFit, fit_terms, round_sig
from plait.spec.cluster import COLLECTIVES, Algorithm, ClusterSpec, Efficiency, HostOverheads, LinkSpec

GEMM_NAMES = ("qkv", "proj", "fc1", "fc2")


@dataclass(frozen=True, kw_only=True)
class HostSample:
    """One probe plan (Plan.to_dict()) and its measured step time (the slowest rank's, at the median round:
    plait.profile.host.steady_probe_times)."""

    plan: dict
    seconds: float
    step_times: tuple[float, ...] = ()
    """Its timed steps, slowest rank, one per round of the round-robin (kept in the samples file, to refit)."""


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Everything one profile measured, as plain numbers."""

    world_size: int
    devices_per_node: int
    num_nodes: int
    device_type: Literal["cuda", "cpu"]
    device_name: str
    dtype: str
    backend: Literal["nccl", "gloo"]
    datasheet_peak_flops: float | None
    memory_bytes: float
    compute: tuple[ComputeSample, ...]
    comm: dict[str, tuple[CommSample, ...]] = field(default_factory=dict)
    """Samples per link level ("intra_node", "inter_node"); a level with no groups is absent."""
    oversubscription: float = 1.0
    """Threads of a node's ranks over its cores, where above 1 (ClusterSpec.oversubscription)."""
    host_steps: tuple["HostSample", ...] = ()
    """Small plans timed end to end (plait/profile/host.py): the host time per layer pass and parameter."""
    host: str = ""
    torch_version: str = ""
    started_at: str = ""
    seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Calibration:
    cluster: ClusterSpec
    matmul: MatmulFit
    links: dict[str, LinkFit]
    """Fit per measured link level: the LinkSpec the file holds."""
    per_collective: dict[str, dict[str, LinkFit]] = field(default_factory=dict)
    """level -> collective -> its own fit: how far each collective's algorithm is from the level's line
    (gloo's all-gather, for one, runs well below its all-reduce)."""
    host: "TermFit | None" = None
    """The host-time fit on the probe plans (None where the profile timed none)."""
    notes: tuple[str, ...] = ()
    """Fits that explain little or hit a physical limit, each with what to do (printed and written as comments)."""


MIN_LINK_R2 = 0.5
"""A link fit explaining less than this share of its timings' spread is flagged: at R² <= 0 the line explains
nothing (noise on a busy machine, or too few message sizes), and its latency and bandwidth are guesses."""


def calibrate(m: Measurements, name: str = "") -> Calibration:
    gemms = [s for s in m.compute if s.name in GEMM_NAMES]
    blocks = [s for s in m.compute if s.name == "block"]
    peak, matmul = _peak_and_matmul(gemms, m.datasheet_peak_flops, fastest=max((s.flops_per_s for s in m.compute), default=0.0))
    overhead = fit_overhead(blocks, peak, matmul) if blocks else 0.0
    links = {level: fit_link(samples) for level, samples in m.comm.items() if samples}
    if "intra_node" not in links:
        raise ValueError("no intra-node samples: a profile needs at least 2 ranks on a node")
    per_collective = _per_collective(m.comm)
    intra = _link(links["intra_node"], per_collective.get("intra_node", {}))
    inter = _link(links["inter_node"], per_collective.get("inter_node", {})) if "inter_node" in links else intra
    cluster = ClusterSpec(
        name=name or f"profiled-{m.host or m.device_type}",
        num_devices=m.world_size,
        devices_per_node=m.devices_per_node,
        memory_bytes=float(m.memory_bytes),
        peak_flops=float(peak),
        efficiency=Efficiency(matmul=round(matmul.matmul, 4), matmul_half_dim=round(matmul.half_dim, 2),
                              overhead=round(overhead, 4)),
        intra_node=intra,
        inter_node=inter,
        device_type=m.device_type,
        backend=m.backend,
        oversubscription=round(max(1.0, m.oversubscription), 3),
    )
    host = fit_host_terms(m.host_steps, cluster) if m.host_steps else None
    if host is not None:
        cluster = host.cluster
    notes = _link_notes(links, m) + _matmul_notes(matmul, m) + (list(host.notes) if host is not None else [])
    return Calibration(cluster=cluster, matmul=matmul, links=links, per_collective=per_collective, host=host,
                       notes=tuple(notes))


def _link_notes(links: dict[str, LinkFit], m: Measurements) -> list[str]:
    advice = "rerun without --quick, on an otherwise idle machine" if len(m.comm) else "rerun"
    return [f"{level}: the latency-bandwidth line explains {'nothing' if fit.r2 <= 0 else 'little'} of these "
            f"timings (R² {fit.r2:.2f}, median residual {fit.median_rel_residual:.0%}): its latency and bandwidth "
            f"are rough; {advice}" for level, fit in links.items() if fit.r2 < MIN_LINK_R2]


def _matmul_notes(matmul: MatmulFit, m: Measurements) -> list[str]:
    if not m.datasheet_peak_flops or matmul.matmul < 1.0:
        return []
    return [f"GEMMs measured at or above the datasheet peak of {m.device_name} ({m.datasheet_peak_flops / 1e12:.4g} "
            f"TFLOP/s): efficiency.matmul is held at 1; the timing is wrong, or the datasheet figure is for "
            f"another dtype than {m.dtype}"]


CPU_LAYER_PASS_FLOOR_S = 20e-6
"""Host seconds a CPU process spends at least per layer pass: a decoder layer's forward dispatches some twenty ops
through Python, autograd and the dispatcher, each a microsecond or more on any CPU (an assumption, not fitted; the
probe plans measure 0.3 to 3 ms on an idle machine). The host fit of CPU processes never goes below it, so that
timings on a loaded machine, whose noise can pull the per-pass time to 0, leave it physical."""


def fit_host_terms(samples: tuple[HostSample, ...], cluster: ClusterSpec) -> "TermFit":
    """The host-time fields of `cluster` that best explain the probe plans' measured steps, given its
    compute and link fits (which stay as they are). On CPU processes the per-pass time is held at or above
    CPU_LAYER_PASS_FLOOR_S; a fit that ends at the floor (or could not fit it) says so."""
    from plait.plan import Plan

    observations = [Observation(plan=Plan.from_dict(s.plan).replace(cluster=cluster, predicted=None),
                                measured_s=s.seconds) for s in samples]
    cpu = cluster.device_type == "cpu"
    fit = fit_terms(observations, cluster, tuple(HOST_TERMS),
                    floors={"layer_overhead": CPU_LAYER_PASS_FLOOR_S} if cpu else None)
    if not cpu or fit.cluster.host.layer_overhead_s > CPU_LAYER_PASS_FLOOR_S * 1.01:
        return fit
    host = dataclasses.replace(fit.cluster.host, layer_overhead_s=max(fit.cluster.host.layer_overhead_s,
                                                                      CPU_LAYER_PASS_FLOOR_S))
    return dataclasses.replace(fit, cluster=fit.cluster.replace(host=host), notes=(*fit.notes, (
        f"host time per layer pass: the probe timings do not tell it apart from the other terms (a loaded "
        f"machine?); held at its floor of {CPU_LAYER_PASS_FLOOR_S * 1e6:g} us rather than fitted: rerun "
        f"`plait profile` on an idle machine, or `plait tune` on the planned model")))


def _per_collective(comm: dict[str, tuple[CommSample, ...]]) -> dict[str, dict[str, LinkFit]]:
    fits: dict[str, dict[str, LinkFit]] = {}
    for level, samples in comm.items():
        for name in dict.fromkeys(s.collective for s in samples):
            rows = [s for s in samples if s.collective == name]
            if len({s.num_bytes for s in rows}) >= 2:
                fits.setdefault(level, {})[name] = fit_link(rows)
    return fits


def _peak_and_matmul(gemms: list[ComputeSample], datasheet_peak: float | None, fastest: float = 0.0
                     ) -> tuple[float, MatmulFit]:
    """The peak and the size curve as fractions of it, never above 1: a datasheet peak caps the fitted
    fraction; without one (CPU) the peak is the fitted large-GEMM rate, or the fastest operation measured if
    that was faster (a rate above "peak" would print as more than 100% of it)."""
    if datasheet_peak:
        fit = fit_matmul_efficiency(gemms, datasheet_peak)
        return datasheet_peak, dataclasses.replace(fit, matmul=min(1.0, fit.matmul))
    absolute = fit_matmul_efficiency(gemms, 1.0)  # fraction of 1 FLOP/s = the rate itself
    peak = float(f"{max(absolute.matmul, fastest):.4g}")
    return peak, MatmulFit(matmul=min(1.0, round(absolute.matmul / peak, 4)), half_dim=absolute.half_dim,
                           max_rel_residual=absolute.max_rel_residual)


def _link(fit: LinkFit, own: dict[str, LinkFit]) -> LinkSpec:
    """The level's line over every collective, and each plan collective's own line as multiples of it."""
    latency, bandwidth = round_sig(fit.latency_s), round_sig(fit.bandwidth)
    algorithms = {}
    for name in COLLECTIVES:
        if name in own:
            algorithms[name] = Algorithm(latency=round_sig(own[name].latency_s / latency) if latency > 0 else 1.0,
                                         bandwidth=round_sig(own[name].bandwidth / bandwidth))
    return LinkSpec(latency_s=latency, bandwidth=bandwidth, **algorithms)


# ---- the file's comment header ------------------------------------------------------------------

def describe(m: Measurements, cal: Calibration) -> list[str]:
    """Comment lines for the cluster file: what was measured, where, when, and how well it fits."""
    lines = [
        "Written by `plait profile`: measured on the devices in hand, fitted to plait's cost model.",
        f"measured: {m.started_at} in {m.seconds:.0f} s on host {m.host or '?'}, torch {m.torch_version}",
        f"world: {m.world_size} ranks = {m.num_nodes} node(s) x {m.devices_per_node}, {m.device_type} "
        f"{m.device_name} ({m.dtype}), backend {m.backend}",
        f"memory_bytes: smallest free memory of any rank ({m.memory_bytes / 2**30:.2f} GiB)",
        _peak_line(m, cal),
        f"oversubscription {m.oversubscription:g}: threads of this node's ranks over its cores"
        + (" (ranks share cores: an idle pipeline stage lends its cores to the busy ones)" if m.oversubscription > 1 else ""),
        "compute (forward + backward, every rank computing at once; GFLOP/s per rank):",
    ]
    lines += ["  " + row for row in compute_rows(m.compute)]
    lines.append("links (alpha-beta, ring convention, fit over all collectives/group sizes/message sizes):")
    for level, fit in cal.links.items():
        lines.append(f"  {level}: latency {fit.latency_s * 1e6:.1f} us, bandwidth {fit.bandwidth / 1e9:.3f} GB/s, "
                     f"R2 {fit.r2:.3f}, max rel residual {fit.max_rel_residual:.0%}, "
                     f"median {fit.median_rel_residual:.0%}, {fit.num_samples} samples")
        for name, own in cal.per_collective.get(level, {}).items():
            lines.append(f"    {name} alone: latency {own.latency_s * 1e6:.1f} us, bandwidth "
                         f"{own.bandwidth / 1e9:.3f} GB/s, max rel residual {own.max_rel_residual:.0%}")
    if "inter_node" not in cal.links:
        lines.append("  inter_node: one node, nothing crosses nodes: set equal to intra_node")
    if cal.host is not None:
        lines.append(host_line(cal.host, len(m.host_steps)))
    lines += [f"note: {note}" for note in cal.notes]
    return lines


def host_line(fit: "TermFit", plans: int) -> str:
    errors = sorted(fit.errors_after)
    return (f"host time (fitted on {plans} small plans timed end to end): {host_time_text(fit.cluster.host)}; "
            f"step error {errors[len(errors) // 2]:.0%} median, {errors[-1]:.0%} worst")


def host_time_text(host: HostOverheads) -> str:
    """Every host-time field, e.g. '0.57 ms per layer pass, 9.48 ms more per layer pass under TP, ...'."""
    return ", ".join(f"{getattr(host, f'{term}_s') * 1e3:.3g} ms {paid_for}" for term, paid_for in HOST_TERMS.items())


def _peak_line(m: Measurements, cal: Calibration) -> str:
    eff = cal.cluster.efficiency
    if m.datasheet_peak_flops:
        source = f"datasheet peak of {m.device_name}"
    else:
        source = "no datasheet peak on CPU: the fitted large-GEMM rate per rank stands in for it"
    return (f"peak_flops: {source}; GEMM fraction = {eff.matmul:g} * h / (h + {eff.matmul_half_dim:g}) "
            f"(max rel residual {cal.matmul.max_rel_residual:.0%}); non-GEMM overhead {eff.overhead:.0%} of GEMM time")


def compute_rows(samples: tuple[ComputeSample, ...] | list[ComputeSample]) -> list[str]:
    """One line per width: the rate of each measured operation."""
    by_width: dict[int, list[ComputeSample]] = {}
    for s in samples:
        by_width.setdefault(s.hidden_size, []).append(s)
    return [f"h={h}: " + ", ".join(f"{s.name} {s.flops_per_s / 1e9:.1f}" for s in rows)
            for h, rows in sorted(by_width.items())]


def measurements_json(m: Measurements) -> str:
    """Every raw measurement as JSON (what `--samples FILE` writes)."""
    import dataclasses
    import json

    return json.dumps(dataclasses.asdict(m), indent=1)


def measurements_from_json(text: str) -> Measurements:
    import json

    data = json.loads(text)
    data["compute"] = tuple(ComputeSample(**s) for s in data["compute"])
    data["comm"] = {level: tuple(CommSample(**s) for s in rows) for level, rows in data["comm"].items()}
    data["host_steps"] = tuple(HostSample(**{**s, "step_times": tuple(s.get("step_times", ()))})
                               for s in data.get("host_steps", ()))
    return Measurements(**data)
