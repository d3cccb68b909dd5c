"""Which device group serves each pipeline rank of a mixed cluster: the learned policy, one rank at a time.

For a layout whose pipeline ranks are not yet placed, the policy walks the ranks in order and scores each device
group that still has ranks to give: how fast and how large its devices are against the others', how much of
the work and of the ranks are left, the rank's position (the first holds the embedding and the most activations
in flight, the last the output layer and loss), and whether the previous rank is in the same group (a boundary
between groups crosses the slowest link). The scores come from a small network trained offline against the
cost model (plait.search.training.train_groups); the exact split then balances the layers over the chosen
groups (plait.search.partition).

`propose` returns the greedy ordering and a few sampled ones, each of which the cost model prices.
"""

from __future__ import annotations

import math

import numpy as np

from plait.plan import Layout
from plait.cost.memory import memory_table_parts
from plait.plan import RECOMPUTE_MODES
from plait.search.learned import load_weights, mlp_forward
from plait.search.pricing import Pricer

GROUP_FEATURES = ("position", "first", "last", "speed", "memory", "group_share_left", "work_left", "same_as_previous",
                  "memory_need", "ends_share", "bias")


class GroupContext:
    """What the features of one layout need, per device group: a layer's time, the memory of each rank position,
    the capacity, and the ends' times."""

    def __init__(self, pricer: Pricer, layout: Layout, counts: dict[str, int]) -> None:
        self.counts, self.pp = counts, layout.pp
        setting = pricer.setting
        self.names = list(counts)
        self.layer, self.cap, self.need, self.ends = {}, {}, {}, {}
        share = setting.model.num_layers / layout.pp
        for name in self.names:
            lc, ends = pricer.layer_cost(layout, name)
            at = setting.cluster.view(name)
            fixed, states, acts = memory_table_parts(type(setting)(setting.model, at, setting.train), layout,
                                                     tuple(RECOMPUTE_MODES))
            self.layer[name] = lc.total
            self.cap[name] = at.memory_bytes
            self.need[name] = fixed[:, -1] + share * (states + acts[:, -1])  # fully recomputed: the least it needs
            self.ends[name] = (ends.embed_fwd + ends.embed_bwd, ends.head_fwd + ends.head_bwd + ends.head_tp)
        self.mean_layer = sum(counts[n] * self.layer[n] for n in self.names) / self.pp
        self.mean_cap = sum(counts[n] * self.cap[n] for n in self.names) / self.pp

    def features(self, position: int, left: dict[str, int], previous: str | None) -> tuple[list[str], np.ndarray]:
        """The groups that may take pipeline rank `position`, and their features [groups, GROUP_FEATURES]."""
        slots = self.pp - position
        # the rates of the ranks still to place, against the whole pipeline's: how much work is left for them
        rate_left = sum(left[n] / self.layer[n] for n in self.names)
        rate_all = sum(self.counts[n] / self.layer[n] for n in self.names)
        rows, names = [], []
        for name in self.names:
            if not left[name]:
                continue
            first, last = position == 0, position == self.pp - 1
            ends = self.ends[name][0] * first + self.ends[name][1] * last
            rows.append([position / max(1, self.pp - 1), float(first), float(last),
                         math.log(self.mean_layer / self.layer[name]), math.log(self.cap[name] / self.mean_cap),
                         left[name] / slots, rate_left / rate_all, float(previous == name),
                         math.log(max(self.need[name][position], 1.0) / self.cap[name]),
                         ends / (self.layer[name] * max(1.0, self.pp)), 1.0])
            names.append(name)
        return names, np.array(rows)


def walk(context: GroupContext, choose) -> tuple[tuple[str, ...], list[tuple[np.ndarray, int]]]:
    """Place every pipeline rank with `choose(features) -> index`; returns the ordering and each step's
    (features, chosen index)."""
    left, previous, ordering, steps = dict(context.counts), None, [], []
    for position in range(context.pp):
        names, x = context.features(position, left, previous)
        index = 0 if len(names) == 1 else choose(x)
        steps.append((x, index))
        name = names[index]
        ordering.append(name)
        left[name] -= 1
        previous = name
    return tuple(ordering), steps


def propose(pricer: Pricer, layout: Layout, counts: dict[str, int], samples: int = 4, seed: int = 0,
            weights: dict[str, np.ndarray] | None = None) -> list[tuple[str, ...]]:
    """The policy's greedy ordering and up to `samples` more sampled from it, distinct."""
    weights = weights or load_weights()
    context = GroupContext(pricer, layout, counts)

    def scores(x: np.ndarray) -> np.ndarray:
        return mlp_forward(weights, (x - weights["group_mean"]) / weights["group_std"], "group")

    rng = np.random.default_rng(seed)
    out = [walk(context, lambda x: int(np.argmax(scores(x))))[0]]
    for _ in range(samples * 3):
        if len(out) > samples:
            break

        def sample(x: np.ndarray) -> int:
            s = scores(x)
            p = np.exp(s - s.max())
            return int(rng.choice(len(p), p=p / p.sum()))

        ordering = walk(context, sample)[0]
        if ordering not in out:
            out.append(ordering)
    return out


def random_orderings(counts: dict[str, int], count: int, seed: int = 0) -> list[tuple[str, ...]]:
    """Up to `count` distinct orderings of the pipeline ranks over the groups (`counts` ranks each), uniformly
    drawn (seeded): a placement that does not depend on the policy."""
    rng = np.random.default_rng(seed)
    ranks = [name for name, c in counts.items() for _ in range(c)]
    out: list[tuple[str, ...]] = []
    for _ in range(count * 3):
        if len(out) >= count:
            break
        ordering = tuple(ranks[i] for i in rng.permutation(len(ranks)))
        if ordering not in out:
            out.append(ordering)
    return out
