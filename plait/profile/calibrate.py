"""Turn raw measurements into a ClusterSpec (pure: numbers in, spec out; no torch).

Two sources: `calibrate` fits what `plait profile` measured (GEMMs, blocks, collectives); `fit_terms`
corrects a ClusterSpec from the measured step times of whole plans (`plait tune`), term by term,
through the cost model itself. `kendall_tau` and `regret` say how right a ranking was.

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
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from plait.profile.fit import (
    CommSample, ComputeSample, LinkFit, MatmulFit, fit_link, fit_matmul_efficiency, fit_overhead,
)
from plait.spec.cluster import COLLECTIVES, Algorithm, ClusterSpec, Efficiency, HostOverheads, LinkSpec

if TYPE_CHECKING:
    from plait.plan import Plan

GEMM_NAMES = ("qkv", "proj", "fc1", "fc2")


@dataclass(frozen=True, kw_only=True)
class HostSample:
    """One probe plan (Plan.to_dict()) and its measured step time (median over steps, slowest rank)."""

    plan: dict
    seconds: float


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


def fit_host_terms(samples: tuple[HostSample, ...], cluster: ClusterSpec) -> "TermFit":
    """The host-time fields of `cluster` that best explain the probe plans' measured steps, given its
    compute and link fits (which stay as they are)."""
    from plait.plan import Plan

    observations = [Observation(plan=Plan.from_dict(s.plan).replace(cluster=cluster, predicted=None),
                                measured_s=s.seconds) for s in samples]
    return fit_terms(observations, cluster, tuple(HOST_TERMS))


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
    latency, bandwidth = _sig(fit.latency_s), _sig(fit.bandwidth)
    algorithms = {}
    for name in COLLECTIVES:
        if name in own:
            algorithms[name] = Algorithm(latency=_sig(own[name].latency_s / latency) if latency > 0 else 1.0,
                                         bandwidth=_sig(own[name].bandwidth / bandwidth))
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
    data["host_steps"] = tuple(HostSample(**s) for s in data.get("host_steps", ()))
    return Measurements(**data)


# ---- correcting the cost model from measured step times (`plait tune`) --------------------------
#
# The cost model is a function of the ClusterSpec. Each *term* below is one ClusterSpec quantity in
# which a kind of predicted time is proportional: 1/efficiency.matmul for compute (and the recompute
# and bubble made of it), a link's latency for the latency share of its collectives, 1/bandwidth for
# their volume share, host.layer_overhead_s for the fixed host time of every layer pass (and
# tp_layer_overhead_s for what DTensor adds to it under tensor parallelism; dtensor_param_overhead_s per
# DTensor parameter and step, step_overhead_s once per step). With
# x_k term k's value in units of a reference r_k, the predicted step of plan i is, to first order
# (exactly where the model is linear in them),
#
#     T_i(x) = T_i(x0) + sum_k X_ik · (x_k - x0_k),      X_ik = r_k · dT_i / d value_k
#
# so the measured steps y_i give a bounded least-squares problem for x. X_ik is read off the cost
# model by a finite difference, which needs no knowledge of its internals; the overlap rules
# (max(comm - compute, last bucket)) make it piecewise linear, hence a few Gauss-Newton rounds,
# re-linearizing at the corrected cluster each time.

HOST_TERMS: dict[str, str] = {
    "layer_overhead": "per layer pass",
    "tp_layer_overhead": "more per layer pass under TP",
    "fsdp_layer_overhead": "more per layer pass on fully_shard",
    "dtensor_param_overhead": "per DTensor parameter and step",
    "tp_param_overhead": "more per parameter and step under TP",
    "pipeline_overhead": "per pipeline stage pass",
    "step_overhead": "per step",
}
"""Terms that are a HostOverheads field `<term>_s` (ClusterSpec.host) of host seconds, and what each is paid for."""
TERMS: tuple[str, ...] = ("compute", *HOST_TERMS, "intra_latency", "intra_bandwidth", "inter_latency", "inter_bandwidth")
"""Terms `fit_terms` corrects, each one ClusterSpec quantity (see `term_value`)."""

ZERO_REFERENCE = {"layer_overhead": 1e-4, "tp_layer_overhead": 1e-3, "fsdp_layer_overhead": 1e-4,
                  "dtensor_param_overhead": 1e-4, "tp_param_overhead": 1e-4, "pipeline_overhead": 1e-4,
                  "step_overhead": 1e-3, "intra_latency": 1e-6, "inter_latency": 1e-6}
"""Reference of a term whose value is 0 (a preset without that cost): 100 us of host time per layer pass
(a CPU's dispatch of a transformer block's ops), 1 ms more under DTensor, 1 us per message. It sets the
scale at which the term counts as exercised (MIN_TERM_SHARE) and its bound (ZERO_BOUND times it)."""

MIN_TERM_SHARE = 0.01
"""A term below this share of every measured step (at its reference) is not identifiable from them
and is left as it was."""

PRIOR_WEIGHT = 0.005
"""Pull of each term towards its value before the fit, against the sum of squared relative errors:
the ratio of the variances of a measured step (~5% on a busy machine) and of the profiled value's log
(~0.7: right within a factor of 2), 0.05² / 0.7² ~ 0.005. It decides what the measurements cannot
(collinear or barely exercised terms) and yields to a term that moves every step by more than the noise."""

ZERO_PRIOR_WEIGHT = 1e-6
"""A term that was 0 has no scale to be right within: its pull back to 0 only keeps the problem regular."""

FACTOR_BOUNDS = (0.02, 50.0)
"""A term may shrink or grow at most this much in one fit (a larger change means the wrong term);
a term that was 0 may grow to ZERO_BOUND times its reference."""
ZERO_BOUND = 1000.0

# Physics, on top of those bounds: every time and latency stays >= 0 and every bandwidth > 0 (the terms are
# times, bounded below by 0 or by a positive fraction of their value), and efficiency.matmul stays <= 1: a
# fraction of peak. Where the peak is a datasheet's (GPUs), GEMMs cannot beat it: the compute term is bounded
# there. A CPU's peak_flops is the GEMM rate plait measured (plait profile) or a preset's guess: steps faster
# than it allows raise peak_flops instead (`_within_physics`), the same GEMM time with efficiency.matmul = 1.


@dataclass(frozen=True, kw_only=True)
class Observation:
    """One plan and its measured step time (median over steps, slowest rank)."""

    plan: "Plan"
    measured_s: float


@dataclass(frozen=True, kw_only=True)
class TermFit:
    """The result of `fit_terms`: a corrected cluster and how it was found."""

    cluster: ClusterSpec
    before: dict[str, float]
    """Term -> its value in the cluster given (term_value)."""
    after: dict[str, float]
    """Term -> its value in the corrected cluster."""
    fitted: tuple[str, ...]
    """Terms the measurements could identify; the others kept their values."""
    errors_before: tuple[float, ...]
    """Relative error |predicted - measured| / measured per observation, with the cluster given."""
    errors_after: tuple[float, ...]
    rounds: int
    notes: tuple[str, ...] = ()
    """What a person should know about the fit: a term held at a bound, a peak raised, too few plans."""

    @property
    def explains_nothing(self) -> bool:
        """The corrected cluster predicts the measured steps no better than the one given (root mean square of
        the relative errors): the timings are noise to the cost model, and the fit must not be used."""
        return _rms(self.errors_after) >= _rms(self.errors_before)

    @property
    def factors(self) -> dict[str, float]:
        """Term -> how many times its time grew (nan for a term that was 0)."""
        return {t: self.after[t] / self.before[t] if self.before[t] > 0 else math.nan for t in self.before}


def term_value(cluster: ClusterSpec, term: str) -> float:
    """The quantity of `cluster` that term `term`'s time is proportional to."""
    if term == "compute":
        return 1.0 / cluster.efficiency.matmul
    if term in HOST_TERMS:
        return getattr(cluster.host, f"{term}_s")
    link = getattr(cluster, _link_attr(term))
    return link.latency_s if term.endswith("_latency") else 1.0 / link.bandwidth


def with_term_value(cluster: ClusterSpec, term: str, value: float) -> ClusterSpec:
    """`cluster` with term `term` set to `value` (in term_value's units)."""
    eff = cluster.efficiency
    if term == "compute":
        return cluster.replace(efficiency=dataclasses.replace(eff, matmul=1.0 / value))
    if term in HOST_TERMS:
        return cluster.replace(host=dataclasses.replace(cluster.host, **{f"{term}_s": value}))
    attr = _link_attr(term)
    link = getattr(cluster, attr)  # every collective's line moves with the level's (their ratios are kept)
    if term.endswith("_latency"):
        return cluster.replace(**{attr: dataclasses.replace(link, latency_s=value)})
    return cluster.replace(**{attr: dataclasses.replace(link, bandwidth=1.0 / value)})


def _link_attr(term: str) -> str:
    level, _, quantity = term.partition("_")
    if level not in ("intra", "inter") or quantity not in ("latency", "bandwidth"):
        raise ValueError(f"term={term!r} is not one of {', '.join(TERMS)}")
    return f"{level}_node"


def scale_term(cluster: ClusterSpec, term: str, factor: float) -> ClusterSpec:
    """The cluster whose `term` time is `factor` times `cluster`'s."""
    return with_term_value(cluster, term, term_value(cluster, term) * factor)


def predicted_step(plan: "Plan", cluster: ClusterSpec) -> float:
    from plait.cost import predict

    return predict(plan.replace(cluster=cluster, predicted=None)).step_time_s


def reference(cluster: ClusterSpec, term: str) -> float:
    return term_value(cluster, term) or ZERO_REFERENCE.get(term, 1.0)


def term_shares(plan: "Plan", cluster: ClusterSpec, terms: tuple[str, ...] = TERMS,
                rel_step: float = 1e-3) -> dict[str, float]:
    """X_k: seconds of `plan`'s predicted step per reference unit of each term (= the term's share of
    the step for a term that is not 0), by a central difference (forward from 0)."""
    shares = {}
    for term in terms:
        value, delta = term_value(cluster, term), rel_step * reference(cluster, term)
        low = max(value - delta, 0.0)
        up = predicted_step(plan, with_term_value(cluster, term, value + delta))
        down = predicted_step(plan, with_term_value(cluster, term, low))
        shares[term] = max(0.0, (up - down) / (value + delta - low) * reference(cluster, term))
    return shares


def fit_terms(observations: list[Observation], cluster: ClusterSpec, terms: tuple[str, ...] = TERMS, *,
              prior_weight: float = PRIOR_WEIGHT, max_rounds: int = 12, tolerance: float = 1e-4) -> TermFit:
    """Correct `cluster`'s terms so the cost model best explains the measured step times.

    Minimizes the squared *relative* errors (a slow plan is not worth more than a fast one), with a
    weak prior pulling every term to its value before, within FACTOR_BOUNDS. Terms that no plan
    exercises (e.g. inter-node links on one machine) are left untouched; on one node the inter-node
    link is kept equal to the intra-node one, as `plait profile` writes it.
    """
    usable = [o for o in observations if o.measured_s > 0 and math.isfinite(o.measured_s)]
    if not usable:
        raise ValueError("no measured step times to fit")
    measured = np.array([o.measured_s for o in usable])
    refs = np.array([reference(cluster, t) for t in terms])
    original = np.array([term_value(cluster, t) for t in terms]) / refs
    low, high = _bounds(original)
    if "compute" in terms and cluster.device_type != "cpu":  # efficiency.matmul <= 1 of a datasheet peak
        k = terms.index("compute")
        low[k] = max(low[k], 1.0 / refs[k])
    current, fitted, rounds = cluster, (), 0
    for rounds in range(1, max_rounds + 1):
        shares = np.array([[s[t] for t in terms] for s in (term_shares(o.plan, current, terms) for o in usable)])
        shares *= refs / np.array([reference(current, t) for t in terms])  # per unit of the fixed reference
        active = [k for k in range(len(terms)) if (shares[:, k] / measured).max() >= MIN_TERM_SHARE]
        fitted = tuple(terms[k] for k in active)
        if not active:
            break
        x_now = np.array([term_value(current, t) for t in terms]) / refs
        predicted = np.array([predicted_step(o.plan, current) for o in usable])
        # what the active terms do not explain stays as it is
        rest = predicted - shares[:, active] @ x_now[active]
        weights = np.where(original[active] > 0, prior_weight, ZERO_PRIOR_WEIGHT)
        x = bounded_prior_lstsq(shares[:, active] / measured[:, None], 1.0 - rest / measured, original[active],
                                weights, (low[active], high[active]))
        for k, value in zip(active, x):
            current = with_term_value(current, terms[k], float(value * refs[k]))
        if np.abs(x - x_now[active]).max() < tolerance:
            break
    current = _tidy(current, cluster)
    after = {t: term_value(current, t) for t in terms}
    notes = _bound_notes(terms, fitted, after, refs, low, high, cluster) + _too_few(fitted, usable)
    final, raised = _within_physics(current)
    return TermFit(cluster=final, before={t: term_value(cluster, t) for t in terms}, after=after, fitted=fitted,
                   errors_before=_relative_errors(usable, cluster), errors_after=_relative_errors(usable, final),
                   rounds=rounds, notes=tuple(raised + notes))


def _within_physics(cluster: ClusterSpec) -> tuple[ClusterSpec, list[str]]:
    """efficiency.matmul above 1 on a CPU becomes a higher peak_flops (the same GEMM time): a fraction of
    peak above 1 would show as MFU above 100%."""
    eff = cluster.efficiency
    if eff.matmul <= 1.0:
        return cluster, []
    peak = _sig(cluster.peak_flops * eff.matmul)
    note = (f"compute: the steps ran faster than peak_flops allows; on a CPU the peak is a measured (or preset) GEMM "
            f"rate, so peak_flops {cluster.peak_flops / 1e9:.4g} -> {peak / 1e9:.4g} GFLOP/s and efficiency.matmul "
            f"stays 1")
    return cluster.replace(peak_flops=peak, efficiency=dataclasses.replace(eff, matmul=1.0)), [note]


def _bound_notes(terms: tuple[str, ...], fitted: tuple[str, ...], after: dict[str, float], refs: np.ndarray,
                 low: np.ndarray, high: np.ndarray, cluster: ClusterSpec) -> list[str]:
    notes = []
    for k, term in enumerate(terms):
        if term not in fitted:
            continue
        x = after[term] / refs[k]
        if term == "compute" and cluster.device_type != "cpu" and x <= low[k] * (1 + 1e-3) and low[k] * refs[k] >= 1:
            notes.append("compute: held at efficiency.matmul = 1 (the datasheet peak): the steps ran faster than "
                         "the cost model allows even at peak; the missing time is in another term, or peak_flops "
                         "is for another dtype")
        elif x >= high[k] * (1 - 1e-3) or (low[k] > 0 and x <= low[k] * (1 + 1e-3)):
            notes.append(f"{term}: held at the limit of one fit (x{FACTOR_BOUNDS[0]:g} to x{FACTOR_BOUNDS[1]:g}): a "
                         f"change this large means the time belongs to another term; time more plans (--top)")
    return notes


def _too_few(fitted: tuple[str, ...], usable: list["Observation"]) -> list[str]:
    if len(usable) >= len(fitted):
        return []
    return [f"{len(fitted)} terms from {len(usable)} timed plan(s): the prior decides what the plans cannot tell "
            f"apart; time at least {len(fitted)} plans (--top {len(fitted)}) for a fit of every term"]


def _rms(values: tuple[float, ...]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0


def _bounds(original: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    low, high = FACTOR_BOUNDS
    zero = original == 0
    return np.where(zero, 0.0, original * low), np.where(zero, ZERO_BOUND, original * high)


def bounded_prior_lstsq(a: np.ndarray, b: np.ndarray, prior: np.ndarray, weight: float | np.ndarray,
                        bounds: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """argmin ||a x - b||² + sum_k weight_k·(x_k - prior_k)² subject to low <= x <= high.

    A convex quadratic over a box (positive definite where every weight is > 0), solved by the primal
    active-set method: solve for the free unknowns with the others held at their bounds; where that
    leaves the box, walk towards it up to the first bound and hold that unknown there; where it stays
    inside, release the held unknown whose gradient points most into the box, until none does. Exact,
    and a handful of small solves for the dozen unknowns here."""
    low, high = (np.asarray(v, dtype=float) for v in bounds)
    n = a.shape[1]
    weight = np.broadcast_to(np.asarray(weight, dtype=float), (n,))
    gram = a.T @ a + np.diag(weight)
    rhs = a.T @ b + weight * prior
    x = np.clip(np.asarray(prior, dtype=float), low, high)
    held = np.zeros(n, dtype=bool)
    for _ in range(10 * n + 10):
        free = ~held
        target = x.copy()
        if free.any():
            target[free] = np.linalg.solve(gram[np.ix_(free, free)], rhs[free] - gram[np.ix_(free, held)] @ x[held])
        step = target - x
        with np.errstate(divide="ignore", invalid="ignore"):
            room = np.where(step > 0, (high - x) / step, np.where(step < 0, (low - x) / step, np.inf))
        room[held] = np.inf
        blocking = int(np.argmin(room))
        if room[blocking] < 1.0:  # the free solution leaves the box: go to its edge and hold that unknown
            x = np.clip(x + room[blocking] * step, low, high)
            x[blocking] = high[blocking] if step[blocking] > 0 else low[blocking]
            held[blocking] = True
            continue
        x = target
        gradient = gram @ x - rhs
        # a held unknown may leave its bound when the gradient points into the box
        pulls = np.where(held & (x <= low) & (gradient < 0), -gradient, 0.0)
        pulls += np.where(held & (x >= high) & (gradient > 0), gradient, 0.0)
        if not (pulls > 1e-12 * (1.0 + np.abs(rhs).max())).any():
            return x
        held[int(np.argmax(pulls))] = False
    return x


def _relative_errors(observations: list[Observation], cluster: ClusterSpec) -> tuple[float, ...]:
    return tuple(abs(predicted_step(o.plan, cluster) - o.measured_s) / o.measured_s for o in observations)


def _tidy(cluster: ClusterSpec, original: ClusterSpec) -> ClusterSpec:
    """Round to 4 significant figures (a file a person reads), and keep one node's inter-node link
    equal to its intra-node one when it was so (nothing measured can tell them apart)."""
    eff = cluster.efficiency
    cluster = cluster.replace(
        efficiency=dataclasses.replace(eff, matmul=_sig(eff.matmul)),
        host=dataclasses.replace(cluster.host, **{f"{t}_s": _sig(getattr(cluster.host, f"{t}_s")) for t in HOST_TERMS}),
        intra_node=_sig_link(cluster.intra_node), inter_node=_sig_link(cluster.inter_node))
    if cluster.num_nodes == 1 and original.inter_node == original.intra_node:
        cluster = cluster.replace(inter_node=cluster.intra_node)
    return cluster


def _sig(value: float) -> float:
    return float(f"{value:.4g}")


def _sig_link(link: LinkSpec) -> LinkSpec:
    return dataclasses.replace(link, latency_s=_sig(link.latency_s), bandwidth=_sig(link.bandwidth))


# ---- how right the predictions are ---------------------------------------------------------------

def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b rank correlation of two paired lists (ties counted as neither order)."""
    if len(xs) != len(ys):
        raise ValueError(f"paired lists differ in length: {len(xs)} and {len(ys)}")
    concordant = discordant = ties_x = ties_y = 0
    for i, j in itertools.combinations(range(len(xs)), 2):
        dx, dy = xs[i] - xs[j], ys[i] - ys[j]
        if dx == 0 and dy == 0:
            continue
        if dx == 0:
            ties_x += 1
        elif dy == 0:
            ties_y += 1
        elif (dx > 0) == (dy > 0):
            concordant += 1
        else:
            discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denominator if denominator else 0.0


def regret(predicted: list[float], measured: list[float]) -> float:
    """Measured step of the plan predicted fastest over the fastest measured step, minus 1 (0 = chose the best)."""
    chosen = min(range(len(predicted)), key=lambda i: predicted[i])
    return measured[chosen] / min(measured) - 1.0
