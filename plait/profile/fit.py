"""Fit measured timings to the cost model's formulas (pure numpy: no torch, no process groups).

Communication uses the alpha-beta ring convention of `LinkSpec`: one ring step costs the link's
latency alpha, and a device pushes bytes at the bus bandwidth beta. For a group of p devices and a
message of n bytes (n = the full tensor: the all-reduce buffer, the all-gather output, the
reduce-scatter input, one rank's all-to-all buffer):

    all_reduce      t = 2(p-1)·alpha + 2(p-1)/p · n/beta     (reduce-scatter then all-gather)
    all_gather      t =  (p-1)·alpha +  (p-1)/p · n/beta
    reduce_scatter  t =  (p-1)·alpha +  (p-1)/p · n/beta
    all_to_all      t =  (p-1)·alpha +  (p-1)/p · n/beta     (each rank keeps 1/p of its buffer)
    p2p             t =        alpha +            n/beta

so t = steps·alpha + volume/beta is linear in (alpha, 1/beta), and a least-squares fit over every
(collective, group size, message size) gives one LinkSpec per link level.

Compute uses the achieved fraction of peak of a GEMM whose model width is h:
    fraction(h) = matmul · h / (h + matmul_half_dim)
so 1/fraction = 1/matmul + (matmul_half_dim/matmul)·(1/h), again linear.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import numpy as np

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
COLLECTIVES: tuple[Collective, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def ring_terms(collective: Collective, group_size: int) -> tuple[float, float]:
    """(latency steps, bus-volume factor) of `collective` on `group_size` devices: t = steps·alpha + factor·n/beta."""
    p = group_size
    if p < 1:
        raise ValueError(f"group_size={p} must be >= 1")
    if collective == "p2p":
        return 1.0, 1.0
    if p == 1:
        return 0.0, 0.0
    if collective == "all_reduce":
        return 2.0 * (p - 1), 2.0 * (p - 1) / p
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(p - 1), (p - 1) / p
    raise ValueError(f"collective={collective!r} is not one of {', '.join(COLLECTIVES)}")


def predict_seconds(collective: Collective, group_size: int, num_bytes: float, latency_s: float,
                    bandwidth: float) -> float:
    """Time the alpha-beta model predicts for one collective call."""
    steps, factor = ring_terms(collective, group_size)
    return steps * latency_s + factor * num_bytes / bandwidth


@dataclass(frozen=True, kw_only=True)
class CommSample:
    """One measured collective: median seconds per call over several calls."""

    collective: Collective
    group_size: int
    num_bytes: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """A fitted (latency, bandwidth) pair and how well it explains the samples it came from."""

    latency_s: float
    bandwidth: float
    """Bytes per second (bus bandwidth, ring convention)."""
    r2: float
    """Coefficient of determination of predicted against measured seconds."""
    max_rel_residual: float
    """Largest |predicted - measured| / measured over the samples."""
    median_rel_residual: float
    num_samples: int


def fit_link(samples: Sequence[CommSample]) -> LinkFit:
    """Least-squares fit of t = steps·alpha + volume/beta to `samples`, alpha >= 0, beta > 0.

    Residuals are relative (each row divided by its measured time) because message times span
    four orders of magnitude: an absolute fit would ignore every small message, i.e. the latency.
    """
    usable = [s for s in samples if s.seconds > 0 and ring_terms(s.collective, s.group_size)[1] > 0]
    if len(usable) < 2:
        raise ValueError(f"need at least 2 timed samples to fit latency and bandwidth, got {len(usable)}")
    design = np.array([ring_terms(s.collective, s.group_size) for s in usable], dtype=float)
    design[:, 1] *= np.array([s.num_bytes for s in usable], dtype=float)
    seconds = np.array([s.seconds for s in usable], dtype=float)
    alpha, inv_beta = _nonnegative_lstsq(design / seconds[:, None], np.ones_like(seconds))
    if inv_beta <= 0:
        # Every sample looked latency-bound: fall back to the largest message's rate.
        inv_beta = max(seconds / np.maximum(design[:, 1], 1.0))
    predicted = design @ np.array([alpha, inv_beta])
    return LinkFit(latency_s=float(alpha), bandwidth=float(1.0 / inv_beta), r2=r_squared(seconds, predicted),
                   **_relative_residuals(seconds, predicted), num_samples=len(usable))


def evaluate_link(samples: Sequence[CommSample], latency_s: float, bandwidth: float) -> LinkFit:
    """How well a given (latency, bandwidth) explains `samples` (e.g. a preset, or a fit on other samples)."""
    seconds = np.array([s.seconds for s in samples], dtype=float)
    predicted = np.array([predict_seconds(s.collective, s.group_size, s.num_bytes, latency_s, bandwidth)
                          for s in samples])
    return LinkFit(latency_s=latency_s, bandwidth=bandwidth, r2=r_squared(seconds, predicted),
                   **_relative_residuals(seconds, predicted), num_samples=len(samples))


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """min ||a x - b|| over x >= 0 for two unknowns: the unconstrained solution, else the best edge."""
    x, *_ = np.linalg.lstsq(a, b, rcond=None)
    if (x >= 0).all():
        return float(x[0]), float(x[1])
    candidates = []
    for column in range(2):
        col = a[:, column]
        value = max(float(col @ b) / float(col @ col), 0.0) if col @ col > 0 else 0.0
        solution = np.zeros(2)
        solution[column] = value
        candidates.append((float(np.sum((a @ solution - b) ** 2)), solution))
    best = min(candidates, key=lambda c: c[0])[1]
    return float(best[0]), float(best[1])


def r_squared(measured: np.ndarray, predicted: np.ndarray) -> float:
    total = float(np.sum((measured - measured.mean()) ** 2))
    if total == 0:
        return 1.0 if np.allclose(measured, predicted) else 0.0
    return 1.0 - float(np.sum((measured - predicted) ** 2)) / total


def _relative_residuals(measured: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    rel = np.abs(predicted - measured) / measured
    return {"max_rel_residual": float(rel.max()), "median_rel_residual": float(np.median(rel))}


# ---- compute ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ComputeSample:
    """Achieved FLOP/s of one operation (forward + backward) of a model of width `hidden_size`."""

    name: str
    hidden_size: int
    flops: float
    seconds: float

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds


@dataclass(frozen=True, kw_only=True)
class MatmulFit:
    """fraction(h) = matmul · h / (h + half_dim) of `peak_flops`."""

    matmul: float
    half_dim: float
    max_rel_residual: float


def fit_matmul_efficiency(samples: Iterable[ComputeSample], peak_flops: float) -> MatmulFit:
    """Fit the size curve to measured GEMM rates: 1/fraction is linear in 1/h (least squares)."""
    samples = list(samples)
    if not samples:
        raise ValueError("need at least one GEMM sample to fit matmul efficiency")
    inv_h = np.array([1.0 / s.hidden_size for s in samples])
    fraction = np.array([s.flops_per_s / peak_flops for s in samples])
    intercept, slope = _line_fit(inv_h, 1.0 / fraction)
    if slope < 0 or intercept <= 0:
        # No size effect visible (noise, or every shape already saturates): one constant fraction.
        intercept, slope = float(np.mean(1.0 / fraction)), 0.0
    matmul, half_dim = 1.0 / intercept, slope / intercept
    predicted = matmul * (1.0 / inv_h) / (1.0 / inv_h + half_dim)
    return MatmulFit(matmul=float(matmul), half_dim=float(half_dim),
                     max_rel_residual=float(np.max(np.abs(predicted - fraction) / fraction)))


def _line_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line; a flat line through the mean for one distinct x."""
    if np.ptp(x) == 0:
        return float(np.mean(y)), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def fit_overhead(blocks: Iterable[ComputeSample], peak_flops: float, matmul: MatmulFit) -> float:
    """Non-GEMM time of a whole block as a fraction of its GEMM time predicted by `matmul`.

    The block's FLOPs (weight GEMMs and attention, as the cost model counts them) at the fitted rate
    give the GEMM time; what the measured block takes beyond it is norms, softmax, GeLU, residuals
    and launches. Median over widths; never negative (a block cannot beat its own GEMMs on average).
    """
    ratios = []
    for block in blocks:
        fraction = matmul.matmul * block.hidden_size / (block.hidden_size + matmul.half_dim)
        gemm_seconds = block.flops / (peak_flops * fraction)
        ratios.append(block.seconds / gemm_seconds - 1.0)
    if not ratios:
        raise ValueError("need at least one block sample to fit the non-GEMM overhead")
    return max(0.0, float(np.median(ratios)))
