"""Correcting a ClusterSpec from measured times of whole plans (`plait tune`, `plait tune --from-run`, and the
host-time fit of `plait profile`): fit only what the timings identify, within physics, and check the fit on
timings it was not fitted on. Pure: numbers in, a ClusterSpec out (no torch).

The cost model is a function of the ClusterSpec. Each *term* below is one ClusterSpec quantity in which a kind
of predicted time is proportional: 1/efficiency.matmul for compute (and the recompute and bubble made of it), a
link's latency for the latency share of its collectives, 1/bandwidth for their volume share, and the host
times of HostOverheads (per layer pass, per parameter tensor, per stage pass, per step). With x_k term k's value
in units of a reference r_k, the predicted time of observation i is, to first order (exactly where the model is
linear in them),

    T_i(x) = T_i(x0) + sum_k X_ik · (x_k - x0_k),      X_ik = r_k · dT_i / d value_k

so the measured times y_i give a bounded least-squares problem for x. X_ik is read off the cost model by a
finite difference, which needs no knowledge of its internals; the overlap rules (max(comm - compute, last
bucket)) make it piecewise linear, hence a few Gauss-Newton rounds, re-linearizing at the corrected cluster.

What keeps a fit from fitting noise:

* **Identifiability** (`identifiable`): a term is fitted only if it makes the cost model predict each timing
  from the others better (leave one out, on the model linearized at the cluster given), and never more terms than
  independent timings less one: two timed plans fit one constant, not five. The others keep their values (the
  prior), and the fit says which.
* **Physics**: every time, latency and host time stays >= 0 and every bandwidth > 0; efficiency.matmul stays
  <= 1 of peak_flops, a datasheet's peak or, on a CPU, the GEMM rate `plait profile` measured (so no plan priced
  on a tuned file shows an MFU above 100%).
* **Held-out error**: each timing is predicted by the fit of the others (leave one out). `refusal` turns down
  a fit whose held-out error is no better than the cluster given, or that identifies nothing.

An observation is a plan's whole step or one part of it as `plait train` measures them (compute, waiting,
optimizer: plait/train/measure.py), so one run's parts are several timings of one plan.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from plait.spec.cluster import ClusterSpec, LinkSpec

if TYPE_CHECKING:
    from plait.plan import Plan

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

PARTS = ("step", "compute", "waiting", "optimizer")
"""What an observation may time: the whole step, or one of the parts `plait train` measures."""

ZERO_REFERENCE = {"layer_overhead": 1e-4, "tp_layer_overhead": 1e-3, "fsdp_layer_overhead": 1e-4,
                  "dtensor_param_overhead": 1e-4, "tp_param_overhead": 1e-4, "pipeline_overhead": 1e-4,
                  "step_overhead": 1e-3, "intra_latency": 1e-6, "inter_latency": 1e-6}
"""Reference of a term whose value is 0 (a preset without that cost): 100 us of host time per layer pass
(a CPU's dispatch of a transformer block's ops), 1 ms more under DTensor, 1 us per message. It sets the
scale at which the term counts as exercised (MIN_TERM_SHARE) and its bound (ZERO_BOUND times it)."""

MIN_TERM_SHARE = 0.01
"""A term below this share of every measured time (at its reference) is not exercised by them."""

MIN_HELD_OUT_GAIN = 0.05
"""A term is fitted only if it lowers the held-out error (each timing predicted from the others) by at least this
share of it: less is what fitting the noise of a few timings gains by chance."""

PRIOR_WEIGHT = 1e-4
"""Pull of each fitted term towards its value before the fit, against the sum of squared relative errors: the
ratio of the variances of a measured step (~2% on a quiet machine) and of the profiled value (right within a
factor of 3), 0.02² / 2² = 1e-4. It only keeps a fit regular: which terms the timings decide is `identifiable`'s
business, and a term they decide should follow them (a stronger pull biased a term 3x its prior to 0.8x the
truth in tests/unit/test_calibrate_tune.py)."""

ZERO_PRIOR_WEIGHT = 1e-6
"""A term that was 0 has no scale to be right within: its pull back to 0 only keeps the problem regular."""

FACTOR_BOUNDS = (0.02, 50.0)
"""A term may shrink or grow at most this much in one fit (a larger change means the wrong term);
a term that was 0 may grow to ZERO_BOUND times its reference."""
ZERO_BOUND = 1000.0


@dataclass(frozen=True, kw_only=True)
class Observation:
    """One plan and what it measured: its step (median over steps, slowest rank), or one part of it."""

    plan: "Plan"
    measured_s: float
    part: str = "step"
    """One of PARTS."""
    launch: str = ""
    """Which launch timed it (`plait tune --from-run`: the run's LOG_DIR; one `plait tune` times all its plans in
    one). Plans timed in one launch, stepped together, differ by what they are; plans of separate runs differ by
    their minutes' load on a shared machine too (separable_terms)."""

    def __post_init__(self) -> None:
        if self.part not in PARTS:
            raise ValueError(f"part={self.part!r} is not one of {', '.join(PARTS)}")


@dataclass(frozen=True, kw_only=True)
class TermFit:
    """The result of `fit_terms`: a corrected cluster, how it was found, and how well it predicts."""

    cluster: ClusterSpec
    before: dict[str, float]
    """Term -> its value in the cluster given (term_value)."""
    after: dict[str, float]
    """Term -> its value in the corrected cluster."""
    fitted: tuple[str, ...]
    """Terms the measurements identify (see `identifiable`), in the order they were chosen; the others kept their
    values."""
    errors_before: tuple[float, ...]
    """Relative error |predicted - measured| / measured per observation, with the cluster given."""
    errors_after: tuple[float, ...]
    """The same with the corrected cluster (in-sample: it was fitted on them)."""
    rounds: int
    notes: tuple[str, ...] = ()
    """What a person should know about the fit: a term held at a bound, terms left at their prior."""
    held_out: tuple[float, ...] = ()
    """Per observation, the relative error of the fit of the other observations (leave one out); () below two."""
    left: tuple[str, ...] = ()
    """Terms some timing moves that the timings could not tell apart from the fitted ones: kept as they were."""
    best_first_before: bool | None = None
    """Whether the cluster given predicts the plan measured fastest to be the fastest (None: fewer than two plans
    timed whole)."""
    best_first_after: bool | None = None
    uncertainty: dict[str, float] = dataclasses.field(default_factory=dict)
    """Fitted term -> its standard error (term_value's units): the spread of the timings around the fit, carried
    through the cost model linearized at the fit. A term whose error is as large as its value is barely told apart
    from the others."""

    @property
    def factors(self) -> dict[str, float]:
        """Term -> how many times its time grew (nan for a term that was 0)."""
        return {t: self.after[t] / self.before[t] if self.before[t] > 0 else math.nan for t in self.before}


def refusal(fit: TermFit) -> str | None:
    """Why the fit must not be used (None when it may): what it cannot show, in a sentence; the caller says what
    to measure more of."""
    n = len(fit.errors_before)
    if n < 2:
        return "one timing leaves nothing to check a fit against"
    if not fit.fitted:
        return (f"these {n} timings identify no constant of the cost model: fitting any of them predicts each timing "
                f"from the others no better than the cluster given does")
    before, in_sample = rms(fit.errors_before), rms(fit.errors_after)
    held = rms(fit.held_out) if fit.held_out else in_sample
    if in_sample >= before or held >= before:
        return (f"the fit predicts each timing from the others no better than the cluster given (RMS error "
                f"{before:.1%} -> {held:.1%} held out, {in_sample:.1%} in-sample): the timings are noise to the cost "
                f"model")
    return None


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


def predicted_time(plan: "Plan", cluster: ClusterSpec, part: str = "step") -> float:
    """The cost model's step of `plan` on `cluster`, or one part of it grouped as `plait train` measures it."""
    from plait.cost.layout import Setting
    from plait.cost.model import step_time
    from plait.train.measure import Parts

    step = step_time(Setting(plan.model, cluster, plan.train), plan.layout, plan.layers_per_stage, plan.recompute)
    if part == "step":
        return step.total
    return getattr(Parts.of_prediction(step.total, step.parts), part)


def predicted_step(plan: "Plan", cluster: ClusterSpec) -> float:
    return predicted_time(plan, cluster)


def reference(cluster: ClusterSpec, term: str) -> float:
    return term_value(cluster, term) or ZERO_REFERENCE.get(term, 1.0)


def term_shares(plan: "Plan", cluster: ClusterSpec, terms: tuple[str, ...] = TERMS, rel_step: float = 1e-3,
                part: str = "step") -> dict[str, float]:
    """X_k: seconds of `plan`'s predicted step (or `part`) per reference unit of each term (= the term's share of
    it for a term that is not 0), by a central difference (forward from 0)."""
    shares = {}
    for term in terms:
        value, delta = term_value(cluster, term), rel_step * reference(cluster, term)
        low = max(value - delta, 0.0)
        up = predicted_time(plan, with_term_value(cluster, term, value + delta), part)
        down = predicted_time(plan, with_term_value(cluster, term, low), part)
        shares[term] = max(0.0, (up - down) / (value + delta - low) * reference(cluster, term))
    return shares


def share_matrix(observations: list[Observation], cluster: ClusterSpec, terms: tuple[str, ...]) -> np.ndarray:
    """[observation, term]: each term's share of each observation's measured time per reference unit."""
    measured = np.array([o.measured_s for o in observations])
    shares = np.array([[s[t] for t in terms] for s in (term_shares(o.plan, cluster, terms, part=o.part)
                                                         for o in observations)])
    return shares / measured[:, None]


def identifiable(relative: np.ndarray, residual: np.ndarray, weights: np.ndarray, bounds: tuple[np.ndarray, np.ndarray],
                 *, min_share: float = MIN_TERM_SHARE, min_gain: float = MIN_HELD_OUT_GAIN) -> list[int]:
    """The terms (columns of `relative`, [timing, term] shares per reference unit) the timings identify, in the order
    chosen: forward selection on the held-out error of the cost model linearized at the cluster given.

    `residual` is each timing's relative error there ((measured - predicted) / measured); a set of terms predicts
    timing i by the bounded fit (`bounded_prior_lstsq`, changes within `bounds`, prior pull `weights`) of the other
    timings. Starting from none, the term that lowers the RMS of those held-out errors the most is added, as long
    as it lowers it by `min_gain` of itself, can move some timing by `min_share` within its bounds, and the terms
    stay fewer than the independent timings (the rank of `relative`, at most the timings less one). A term the
    others already explain, or that only follows the noise, does not predict a timing it was not fitted on, and is
    left out."""
    reach = np.maximum(np.abs(bounds[0]), np.abs(bounds[1]))
    exercised = [k for k in range(relative.shape[1]) if relative[:, k].max() * reach[k] >= min_share]
    if not exercised:
        return []
    cap = min(len(residual) - 1, int(np.linalg.matrix_rank(relative[:, exercised], tol=1e-3)))
    chosen: list[int] = []
    best = rms(list(residual))
    while len(chosen) < cap:
        scores = {k: _linear_held_out(relative, residual, chosen + [k], weights, bounds)
                  for k in exercised if k not in chosen}
        k = min(scores, key=scores.get)
        if scores[k] > best * (1.0 - min_gain):
            break
        chosen.append(k)
        best = scores[k]
    return chosen


def _linear_held_out(relative: np.ndarray, residual: np.ndarray, terms: list[int], weights: np.ndarray,
                     bounds: tuple[np.ndarray, np.ndarray]) -> float:
    """RMS relative error of each timing predicted by the linearized fit of the others, with `terms` free."""
    errors = []
    for i in range(len(residual)):
        keep = np.arange(len(residual)) != i
        change = bounded_prior_lstsq(relative[np.ix_(keep, terms)], residual[keep], np.zeros(len(terms)),
                                     weights[terms], (bounds[0][terms], bounds[1][terms]))
        errors.append(float(residual[i] - relative[i, terms] @ change))
    return rms(errors)


def fit_terms(observations: list[Observation], cluster: ClusterSpec, terms: tuple[str, ...] = TERMS, *,
              prior_weight: float = PRIOR_WEIGHT, max_rounds: int = 12, tolerance: float = 1e-4,
              only: tuple[str, ...] | None = None, validate: bool = True,
              floors: dict[str, float] | None = None) -> TermFit:
    """Correct `cluster`'s terms so the cost model best explains the measured times.

    Fits the terms the timings identify (`identifiable`, at most one fewer than the timings; `only` fixes them
    instead), minimizing the squared *relative* errors (a slow plan is not worth more than a fast one) with a weak
    prior pulling every term to its value before, within FACTOR_BOUNDS and physics (see the module docstring).
    On one node the inter-node link is kept equal to the intra-node one, as `plait profile` writes it. With
    `validate`, every observation is also predicted by the fit of the others (TermFit.held_out)."""
    usable = [o for o in observations if o.measured_s > 0 and math.isfinite(o.measured_s)]
    if not usable:
        raise ValueError("no measured step times to fit")
    if only is None:
        terms = separable_terms(usable, terms)
    measured = np.array([o.measured_s for o in usable])
    refs = np.array([reference(cluster, t) for t in terms])
    original = np.array([term_value(cluster, t) for t in terms]) / refs
    low, high = _physical_bounds(terms, original, refs, floors or {})
    weights = np.where(original > 0, prior_weight, ZERO_PRIOR_WEIGHT)
    residual = 1.0 - np.array([predicted_time(o.plan, cluster, o.part) for o in usable]) / measured
    relative = np.zeros((len(usable), len(terms)))
    needed = [k for k, t in enumerate(terms) if only is None or t in only]
    relative[:, needed] = share_matrix(usable, cluster, tuple(terms[k] for k in needed))
    if only is None:
        start = np.clip(original, low, high)
        free = identifiable(relative, residual, weights, (low - start, high - start))
    else:
        free = [terms.index(t) for t in only if t in terms]
    fitted = tuple(terms[k] for k in free)
    current, rounds, shares = cluster, 0, relative * measured[:, None]
    for rounds in range(1, max_rounds + 1 if free else 1):
        shares = relative * measured[:, None]
        if rounds > 1:  # re-linearize the free terms at the corrected cluster
            shares[:, free] = share_matrix(usable, current, tuple(terms[k] for k in free)) * measured[:, None]
        shares *= refs / np.array([reference(current, t) for t in terms])  # per unit of the fixed reference
        x_now = np.array([term_value(current, t) for t in terms]) / refs
        predicted = np.array([predicted_time(o.plan, current, o.part) for o in usable])
        rest = predicted - shares[:, free] @ x_now[free]  # what the free terms do not explain stays as it is
        x = bounded_prior_lstsq(shares[:, free] / measured[:, None], 1.0 - rest / measured,
                                np.clip(original[free], low[free], high[free]), weights[free], (low[free], high[free]))
        for k, value in zip(free, x):
            current = with_term_value(current, terms[k], float(value * refs[k]))
        if np.abs(x - x_now[free]).max() < tolerance:
            break
    current = _tidy(current, cluster)
    after = {t: term_value(current, t) for t in terms}
    left = tuple(t for k, t in enumerate(terms) if t not in fitted and relative[:, k].max() >= MIN_TERM_SHARE)
    notes = _bound_notes(terms, fitted, after, refs, low, high, cluster)
    if "compute" in terms and "compute" not in fitted and cluster.efficiency.matmul >= 1.0 and np.median(residual) < -0.1:
        notes.insert(0, _at_peak_note(cluster))
    errors_after = _relative_errors(usable, current)
    fit = TermFit(cluster=current, before={t: term_value(cluster, t) for t in terms}, after=after, fitted=fitted,
                  errors_before=_relative_errors(usable, cluster), errors_after=errors_after,
                  rounds=rounds, notes=tuple(notes), left=left, best_first_before=_best_first(usable, cluster),
                  best_first_after=_best_first(usable, current),
                  uncertainty=_standard_errors(shares[:, free] / measured[:, None], weights[free], refs[free], fitted,
                                               errors_after))
    if validate and len(usable) >= 2 and fitted:
        held = tuple(_held_out_error(usable, i, cluster, terms, fitted, prior_weight, floors)
                     for i in range(len(usable)))
        fit = dataclasses.replace(fit, held_out=held)
    return fit


def separable_terms(observations: list[Observation], terms: tuple[str, ...]) -> tuple[str, ...]:
    """`terms` less those the observations cannot tell from another: timings of one plan (a run's parts, `plait tune
    --from-run` of one run) grow with its FLOPs and with its layer passes alike, so the GEMM time ("compute") and the
    host time per layer pass ("layer_overhead") are one column to them, and a fit picks between the two by the
    timings' noise. Another plan timed in the same launch tells them apart (another micro-batch size: as many FLOPs,
    other passes), and the one it picks generalises only if it is the right one. Plans of separate runs do not: on a
    machine shared with other work, the minutes between them move their steps as much as the plans do (one plan
    measured 0.10 s and 0.16 s a step in two runs minutes apart), and a fit that read that load as the difference
    between the plans put it into the GEMM rate. There the GEMM efficiency, which `plait profile` measures on its
    own (GEMMs at the model's widths), keeps its value and the host terms take the difference: the host time of the
    model's own layer code is what no profile measures (its probes run plait's tiny GPT)."""
    plans_per_launch: dict[str, set[str]] = {}
    for o in observations:
        plans_per_launch.setdefault(o.launch, set()).add(o.plan.to_json())
    together = any(len(plans) > 1 for plans in plans_per_launch.values())
    if not together and "compute" in terms and "layer_overhead" in terms:
        return tuple(t for t in terms if t != "compute")
    return terms


def _standard_errors(jacobian: np.ndarray, weights: np.ndarray, refs: np.ndarray, fitted: tuple[str, ...],
                     errors: tuple[float, ...]) -> dict[str, float]:
    """Standard error of each fitted term: residual variance (over the degrees of freedom left) times the inverse
    of the linearized normal matrix, in the terms' own units."""
    if not fitted:
        return {}
    variance = sum(e * e for e in errors) / max(1, len(errors) - len(fitted))
    covariance = variance * np.linalg.inv(jacobian.T @ jacobian + np.diag(weights))
    return {t: float(np.sqrt(max(covariance[k, k], 0.0)) * refs[k]) for k, t in enumerate(fitted)}


def _held_out_error(observations: list[Observation], index: int, cluster: ClusterSpec, terms: tuple[str, ...],
                    fitted: tuple[str, ...], prior_weight: float, floors: dict[str, float] | None = None) -> float:
    """Observation `index` predicted by the fit of the others (the same terms: at most as many as they are)."""
    others = observations[:index] + observations[index + 1:]
    fold = fit_terms(others, cluster, terms, prior_weight=prior_weight, only=fitted, validate=False, floors=floors)
    held = observations[index]
    return relative_error(predicted_time(held.plan, fold.cluster, held.part), held.measured_s)


def _physical_bounds(terms: tuple[str, ...], original: np.ndarray, refs: np.ndarray,
                     floors: dict[str, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """FACTOR_BOUNDS around each term's value, efficiency.matmul <= 1 (the compute term >= 1), and each term of
    `floors` at least its floor (a time no machine goes below: plait.profile.calibrate.CPU_LAYER_PASS_FLOOR_S)."""
    low, high = FACTOR_BOUNDS
    zero = original == 0
    low, high = np.where(zero, 0.0, original * low), np.where(zero, ZERO_BOUND, original * high)
    for term, floor in (floors or {}).items():
        if term in terms:
            k = terms.index(term)
            low[k] = max(low[k], floor / refs[k])
            high[k] = max(high[k], low[k])
    if "compute" in terms:
        k = terms.index("compute")
        low[k] = max(low[k], 1.0 / refs[k])
        high[k] = max(high[k], low[k])
    return low, high


def _bound_notes(terms: tuple[str, ...], fitted: tuple[str, ...], after: dict[str, float], refs: np.ndarray,
                 low: np.ndarray, high: np.ndarray, cluster: ClusterSpec) -> list[str]:
    notes = []
    for k, term in enumerate(terms):
        if term not in fitted:
            continue
        x = after[term] / refs[k]
        if term == "compute" and x <= low[k] * (1 + 1e-3) and low[k] * refs[k] >= 1:
            notes.append(_at_peak_note(cluster))
        elif x >= high[k] * (1 - 1e-3) or (low[k] > 0 and x <= low[k] * (1 + 1e-3)):
            notes.append(f"{term}: held at the limit of one fit (x{FACTOR_BOUNDS[0]:g} to x{FACTOR_BOUNDS[1]:g}): a "
                         f"change this large means the time belongs to another term; time more plans (--top)")
    return notes


def _at_peak_note(cluster: ClusterSpec) -> str:
    peak = "the datasheet peak" if cluster.device_type != "cpu" else "peak_flops, the GEMM rate plait profile measured"
    return (f"compute: held at efficiency.matmul = 1 ({peak}): the steps ran faster than the cost model allows even at "
            f"that rate; the missing time is in another term, or peak_flops is wrong (re-run plait profile)")


def _best_first(observations: list[Observation], cluster: ClusterSpec) -> bool | None:
    """Whether `cluster` predicts the plan measured fastest to be the fastest (whole steps of two plans or more)."""
    steps = [o for o in observations if o.part == "step"]
    if len({o.plan.describe() for o in steps}) < 2:
        return None
    predicted = [predicted_time(o.plan, cluster) for o in steps]
    return regret(predicted, [o.measured_s for o in steps]) == 0.0


def rms(values: tuple[float, ...] | list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0


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
    return tuple(relative_error(predicted_time(o.plan, cluster, o.part), o.measured_s) for o in observations)


def _tidy(cluster: ClusterSpec, original: ClusterSpec) -> ClusterSpec:
    """Round to 4 significant figures (a file a person reads), efficiency.matmul never above 1, and keep one node's
    inter-node link equal to its intra-node one when it was so (nothing measured can tell them apart)."""
    eff = cluster.efficiency
    cluster = cluster.replace(
        efficiency=dataclasses.replace(eff, matmul=min(round_sig(eff.matmul), 1.0)),
        host=dataclasses.replace(cluster.host, **{f"{t}_s": round_sig(getattr(cluster.host, f"{t}_s")) for t in HOST_TERMS}),
        intra_node=_sig_link(cluster.intra_node), inter_node=_sig_link(cluster.inter_node))
    if cluster.num_nodes == 1 and original.inter_node == original.intra_node:
        cluster = cluster.replace(inter_node=cluster.intra_node)
    return cluster


def round_sig(value: float) -> float:
    """4 significant figures: what a cluster file a person reads holds."""
    return float(f"{value:.4g}")


def _sig_link(link: LinkSpec) -> LinkSpec:
    return dataclasses.replace(link, latency_s=round_sig(link.latency_s), bandwidth=round_sig(link.bandwidth))


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


# ---- which plans to time -----------------------------------------------------------------------------------

def informative_plans(plans: list["Plan"], cluster: ClusterSpec, count: int,
                      terms: tuple[str, ...] = TERMS) -> list["Plan"]:
    """`count` of `plans` (best first) to time so that each term moves some of them, differently: the best plan
    first (the one a user would run), then, in turn, the plan whose row of term shares lies furthest outside the
    span of the rows chosen (each term scaled to its largest share among the candidates, so a term with little
    time counts as much as compute); ties go to the better-ranked plan. Plans that only differ in what no term
    prices (or in the same proportions) add nothing a fit can use."""
    if count >= len(plans):
        return list(plans)
    rows = np.array([[s[t] for t in terms] for s in (term_shares(p, cluster, terms) for p in plans)])
    rows /= np.array([predicted_time(p, cluster) for p in plans])[:, None]
    scale = rows.max(axis=0)
    rows = rows[:, scale > 0] / scale[scale > 0]
    chosen, basis = [0], []
    while len(chosen) < count:
        last = rows[chosen[-1]] - sum((rows[chosen[-1]] @ q) * q for q in basis)
        if np.linalg.norm(last) > 1e-9:
            basis.append(last / np.linalg.norm(last))
        outside = [np.linalg.norm(r - sum((r @ q) * q for q in basis)) if i not in chosen else -1.0
                   for i, r in enumerate(rows)]
        best = max(outside)
        chosen.append(next(i for i, v in enumerate(outside) if v >= best - 1e-9))
    return [plans[i] for i in chosen]
