"""Exact stage split: layers over pipeline stages, minimizing the slowest stage, under per-stage memory.

Pure kernels, numbers in, (cost, solution) out. Stage j holding k >= 1 layers with recompute
mode i takes ``fixed_time[j] + k * layer_time[j, i]`` seconds per micro-batch (the embedding
and the output layer are the first and last stage's fixed time) and needs
``fixed_mem[j, i] + k * layer_mem[j, i] <= capacity[j]`` bytes.

For a bound T, stage j can hold at most kmax_j(T) = max_i min(⌊(T - fixed_time[j]) /
layer_time[j, i]⌋, ⌊(capacity[j] - fixed_mem[j, i]) / layer_mem[j, i]⌋) layers, and a split
with every stage under T exists iff every kmax_j >= 1 and Σ min(kmax_j, L) >= L (counts
1 <= k_j <= kmax_j summing to L then exist). Feasibility is monotone in T, so a bisection
over the finitely many stage times fixed_time[j] + k·layer_time[j, i] finds the optimum
exactly. `min_max_split_reference` enumerates all compositions to check it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Split:
    bottleneck: float
    """The slowest stage's time."""
    layers: tuple[int, ...]
    modes: tuple[int, ...]
    """Index of each stage's recompute mode (columns of layer_time)."""


VECTOR_LIMIT = 2**16
"""min_max_split tests every candidate bound at once where candidates x stages x modes stay within this many
elements (a few arrays of this size: under a MiB each), and bisects one bound at a time beyond."""


def _most_layers(fixed: np.ndarray, per_layer: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """Largest k with fixed + k·per_layer <= limit, elementwise (may be < 1; inf when per_layer is 0).

    The floor of the quotient is corrected by one step either way so that k agrees with the inequality
    itself as floating point evaluates it (the reference checks exactly that)."""
    room = limit - fixed
    safe = np.where(per_layer > 0, per_layer, 1.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        k = np.floor(room / safe)
        k = np.where(np.isfinite(k) & (fixed + (k + 1) * per_layer <= limit), k + 1, k)
        k = np.where(np.isfinite(k) & (fixed + k * per_layer > limit), k - 1, k)
    return np.where(per_layer > 0, k, np.where(room >= 0, np.inf, -1.0))


def _max_by_memory(fixed_mem: np.ndarray, layer_mem: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """[stage, mode] -> most layers that fit in memory (may be < 1)."""
    return _most_layers(fixed_mem, layer_mem, np.broadcast_to(capacity[:, None], fixed_mem.shape))


def _max_by_time(bound: float, fixed_time: np.ndarray, layer_time: np.ndarray) -> np.ndarray:
    """[stage, mode] -> most layers that finish within `bound`."""
    fixed = np.broadcast_to(fixed_time[:, None], layer_time.shape)
    return _most_layers(fixed, layer_time, np.full(layer_time.shape, bound))


def min_max_split(num_layers: int, fixed_time, layer_time, fixed_mem, layer_mem, capacity) -> Split | None:
    """Optimal split (or None when no split fits). Arrays: fixed_time [S], layer_time/fixed_mem/layer_mem [S, M],
    capacity [S]."""
    fixed_time = np.asarray(fixed_time, float)
    layer_time, fixed_mem, layer_mem = (np.asarray(a, float) for a in (layer_time, fixed_mem, layer_mem))
    capacity = np.asarray(capacity, float)
    stages = len(fixed_time)
    if num_layers < stages:
        return None
    by_mem = np.minimum(_max_by_memory(fixed_mem, layer_mem, capacity), num_layers - stages + 1)
    if not np.all(by_mem.max(axis=1) >= 1) or by_mem.max(axis=1).sum() < num_layers:
        return None
    ks = np.arange(1, num_layers - stages + 2, dtype=float)
    times = fixed_time[:, None, None] + ks[None, None, :] * layer_time[:, :, None]  # [stage, mode, k]
    allowed = ks[None, None, :] <= by_mem[:, :, None]
    candidates = np.unique(times[allowed])
    if candidates.size * layer_time.size <= VECTOR_LIMIT:  # every candidate's test at once: fewer numpy calls
        kmax = np.minimum(_most_layers(fixed_time[None, :, None], layer_time[None], candidates[:, None, None]),
                          by_mem).max(axis=2)  # [candidate, stage]
        verdicts = (kmax >= 1).all(axis=1) & (np.minimum(kmax, num_layers).sum(axis=1) >= num_layers)
        feasible = verdicts.__getitem__
        most = kmax.__getitem__
    else:
        def most(i: int) -> np.ndarray:
            return np.minimum(_max_by_time(candidates[i], fixed_time, layer_time), by_mem).max(axis=1)

        def feasible(i: int) -> bool:
            kmax = most(i)
            return bool(np.all(kmax >= 1) and np.minimum(kmax, num_layers).sum() >= num_layers)

    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid + 1
    return _assign(num_layers, most(lo), fixed_time, layer_time, by_mem)


def _assign(num_layers: int, most: np.ndarray, fixed_time, layer_time, by_mem) -> Split:
    """Counts under the optimal bound summing to L: start from each stage's `most` layers under it (its kmax), then
    take layers off the slowest stages a round at a time (so the split is balanced, not front-loaded); each stage runs
    its fastest mode that fits."""
    counts = np.minimum(most, num_layers).astype(np.int64)

    def best(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        times = fixed_time[:, None] + k[:, None] * layer_time
        times = np.where(k[:, None] <= by_mem, times, np.inf)
        return times.min(axis=1), times.argmin(axis=1)

    excess = int(counts.sum()) - num_layers
    while excess > 0:
        times, _ = best(counts)
        order = np.argsort(-times, kind="stable")
        order = order[counts[order] > 1][:excess]
        counts[order] -= 1
        excess -= len(order)
    times, modes = best(counts)
    return Split(bottleneck=float(times.max()), layers=tuple(int(k) for k in counts),
                 modes=tuple(int(i) for i in modes))


def min_max_split_reference(num_layers: int, fixed_time, layer_time, fixed_mem, layer_mem, capacity) -> float | None:
    """Slow reference: the optimal bottleneck by enumerating every composition of L into S positive parts."""
    stages = len(fixed_time)
    best = None
    for cuts in itertools.combinations(range(1, num_layers), stages - 1):
        counts = np.diff((0, *cuts, num_layers))
        worst = 0.0
        for j, k in enumerate(counts):
            options = [fixed_time[j] + k * layer_time[j][i] for i in range(len(layer_time[j]))
                       if fixed_mem[j][i] + k * layer_mem[j][i] <= capacity[j]]
            if not options:
                worst = None
                break
            worst = max(worst, min(options))
        if worst is not None and (best is None or worst < best):
            best = worst
    return best


def min_max_split_weighted(time_w, param_w, act_w, fixed_time, layer_time, fixed_mem, layer_states, layer_act,
                           capacity, rel_tol: float = 1e-9) -> Split | None:
    """The optimal contiguous split of blocks that differ (a model measured on meta).

    Block b weighs time_w[b], param_w[b], act_w[b] mean blocks; stage j holding blocks [a, e) in mode i takes
    fixed_time[j] + T(a, e)·layer_time[j, i] seconds and needs fixed_mem[j, i] + P(a, e)·layer_states[j] +
    A(a, e)·layer_act[j, i] bytes <= capacity[j] (T, P, A: sums of the weights). Every stage holds a block.

    For a bound on the slowest stage, taking as many blocks as fit on each stage in turn finds a split if
    one exists (a stage's time and memory only grow with its range), so a bisection over the bound finds the
    optimum to `rel_tol`. Arrays: weights [L]; fixed_time [S]; layer_time, fixed_mem, layer_act [S, M];
    layer_states, capacity [S]. `min_max_split_weighted_reference` enumerates every split to check it."""
    tw, pw, aw = (np.concatenate(([0.0], np.cumsum(np.asarray(w, float)))) for w in (time_w, param_w, act_w))
    fixed_time, capacity, layer_states = (np.asarray(a, float) for a in (fixed_time, capacity, layer_states))
    layer_time, fixed_mem, layer_act = (np.asarray(a, float) for a in (layer_time, fixed_mem, layer_act))
    num_blocks, stages = len(tw) - 1, len(fixed_time)
    if num_blocks < stages:
        return None

    def stage_cost(j: int, start: int, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Times [len(ends), M] and fits [len(ends), M] of stage j holding [start, end) for each end."""
        times = fixed_time[j] + (tw[ends] - tw[start])[:, None] * layer_time[j][None, :]
        mems = fixed_mem[j][None, :] + (pw[ends] - pw[start])[:, None] * layer_states[j] \
            + (aw[ends] - aw[start])[:, None] * layer_act[j][None, :]
        return times, mems <= capacity[j]

    def assign(bound: float) -> list[int] | None:
        ends, start = [], 0
        for j in range(stages):
            last = num_blocks if j == stages - 1 else num_blocks - (stages - 1 - j)
            candidates = np.arange(start + 1, last + 1)
            if j == stages - 1:
                candidates = candidates[-1:]
            times, fits = stage_cost(j, start, candidates)
            ok = np.any(fits & (times <= bound), axis=1)
            if not ok.any():
                return None
            start = int(candidates[np.nonzero(ok)[0][-1]])  # ranges grow monotonically: the last that fits
            ends.append(start)
        return ends if start == num_blocks else None

    everything = [stage_cost(j, 0, np.array([num_blocks]))[0].max() for j in range(stages)]
    hi = float(max(everything)) * 1.0001 + 1e-30
    if assign(hi) is None:
        return None
    lo = 0.0
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if assign(mid) is None:
            lo = mid
        else:
            hi = mid
    ends = assign(hi)
    counts, modes, worst, start = [], [], 0.0, 0
    for j, end in enumerate(ends):
        times, fits = stage_cost(j, start, np.array([end]))
        options = np.where(fits[0], times[0], np.inf)
        modes.append(int(np.argmin(options)))
        worst = max(worst, float(options.min()))
        counts.append(end - start)
        start = end
    return Split(bottleneck=worst, layers=tuple(counts), modes=tuple(modes))


def min_max_split_weighted_reference(time_w, param_w, act_w, fixed_time, layer_time, fixed_mem, layer_states,
                                     layer_act, capacity) -> float | None:
    """Slow reference: the optimal bottleneck over every composition of the blocks into stages."""
    num_blocks, stages = len(time_w), len(fixed_time)
    best = None
    for cuts in itertools.combinations(range(1, num_blocks), stages - 1):
        bounds = (0, *cuts, num_blocks)
        worst = 0.0
        for j in range(stages):
            a, e = bounds[j], bounds[j + 1]
            t, p, r = sum(time_w[a:e]), sum(param_w[a:e]), sum(act_w[a:e])
            options = [fixed_time[j] + t * layer_time[j][i] for i in range(len(layer_time[j]))
                       if fixed_mem[j][i] + p * layer_states[j] + r * layer_act[j][i] <= capacity[j]]
            if not options:
                worst = None
                break
            worst = max(worst, min(options))
        if worst is not None and (best is None or worst < best):
            best = worst
    return best
