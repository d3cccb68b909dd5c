"""Solvers: how the joint space is searched. Every solver asks the same Pricer (plait.search.pricing) to price
the layouts it chooses; they differ only in which, and in what order.

* "exact": every layout, best-first by a lower bound on its step time, stopping once no bound can beat the
  shortlist; a layout whose smaller micro-batch missed memory is skipped for larger ones (but the one that makes
  the step a single micro-batch, which holds no accumulated gradients); one whose model states alone overflow
  the devices is refused unsplit (plait.cost.memory.states_overflow); a split whose stage times alone cannot beat
  the shortlist is not priced further (Pricer.split_bound). Finds the cost model's optimum.
* "dichotomy": the improved multi-dimensional dichotomy of CSIMD (Euro-Par 2024): per family of layouts
  (everything fixed but the micro-batch), the micro-batch division by bisection over the sign of the step
  time's slope (per-micro-batch time is non-linear in its size: small ones waste GEMM efficiency and host
  time, large ones widen the bubble), each candidate's stage division by bisection over the bottleneck
  (the exact split already is one). Prices O(log B) micro-batch sizes per family instead of all B.
* "learned": plait.search.learned (a network trained offline against the cost model proposes; the Pricer
  decides).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

from plait.axes import Degrees
from plait.cost.layout import slicing_of
from plait.errors import ConfigError

from plait.search.pricing import Pricer
from plait.search.space import Space, family_key


class Solver(Protocol):
    name: str

    def solve(self, space: Space, pricer: Pricer) -> None:
        """Ask `pricer` to evaluate the layouts this solver picks; the pricer keeps the candidates."""


class ExactSolver:
    name = "exact"

    def solve(self, space: Space, pricer: Pricer) -> None:
        # layouts before device groups are placed; each one's placements are priced in turn (a mixed cluster's
        # bound does not depend on them: it assumes the fastest group everywhere)
        # (Layouts are made only for the choices reached: most are pruned by their bound.)
        bases = [(d, choice) for d in space.degrees for choice in space.base_choices(d)]
        bounds = [_bound(pricer, d, choice) for d, choice in bases]
        if pricer.shortlist is not None:
            order = sorted(range(len(bases)), key=bounds.__getitem__)
            bases, bounds = [bases[i] for i in order], [bounds[i] for i in order]
        too_big: dict[tuple, int] = {}  # layout (but b) -> smallest micro-batch that missed memory
        pricer.bound_splits = pricer.shortlist is not None  # skipping what cannot enter the shortlist changes nothing
        for i, (d, choice) in enumerate(bases):
            if pricer.shortlist is not None and bounds[i] >= pricer.cutoff():
                pricer.pruned += sum(space.count_orderings(dd) for dd, _ in bases[i:])
                return
            base = space.layout(d, choice)
            cutoff = pricer.cutoff()
            if cutoff < math.inf and bounds[i] + pricer.tail_bound(base) >= cutoff:
                pricer.pruned += space.count_orderings(d)  # its data-parallel tail and optimizer step add too much
                continue
            for layout in space.layouts(d, [()] if not space.groups else None, base=base):
                key = family_key(layout)
                if layout.micro_batch >= too_big.get(key, layout.micro_batch + 1) and layout.num_micro_batches > 1:
                    # activations grow with b: a larger micro-batch cannot fit either -- unless it is the step's only
                    # one, which accumulates no gradients (fully_shard holds them unsharded between micro-batches)
                    pricer.pruned += 1
                    continue
                if pricer.evaluate(layout) is None:
                    too_big[key] = min(layout.micro_batch, too_big.get(key, layout.micro_batch))


def _bound(pricer: Pricer, d: Degrees, choice: tuple) -> float:
    """Pricer.lower_bound of `Space.layout(d, choice)`, without making the Layout."""
    sp, _, b, m, schedule, v, kind = choice
    return pricer.bound(slicing_of(d, sp, kind), b, d.pp, m, v, schedule)


class DichotomySolver:
    name = "dichotomy"

    def solve(self, space: Space, pricer: Pricer) -> None:
        # families of base layouts (no device groups placed): their bound holds for every placement, and the
        # placements are generated one at a time (a mixed cluster has too many to hold: 24 GB were not enough)
        families: list[tuple[Degrees, list]] = []
        for d in space.degrees:
            grouped: dict[tuple, list] = {}
            for layout in space.base_layouts(d):
                grouped.setdefault(family_key(layout), []).append(layout)
            families += [(d, family) for family in grouped.values()]
        bounds = [min(pricer.lower_bound(layout) for layout in family) for _, family in families]
        order = sorted(range(len(families)), key=bounds.__getitem__)
        for position, i in enumerate(order):  # best-first by the family's lower bound, like exact
            if pricer.shortlist is not None and bounds[i] >= pricer.cutoff():
                pricer.pruned += sum(len(families[j][1]) * space.count_orderings(families[j][0])
                                     for j in order[position:])
                return
            d, family = families[i]
            for ordering in space.iter_orderings(d):
                placed = [dataclasses.replace(layout, stage_groups=ordering) for layout in family] if ordering \
                    else family
                self._bisect(placed, pricer)

    @staticmethod
    def _bisect(family: list, pricer: Pricer) -> None:
        """The micro-batch size of least estimated step time among `family` (growing b), by bisection on the
        slope between neighbours; an infeasible size counts as infinitely slow (memory only grows with b)."""
        cache: dict[int, float] = {}

        def cost(i: int) -> float:
            if i not in cache:
                result = pricer.evaluate(family[i])
                cache[i] = float("inf") if result is None else result
            return cache[i]

        lo, hi = 0, len(family) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if cost(mid) <= cost(mid + 1):
                hi = mid
            else:
                lo = mid + 1
        cost(lo)
        pricer.pruned += len(family) - len(cache)


LEARNED_OPTIONS = ("proposals", "orderings", "random_orderings", "weights")
SOLVER_OPTIONS: dict[str, tuple[str, ...]] = {"exact": (), "dichotomy": (), "learned": LEARNED_OPTIONS,
                                              "auto": LEARNED_OPTIONS}
"""What each solver lets a caller set (plait.search.plan_with_stats' `solver_options`; the learned solver's are
plait.search.learned.LearnedSolver's arguments; `auto` passes them on where it picks the learned solver). A
budget is an argument of the search, never a patch."""


def check_options(name: str, options: dict) -> None:
    """ConfigError naming an option solver `name` does not take (SOLVER_OPTIONS)."""
    known = SOLVER_OPTIONS.get(name)
    if known is None:
        raise ConfigError(f"solver={name!r} is not one of {', '.join(SOLVER_NAMES)}")
    if unknown := sorted(set(options) - set(known)):
        takes = f"takes {', '.join(known)}" if known else "takes no options"
        raise ConfigError(f"solver option {unknown[0]!r} is not one of the {name} solver's: it {takes}")


def get_solver(name: str, **options) -> Solver:
    """The solver `name` with `options` (SOLVER_OPTIONS[name]); ConfigError for an option it does not take."""
    check_options(name, options)
    if name == "learned":
        from plait.search.learned import LearnedSolver

        return LearnedSolver(**options)
    return {"exact": ExactSolver, "dichotomy": DichotomySolver}[name]()


SOLVER_NAMES = ("exact", "dichotomy", "learned", "auto")

EXACT_UP_TO = 5_000
"""On a mixed cluster, `auto` runs exact search where the space holds at most this many candidates (layouts x
placements of the device groups on the pipeline ranks: a few seconds of pricing), the learned solver beyond
(benchmarks/solvers.py measures both). On a uniform cluster exact search prunes by its bound and stays fast
(benchmarks/planner_speed.py), so `auto` is exact there."""


def space_size(space: Space) -> int:
    return sum(sum(1 for _ in space.base_layouts(d)) * space.count_orderings(d) for d in space.degrees)


def choose_solver(space: Space) -> str:
    if not space.groups:
        return "exact"
    return "exact" if space_size(space) <= EXACT_UP_TO else "learned"
