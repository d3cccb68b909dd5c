"""Table-wise placement of embedding tables: a whole table on one rank of the tensor-parallel axis (TorchRec's
table_wise), which DTensor has no placement for. The planner offers it ("T") to a fused table (trained by a fused
row-wise optimizer, plait.execute.embedding_tables, so no dense gradient or optimizer state has to live anywhere
else) that only lookups read; the executor runs it as the table on its owner, whose lookup's rows are broadcast to
the tensor-parallel ranks (which hold the same ids: the batch enters replicated on tp), and whose backward updates
the table on the owner alone.

Pricing, inside the per-operator program (one rank's view, plait.operators.planner.build_problem): the table's
bytes (and row-wise Adagrad's accumulators) over the axis, as if spread evenly; each lookup reads it replicated and
pays the broadcast of its rows (`lookup_exchange`); over dp the owners exchange their touched rows as a replicated
table's do. After the solve the tables placed "T" are bin-packed onto the ranks (`pack`: largest first onto the
least loaded rank, by bytes then lookup seconds, TorchRec's greedy partitioner's rule), the plan records each owner
("T<rank>") and its peak memory is the fullest rank's: where that one does not fit, the program is solved again with
the imbalance taken off its limit (`solve_packed`).

Table-row-wise (TorchRec: rows split over the ranks of one node) is S0 on the tensor-parallel axis, which stays in a
node; tables are replicated over dp (their rows exchanged there), so TorchRec's row_wise over the whole world has
no counterpart.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from plait.cost import comm
from plait.cost import operators as price
from plait.errors import ConfigError
from plait.spec.cluster import ClusterSpec

TABLE_WISE = "T"
"""A table-wise placement in the program; a plan names its owner: "T0", "T1", ... (the rank on the axis)."""
_OWNED = re.compile(r"^T(\d*)$")
LOOKUP_OPS = ("embedding.default",)
"""The ATen calls a table-wise table may be read by (the executor's lookup runs these alone)."""
RESOLVES = 3
"""Solves with a tightened limit before table-wise placements are given up for one that fits."""


def is_table_wise(placement: str) -> bool:
    return bool(_OWNED.match(placement))


def owner_of(placement: str) -> int | None:
    """The rank a "T<rank>" placement names (None for "T": the packing chooses)."""
    found = _OWNED.match(placement)
    return int(found.group(1)) if found and found.group(1) else None


def offered(graph, name: str, fused: dict[str, str], axis_size: int) -> bool:
    """Whether parameter `name` may be placed table-wise: a fused table over more than one rank, read by lookups
    only."""
    if name not in fused or axis_size <= 1:
        return False
    ref = graph.params[name]
    readers = [call for call in graph.calls if any(r.value == ref.value for r in call.inputs)]
    return bool(readers) and all(call.op.__name__ in LOOKUP_OPS and call.inputs[0].value == ref.value
                                 for call in readers)


def check_pin(name: str, placement: str, axis_size: int, fused: dict[str, str]) -> str:
    """The program's placement a pin asks for ("T" for "T<rank>"); ConfigError in one line where a table-wise pin
    cannot hold: not a fused table, or a rank the axis does not have (PinRefused: another degree may)."""
    if not is_table_wise(placement):
        return placement
    from plait.operators.planner import PinRefused

    if name not in fused:
        raise ConfigError(f"pin {name!r} = {placement!r}: a table-wise placement is for an nn.Embedding trained by a "
                          f"fused table optimizer (--table-optimizer sgd or rowwise_adagrad)")
    rank = owner_of(placement)
    if rank is not None and rank >= axis_size:
        raise PinRefused(f"pin {name!r} = {placement!r}: tp={axis_size} has ranks 0-{axis_size - 1}")
    return TABLE_WISE


def lookup_exchange(out_bytes: float, group: comm.Group, cluster: ClusterSpec) -> price.Redistribution:
    """A table-wise lookup's rows broadcast from the owner to the axis's ranks."""
    return price.Redistribution("broadcast", comm.broadcast(out_bytes, group, cluster), out_bytes)


def edge_seconds(dst: str, grad: str, out_bytes: float, group: comm.Group, cluster: ClusterSpec) -> float:
    """A table-wise table into one strategy of its lookup: runs where the lookup reads everything replicated (its
    rows then leave replicated; `grad` "R": no argument split), at the broadcast's price."""
    if dst != "R" or grad != "R":
        return price.UNRUNNABLE_S
    return lookup_exchange(out_bytes, group, cluster).seconds


def rows_bytes(node, read_rows: dict[int, float]) -> float:
    """Bytes of the rows a table-wise lookup broadcasts: its distinct ids' (the sample's), or one row an id."""
    if node.call is None:
        return 0.0
    out = node.call.outputs[0]
    if node.call.index in read_rows:
        return read_rows[node.call.index] * out.shape[-1] * out.dtype.itemsize
    return float(out.nbytes)


def table_bytes(ref, optimizer: str) -> float:
    """Bytes the owner of a table-wise table holds: the weights (and row-wise Adagrad's accumulators)."""
    return price.parameter_bytes(ref, "R", 1, 1, price.fused_table_copies(optimizer, ref))


def pack(tables: dict[str, tuple[float, float]], axis_size: int, pinned: dict[str, int] | None = None
         ) -> tuple[dict[str, int], list[float]]:
    """({table: owner rank}, bytes per rank) of tables {name: (bytes, lookup seconds)}: the pinned ones on their
    ranks, then largest first each onto the rank with the fewest bytes (then the least lookup work)."""
    pinned = pinned or {}
    owners: dict[str, int] = {}
    load = [[0.0, 0.0] for _ in range(axis_size)]
    for name in sorted(tables, key=lambda n: (n not in pinned, -tables[n][0], -tables[n][1], n)):
        rank = pinned[name] if name in pinned else min(range(axis_size), key=lambda r: (load[r][0], load[r][1], r))
        owners[name] = rank
        load[rank][0] += tables[name][0]
        load[rank][1] += tables[name][1]
    return owners, [b for b, _ in load]


def placed(built, choice) -> dict[str, int]:
    """Parameter name -> its node, for the parameters `choice` places table-wise."""
    found = {}
    for name, ref in built.graph.params.items():
        node = built.value_node[ref.value]
        if built.nodes[node].strategies[choice[node]].outputs[0] == TABLE_WISE:
            found[name] = node
    return found


def packing(built, choice, fused: dict[str, str], pins: dict[str, str]) -> tuple[dict[str, int], float]:
    """(owners, bytes the fullest rank holds beyond the program's even spread) of `choice`'s table-wise tables."""
    nodes = placed(built, choice)
    if not nodes:
        return {}, 0.0
    tables = {}
    for name in nodes:
        lookups = [c for c in built.graph.calls if built.graph.params[name] in c.inputs]
        seconds = sum(float(built.problem.node_cost[built.call_node[c.index]][choice[built.call_node[c.index]]])
                      for c in lookups)
        tables[name] = (table_bytes(built.graph.params[name], fused[name]), seconds)
    pinned = {n: owner_of(pins[n]) for n in nodes if n in pins and owner_of(pins[n]) is not None}
    owners, loads = pack(tables, built.axis_size, pinned)
    return owners, max(loads) - sum(b for b, _ in tables.values()) / built.axis_size


def solve_packed(solve, built, fused: dict[str, str], pins: dict[str, str]):
    """`solve(built)` where its table-wise tables, bin-packed, fit the limit on the fullest rank (the program spreads
    them evenly, a relaxation: what fits is optimal); else the cheapest of the program solved again with the
    imbalance taken off the limit (up to RESOLVES times) and solved without table-wise placements (pinned ones
    excepted), among those that fit."""
    from plait.search import sharding

    built = dataclasses.replace(built, problem=dataclasses.replace(built.problem, allowed=_whole_fits(built)))
    problem = built.problem

    def imbalance(solution) -> float:
        return packing(built, solution.choice, fused, pins)[1]

    def fits(solution) -> bool:
        return sharding.total_memory(problem, solution.choice) + imbalance(solution) <= problem.memory_limit

    def solved(**change):
        try:
            return solve(dataclasses.replace(built, problem=dataclasses.replace(problem, **change)))
        except sharding.Infeasible:
            return None

    solution = solve(built)
    if fits(solution):
        return solution
    found = []
    for _ in range(RESOLVES):
        tighter = problem.memory_limit - imbalance(solution)
        solution = solved(memory_limit=tighter) if tighter > 0 else None
        if solution is None:
            break
        if fits(solution):
            found.append(solution)
            break
    whole = solved(allowed=[a & np.array([s.outputs[:1] != (TABLE_WISE,) for s in node.strategies])
                            if node.name not in pins else a for a, node in zip(problem.allowed, built.nodes)])
    found += [whole] if whole is not None and fits(whole) else []
    if not found:
        raise sharding.Infeasible("no placement fits the memory limit once its table-wise tables are packed onto "
                                  "their ranks")
    return min(found, key=lambda s: s.cost)


def _whole_fits(built) -> list[np.ndarray]:
    """The program's allowed strategies less table-wise placements of tables whose owner could not hold them beside
    the least the rest of the plan needs (the other tables may live elsewhere: counted as nothing)."""
    problem = built.problem
    allowed = [a.copy() for a in problem.allowed]
    tables = {built.value_node[ref.value]: (name, ref) for name, ref in built.graph.params.items() if name in built.fused}
    rest = sum(float(m[a].min()) for node, (m, a) in enumerate(zip(problem.node_memory, allowed))
               if a.any() and node not in tables)
    for node, (name, ref) in tables.items():
        wise = np.array([s.outputs[:1] == (TABLE_WISE,) for s in built.nodes[node].strategies])
        if wise.any() and rest + table_bytes(ref, built.fused[name]) > problem.memory_limit and (allowed[node] & ~wise).any():
            allowed[node] &= ~wise
    return allowed


def name_owners(sharding_plan, owners: dict[str, int], extra: float):
    """The OperatorSharding with each table-wise table's owner named ("T<rank>") and the fullest rank's memory."""
    if not owners:
        return sharding_plan
    params = {n: f"{TABLE_WISE}{owners[n]}" if n in owners else p for n, p in sharding_plan.params.items()}
    parts = dict(sharding_plan.memory_parts)
    if "params" in parts:
        parts["params"] += extra
    return dataclasses.replace(sharding_plan, params=params, peak_memory_bytes=sharding_plan.peak_memory_bytes + extra,
                               memory_parts=parts, param_reads={n: p for n, p in sharding_plan.param_reads.items()
                                                                if n not in owners})
