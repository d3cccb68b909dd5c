"""The per-operator sharding solver kernel: pure (numbers in, `(cost, choice)` out; no torch).

A `ShardingProblem` is a graph: node i picks one of its strategies s at `node_cost[i][s]` seconds and
`node_memory[i][s]` bytes per device; an edge (u, v) costs `matrix[s_u, s_v]` seconds (the redistribution
between u's output and what v's strategy needs, forward and backward). Minimise the total under the memory
limit, with the strategies a pin forbids masked out (`allowed`).

* `solve_program`: the integer program (Alpa's formulation, the edge variables linearised by flow constraints:
  the edge's choices sum to each end's choice, which keeps the LP relaxation tight), through
  `scipy.optimize.milp` (HiGHS). Why scipy and not highspy: the same HiGHS, already a dependency of plait's
  stage solver path, no temporary files, and sparse matrices in one call; highspy's warm starts are not needed
  for a one-shot program.
* `solve_propagation`: the heuristic for graphs too big for the program, MindSpore's sharding propagation
  from the costliest (or pinned) node outward, passes of local improvement, then a large-neighbourhood search
  that re-solves windows of the graph exactly with the rest fixed (small integer programs).
* `solve_brute_force`: the slow reference, every combination (tiny graphs; differential tests).

`simplify` first folds every node that has one allowed strategy into its neighbours' own costs, and drops edges
whose matrix cannot change the choice (all equal): chains of forced placements cost nothing to the program.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ShardingProblem:
    node_cost: list[np.ndarray]
    """Per node, seconds per strategy."""
    edges: list[tuple[int, int, np.ndarray]]
    """(u, v, matrix[len(strategies u), len(strategies v)]) seconds."""
    node_memory: list[np.ndarray] | None = None
    """Per node, bytes per device per strategy (None: no memory constraint)."""
    memory_limit: float = math.inf
    allowed: list[np.ndarray] | None = None
    """Per node, a boolean mask of the strategies pins leave (None: all)."""

    def __post_init__(self) -> None:
        self.node_cost = [np.asarray(c, dtype=float) for c in self.node_cost]
        if self.node_memory is None:
            self.node_memory = [np.zeros_like(c) for c in self.node_cost]
        self.node_memory = [np.asarray(m, dtype=float) for m in self.node_memory]
        if self.allowed is None:
            self.allowed = [np.ones(len(c), dtype=bool) for c in self.node_cost]
        for i, mask in enumerate(self.allowed):
            if not mask.any():
                raise ValueError(f"node {i} has no allowed strategy")

    @property
    def num_nodes(self) -> int:
        return len(self.node_cost)


@dataclass(frozen=True)
class Solution:
    cost: float
    choice: tuple[int, ...]
    solver: str
    lower_bound: float = -math.inf
    """What the solver proves no choice beats (the program only): HiGHS's dual bound, or for a tied solve the
    untied program's LP relaxation (`relaxation_bound`), a bound on every choice."""
    stats: dict = field(default_factory=dict)
    status: str = "optimal"
    """How the solve ended (STATUSES): "optimal" (HiGHS proved the optimum within MIP_REL_GAP), "time limit" (stopped
    with the best choice found so far), "tied" (the optimum over choices that give every copy of a repeated block
    the same strategies), "heuristic" (no proof), "forced" (pins left one choice)."""

    @property
    def gap(self) -> float | None:
        """The proven gap: how far above `lower_bound` the cost is, as a fraction of the bound (None: no bound)."""
        if not math.isfinite(self.lower_bound) or self.lower_bound <= 0:
            return None if not math.isfinite(self.lower_bound) else (0.0 if self.cost <= 0 else None)
        return max(0.0, self.cost / self.lower_bound - 1)


STATUSES = ("optimal", "time limit", "tied", "heuristic", "forced")
MIP_REL_GAP = 1e-4
"""HiGHS's relative gap at which a solve stops as optimal (its default, stated)."""


class Infeasible(ValueError):
    """No choice fits the memory limit with the pins given."""


def total_cost(problem: ShardingProblem, choice: tuple[int, ...]) -> float:
    cost = sum(float(problem.node_cost[i][s]) for i, s in enumerate(choice))
    return cost + sum(float(m[choice[u], choice[v]]) for u, v, m in problem.edges)


def total_memory(problem: ShardingProblem, choice: tuple[int, ...]) -> float:
    return sum(float(problem.node_memory[i][s]) for i, s in enumerate(choice))


def _feasible(problem: ShardingProblem, choice: tuple[int, ...]) -> bool:
    return all(problem.allowed[i][s] for i, s in enumerate(choice)) and \
        total_memory(problem, choice) <= problem.memory_limit * (1 + 1e-9)


# ---- reduction -------------------------------------------------------------------------------
def simplify(problem: ShardingProblem) -> tuple[ShardingProblem, dict[int, int]]:
    """Fold forced nodes (one allowed strategy) into their neighbours and merge parallel edges. Returns the
    smaller problem over the free nodes, and {original node: its forced strategy}. Costs stay exact: the
    smaller problem's total plus the forced nodes' own costs is the original total."""
    forced = {i: int(np.flatnonzero(m)[0]) for i, m in enumerate(problem.allowed) if m.sum() == 1}
    free = [i for i in range(problem.num_nodes) if i not in forced]
    new_index = {old: new for new, old in enumerate(free)}
    cost = [problem.node_cost[i].copy() for i in free]
    memory = [problem.node_memory[i].copy() for i in free]
    offset = sum(problem.node_cost[i][s] for i, s in forced.items())
    forced_memory = sum(problem.node_memory[i][s] for i, s in forced.items())
    merged: dict[tuple[int, int], np.ndarray] = {}
    for u, v, m in problem.edges:
        if u in forced and v in forced:
            offset += m[forced[u], forced[v]]
        elif u in forced:
            cost[new_index[v]] += m[forced[u], :]
        elif v in forced:
            cost[new_index[u]] += m[:, forced[v]]
        elif u == v:
            cost[new_index[u]] += np.diag(m)
        else:
            a, b = new_index[u], new_index[v]
            key, mat = ((a, b), m) if a < b else ((b, a), m.T)
            merged[key] = merged[key] + mat if key in merged else mat.copy()
    edges = []
    for (a, b), m in merged.items():
        if np.ptp(m) == 0:  # a constant edge cannot change the choice
            offset += m.flat[0]
        else:
            edges.append((a, b, m))
    small = ShardingProblem(cost, edges, memory, problem.memory_limit - forced_memory,
                            [problem.allowed[i] for i in free])
    small.offset = float(offset)  # type: ignore[attr-defined]
    small.free = free  # type: ignore[attr-defined]
    return small, forced


def _expand(problem: ShardingProblem, small: ShardingProblem, forced: dict[int, int], choice: tuple[int, ...]
            ) -> tuple[int, ...]:
    full = [0] * problem.num_nodes
    for i, s in forced.items():
        full[i] = s
    for new, old in enumerate(small.free):  # type: ignore[attr-defined]
        full[old] = choice[new]
    return tuple(full)


# ---- repeated blocks ---------------------------------------------------------------------------
def tie(problem: ShardingProblem, classes: list[list[int]]) -> tuple[ShardingProblem, list[int]]:
    """The problem with the nodes of each class choosing one strategy together (copies of a repeated block: node j
    of every copy in one class), as one node: their costs and memories summed, their masks intersected, every edge
    moved onto the classes' representatives (an edge between two copies of one node, such as block i's output
    into block i+1's input, becomes that node's own diagonal, which simplify() folds in). Totals stay exact for
    every tied choice. Returns the smaller problem and, per original node, its node in it."""
    representative = list(range(problem.num_nodes))
    for members in classes:
        sizes = {len(problem.node_cost[i]) for i in members}
        if len(sizes) != 1:
            raise ValueError(f"tied nodes {members[:4]} have different strategy counts {sorted(sizes)}")
        for i in members:
            representative[i] = members[0]
    kept = sorted(set(representative))
    index = {old: new for new, old in enumerate(kept)}
    to_new = [index[representative[i]] for i in range(problem.num_nodes)]
    cost = [np.zeros_like(problem.node_cost[i]) for i in kept]
    memory = [np.zeros_like(problem.node_memory[i]) for i in kept]
    allowed = [np.ones_like(problem.allowed[i]) for i in kept]
    for i in range(problem.num_nodes):
        cost[to_new[i]] += problem.node_cost[i]
        memory[to_new[i]] += problem.node_memory[i]
        allowed[to_new[i]] &= problem.allowed[i]
    edges = [(to_new[u], to_new[v], m) for u, v, m in problem.edges]
    return ShardingProblem(cost, edges, memory, problem.memory_limit, allowed), to_new


# ---- the integer program ---------------------------------------------------------------------
def solve_program(problem: ShardingProblem, time_limit: float = 60.0, classes: list[list[int]] | None = None,
                  prove: bool = True) -> Solution:
    """The exact optimum (within HiGHS's gap) of the integer program; with `classes`, of the program whose tied
    nodes choose together (tie()), which a repeated block's copies solve once, its gap proven against the untied
    program's LP relaxation where `prove` (seconds on a large graph: Llama 3 8B's, 1.6 s)."""
    if classes:
        tied, to_new = tie(problem, classes)
        solution = solve_program(tied, time_limit)
        choice = tuple(solution.choice[to_new[i]] for i in range(problem.num_nodes))
        # the tied program's own bound holds for tied choices only; the untied relaxation bounds every choice
        status = "time limit" if solution.status == "time limit" else "tied"
        bound = relaxation_bound(problem, time_limit) if prove else -math.inf
        return Solution(total_cost(problem, choice), choice, "program", bound,
                        stats={**solution.stats, "tied_from": problem.num_nodes}, status=status)
    small, forced = simplify(problem)
    if small.num_nodes == 0:
        choice = _expand(problem, small, forced, ())
        if not _feasible(problem, choice):
            raise Infeasible("the pinned placements do not fit the memory limit")
        cost = total_cost(problem, choice)
        return Solution(cost, choice, "program", cost, stats={"variables": 0}, status="forced")
    choice, bound, stats = _milp(small, time_limit)
    full = _expand(problem, small, forced, choice)
    status = "optimal" if stats["status"] == 0 else "time limit"
    return Solution(total_cost(problem, full), full, "program", bound + small.offset, stats, status)  # type: ignore


def relaxation_bound(problem: ShardingProblem, time_limit: float = 60.0) -> float:
    """What the program's LP relaxation proves no choice beats (every variable in [0, 1]; the memory limit and the
    pins kept): a lower bound on the untied optimum, against which a tied or heuristic choice's proven gap is read.
    -inf when the relaxation does not finish in `time_limit`."""
    small, _ = simplify(problem)
    if small.num_nodes == 0:
        return small.offset  # type: ignore[attr-defined]
    try:
        _, bound, _ = _milp(small, time_limit, relax=True)
    except Infeasible:
        return -math.inf
    return bound + small.offset  # type: ignore[attr-defined]


def _milp(problem: ShardingProblem, time_limit: float, relax: bool = False) -> tuple[tuple[int, ...], float, dict]:
    """(choice, proven lower bound, stats with HiGHS's status). `relax`: the LP relaxation (its optimum is the
    bound; the choice is its largest value per node, not necessarily feasible)."""
    from plait.extras import require

    require("auto", "per-operator sharding's integer program", "use the propagation heuristic "
            "(--operator-solver propagation)")
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    sizes = [len(c) for c in problem.node_cost]
    x_start = np.concatenate([[0], np.cumsum(sizes)])
    num_x = int(x_start[-1])
    edge_start, num_vars = [], num_x
    for u, v, m in problem.edges:
        edge_start.append(num_vars)
        num_vars += m.size
    objective = np.concatenate([*problem.node_cost, *[m.ravel() for _, _, m in problem.edges]])
    rows, cols, vals, lower, upper = [], [], [], [], []

    def add_row(columns, coefficients, lo, hi):
        r = len(lower)
        rows.extend([r] * len(columns))
        cols.extend(columns)
        vals.extend(coefficients)
        lower.append(lo)
        upper.append(hi)

    for i, n in enumerate(sizes):  # one strategy per node
        add_row(range(x_start[i], x_start[i] + n), [1.0] * n, 1.0, 1.0)
    for (u, v, m), start in zip(problem.edges, edge_start):
        nu, nv = m.shape
        for s in range(nu):  # the edge's choices in row s sum to x[u, s]
            add_row([start + s * nv + t for t in range(nv)] + [x_start[u] + s], [1.0] * nv + [-1.0], 0.0, 0.0)
        for t in range(nv):
            add_row([start + s * nv + t for s in range(nu)] + [x_start[v] + t], [1.0] * nu + [-1.0], 0.0, 0.0)
    memory = np.concatenate(problem.node_memory)
    if math.isfinite(problem.memory_limit) and memory.any():
        # in units of the limit: bytes (1e9) next to seconds (1e-6) leave HiGHS's LP without a status
        scale = max(abs(problem.memory_limit), 1.0)
        add_row(range(num_x), (memory / scale).tolist(), -np.inf, problem.memory_limit / scale)
    matrix = coo_array((vals, (rows, cols)), shape=(len(lower), num_vars)).tocsr()
    upper_bounds = np.ones(num_vars)
    upper_bounds[:num_x] = np.concatenate(problem.allowed).astype(float)
    integrality = np.zeros(num_vars)
    integrality[:num_x] = 0 if relax else 1
    result = milp(objective, constraints=LinearConstraint(matrix, lower, upper), integrality=integrality,
                  bounds=Bounds(np.zeros(num_vars), upper_bounds),
                  options={"time_limit": time_limit, "mip_rel_gap": MIP_REL_GAP})
    if result.x is None:
        raise Infeasible(f"no placement fits the memory limit with the pins given ({result.message})")
    x = result.x[:num_x]
    choice = tuple(int(np.argmax(x[x_start[i]:x_start[i + 1]])) for i in range(len(sizes)))
    if relax:
        bound = result.fun if result.status == 0 else None
    else:
        bound = getattr(result, "mip_dual_bound", None)
    stats = {"variables": num_vars, "constraints": len(lower), "nodes": len(sizes), "edges": len(problem.edges),
             "status": int(result.status)}
    return choice, float(bound) if bound is not None else -math.inf, stats


# ---- the propagation heuristic ---------------------------------------------------------------
def solve_propagation(problem: ShardingProblem, sweeps: int = 8, seeds: int = 3,
                      classes: list[list[int]] | None = None) -> Solution:
    """The propagation heuristic under the memory limit, then window moves (`_improve_windows`) from what it found
    and from the replicated start (every node's first allowed strategy after single and pair moves) where that
    fits: the cheaper wins. The propagation alone can settle on a layout (a batch split here, heads there) no
    window leaves; the replicated start is the layout Megatron's pattern grows from. With `classes`, on the
    problem whose tied nodes choose together (tie(), as solve_program)."""
    if classes:
        tied, to_new = tie(problem, classes)
        solution = solve_propagation(tied, sweeps, seeds)
        choice = tuple(solution.choice[to_new[i]] for i in range(problem.num_nodes))
        return Solution(total_cost(problem, choice), choice, "propagation", stats={"tied_from": problem.num_nodes},
                        status="heuristic")
    small, forced = simplify(problem)  # a tied problem holds many parallel edges: merged here
    choice = _expand(problem, small, forced, _propagation_and_windows(small, sweeps, seeds) if small.num_nodes else ())
    if not _feasible(problem, choice):
        raise Infeasible("no placement fits the memory limit with the pins given")
    return Solution(total_cost(problem, choice), choice, "propagation", status="heuristic")


def _propagation_and_windows(problem: ShardingProblem, sweeps: int, seeds: int) -> tuple[int, ...]:
    starts = [list(_propagation_under_limit(problem, sweeps, seeds))]
    replicated = _replicated_start(problem, sweeps)
    if _feasible(problem, tuple(replicated)):
        starts.append(replicated)
    return tuple(min((_improve_windows(problem, start) for start in starts),
                     key=lambda c: total_cost(problem, tuple(c))))


def _propagation_under_limit(problem: ShardingProblem, sweeps: int, seeds: int) -> tuple[int, ...]:
    """Unconstrained first; when that breaks the limit, memory is priced into every node's cost (a Lagrange
    multiplier, seconds per byte, raised 4x at a time and then bisected) until the cheapest choice fits; the
    cheapest fitting choice by the true cost wins."""
    best = _propagation(problem, sweeps, seeds)
    if total_memory(problem, best.choice) <= problem.memory_limit:
        return best.choice
    scale = max(sum(float(c.max()) for c in problem.node_cost), 1e-12) / \
        max(sum(float(m.max()) for m in problem.node_memory), 1e-12)
    low, high, fitting = 0.0, scale, None
    for _ in range(40):  # raise the price of memory until a choice fits
        fitting = _fitting(problem, high, sweeps, seeds)
        if fitting is not None:
            break
        low, high = high, high * 4
    if fitting is None:
        return _repair(problem, best.choice)
    for _ in range(BISECTIONS):  # then find a lower price that still fits
        middle = (low + high) / 2
        candidate = _fitting(problem, middle, sweeps, seeds)
        if candidate is None:
            low = middle
        else:
            high = middle
            fitting = min(fitting, candidate, key=lambda s: s.cost)
    return fitting.choice


BISECTIONS = 3
"""Steps of the memory price's bisection: each is a whole propagation, and the window moves after it re-solve
under the exact limit (8 steps found the same plans on the benchmark models, at twice the time)."""


def _replicated_start(problem: ShardingProblem, sweeps: int) -> list[int]:
    neighbours, masked = _adjacency(problem)
    choice = _improve(masked, neighbours, [int(np.flatnonzero(m)[0]) for m in problem.allowed], sweeps)
    return _improve_pairs(problem, masked, neighbours, choice, sweeps)


def _fitting(problem: ShardingProblem, price: float, sweeps: int, seeds: int) -> Solution | None:
    priced = ShardingProblem([c + price * m for c, m in zip(problem.node_cost, problem.node_memory)], problem.edges,
                             problem.node_memory, math.inf, problem.allowed)
    choice = _propagation(priced, sweeps, seeds).choice
    if total_memory(problem, choice) > problem.memory_limit:
        return None
    return Solution(total_cost(problem, choice), choice, "propagation")


def _adjacency(problem: ShardingProblem) -> tuple[list[list[tuple[int, np.ndarray]]], list[np.ndarray]]:
    """Each node's neighbours with the edge cost matrix seen from its side, and its own cost with the strategies it
    may not take at infinity."""
    neighbours: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(problem.num_nodes)]
    for u, v, m in problem.edges:
        neighbours[u].append((v, m))
        neighbours[v].append((u, m.T))
    masked = [np.where(problem.allowed[i], problem.node_cost[i], np.inf) for i in range(problem.num_nodes)]
    return neighbours, masked


def _repair(problem: ShardingProblem, choice: tuple[int, ...]) -> tuple[int, ...]:
    neighbours, masked = _adjacency(problem)
    return tuple(_repair_memory(problem, masked, neighbours, list(choice)))


def _propagation(problem: ShardingProblem, sweeps: int, seeds: int) -> Solution:
    """Greedy propagation, then local improvement (MindSpore's sharding propagation, tried from a few starts).
    From a seed node (the few whose own cost varies most, each with every strategy it may take; a pinned node has
    one), each next node is the undecided neighbour of the decided set with the most edge cost at stake, and takes
    the strategy cheapest against its decided neighbours; every node still undecided starts a new front. Then
    each node in turn moves to its best strategy given all others, until nothing improves. The cheapest result
    wins; one that breaks the memory limit is repaired by moving the nodes that save the most bytes per second
    lost. One more start is every node's first allowed strategy (by convention its replicated one).
    """
    n = problem.num_nodes
    neighbours, masked = _adjacency(problem)
    stake = [float(np.ptp(np.where(np.isfinite(c), c, 0))) for c in masked]
    order = sorted(range(n), key=lambda i: -stake[i])
    free = [i for i in order if problem.allowed[i].sum() > 1] or order
    starts = [(seed, int(s)) for seed in free[:seeds] for s in np.flatnonzero(problem.allowed[seed])]
    best: tuple[float, list[int]] | None = None
    first_allowed = [int(np.flatnonzero(m)[0]) for m in problem.allowed]  # strategy 0 is each node's replicated one
    for seed, strategy in [(None, None)] + starts:
        choice = list(first_allowed) if seed is None else _propagate(masked, neighbours, stake, order, seed, strategy)
        choice = _improve(masked, neighbours, choice, sweeps)
        choice = _improve_pairs(problem, masked, neighbours, choice, sweeps)
        cost = total_cost(problem, tuple(choice))
        if best is None or cost < best[0]:
            best = (cost, choice)
    return Solution(total_cost(problem, tuple(best[1])), tuple(best[1]), "propagation",
                    stats={"starts": len(starts)})


def _propagate(masked, neighbours, stake, order, seed: int, strategy: int) -> list[int]:
    choice = [int(np.argmin(c)) if np.isfinite(c).sum() == 1 else -1 for c in masked]  # pinned or forced
    choice[seed] = strategy
    visited: set[int] = set()
    for start in [seed] + order:
        if start in visited:
            continue
        frontier = {start: 0.0}
        while frontier:
            node = max(frontier, key=frontier.get)
            del frontier[node]
            visited.add(node)
            if choice[node] < 0:
                choice[node] = int(np.argmin(_local_cost(masked, neighbours, choice, node)))
            for other, m in neighbours[node]:
                if other not in visited:
                    frontier[other] = frontier.get(other, 0.0) + float(np.ptp(m))
    return choice


def _improve(masked, neighbours, choice: list[int], sweeps: int) -> list[int]:
    for _ in range(sweeps):
        changed = False
        for node in range(len(choice)):
            local = _local_cost(masked, neighbours, choice, node)
            best = int(np.argmin(local))
            if local[best] < local[choice[node]] - 1e-15:
                choice[node], changed = best, True
        if not changed:
            break
    return choice


def _local_cost(masked, neighbours, choice, node) -> np.ndarray:
    cost = masked[node].copy()
    for other, m in neighbours[node]:
        if choice[other] >= 0:
            cost = cost + m[:, choice[other]]
    return cost


def _improve_pairs(problem, masked, neighbours, choice: list[int], sweeps: int) -> list[int]:
    """Moves of both ends of an edge at once: what single moves cannot reach when a placement change only pays
    if the operator next to it changes too (a table and its lookup). Ends with single moves again."""
    for _ in range(sweeps):
        changed = False
        for u, v, m in problem.edges:
            cost_u = _local_cost(masked, neighbours, choice, u) - m[:, choice[v]]  # u's cost without the u-v edge
            cost_v = _local_cost(masked, neighbours, choice, v) - m[choice[u], :]
            joint = cost_u[:, None] + cost_v[None, :] + m
            a, b = np.unravel_index(int(np.argmin(joint)), joint.shape)
            if joint[a, b] < joint[choice[u], choice[v]] - 1e-15:
                choice[u], choice[v], changed = int(a), int(b), True
        choice = _improve(masked, neighbours, choice, sweeps)
        if not changed:
            break
    return choice


WINDOW = 100
"""Nodes re-solved together by the window moves. Measured on the decoders, examples/operators and Llama 3 8B's graph
(benchmarks/per_operator.py): 40 leaves the decoders 6-15% above the program, as the old region moves did, and 80
up to 7%: a window must hold a whole attention block (about 60 operators from the projections in to the
projection out, with their parameters) for the move onto heads to pay; 100 reaches the program's optimum on every
benchmark model."""


def _improve_windows(problem: ShardingProblem, choice: list[int], size: int = WINDOW, rounds: int = 3,
                     time_limit: float = 10.0) -> list[int]:
    """Large-neighbourhood search: re-solve a window of `size` consecutive nodes exactly (the integer program, the
    rest of the graph fixed at its current choice: their edges into the window become the window's own costs),
    sliding by half a window over the graph, a few rounds, keeping each window's answer where the total drops; then
    the same with windows twice as wide (Llama 3 8B's tied graph, 308 nodes: the propagation's start there breaks
    placement rules in chains longer than 100 nodes; 200 repairs them). Finds
    the joint moves that single, pair and greedy moves cannot (a whole attention block onto heads). Needs scipy; without
    it the choice is returned as it is."""
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        return choice
    incident: list[list[int]] = [[] for _ in range(problem.num_nodes)]
    for e, (u, v, _) in enumerate(problem.edges):
        incident[u].append(e)
        if v != u:
            incident[v].append(e)
    order = _window_order(problem)
    cost = total_cost(problem, tuple(choice))
    for width in (size, 2 * size):  # then twice as wide, from where the first width stopped
        stride = max(1, width // 2)
        for _ in range(rounds):
            improved = False
            for start in range(0, max(1, len(order) - stride), stride):
                window = order[start:start + width]
                try:
                    solved = solve_program(_window_problem(problem, incident, window, choice), time_limit).choice
                except Infeasible:
                    continue
                trial = list(choice)
                for new, old in enumerate(window):
                    trial[old] = solved[new]
                new_cost = total_cost(problem, tuple(trial))
                if new_cost < cost - 1e-12 * abs(cost) and _feasible(problem, tuple(trial)):
                    choice, cost, improved = trial, new_cost, True
            if not improved:
                break
    return choice


def _window_order(problem: ShardingProblem) -> list[int]:
    """Nodes in index order (a graph's calls in the order they ran), each node with no producer (a parameter, an
    input) just before its first consumer, so that a window of consecutive nodes holds operators and their weights."""
    consumers: list[list[int]] = [[] for _ in range(problem.num_nodes)]
    produced = [False] * problem.num_nodes
    for u, v, _ in problem.edges:
        if u != v:
            consumers[u].append(v)
            produced[v] = True
    position = [min(consumers[i]) - 0.5 if not produced[i] and consumers[i] else float(i)
                for i in range(problem.num_nodes)]
    return sorted(range(problem.num_nodes), key=lambda i: (position[i], i))


def _window_problem(problem: ShardingProblem, incident: list[list[int]], window: list[int], choice: list[int]
                    ) -> ShardingProblem:
    """The problem over `window` with every other node fixed at `choice`: an edge to a fixed node becomes a cost of
    the window's node, the fixed nodes' memory comes off the limit."""
    index = {old: new for new, old in enumerate(window)}
    cost = [problem.node_cost[i].copy() for i in window]
    edges = []
    for e in sorted({e for i in window for e in incident[i]}):
        u, v, m = problem.edges[e]
        if u in index and v in index:
            if u == v:
                cost[index[u]] += np.diag(m)
            else:
                edges.append((index[u], index[v], m))
        elif u in index:
            cost[index[u]] += m[:, choice[v]]
        else:
            cost[index[v]] += m[choice[u], :]
    fixed_memory = total_memory(problem, tuple(choice)) - sum(float(problem.node_memory[i][choice[i]]) for i in window)
    return ShardingProblem(cost, edges, [problem.node_memory[i] for i in window], problem.memory_limit - fixed_memory,
                           [problem.allowed[i] for i in window])


def _repair_memory(problem, masked, neighbours, choice) -> list[int]:
    while total_memory(problem, tuple(choice)) > problem.memory_limit:
        best, best_ratio = None, -math.inf
        for node in range(problem.num_nodes):
            local = _local_cost(masked, neighbours, choice, node)
            for s in range(len(local)):
                saved = problem.node_memory[node][choice[node]] - problem.node_memory[node][s]
                if saved > 0 and np.isfinite(local[s]):
                    ratio = saved / max(local[s] - local[choice[node]], 1e-12)
                    if ratio > best_ratio:
                        best, best_ratio = (node, s), ratio
        if best is None:
            raise Infeasible("no placement fits the memory limit with the pins given")
        choice[best[0]] = best[1]
    return choice


# ---- the slow reference ----------------------------------------------------------------------
def solve_brute_force(problem: ShardingProblem) -> Solution:
    """Every combination; for differential tests on graphs of a few nodes."""
    options = [np.flatnonzero(m).tolist() for m in problem.allowed]
    best: tuple[float, tuple[int, ...]] | None = None
    for choice in itertools.product(*options):
        if total_memory(problem, choice) > problem.memory_limit:
            continue
        cost = total_cost(problem, choice)
        if best is None or cost < best[0] - 1e-15:
            best = (cost, choice)
    if best is None:
        raise Infeasible("no placement fits the memory limit with the pins given")
    return Solution(best[0], best[1], "brute_force")
