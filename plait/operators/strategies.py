"""Each captured call's candidate placements, from DTensor's own sharding-propagation rules.

The private names of DTensor it needs (the sharding propagator, `DTensorSpec`, `TensorMeta`, `OpSchema`) come from
plait/torch_internals.py, which holds every private torch name plait uses.

How: on a fake process group of the mesh axis's size (no processes), each call is asked of DTensor's eager
propagator once per combination of its tensor arguments' placements (replicated, sharded on a dimension the
axis divides, partial); the propagator answers with the placements it would run the op with (redistributing
its arguments if needed) and the output's. The distinct answers are the op's strategies. This is the rule DTensor
itself runs in eager mode, so the executor runs what was priced. Calls with the same operator, shapes and
arguments share one answer (a repeated block is asked once). An operator without a rule (the propagator
raises), or whose backward kernel has none (avg_pool2d's, native_group_norm's: `missing_backward_rules`), gets one
strategy, everything replicated, and is named in the plan's report; `register_sharding`
(torch.distributed.tensor.experimental) adds a rule for a custom op, and this module then sees it.

Rules plait adds (`register_plait_rules`, through the same public `register_sharding`, for the planner and the
executor alike): CPU's fused attention, `aten._scaled_dot_product_flash_attention_for_cpu` and its backward, which
torch 2.13 gives no rule while DTensor's CPU run dispatches `scaled_dot_product_attention` to it: heads split
(q, k, v, output and log-sum-exp Shard(1), Megatron's attention), batch split (Shard(0)) or everything
replicated, as DTensor's own rule for the CUDA flash kernel. Grouped-query attention splits when the axis divides
the key/value heads too (contiguous head shards keep each query head with its key/value head).
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from plait.operators import norms
from plait.operators.capture import OpCall, TensorRef
from plait.torch_internals import (DTensorSpec, OpSchema, RuntimeSchemaInfo, TensorMeta,
                                   dispatch_has_kernel_for_dispatch_key, sharding_propagator, tree_flatten, tree_map)

MAX_COMBINATIONS = 400
"""Placement combinations asked per call; beyond, only single-argument sharding is asked (ops of many inputs)."""


@dataclass(frozen=True)
class Strategy:
    """One way to run a call on the axis: the placement each tensor argument must have, and each output's."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def placement_name(placement: Placement) -> str:
    """"R", "S0", "S1", ... or "P" (a pending sum). ValueError for a placement plans do not hold: a strided shard
    (torch's `_StridedShard`, what a view flattening a split dimension into an outer one leaves) is neither a
    plain shard nor replicated, and reading it as either would price a gather the run then makes unpriced."""
    if type(placement) is Shard:
        return f"S{placement.dim}"
    if isinstance(placement, Partial):
        return "P"
    if isinstance(placement, Replicate):
        return "R"
    raise ValueError(f"placement {placement!r} has no name in a plan")


def placement_of(name: str) -> Placement:
    if name == "R":
        return Replicate()
    if name == "P":
        return Partial()
    if name.startswith("S") and name[1:].isdigit():
        return Shard(int(name[1:]))
    raise ValueError(f"placement {name!r} is not R, P or S<dim>")


def candidate_placements(ref: TensorRef, axis_size: int, partial: bool = True, uneven: bool = False) -> list[str]:
    """Placements a tensor can hold on an axis of `axis_size`: dims the axis divides evenly, with `uneven` (a
    parameter: an embedding table's 200,003 rows) any dim at least as long as the axis (DTensor's Shard gives the
    first ranks one row more, as torch.chunk splits), and P for floats."""
    names = ["R"] + [f"S{d}" for d, size in enumerate(ref.shape) if size >= axis_size and (
        size % axis_size == 0 or uneven and size >= UNEVEN_MIN_PER_RANK * axis_size)]
    if partial and ref.is_float:
        names.append("P")
    return names


UNEVEN_MIN_PER_RANK = 16
"""An uneven split is offered where every rank gets at least this many rows of the dimension: a table's rows, not a
convolution's 3-wide kernel (whose padded shards move a third more than the tensor)."""

ANSWERS: dict[tuple, tuple[list[Strategy], bool]] = {}
"""DTensor's answers, by (axis size, rules held, operator, arguments): the strategies depend on nothing else."""


def _whole_statistics(call: OpCall, found: list[Strategy], has_rule: bool) -> tuple[list[Strategy], bool]:
    """A normalisation reads its input whole along the dimensions its statistics span (plait.operators.norms, the
    executor's rule too): strategies that read them split are left out (all replicated if none is left)."""
    dims = norms.aten_statistics_dims(call.op.__name__.split(".")[0], call.args)
    kept = [s for s in found if not norms.reads_split_statistics(dims, s.inputs[0])] if dims is not None else found
    return kept or [Strategy(("R",) * len(call.inputs), ("R",) * len(call.outputs))], has_rule


class StrategyOracle:
    """DTensor's answers for one mesh axis size, cached by (op, arguments)."""

    def __init__(self, axis_size: int, mesh) -> None:
        self.axis_size = axis_size
        self.mesh = mesh
        self.propagator = sharding_propagator()

    def strategies(self, call: OpCall, uneven: tuple[bool, ...] = ()) -> tuple[list[Strategy], bool]:
        """(strategies, has_rule); without a rule: [everything replicated], False. `uneven`: per tensor argument,
        whether it may arrive split unevenly (a parameter; candidate_placements). Answers are kept for the process
        (ANSWERS: a plan asked again, the program and the heuristic, the same block in another model), keyed by the
        rules DTensor holds so that a rule registered since is asked."""
        rules = (len(self.propagator.op_strategy_funcs), len(self.propagator.op_single_dim_strategy_funcs))
        uneven = tuple(uneven) or (False,) * len(call.inputs)
        key = (self.axis_size, rules, call.op, *_call_signature(call), uneven)
        if key not in ANSWERS:
            ANSWERS[key] = _whole_statistics(call, *self._ask(call, uneven))
        return ANSWERS[key]

    def _ask(self, call: OpCall, uneven: tuple[bool, ...]) -> tuple[list[Strategy], bool]:
        with _output_meta_once(self.propagator):
            return self._ask_each_combination(call, uneven)

    def _ask_each_combination(self, call: OpCall, uneven: tuple[bool, ...]) -> tuple[list[Strategy], bool]:
        replicated = Strategy(("R",) * len(call.inputs), ("R",) * len(call.outputs))
        if missing_backward_rules(call.op) or call.op in REPLICATED_BY_PLAIT:
            # its backward would stop the run, or its only rule is the replicated one an executor in this process
            # registered (the plan must still name it, so that the ranks register it too): replicated, both ways
            return [replicated], False
        # over one rank every placement is the whole tensor: ask only whether the op runs replicated at all
        options = [candidate_placements(ref, self.axis_size, uneven=u) if self.axis_size > 1 else ["R"]
                   for ref, u in zip(call.inputs, uneven)]
        combos = list(itertools.islice(itertools.product(*options), MAX_COMBINATIONS + 1))
        if len(combos) > MAX_COMBINATIONS:
            combos = [tuple(o if i == j else "R" for j in range(len(options))) for i, opts in enumerate(options)
                      for o in opts]
        found: dict[Strategy, None] = {}
        any_rule = False
        for combo in combos:
            strategy = self._propagate(call, combo)
            if strategy is not None:
                any_rule = True
                found[strategy] = None
        if not any_rule:
            return [replicated], False
        # A rule that cannot replicate still can (run it whole on every rank); replicated goes first, the solver's
        # convention (plait.search.sharding.solve_propagation starts from it).
        return [replicated] + [s for s in found if s != replicated], True

    def _propagate(self, call: OpCall, combo: tuple[str, ...]) -> Strategy | None:
        chosen = iter(combo)
        to_spec = lambda a: self._spec(a, next(chosen)) if isinstance(a, TensorRef) else a  # noqa: E731
        args, kwargs = tree_map(to_spec, call.args), tree_map(to_spec, call.kwargs)
        try:
            sharding = self.propagator.propagate_op_sharding(OpSchema(call.op, args, kwargs,
                                                                      schema_info=self._schema_info(call.op, args)))
        except Exception:  # noqa: BLE001 - no rule, or the rule refuses these placements
            return None
        needed = combo
        if sharding.redistribute_schema is not None:
            specs = [a for a in tree_flatten((sharding.redistribute_schema.args_schema,
                                              sharding.redistribute_schema.kwargs_schema))[0]
                     if isinstance(a, DTensorSpec)]
            try:
                needed = tuple(placement_name(s.placements[0]) for s in specs)
            except ValueError:  # a placement plans do not hold: not a strategy the planner offers
                return None
        outputs = [s for s in tree_flatten(sharding.output_spec)[0] if isinstance(s, DTensorSpec)]
        if len(needed) != len(call.inputs) or len(outputs) < len(call.outputs):
            return None
        try:
            made = tuple(placement_name(s.placements[0]) for s in outputs[:len(call.outputs)])
        except ValueError:
            return None
        return Strategy(tuple(needed), made)

    def _schema_info(self, op, args) -> RuntimeSchemaInfo | None:
        """What DTensor's eager dispatch gives the op's schema (torch/distributed/tensor/_dispatch.py): its rule's
        registered info, and list arguments flattened (stack, cat). Without it a list of tensors reads as a
        constant and the rule asks no redistribution of them (a free gather)."""
        info = self.propagator.op_to_schema_info.get(op) or \
            self.propagator.op_to_schema_info_for_single_dim_strategy.get(op)
        has_list = any(isinstance(a, (list, tuple)) and any(isinstance(x, DTensorSpec) for x in a) for a in args)
        if has_list and (info is None or not info.needs_pytree):
            info = RuntimeSchemaInfo(info.static_argnum if info else 100, info.static_kwargkey if info else None,
                                     needs_pytree=True)
        return info

    def _spec(self, ref: TensorRef, placement: str) -> DTensorSpec:
        meta = TensorMeta(torch.Size(ref.shape), ref.stride, ref.dtype)
        return DTensorSpec(self.mesh, (placement_of(placement),), tensor_meta=meta)


@contextmanager
def _output_meta_once(propagator) -> Iterator[None]:
    """While one call's placements are asked: the propagator's output shapes (it runs the op on fake tensors for
    each question, half its time) computed once per operator and global argument shapes, which placements do not
    change."""
    compute = propagator._propagate_tensor_meta_non_cached
    known: dict[tuple, object] = {}

    def once(op_schema):
        key = (op_schema.op, *(_meta_key(a) for a in tree_flatten((op_schema.args_schema,
                                                                    op_schema.kwargs_schema))[0]))
        if key not in known:
            known[key] = compute(op_schema)
        return known[key]

    propagator._propagate_tensor_meta_non_cached = once
    try:
        yield
    finally:
        del propagator._propagate_tensor_meta_non_cached  # the class's own again


def _meta_key(arg):
    if isinstance(arg, DTensorSpec):
        meta = arg.tensor_meta
        return (tuple(meta.shape), tuple(meta.stride), meta.dtype) if meta is not None else None
    return _hashable(arg)


def _call_signature(call: OpCall) -> tuple[tuple, tuple]:
    """(args, kwargs) signatures of a captured call, made once per call (a search asks about each call of a kept
    capture for every mesh shape)."""
    found = call.__dict__.get("_signature")
    if found is None:
        found = call.__dict__["_signature"] = (_signature(call.args), _signature(call.kwargs))
    return found


def _signature(tree) -> tuple:
    flat, spec = tree_flatten(tree)
    return tuple((r.shape, r.stride, r.dtype) if isinstance(r, TensorRef) else _hashable(r) for r in flat) + (str(spec),)


def _hashable(x):
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


@contextmanager
def strategy_oracle(axis_size: int) -> Iterator[StrategyOracle]:
    """A StrategyOracle on a 1-D DeviceMesh of `axis_size` ranks over a fake process group (no processes), which
    is destroyed on leaving, so planning leaves no process group behind (plait check --dry-run and the executor
    start their own). Refuses to run inside an existing process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from plait.torch_internals import FakeStore

    if dist.is_initialized():
        raise RuntimeError("per-operator planning starts its own fake process group; plan before "
                           "init_process_group (in the planner's process)")
    register_plait_rules()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=axis_size)
    try:
        yield StrategyOracle(axis_size, init_device_mesh("cpu", (axis_size,), mesh_dim_names=("tp",)))
    finally:
        dist.destroy_process_group()


CPU_ATTENTION = "_scaled_dot_product_flash_attention_for_cpu"
"""The ATen kernel CPU runs scaled_dot_product_attention with (plait.operators.capture records it on meta)."""


def register_plait_rules() -> None:
    """Give DTensor the rules plait adds (see the module docstring); once per process, and never over a rule torch
    itself has (a later torch that ships one keeps its own)."""
    aten = torch.ops.aten
    forward = getattr(aten, CPU_ATTENTION, None)
    backward = getattr(aten, f"{CPU_ATTENTION}_backward", None)
    if forward is None or backward is None:
        return
    from torch.distributed.tensor.experimental import register_sharding

    funcs = sharding_propagator().op_strategy_funcs
    if forward.default not in funcs:
        register_sharding(forward.default)(_attention_rule(outputs=2))
    if backward.default not in funcs:
        register_sharding(backward.default)(_attention_rule(outputs=3))


def _attention_rule(outputs: int):
    """The attention kernels' rule: every tensor argument and output split on heads (dim 1), or on the batch (dim
    0), or replicated. A mask broadcast over a dimension (size 1 there) stays replicated."""

    def rule(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensorSpec)]
        found = [([Replicate()] * outputs, [Replicate() if isinstance(a, DTensorSpec) else None
                                            for a in (*args, *kwargs.values())])]
        for dim in (1, 0):
            def place(a):
                if not isinstance(a, DTensorSpec):
                    return None
                return Shard(dim) if a.ndim > dim and a.shape[dim] > 1 else Replicate()
            if all(a.ndim > dim and a.shape[dim] > 1 for a in tensors[:3]):
                found.append(([Shard(dim)] * outputs, [place(a) for a in (*args, *kwargs.values())]))
        return found
    return rule


REPLICATED_BY_PLAIT: set = set()
"""Operators register_replicated gave a rule in this process: not DTensor's own, so the planner still names them."""


def _has_rule(op) -> bool:
    propagator = sharding_propagator()
    return op not in REPLICATED_BY_PLAIT and (op in propagator.op_strategy_funcs or
                                              op in propagator.op_single_dim_strategy_funcs or op in propagator.op_to_rules)


def missing_backward_rules(op) -> list:
    """The backward kernel autograd calls for `op` (aten's `<name>_backward`: avg_pool2d's, native_group_norm's,
    _embedding_bag's), where DTensor has no rule for it (torch 2.13): [] when it has one or there is none. The
    forward may have a rule, but a run whose backward meets the kernel stops; the planner runs such an operator
    replicated and the executor gives its backward a replicated rule too (register_replicated)."""
    name = getattr(getattr(op, "_overloadpacket", None), "__name__", "")
    packet = getattr(torch.ops.aten, f"{name}_backward", None) if name else None
    backward = getattr(packet, "default", None) if packet is not None else None
    if backward is None or _has_rule(backward) or \
            dispatch_has_kernel_for_dispatch_key(backward.name(), "CompositeImplicitAutograd"):
        return []  # a composite (embedding_backward) decomposes into kernels before DTensor sees it
    return [backward]


def register_replicated(call_name: str) -> None:
    """Give an ATen operator without a DTensor rule one (torch's public register_sharding): run it replicated,
    every tensor argument gathered, as the planner priced it; and its backward kernel, where that has no rule
    (missing_backward_rules). `call_name` is a captured call's name ("module:op.overload#index")."""
    from torch.distributed.tensor.experimental import register_sharding

    op_name = call_name.split(":", 1)[1].split("#")[0]
    packet, _, overload = op_name.partition(".")
    op = getattr(getattr(torch.ops.aten, packet), overload or "default")
    for kernel in [op, *missing_backward_rules(op)]:
        register_sharding(kernel)(_replicated_rule(len(kernel._schema.returns)))
        REPLICATED_BY_PLAIT.add(kernel)


def _replicated_rule(num_outputs: int):
    def replicated(*args, **kwargs):
        flat = [a for a in args] + list(kwargs.values())
        inputs = [Replicate() if isinstance(a, DTensorSpec) else None for a in flat]
        return [([Replicate()] * num_outputs, inputs)]
    return replicated
