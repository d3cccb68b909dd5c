"""Plan per-operator sharding for a module of any shape: capture (plait.operators.capture), strategies
(plait.operators.strategies), costs (plait.cost.operators), solve (plait.search.sharding), and the result as the
Plan's OperatorSharding.

The solve is on the tensor-parallel axis of a dp x tp mesh: data parallelism (fully_shard over dp) runs around
it, and its per-parameter cost (gathering and reducing this rank's shard) is part of each parameter's price, so
the solver trades splitting an operator against replicating it.

Pins (semi-automatic mode) name a parameter ("fc1.weight": "S0") or a module ("fc1": "S1", the placement of
its output); the solver keeps only the strategies they allow. A pin on a name that does not exist, a placement a
shape cannot take, or pins that leave no strategy are refused with a ConfigError naming the pin.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from plait.cost import comm
from plait.cost import operators as price
from plait.errors import ConfigError
from plait.operators import table_wise
from plait.operators.capture import Graph, TensorRef, capture, check_loss
from plait.operators.id_sample import TableSample, cached_sample, rows_by_call
from plait.operators.solution import FUSED_OPTIMIZERS, OperatorCost, OperatorSharding
from plait.operators.strategies import Strategy, StrategyOracle, candidate_placements, strategy_oracle
from plait.search import sharding
from plait.spec.cluster import ClusterSpec

COSTLIEST = 10
"""Operators the plan keeps for its report."""
OUTPUT_NODE = "<output>"
"""The loss's node: it leaves replicated; its memory is what the peak holds beside the kept activations."""


@dataclass
class _Node:
    name: str
    strategies: list[Strategy]
    ref: TensorRef | None = None
    """A parameter's or input's value; None for a call."""
    call: object | None = None


@dataclass
class Built:
    """The problem and what its indices mean."""

    graph: Graph
    nodes: list[_Node]
    value_node: dict[int, int]
    """Value id -> node that produces it (with output index)."""
    call_node: dict[int, int]
    problem: sharding.ShardingProblem
    edge_parts: list[tuple[int, int, int, TensorRef]]
    """Per problem edge: (producer node, output index, consumer node, consumed tensor) ... argument index."""
    unsupported: tuple[str, ...]
    gradient_sums: dict[int, int] = dataclasses.field(default_factory=dict)
    """Value id -> its gradient-sum node (values several calls read; see build_problem)."""
    gradient_shares: dict[int, int] = dataclasses.field(default_factory=dict)
    """Value id a reader reads -> the value whose gradient sum that reading may join (itself, or the value a view
    was taken of)."""
    axis_size: int = 0
    """The tensor-parallel degree the problem was built for."""
    fused: dict[str, str] = dataclasses.field(default_factory=dict)
    """The fused tables' optimizers (build_problem's `fused`)."""
    read_rows: dict[int, float] = dataclasses.field(default_factory=dict)
    """Lookup call index -> the distinct rows it reads (the ids sample's)."""
    distinct_exchange: frozenset[str] = frozenset()
    """Fused tables whose dp exchange sends distinct rows (price.row_exchange_time)."""
    recomputed: frozenset[int] = frozenset()
    """Calls (their index) of recomputed blocks: the redistributions into them are made again in the backward."""


def _output_of(node: _Node, strategy: int, index: int) -> str:
    return node.strategies[strategy].outputs[index]


def build_problem(graph: Graph, axis_size: int, dp: int, cluster: ClusterSpec, memory_limit: float | None = None,
                  oracle: StrategyOracle | None = None, fused: dict[str, str] | frozenset[str] = frozenset(),
                  sample: TableSample | None = None, carry: price.DataParallelCarry | None = None,
                  recompute: str = "") -> Built:
    """`carry`: how data parallelism is carried (price.DataParallelCarry: the ZeRO stage, fully_shard's units, the
    micro-batches a step accumulates, whose calls and redistributions the step runs that many times); default:
    fully_shard over dp on the whole module as one unit, one micro-batch (what a pipeline stage runs).
    `recompute`: the path of the repeated blocks recomputed in the backward (plait.execute.recompute's "full" per
    block), priced by price.recomputed_blocks.
    `fused`: parameters (embedding tables) trained by a fused row-wise optimizer ({name: optimizer}; a set of
    names means SGD): weights alone (and row-wise Adagrad's accumulators), kept whole over dp
    (plait.execute.embedding_tables); the rows their lookups move counted from `sample` where given (the distinct
    rows a micro-batch reads, plait.operators.id_sample), else one row an id.

    A value several calls read, and a gradient reaches, gets a gradient-sum node right after its producer, of two
    strategies: "separate" (each reader pays its own backward image, as an edge does) and "summed" (the readers
    whose Partial gradients autograd adds before DTensor reduces them, price.joins_gradient_sum, share one
    all-reduce: the node's edge to the producer costs it, on a replicated producer only, and its edge to each such
    reader refunds that reader's own). The backward of a value is then priced once per value, not once per edge."""
    if oracle is None:
        with strategy_oracle(axis_size) as oracle:
            return build_problem(graph, axis_size, dp, cluster, memory_limit, oracle, fused, sample, carry,
                                 recompute)
    carry = carry or price.data_parallel_carry(dp, axis_size, 2, cluster)
    repeat = carry.micro_batches  # each micro-batch's calls and redistributions, once a step each
    recomputed = price.recomputed_blocks(graph, recompute, axis_size)
    group, dp_group = comm.Group(axis_size, 1), comm.Group(dp, axis_size)
    fused = fused if isinstance(fused, dict) else dict.fromkeys(fused, "sgd")
    nodes: list[_Node] = []
    value_node: dict[int, tuple[int, int]] = {}
    costs, memory = [], []
    unsupported = []
    grads = needs_gradient(graph)
    readers: dict[int, list] = {}
    for call in graph.calls:
        for k, ref in enumerate(call.inputs):
            readers.setdefault(ref.value, []).append((call, k))
    gradient_sums: dict[int, int] = {}
    summed_refs: dict[int, TensorRef] = {}
    distinct: set[str] = set()

    def add_gradient_sums(refs) -> None:
        for ref in refs:
            if len(readers.get(ref.value, ())) >= 2 and ref.is_float and ref.value in grads:
                gradient_sums[ref.value], summed_refs[ref.value] = len(nodes), ref
                nodes.append(_Node(f"<gradient sum of value {ref.value}>", [Strategy((), ("separate",)),
                                                                           Strategy((), ("summed",))]))
                costs.append([0.0, 0.0])
                memory.append([0.0, 0.0])

    for value in graph.values.values():
        if value.kind == "op":
            continue
        placed = value.kind in ("param", "buffer") and axis_size > 1
        options = candidate_placements(value.ref, axis_size, partial=False, uneven=value.kind == "param") \
            if placed else ["R"]
        if value.kind == "param" and table_wise.offered(graph, value.name, fused, axis_size):
            options.append(table_wise.TABLE_WISE)
        value_node[value.id] = (len(nodes), 0)
        nodes.append(_Node(value.name, [Strategy((), (p,)) for p in options], ref=value.ref))
        if value.kind == "param" and value.name in fused:
            lookups = [out for call in graph.calls if value.ref in call.inputs for out in call.outputs]
            ids = sum(out.nbytes // max(1, value.ref.shape[-1] * out.dtype.itemsize) for out in lookups)
            count = sample.touched.get(value.name, ids) if sample is not None else ids
            row = value.ref.nbytes / max(1, value.ref.shape[0])
            rows, tables = count * row, sum(n in fused for n in graph.params)  # the distinct rows, exchanged over dp
            if price.row_exchange_time(rows, ids * row, dp, cluster, dp_group, tables)[1]:
                distinct.add(value.name)
            optimizer = fused[value.name]
            # table-wise: its owners exchange their rows over dp as a replicated table's; its bytes spread evenly
            # here, the ranks' real shares after the solve (plait.operators.table_wise); each micro-batch's rows
            costs.append([price.fused_table_sync_time(repeat * rows, "R" if p == table_wise.TABLE_WISE else p,
                                                      axis_size, dp, cluster, dp_group, optimizer, repeat * count,
                                                      group, tables, repeat * ids * row) for p in options])
            memory.append([table_wise.table_bytes(value.ref, optimizer) / axis_size if p == table_wise.TABLE_WISE
                           else price.parameter_bytes(value.ref, p, axis_size, 1, price.fused_table_copies(
                               optimizer, value.ref)) for p in options])
        elif value.kind == "param":
            costs.append([carry.sync_time(price.shard_bytes(value.ref, p, axis_size), value.name, cluster, dp_group)
                          for p in options])
            memory.append([price.shard_bytes(value.ref, p, axis_size) * carry.copies(value.name) for p in options])
        else:
            costs.append([0.0] * len(options))
            memory.append([price.shard_bytes(value.ref, p, axis_size) for p in options])
        add_gradient_sums([value.ref])
    call_node = {}
    param_values = {ref.value for ref in graph.params.values()}  # arguments that may arrive split unevenly
    for call in graph.calls:
        strategies, has_rule = oracle.strategies(call, tuple(ref.value in param_values for ref in call.inputs))
        if not has_rule:
            unsupported.append(call.name)
        call_node[call.index] = len(nodes)
        for i, ref in enumerate(call.outputs):
            value_node[ref.value] = (len(nodes), i)
        nodes.append(_Node(call.name, strategies, call=call))
        again = price.RECOMPUTED_WORK if call.index in recomputed.calls else 1.0
        costs.append([repeat * again * price.compute_time(call.flops, call.outputs, price.is_split(s.inputs),
                                                          axis_size, cluster) for s in strategies])
        memory.append([0.0 if call.index in recomputed.calls else
                       price.activation_bytes(call.outputs, s.outputs, axis_size, call.saved) for s in strategies])
        add_gradient_sums(call.outputs)
    edges, parts = [], []

    enforced = _enforced_reads(graph)
    read_rows = rows_by_call(sample, graph)
    # an edge's price depends on the placements and the tensor's shape alone: millions of edges, thousands of prices
    edge_prices: dict[tuple, float] = {}
    layouts: dict[tuple, bool] = {}

    def edge_seconds(src: str, dst: str, grad: str, ref: TensorRef, needs_grad: bool, again: bool) -> float:
        """The edge's forward and backward seconds; `again`: its reader is recomputed, its forward made twice."""
        key = (src, dst, grad, ref.shape, ref.dtype, needs_grad, again)
        if key not in edge_prices:
            seconds, forward, _ = price.edge_time(src, dst, grad, ref, group, cluster, needs_grad)
            edge_prices[key] = seconds + (forward.seconds if again else 0.0)
        return edge_prices[key]

    def runs_on_layout(src: str, dst: str, ref: TensorRef) -> bool:
        key = (src, dst, ref.shape, ref.stride)
        if key not in layouts:
            layouts[key] = price.runs_on_layout(src, dst, ref)
        return layouts[key]

    def connect(ref: TensorRef, consumer: int, reads: list[tuple[str, str]], accepts: frozenset[str] = frozenset()
                ) -> None:
        if enforced.get(ref.value) == consumer_call.get(consumer):
            accepts = frozenset()  # the executor redistributes it here itself (a module's hook)
        producer, index = value_node[ref.value]
        source = nodes[producer]
        lookup = source.call is not None and source.call.op.__name__ in table_wise.LOOKUP_OPS
        matrix = np.zeros((len(source.strategies), len(reads)))
        needs_grad, again = ref.value in grads, consumer_call.get(consumer) in recomputed.calls
        for a, strategy in enumerate(source.strategies):
            for b, (dst, grad) in enumerate(reads):
                src = strategy.outputs[index]
                if src == table_wise.TABLE_WISE:  # the owner's lookup, its rows broadcast
                    rows = table_wise.rows_bytes(nodes[consumer], read_rows)
                    matrix[a, b] = repeat * table_wise.edge_seconds(dst, grad, rows, group, cluster)
                    continue
                runs = (src == dst or (src not in accepts and runs_on_layout(src, dst, ref))) and not (
                    src == dst == "P" and lookup)  # a row-split lookup's MaskPartial dies in the next op that
                # changes its shape (a bag's pooling) in torch 2.13: its rows are made whole at their first reader
                matrix[a, b] = repeat * edge_seconds(src, dst, grad, ref, needs_grad, again) + \
                    (0.0 if runs else price.UNRUNNABLE_S)
        edges.append((producer, consumer, matrix))
        parts.append((producer, index, consumer, ref))

    consumer_call = {node: index for index, node in call_node.items()}
    for call in graph.calls:
        v = call_node[call.index]
        for k, ref in enumerate(call.inputs):
            reads = [(s.inputs[k], price.gradient_placement(s.inputs, k)) for s in nodes[v].strategies]
            connect(ref, v, reads, _taken_as_is(nodes[v].strategies, k))
    if graph.output is not None:  # the loss leaves replicated
        sink = len(nodes)
        nodes.append(_Node(OUTPUT_NODE, [Strategy(("R",), ())]))
        costs.append([0.0])
        # beside the kept activations at the peak (price's docstring); under recompute, the blocks' inputs and
        # one block's activations rematerialised in its backward
        memory.append([graph.transient_bytes + recomputed.held_bytes])
        connect(graph.output, sink, [("R", "R")])
    allowed = [np.ones(len(c), dtype=bool) for c in costs]
    shares: dict[int, int] = {}
    for value, node in gradient_sums.items():
        once = repeat * price.redistribution("P", "R", summed_refs[value].nbytes, group, cluster).seconds
        sum_edges = []
        for via, reader, k in _gradient_sum_readers(readers, value):
            strategies = nodes[call_node[reader.index]].strategies
            refund = [-once if price.joins_gradient_sum("R", s.inputs[k], price.gradient_placement(s.inputs, k))
                      else 0.0 for s in strategies]
            if not any(refund):
                continue
            sum_edges.append((node, call_node[reader.index], np.array([[0.0] * len(refund), refund])))
            if via is not None:  # the view between passes the pending sum on only when it is replicated throughout
                sum_edges.append((node, call_node[via.index], np.array(
                    [[0.0] * len(nodes[call_node[via.index]].strategies),
                     [0.0 if s.inputs == ("R",) and s.outputs == ("R",) else price.UNRUNNABLE_S
                      for s in nodes[call_node[via.index]].strategies]])))
            shares[reader.inputs[k].value] = value
        if sum(1 for e in sum_edges if e[2][1].min() < 0) < 2:  # nothing to share: separate
            allowed[node][1] = False
            continue
        edges.extend(sum_edges)
        producer, index = value_node[value]
        # summed is a state of a replicated producer only: elsewhere each reader redistributes its own gradient
        column = [once if _output_of(nodes[producer], s, index) == "R" else price.UNRUNNABLE_S
                  for s in range(len(nodes[producer].strategies))]
        edges.append((producer, node, np.array([[0.0] * len(column), column]).T))
    problem = sharding.ShardingProblem(costs, edges, memory,
                                       memory_limit if memory_limit is not None else cluster.memory_bytes, allowed)
    return Built(graph, nodes, {k: v[0] for k, v in value_node.items()}, call_node, problem, parts,
                 tuple(unsupported), gradient_sums, shares, axis_size, fused, read_rows, frozenset(distinct),
                 recomputed.calls)


def _gradient_sum_readers(readers: dict[int, list], value: int) -> list[tuple[object | None, object, int]]:
    """(view, reader, argument index) for each reading of `value` whose Partial gradient may join its sum: the calls
    that read it, and through a view (one tensor in, one out: F.linear's flattening of its input) read by one call,
    the call that reads the view (a view's backward passes a pending sum on; autograd adds at the value).
    `readers`: value id -> [(call, argument index)]."""
    found = []
    for call, k in readers[value]:
        if _is_view(call):
            next_readers = readers.get(call.outputs[0].value, [])
            if len(next_readers) == 1:
                found.append((call, *next_readers[0]))
                continue
        found.append((None, call, k))
    return found


def _is_view(call) -> bool:
    return len(call.inputs) == 1 and len(call.outputs) == 1 and (
        call.op.is_view or call.op.__name__.split(".")[0] == "_unsafe_view")


def needs_gradient(graph: Graph) -> set[int]:
    """Value ids a gradient flows to: the parameters, inputs that require one (a pipeline stage's received hidden
    states), and every call output computed from one."""
    grads = {ref.value for ref in graph.params.values()} | graph.grad_inputs
    for call in graph.calls:
        if any(ref.value in grads for ref in call.inputs):
            grads.update(ref.value for ref in call.outputs if ref.is_float)
    return grads


def _enforced_reads(graph: Graph) -> dict[int, int]:
    """Value id -> the call whose read of it the executor enforces: a module's output, a module's first argument,
    a parameter or a buffer is redistributed by a hook to the placement its first consumer reads it in
    (plait.execute.operators; describe() writes those placements), so a redistribution planned there happens there.
    So is a lookup's output (a pooled bag's rows, read by its pooling inside the module): the executor redistributes
    each torch-level call's arguments as planned (PlannedReads), and a row-split lookup's pending sum must be made
    whole there (see build_problem)."""
    boundary = {ref.value for ref in (*graph.module_outputs.values(), *graph.module_inputs.values(),
                                      *graph.params.values(), *graph.buffers.values())}
    boundary |= {out.value for call in graph.calls if call.op.__name__ in table_wise.LOOKUP_OPS for out in call.outputs}
    first: dict[int, int] = {}
    for call in graph.calls:
        for ref in call.inputs:
            if ref.value in boundary:
                first.setdefault(ref.value, call.index)
    return first


def _taken_as_is(strategies: list[Strategy], k: int) -> frozenset[str]:
    """Placements of a call's k-th argument some strategy runs on as they arrive. DTensor's eager dispatch keeps
    an argument as it is where a strategy takes it so, and redistributes later, where it must (where the tensor
    may be a transposed view: see price.runs_on_layout), so a plan that redistributes one of these here is not
    what the run does: the planner prices it out. (For a call of several arguments this is stricter than the
    dispatch, which weighs them together; what it leaves are plans the run follows.)"""
    return frozenset(s.inputs[k] for s in strategies)


class PinRefused(ConfigError):
    """A pin this tensor-parallel degree cannot honour (another degree may)."""


def apply_pins(built: Built, pins: dict[str, str]) -> None:
    """Mask the strategies pins forbid; ConfigError naming the pin when one cannot hold (PinRefused where it is this
    tensor-parallel degree that cannot take it). Over one rank (tp = 1) every pin holds: placements on the axis are
    all the whole tensor there."""
    masks = built.problem.allowed
    by_node: dict[int, list[str]] = {}
    for name, placement in pins.items():
        node, index = _pinned_node(built, name, placement)
        if built.axis_size == 1:  # over one rank every placement is the whole tensor: any pin holds
            continue
        wanted = table_wise.check_pin(name, placement, built.axis_size, built.fused)  # "T1": a "T" and its rank
        keep = np.array([s.outputs[index] == wanted for s in built.nodes[node].strategies])
        if not keep.any():
            options = sorted({s.outputs[index] for s in built.nodes[node].strategies})
            raise PinRefused(f"pin {name!r} = {placement!r}: its shape cannot take that placement over "
                             f"tp={built.axis_size}; it can take {', '.join(options)}")
        by_node.setdefault(node, []).append(name)
        masks[node] = masks[node] & keep
        if not masks[node].any():
            raise ConfigError(f"pins {' and '.join(repr(p) for p in by_node[node])} contradict each other: no "
                              f"strategy of {built.nodes[node].name} satisfies both; drop one")


def pinned_ref(graph: Graph, name: str, placement: str) -> TensorRef:
    """The tensor a pin names (a parameter, a buffer, a module's output); ConfigError in one line for a pin naming
    nothing or no placement."""
    if placement != "R" and placement != "P" and not (placement.startswith("S") and placement[1:].isdigit()) \
            and not table_wise.is_table_wise(placement):
        raise ConfigError(f"pin {name!r} = {placement!r}: a placement is R, P, S<dim> (S0, S1, ...) or, for a fused "
                          f"embedding table, T (table-wise) or T<rank>")
    ref = graph.params.get(name) or graph.buffers.get(name) or graph.module_outputs.get(name)
    if ref is None:
        known = list(graph.params)[:4] + list(graph.module_outputs)[:4]
        raise ConfigError(f"pin {name!r} names no parameter or module of the model; e.g. {', '.join(known)}")
    return ref


def _pinned_node(built: Built, name: str, placement: str) -> tuple[int, int]:
    ref = pinned_ref(built.graph, name, placement)
    node = built.value_node[ref.value]
    index = next(i for i, r in enumerate(
        built.nodes[node].call.outputs if built.nodes[node].call is not None else [ref]) if r.value == ref.value)
    return node, index


TIE_MIN_COPIES = 4
"""A block repeated this many times or more is solved once for its interior copies (all but the first and last,
whose neighbours differ: the embedding, the head)."""


def repeated_blocks(built: Built) -> list[list[int]]:
    """Classes of nodes that choose together: node j of every interior copy of a repeated block. A block is the
    module named by a numbered child ("model.layers.7"); copies have the same operators, in the same order, on the
    same shapes, and the same parameters (plait.search.sharding.tie)."""
    copies: dict[tuple, list[list[int]]] = {}
    for prefix, members in block_nodes(built).items():
        if any(name.startswith(prefix + ".") for name in built.fused):  # tables are placed and packed one by one
            continue
        container = prefix.rsplit(".", 1)[0]
        copies.setdefault((container, tuple(k for _, k in members)), []).append([n for n, _ in members])
    classes = []
    for same in copies.values():
        if len(same) >= TIE_MIN_COPIES:
            interior = same[1:-1]
            classes.extend([list(nodes) for nodes in zip(*interior)])
    return classes


def block_nodes(built: Built) -> dict[str, list[tuple[int, tuple]]]:
    """Per numbered child ("model.layers.7"), its nodes in order with what makes them the same node of another copy
    (operator, place in the block, shapes, scalars; a parameter's name in the block and shape)."""
    import re

    number = re.compile(r"^(.*?\.\d+)(?:\.|$)")
    blocks: dict[str, list[tuple[int, tuple]]] = {}
    # the graph's calls' keys are the same in every problem built on it (a search builds several): made once
    keys = built.graph.__dict__.setdefault("_block_keys", {})
    for call in built.graph.calls:
        found = number.match(call.module)
        if found:
            prefix = found.group(1)
            if call.index not in keys:
                keys[call.index] = (call.op, call.module[len(prefix):], _shapes(call.inputs), _shapes(call.outputs),
                                    _scalars(call))
            key = keys[call.index]
            blocks.setdefault(prefix, []).append((built.call_node[call.index], key))
            blocks[prefix].extend((built.gradient_sums[ref.value], ("gradient sum", key, i))
                                  for i, ref in enumerate(call.outputs) if ref.value in built.gradient_sums)
    for name, ref in {**built.graph.params, **built.graph.buffers}.items():
        found = number.match(name)
        if found and found.group(1) in blocks:
            key = ("param", name[len(found.group(1)):], ref.shape)
            blocks[found.group(1)].append((built.value_node[ref.value], key))
    return blocks


def _shapes(refs) -> tuple:
    return tuple((r.shape, r.stride, r.dtype) for r in refs)


def _scalars(call) -> str:
    """The call's arguments other than tensors (dims, sizes, flags), and how they nest."""
    from plait.torch_internals import tree_flatten

    flat, spec = tree_flatten((call.args, call.kwargs))
    return repr([None if isinstance(a, TensorRef) else a for a in flat]) + str(spec)


def solve(built: Built, solver: str = "program", time_limit: float = 60.0, reuse_blocks: bool = True,
          prove: bool = True) -> sharding.Solution:
    """`prove`: a tied solve's gap against the untied bound (sharding.solve_program)."""
    classes = repeated_blocks(built) if reuse_blocks else None
    if classes:  # copies that pins set apart (no placement all of them allow) choose apart
        allowed = built.problem.allowed
        classes = [c for c in classes if np.logical_and.reduce([allowed[i] for i in c]).any()]
    if solver == "propagation":
        return sharding.solve_propagation(built.problem, classes=classes)
    return sharding.solve_program(built.problem, time_limit, classes, prove)


def captured(model: nn.Module, inputs: tuple[torch.Tensor, ...], graphs: dict | None, key: tuple = ()) -> Graph:
    """capture(model, inputs), kept in `graphs` (a search's, by `key` and the inputs' shapes: the graph depends on
    nothing else) when given."""
    if graphs is None:
        return capture(model, inputs)
    from plait.operators import batch as batches

    leaves = [t for t in batches.flat(inputs)[0] if isinstance(t, torch.Tensor)]  # a dict batch, nested ones
    key = (key, batches.flat(inputs)[1], tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in leaves))
    if key not in graphs:
        graphs[key] = capture(model, inputs)
    return graphs[key]


def captured_loss(model: nn.Module, batch, graphs: dict | None, batch_source: str) -> Graph:
    """The whole module's capture (`captured`); ConfigError in one line when its forward does not return a scalar
    loss."""
    graph = captured(model, batch, graphs)
    check_loss(graph, f"model {type(model).__name__} (batches {batch_source!r})")
    return graph


def plan_module(model: nn.Module, batch: tuple[torch.Tensor, ...], *, batch_source: str, tp: int, dp: int,
                cluster: ClusterSpec, pins: dict[str, str] | None = None, solver: str = "program",
                memory_limit: float | None = None, table_optimizer: str | None = None,
                graphs: dict | None = None, prove: bool = True, carry: price.DataParallelCarry | None = None,
                recompute: str = "") -> OperatorSharding:
    """The per-operator plan of `model` (on meta) for one micro-batch `batch` (on meta). `table_optimizer`
    (solution.FUSED_OPTIMIZERS): every nn.Embedding trained by that fused row-wise optimizer. `graphs`: captures
    kept between calls (see `captured`). `carry` and `recompute`: as build_problem's; the plan records the blocks
    either names (OperatorSharding.blocks: the executor's fully_shard units and recomputed blocks)."""
    pins = dict(pins or {})
    fused = fused_tables(model, table_optimizer)
    start = time.perf_counter()
    graph = captured_loss(model, batch, graphs, batch_source)  # one rule for the loss: capture.check_loss
    sample = cached_sample(model, batch, batch_source, fused, graphs)
    built = build_problem(graph, tp, dp, cluster, memory_limit, fused=fused, sample=sample, carry=carry,
                          recompute=recompute)
    apply_pins(built, pins)
    solution = solve_or_refuse(built, solver, pins, fused, model, prove)
    candidate = tensor_plan_price(built, model, pins, solver)
    elapsed = time.perf_counter() - start
    blocks = recompute or (carry.blocks if carry is not None and carry.mode.carrier == "fully_shard" else "")
    return dataclasses.replace(describe(built, solution, batch_source, pins, tp, dp, cluster, elapsed,
                                        carry.micro_batches if carry is not None else 1),
                               fused_tables=fused, synchronised_norms=batch_norms_to_synchronise(model, dp),
                               table_sample=sample.describe() if sample is not None else "",
                               tensor_plan_step_time_s=candidate, blocks=blocks)


def tensor_plan_price(built: Built, model: nn.Module, pins: dict[str, str], solver: str) -> float | None:
    """What the decoder's own tensor plan (plait.operators.tensor_plans: Megatron's pattern as its class declares it)
    costs as a candidate of this program, the rest of the module solved around it; None for a module without one,
    under the user's pins, over one rank, or where the degree cannot split it (or it does not fit)."""
    from plait.operators.tensor_plans import tensor_plan_pins

    if pins or built.axis_size <= 1:
        return None
    candidate = {k: v for k, v in tensor_plan_pins(model).items() if k in built.graph.params}
    if not candidate:
        return None
    pinned = dataclasses.replace(built, problem=dataclasses.replace(
        built.problem, allowed=[m.copy() for m in built.problem.allowed]))
    try:
        apply_pins(pinned, candidate)
        return solve(pinned, solver, prove=False).cost
    except (ConfigError, sharding.Infeasible):
        return None


class DoesNotFit(ConfigError):
    """No placement of this mesh shape fits the memory limit; `needs_bytes` is the least any placement the pins allow
    needs per device (what a budget must hold for this shape)."""

    def __init__(self, message: str, needs_bytes: float) -> None:
        super().__init__(message)
        self.needs_bytes = needs_bytes


def least_memory(built: Built) -> float:
    """The least bytes per device any choice the pins allow needs: memory is a sum over nodes, so each node's
    smallest allowed figure."""
    problem = built.problem
    return float(sum(m[a].min() for m, a in zip(problem.node_memory, problem.allowed)))


def solve_or_refuse(built: Built, solver: str, pins: dict[str, str], fused: dict[str, str], model: nn.Module,
                    prove: bool = True) -> sharding.Solution:
    """`solve`, or DoesNotFit (a ConfigError) in one line when no placement fits the problem's memory limit (naming
    the limit, what the smallest placement needs, the pins, and a fused table optimizer where the module has
    embedding tables without one)."""
    try:  # table-wise tables bin-packed onto the ranks: the fullest must fit too
        solution = table_wise.solve_packed(lambda b: solve(b, solver, prove=prove), built, built.fused, pins)
    except sharding.Infeasible as e:
        reason = str(e)
    else:
        if solution.cost < price.UNRUNNABLE_S:
            return solution
        # what fits holds a redistribution DTensor cannot run as planned (price.runs_on_layout): not a plan
        reason = UNRUNNABLE_ONLY
    hint = ("; a fused table optimizer (--table-optimizer sgd) keeps an embedding table's weights alone"
            if not fused and any(isinstance(m, nn.Embedding) for m in model.modules()) else "")
    needs = least_memory(built) if reason != UNRUNNABLE_ONLY else 0.0
    smallest = f" (the smallest needs {needs / 2**20:.2f} MiB)" if needs else ""
    raise DoesNotFit(f"no placement fits {built.problem.memory_limit / 2**20:.2f} MiB per device"
                     + (f" with pins {pins}" if pins else "") + f"{smallest}{hint}: {reason}", needs)


UNRUNNABLE_ONLY = "only placements the executor cannot run as planned fit"


def fused_tables(model: nn.Module, optimizer: str | None) -> dict[str, str]:
    """{table weight name: optimizer} for every nn.Embedding of `model` (none without an optimizer)."""
    if optimizer is None:
        return {}
    if optimizer not in FUSED_OPTIMIZERS:
        raise ConfigError(f"table optimizer {optimizer!r} is not one plait runs fused; use "
                          f"{', '.join(FUSED_OPTIMIZERS)}")
    tables = {f"{name}.weight" if name else "weight": optimizer for name, m in model.named_modules()
              if isinstance(m, nn.Embedding)}
    bags = [name or "the model" for name, m in model.named_modules() if isinstance(m, nn.EmbeddingBag)]
    if bags:  # bags plait.models.embedding_bags could not pool would train by AdamW while the plan says fused
        raise ConfigError(f"table optimizer {optimizer!r}: nn.EmbeddingBag {', '.join(map(repr, bags[:3]))} "
                          f"cannot be trained fused (only bags of 2-D ids, mode sum or mean, no padding index or "
                          f"max norm run as a lookup and a pooling); make them so, or drop the table optimizer")
    if not tables:
        raise ConfigError(f"table optimizer {optimizer!r}: the model has no nn.Embedding to train with it")
    return tables


def describe(built: Built, solution: sharding.Solution, batch_source: str, pins: dict[str, str], tp: int, dp: int,
             cluster: ClusterSpec, elapsed: float, micro_batches: int = 1) -> OperatorSharding:
    choice = solution.choice
    group = comm.Group(tp, 1)
    placed = {**built.graph.params, **built.graph.buffers}
    params = {name: built.nodes[built.value_node[ref.value]].strategies[choice[built.value_node[ref.value]]].outputs[0]
              for name, ref in placed.items()}
    reads = _first_reads(built, choice)
    # Only placements a user may redistribute to: R -> P is DTensor's internal business (its op rules read a
    # replicated tensor as a pending sum themselves).
    inputs = {module: reads[ref.value] for module, ref in built.graph.module_inputs.items()
              if reads.get(ref.value, "P") != "P"}
    param_reads = {name: reads[ref.value] for name, ref in placed.items()
                   if reads.get(ref.value, "P") not in ("P", params[name])}
    outputs = {}
    for module, ref in built.graph.module_outputs.items():
        node = built.value_node[ref.value]
        if built.nodes[node].call is not None:
            index = [r.value for r in built.nodes[node].call.outputs].index(ref.value)
            # Where its first consumer reads it (Megatron's row-parallel all-reduce: P read as R), else as made.
            placement = reads.get(ref.value) if reads.get(ref.value, "P") != "P" else \
                _output_of(built.nodes[node], choice[node], index)
            if placement != "P":  # a pending sum stays as the operator left it (see inputs above)
                outputs[module] = placement
    grads = needs_gradient(built.graph)
    per_call: dict[int, list] = {}
    counts: dict[str, int] = {}
    total_bytes = 0.0
    summed: set[int] = set()
    for producer, index, consumer, ref in built.edge_parts:
        src = _output_of(built.nodes[producer], choice[producer], index)
        if not built.nodes[consumer].strategies[choice[consumer]].inputs:
            continue
        strategy = built.nodes[consumer].strategies[choice[consumer]]
        k = next(k for k, r in enumerate(built.nodes[consumer].call.inputs if built.nodes[consumer].call else [ref])
                 if r.value == ref.value) if built.nodes[consumer].call else 0
        dst, grad = strategy.inputs[k], price.gradient_placement(strategy.inputs, k)
        if src == table_wise.TABLE_WISE:
            fwd = table_wise.lookup_exchange(table_wise.rows_bytes(built.nodes[consumer], built.read_rows), group,
                                             cluster)
            bwd = price.NONE
            seconds = fwd.seconds
        else:
            seconds, fwd, bwd = price.edge_time(src, dst, grad, ref, group, cluster, ref.value in grads)
        root = built.gradient_shares.get(ref.value)
        if root is not None and choice[built.gradient_sums[root]] == 1 and price.joins_gradient_sum(src, dst, grad):
            if root in summed:  # the value's one all-reduce is its first such reader's
                seconds, bwd = seconds - bwd.seconds, price.NONE
            summed.add(root)
        kinds = []
        again = built.nodes[consumer].call is not None and built.nodes[consumer].call.index in built.recomputed
        for direction, r, times in (("fwd", fwd, 2 if again else 1), ("bwd", bwd, 1)):
            if r.collective:
                counts[r.collective] = counts.get(r.collective, 0) + times
                total_bytes += times * r.nbytes
                kinds.append(f"{r.collective} {_size(r.nbytes)} {direction}" + (" x2 (recomputed)" if times > 1 else ""))
        seconds += fwd.seconds if again else 0.0
        if kinds:
            per_call.setdefault(consumer, []).append((seconds, ", ".join(kinds)))
    ops = []
    for node in built.call_node.values():
        strategy = built.nodes[node].strategies[choice[node]]
        ops.append(OperatorCost(name=built.nodes[node].name,
                                placements=f"{','.join(strategy.inputs)} -> {','.join(strategy.outputs)}",
                                compute_s=float(built.problem.node_cost[node][choice[node]]),
                                comm_s=float(sum(s for s, _ in per_call.get(node, []))),
                                comm="; ".join(c for _, c in per_call.get(node, []))))
    ops.sort(key=lambda o: -(o.compute_s + o.comm_s))
    read = {ref.value for call in built.graph.calls for ref in call.inputs}
    unread = tuple(name for name, ref in built.graph.params.items() if ref.value not in read)
    described = OperatorSharding(batch=batch_source, params=params, outputs=outputs, inputs=inputs,
                                 unread_params=unread, param_reads=param_reads,
                                 function_reads=_function_reads(built, choice), pins=pins, step_time_s=solution.cost,
                                 data_parallel_step_time_s=data_parallel_time(built, tp, dp, cluster, micro_batches),
                                 comm_bytes=total_bytes, comm_counts=counts,
                                 peak_memory_bytes=sharding.total_memory(built.problem, choice), solver=solution.solver,
                                 solve_time_s=elapsed, lower_bound_s=max(0.0, solution.lower_bound),
                                 solver_status=solution.status, proven_gap=solution.gap,
                                 memory_parts=memory_parts(built, choice), time_parts=time_parts(built, choice),
                                 costliest=tuple(ops[:COSTLIEST]), replicated_ops=built.unsupported,
                                 distinct_exchange=tuple(sorted(built.distinct_exchange)))
    return table_wise.name_owners(described, *table_wise.packing(built, choice, built.fused, pins))


def time_parts(built: Built, choice: tuple[int, ...]) -> dict[str, float]:
    """The solution's seconds by part, summing to its cost: "compute" (the calls), "tp_comm" (the redistributions,
    the edges) and "dp_comm" (the parameters' data-parallel synchronisation)."""
    problem = built.problem
    params = {built.value_node[ref.value] for ref in built.graph.params.values()}
    parts = {"compute": 0.0, "tp_comm": 0.0, "dp_comm": 0.0}
    for i, cost in enumerate(problem.node_cost):
        parts["dp_comm" if i in params else "compute"] += float(cost[choice[i]])
    parts["tp_comm"] = float(sum(m[choice[u], choice[v]] for u, v, m in problem.edges))
    return parts


def memory_parts(built: Built, choice: tuple[int, ...]) -> dict[str, float]:
    """Bytes per device of the solution by part: "params" (weights, gradients and optimizer states, with what
    fully_shard gathers), "activations" (what the calls keep for backward, the largest transient output and what
    recomputation holds: the loss's node) and "inputs" (the batch and buffers)."""
    parts = {"params": 0.0, "activations": 0.0, "inputs": 0.0}
    params = {built.value_node[ref.value] for ref in built.graph.params.values()}
    calls = set(built.call_node.values())
    for i, m in enumerate(built.problem.node_memory):
        held = i in calls or built.nodes[i].name == OUTPUT_NODE
        part = "params" if i in params else "activations" if held else "inputs"
        parts[part] += float(m[choice[i]])
    return parts


def _first_reads(built: Built, choice: tuple[int, ...]) -> dict[int, str]:
    """Value id -> the placement its first consumer's strategy reads it in (what the executor redistributes a
    module's input or a parameter to, so that DTensor's eager dispatch runs the planned strategy)."""
    reads: dict[int, str] = {}
    for call in built.graph.calls:
        node = built.call_node[call.index]
        strategy = built.nodes[node].strategies[choice[node]]
        for k, ref in enumerate(call.inputs):
            reads.setdefault(ref.value, strategy.inputs[k])
    return reads


def _function_reads(built: Built, choice: tuple[int, ...]) -> dict[str, dict[str, str]]:
    """Per torch-level call of the forward (its capture.FunctionKeys key), the placement each tensor argument is
    read in: the strategy of the first ATen call inside it that reads the value (what the executor redistributes
    to, so that DTensor's eager dispatch runs the planned strategies and the backward carries the planned
    gradients). A pending sum (P) is left to DTensor: it reads a replicated tensor as one itself."""
    first: dict[tuple[int, int], str] = {}
    for call in built.graph.calls:
        strategy = built.nodes[built.call_node[call.index]].strategies[choice[built.call_node[call.index]]]
        for k, ref in enumerate(call.inputs):
            first.setdefault((call.function, ref.value), strategy.inputs[k])
    reads = {}
    for index, function in enumerate(built.graph.functions):
        placed = {str(pos): first[index, value] for pos, value in function.args.items()
                  if first.get((index, value), "P") != "P"}
        if placed:
            reads[function.key] = placed
    return reads


def data_parallel_time(built: Built, tp: int, dp: int, cluster: ClusterSpec, micro_batches: int = 1) -> float:
    """The same step (`micro_batches` of the captured micro-batch per data-parallel rank) under data parallelism
    alone over dp x tp devices (tp: every other axis's degree): each call's replicated work on 1/tp of the work, and
    every parameter's fully_shard traffic over the whole group once."""
    world = comm.Group(dp * tp, 1)
    compute = micro_batches * sum(price.compute_time(c.flops, c.outputs, False, 1, cluster)
                                  for c in built.graph.calls) / tp
    sync = sum(price.gradient_sync_time(ref, "R", 1, dp * tp, cluster, world) for ref in built.graph.params.values())
    return compute + sync


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def batch_norms_to_synchronise(model: nn.Module, dp: int) -> tuple[str, ...]:
    """BatchNorm's statistics are over the batch each rank sees: the tensor-parallel ranks see the whole micro-batch
    (it enters replicated on tp; DTensor's rule splits BatchNorm by channels only), data-parallel ranks a share,
    so over dp > 1 every BatchNorm sums its statistics over the dp ranks (plait.execute.batchnorm)."""
    if dp <= 1:
        return ()
    from plait.torch_internals import BatchNormBase

    return tuple(name for name, m in model.named_modules() if isinstance(m, BatchNormBase))


def zero_stage(dp: int) -> int:
    """The ZeRO stage a per-operator pipeline's plan is labelled with: its stages' data parallelism rides on
    fully_shard whenever there is more than one data-parallel rank (plait.legality.data_parallel_mode keeps a
    pipeline's parameters gathered through the schedule). Without a pipeline the search chooses the stage
    (plait.operators.search)."""
    return 3 if dp > 1 else 0


def meta_batch(batch_source: str, batch_size: int) -> tuple[torch.Tensor, ...]:
    """The factory's batch at `batch_size`, moved to meta for capture (the factory runs once on CPU: batches are
    small next to the model)."""
    from plait.operators import batch as batches

    return batches.to_device(batches.draw(batch_source, batch_size, torch.Generator().manual_seed(0)), "meta")


def auto_plan(model_source: str, batch_source: str, cluster: ClusterSpec, *, global_batch: int, dp: int = 1,
              tp: int = 1, pins: dict[str, str] | None = None, solver: str = "program",
              memory_limit: float | None = None, table_optimizer: str | None = None, pp: int = 1,
              num_micro_batches: int | None = None, schedule: str = "1f1b", layers_per_stage: tuple[int, ...] = ()):
    """A Plan for a module of any shape at one mesh shape: data parallelism over dp, per-operator placements over
    tp (solved), and with pp > 1 pipeline stages cut between its repeated blocks (plait.operators.pipeline;
    `num_micro_batches` defaults to pp). plait.operators.search ranks every shape."""
    from plait.operators.search import Shape, load_module, plan_shape

    micro_batches = num_micro_batches or pp
    if global_batch % (dp * micro_batches):
        raise ConfigError(f"global batch {global_batch} must divide by dp={dp} x {micro_batches} micro-batches")
    module = load_module(model_source, batch_source, find_blocks=False)
    return plan_shape(module, cluster, Shape(dp, tp, pp, micro_batches, schedule), global_batch=global_batch,
                      pins=dict(pins or {}), solver=solver, memory_limit=memory_limit,
                      table_optimizer=table_optimizer, layers_per_stage=tuple(layers_per_stage))


def check_pin_names(model: nn.Module, batch: tuple[torch.Tensor, ...], pins: dict[str, str]) -> None:
    """ConfigError in one line for a pin naming no parameter, buffer or module of `model`, or no placement (checked
    once, before any shape is planned)."""
    if pins:
        graph = capture(model, batch)
        for name, placement in pins.items():
            pinned_ref(graph, name, placement)
