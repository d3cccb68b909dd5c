"""The learned solver: a small network trained offline against plait's cost model proposes candidates; the cost
model prices them and the best is returned (plait.search.solvers' protocol).

Two policies, both scoring one choice from features that do not name a model or a cluster (normalized costs,
ratios, logs of degrees), so that one set of weights serves any model family and cluster size:

* layouts: each layout of the joint space (degrees, micro-batch, ZeRO, schedule) is scored from the cost
  model's cheap per-layer figures -- its lower bound against the best one, its memory against the device's,
  the share of communication in a layer's time -- and only the top `proposals` are priced exactly;
* stage groups (mixed clusters): which device group serves each pipeline rank is chosen rank by rank, each
  group scored from the work left, the group's speed and memory against the others' and the link to the
  previous rank's group (plait.search.groups).

Weights ship in the package (plait/data/solver.npz, a few kilobytes); `plait solver train` remakes them (seeded,
on CPU, minutes): plait.search.training. Inference is numpy only: the planner never imports torch.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
from pathlib import Path

import numpy as np

from plait.plan import Layout
from plait.errors import ConfigError
from plait.plan import SCHEDULES
from plait.search.pricing import Pricer
from plait.search.space import Space

WEIGHTS_FILE = "solver.npz"
RANDOM_ORDERINGS = 4
"""Uniformly drawn device-group orderings priced beside the policy's for each proposed layout of a mixed cluster."""
LAYOUT_FEATURES = ("lower_bound_gap", "memory_frugal", "memory_none", "tp_comm_share", "p2p_share", "dp_share",
                   "bubble", "log_m_over_pp", "zero0", "zero1", "zero2",
                   "zero3", "sp", "interleave", *(f"schedule_{s}" for s in SCHEDULES), "bias")


def mlp_forward(weights: dict[str, np.ndarray], x: np.ndarray, prefix: str) -> np.ndarray:
    """Two hidden tanh layers and a linear score: x [n, features] -> [n]."""
    h = np.tanh(x @ weights[f"{prefix}_w1"] + weights[f"{prefix}_b1"])
    h = np.tanh(h @ weights[f"{prefix}_w2"] + weights[f"{prefix}_b2"])
    return (h @ weights[f"{prefix}_w3"] + weights[f"{prefix}_b3"])[:, 0]


@functools.lru_cache(maxsize=4)
def load_weights(path: str | None = None) -> dict[str, np.ndarray]:
    source = Path(path) if path else Path(str(importlib.resources.files("plait") / "data" / WEIGHTS_FILE))
    with np.load(source) as data:
        return {k: data[k] for k in data.files}


def layout_features(pricer: Pricer, layout: Layout, best_bound: float) -> np.ndarray:
    """The features of LAYOUT_FEATURES for one layout, from the pricer's cached per-layer costs. Ratios and shares
    only, no absolute sizes or degrees: what makes a layout good on 64 devices makes it good on 4,096."""
    s = pricer.setting
    lc, ends = pricer.layer_cost(layout)
    bound = pricer.lower_bound(layout)
    layer = lc.total
    frugal, none = pricer.even_memory(layout)
    cap = s.cluster.memory_bytes
    from plait.cost.model import dp_exposed, p2p_time
    from plait.cost.memory import layer_params

    p2p = p2p_time(s, layout)
    params = s.model.num_layers / layout.pp * layer_params(s.model, layout.tp, layout.ep)
    dp = dp_exposed(s, layout, params, layer, layer, units=int(s.model.num_layers / layout.pp) + 1)
    work = layout.num_micro_batches * layer * s.model.num_layers / layout.pp
    zero = [float(layout.zero == z) for z in range(4)]
    schedule = [float(layout.schedule == name) for name in SCHEDULES]
    return np.array([
        math.log(bound / best_bound), math.log(max(frugal, 1.0) / cap), math.log(max(none, 1.0) / cap),
        (lc.tp_fwd + lc.tp_bwd) / layer, p2p / (layer + p2p), dp / (work + dp), _bubble(layout),
        math.log2(layout.num_micro_batches / layout.pp), *zero, float(layout.sp), layout.interleave / 8.0,
        *schedule, 1.0,
    ])


def _bubble(layout: Layout) -> float:
    """The textbook idle share of the schedule for uniform stages ((p - 1)/(v·m + p - 1); far less on a V)."""
    p, m, v = layout.pp, layout.num_micro_batches, layout.interleave
    if p == 1:
        return 0.0
    if layout.schedule in ("zbv", "dualpipev"):
        return (p - 1) / (3 * v * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def score_layouts(pricer: Pricer, layouts: list[Layout], weights: dict[str, np.ndarray] | None = None) -> np.ndarray:
    weights = weights or load_weights()
    bounds = [pricer.lower_bound(layout) for layout in layouts]
    best = min(bounds)
    x = np.stack([layout_features(pricer, layout, best) for layout in layouts])
    return mlp_forward(weights, (x - weights["layout_mean"]) / weights["layout_std"], "layout")


class LearnedSolver:
    """Price only the `proposals` layouts the network scores highest (more where none of them fits); on a mixed
    cluster, each with the device-group orderings the group policy proposes (its greedy one and up to `orderings`
    sampled; plait.search.groups) and `random_orderings` drawn uniformly (seeded): the policy alone does not
    transfer to every family of clusters it was not trained on (benchmarks/solvers.py measures both)."""

    name = "learned"

    def __init__(self, proposals: int = 24, orderings: int = 4, random_orderings: int = RANDOM_ORDERINGS,
                 weights: dict[str, np.ndarray] | None = None) -> None:
        for label, value, least in (("proposals", proposals, 1), ("orderings", orderings, 1),
                                    ("random_orderings", random_orderings, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"learned solver option {label}={value!r} must be an integer >= {least}")
        self.proposals, self.orderings, self.random_orderings = proposals, orderings, random_orderings
        self.weights = weights

    def solve(self, space: Space, pricer: Pricer) -> None:
        bases = [(d, layout) for d in space.degrees for layout in space.base_layouts(d)]
        if not bases:
            return
        order = np.argsort(-score_layouts(pricer, [b[1] for b in bases], self.weights), kind="stable")
        for start in range(0, len(order), self.proposals):
            found = [self._price(space, pricer, *bases[i]) for i in order[start:start + self.proposals]]
            if any(found):
                pricer.pruned += max(0, len(order) - start - self.proposals)
                return

    def _price(self, space: Space, pricer: Pricer, d, base: Layout) -> bool:
        """Price one layout (on a mixed cluster: with each proposed placement of its pipeline ranks)."""
        import dataclasses

        if not space.groups:
            return pricer.evaluate(base) is not None
        if space.count_orderings(d) <= self.orderings + self.random_orderings + 1:
            orderings = space.orderings(d)
        else:
            orderings = self.placements(pricer, base, space.group_counts(d))
        results = [pricer.evaluate(dataclasses.replace(base, stage_groups=o) if o else base) for o in orderings]
        return any(r is not None for r in results)

    def placements(self, pricer: Pricer, base: Layout, counts: dict[str, int]) -> list[tuple[str, ...]]:
        """The device-group orderings priced for `base` (`counts` pipeline ranks per group): the policy's greedy
        one, up to `orderings` sampled from it, and `random_orderings` drawn uniformly, distinct."""
        from plait.search.groups import propose, random_orderings

        out = propose(pricer, base, counts, self.orderings, weights=self.weights)
        return out + [o for o in random_orderings(counts, self.random_orderings) if o not in out]
