"""Capture a module's operators: its forward at the plan's micro-batch shape, run on `meta` (no memory, no
devices) under a TorchDispatchMode that records every ATen call DTensor would see.

What is recorded per call: the operator, its arguments with tensors replaced by `TensorRef`s (shape, stride,
dtype: what DTensor's rules need), which earlier value each tensor argument is (a parameter, a batch input or
an earlier call's output), the innermost module that ran it, and its forward FLOPs
(torch.utils.flop_counter's formulas). The backward is not traced op by op: the cost model derives it from
the forward (plait.cost.operators: twice the FLOPs of a FLOP-counted op, and each redistribution's gradient
image), which is what DTensor's autograd does with the placements the forward chose.

Attention is captured as the kernel the CPU run takes: on meta, `scaled_dot_product_attention` would decompose
into its math path (matmuls, softmax), while on CPU (the executor's DTensors included) it runs the fused
`_scaled_dot_product_flash_attention_for_cpu`. `_AttentionAsCpuRuns` asks CPU's own backend choice
(`torch._fused_sdp_choice`, on unallocated CPU stand-ins of the same shapes, strides and dtypes) and calls that
kernel on meta when CPU would, so the plan prices what the run executes (its rule: plait.operators.strategies).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from plait.torch_internals import OpOverload, TorchDispatchMode, fused_sdp_choice, op, tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

# Calls that do not compute anything worth a placement choice of their own.
_SKIP = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default, op("to_copy")}


@dataclass(frozen=True)
class TensorRef:
    """A tensor argument as DTensor's rules see it: shape, stride and dtype, and which value it is."""

    value: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point


@dataclass
class Value:
    """A tensor of the forward: a parameter, a batch input or the output of a call (`producer`, `index`)."""

    id: int
    kind: str
    """"param", "buffer", "input", "const" or "op"."""
    name: str
    ref: TensorRef | None = None
    producer: int | None = None
    """Index of the producing OpCall (kind "op")."""
    output_index: int = 0


@dataclass
class OpCall:
    index: int
    op: OpOverload
    args: tuple
    kwargs: dict
    inputs: list[TensorRef]
    """Tensor arguments in the order DTensor's OpSchema lists them (flattened args)."""
    outputs: list[TensorRef]
    module: str
    flops: float
    function: int = -1
    """Index of the torch-level call (Graph.functions) this ATen call ran inside; -1: none."""
    saved: tuple[bool, ...] = ()
    """Per output: whether autograd keeps it for the backward (its storage counted once, at the first output that
    holds it: a view of a kept tensor costs nothing more). () (a graph built by hand): every output counts."""

    @property
    def name(self) -> str:
        return f"{self.module or '<root>'}:{self.op.__name__}#{self.index}"


@dataclass
class Graph:
    """The captured forward: its values and calls, in execution order, and what the module returned."""

    values: dict[int, Value] = field(default_factory=dict)
    calls: list[OpCall] = field(default_factory=list)
    output: TensorRef | None = None
    params: dict[str, TensorRef] = field(default_factory=dict)
    """Parameter name -> its value (tied parameters: the first name)."""
    buffers: dict[str, TensorRef] = field(default_factory=dict)
    """Buffer name -> its value (BatchNorm's running statistics: placed like parameters, kept whole or split)."""
    module_outputs: dict[str, TensorRef] = field(default_factory=dict)
    """Module name -> the tensor its forward returned (the first tensor of a tuple)."""
    module_inputs: dict[str, TensorRef] = field(default_factory=dict)
    """Module name -> its forward's first tensor argument."""
    transient_bytes: float = 0.0
    """The largest floating output autograd does not keep (what lives beside the kept activations at the peak)."""
    grad_inputs: set[int] = field(default_factory=set)
    """Value ids of batch inputs a gradient flows back to (a pipeline stage's received hidden states: its tensor
    requires grad)."""
    returned: str = ""
    """What the forward returned (capture._returned): "a scalar loss", or a shape or type."""
    functions: list[Function] = field(default_factory=list)
    """The forward's torch-level calls (F.linear, torch.cat, Tensor.__matmul__, ...) in order: where the executor
    redistributes each argument to the placement the plan's strategy reads it in (plait.execute.operators), above
    autograd, so the backward carries each redistribution's gradient as the cost model prices it."""


@dataclass(frozen=True)
class Function:
    """One torch-level call of the forward: its key (FunctionKeys) and which value each flattened tensor argument
    is."""

    key: str
    args: dict[int, int]
    """Position in tree_flatten((args, kwargs)) -> value id."""


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: Graph, refs: dict[int, TensorRef], modules: list[str]) -> None:
        super().__init__()
        self.graph, self.refs, self.modules = graph, refs, modules
        self.function = -1
        """The torch-level call running now (set by _Functions)."""
        self.keep: list[torch.Tensor] = []  # ids stay unique while the capture runs

    def ref_of(self, t: torch.Tensor) -> TensorRef:
        ref = self.refs.get(id(t))
        if ref is None:  # a constant made inside forward (torch.arange, a mask): a value of its own
            ref = self.new_ref(t, "const", f"const{len(self.refs)}")
        return ref

    def new_ref(self, t: torch.Tensor, kind: str, name: str, producer: int | None = None, index: int = 0) -> TensorRef:
        ref = TensorRef(len(self.graph.values), tuple(t.shape), tuple(t.stride()), t.dtype)
        self.refs[id(t)] = ref
        self.keep.append(t)
        self.graph.values[ref.value] = Value(ref.value, kind, name, ref, producer, index)
        return ref

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_out, _ = tree_flatten(out)
        tensors_out = [t for t in flat_out if isinstance(t, torch.Tensor)]
        if not tensors_out:
            return out
        if func in _SKIP:  # an alias of its input: same value
            flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            if flat_in:
                self.refs[id(tensors_out[0])] = self.ref_of(flat_in[0])
                self.keep.append(tensors_out[0])
            return out
        as_ref = lambda a: self.ref_of(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
        ref_args, ref_kwargs = tree_map(as_ref, args), tree_map(as_ref, kwargs)
        inputs = [a for a in tree_flatten((ref_args, ref_kwargs))[0] if isinstance(a, TensorRef)]
        if not inputs:  # a factory (torch.empty, arange): a constant, replicated like any made inside forward
            for t in tensors_out:
                self.new_ref(t, "const", f"const{len(self.refs)}")
            return out
        index = len(self.graph.calls)
        outputs = [self.new_ref(t, "op", f"op{index}.{i}", index, i) for i, t in enumerate(tensors_out)]
        self.graph.calls.append(OpCall(index, func, ref_args, ref_kwargs, inputs, outputs,
                                       self.modules[-1] if self.modules else "", _flops(func, args, kwargs, out),
                                       self.function))
        return out


class FunctionKeys:
    """Names a forward's torch-level calls so capture and the executor agree on which call is which: the callable's
    name (a property's own: `T`, not `__get__`), its tensor arguments' shapes (global shapes, which a DTensor
    keeps), and how many calls with that name and shapes came before. Calls that are not the model's (a hook's,
    a debugging mode's) then shift no other call's key."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def next(self, func, flat: list) -> str:
        name = getattr(func, "__name__", type(func).__name__)
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        shapes = ",".join("x".join(map(str, a.shape)) for a in flat if isinstance(a, torch.Tensor))
        base = f"{name}({shapes})"
        count = self.seen.get(base, 0)
        self.seen[base] = count + 1
        return f"{base}#{count}"


class _Functions(TorchFunctionMode):
    """Numbers the forward's torch-level calls (a mode sees only the outermost: it is popped while one runs) and
    tells the recorder which one its ATen calls belong to."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.keys = FunctionKeys()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        refs = self.recorder.refs
        values = {i: refs[id(a)].value for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and id(a) in refs}
        graph = self.recorder.graph
        graph.functions.append(Function(self.keys.next(func, flat), values))
        outer, self.recorder.function = self.recorder.function, len(graph.functions) - 1
        try:
            return func(*args, **kwargs)
        finally:
            self.recorder.function = outer


CPU_ATTENTION = op("cpu_flash_attention")
_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


class _AttentionAsCpuRuns(TorchFunctionMode):
    """scaled_dot_product_attention on meta as CPU runs it (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            fused = _cpu_flash_attention(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _cpu_flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False) -> torch.Tensor | None:
    """The fused CPU kernel's output where CPU's backend choice picks it for these arguments; else None."""
    stand_in = lambda t: None if t is None else torch.empty_strided(  # noqa: E731 - never touched, so never paged in
        t.shape, t.stride(), dtype=t.dtype, device="cpu")
    choice = fused_sdp_choice(stand_in(query), stand_in(key), stand_in(value), stand_in(attn_mask), dropout_p,
                              is_causal, scale=scale, enable_gqa=enable_gqa)
    if choice != _FLASH:
        return None
    return CPU_ATTENTION(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _flops(func, args, kwargs, out) -> float:
    if func is CPU_ATTENTION:  # no formula registered for the CPU kernel: the same as the CUDA kernels'
        return float(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=out))  # the registry's wrapper reads the shapes


class _ConstantsOnMeta(TorchDispatchMode):
    """A call that mixes meta tensors with real ones (a tensor the module's file made at import, a fixed projection
    or adjacency) runs on meta, the real ones entering as meta tensors of the same shape, stride and dtype: meta and
    real tensors do not mix in most operators. A call on real tensors alone runs as it is (CPU stand-ins,
    _AttentionAsCpuRuns)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {a.device.type for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        if "meta" not in devices or devices == {"meta"}:
            return func(*args, **kwargs)

        def to_meta(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "meta":
                return t
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        args, kwargs = tree_map(lambda a: to_meta(a) if isinstance(a, torch.Tensor) else a, (args, kwargs))
        return func(*args, **kwargs)


@contextmanager
def forward_on_meta() -> Iterator[None]:
    """A module's forward on meta as it runs on a device: tensors it makes itself without a device
    (torch.arange(n), torch.ones(...)) are made on meta, and real tensors it reads (module-level constants) enter
    as meta ones (_ConstantsOnMeta). For every pass plait runs a module on meta (capture, pipeline layouts)."""
    with torch.device("meta"), _ConstantsOnMeta():
        yield


def capture(model: nn.Module, batch: Any) -> Graph:
    """The forward of `model` on `batch` (both on meta; a batch as plait.operators.batch takes it), call by call.
    The model's forward returns its loss (a scalar tensor) or a tensor whose placement the plan leaves
    replicated."""
    from plait.operators import batch as batches

    graph = Graph()
    refs: dict[int, TensorRef] = {}
    modules: list[str] = []
    recorder = _Recorder(graph, refs, modules)
    for name, param in model.named_parameters():
        graph.params[name] = recorder.new_ref(param, "param", name)
    for name, buffer in model.named_buffers():
        graph.buffers[name] = recorder.new_ref(buffer, "buffer", name)
    leaves, _ = batches.flat(batch)
    for i, tensor in enumerate(t for t in leaves if isinstance(t, torch.Tensor)):
        ref = recorder.new_ref(tensor, "input", f"input{i}")
        if tensor.requires_grad:
            graph.grad_inputs.add(ref.value)
    hooks = []
    for name, module in model.named_modules():
        hooks.append(module.register_forward_pre_hook(_input_hook(name, modules, graph, refs)))
        hooks.append(module.register_forward_hook(_output_hook(name, modules, graph, refs)))
    kept = _Kept()
    try:
        # the recorder sees a constant's real tensor (its id stays one value); the call then runs on meta
        with forward_on_meta(), torch.autograd.graph.saved_tensors_hooks(kept.pack, kept.unpack), \
                _AttentionAsCpuRuns(), recorder, _Functions(recorder):
            out = batches.call(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    first = out[0] if isinstance(out, (tuple, list)) else out
    graph.output = refs.get(id(first))
    graph.returned = _returned(out)
    kept.mark(graph, recorder)
    return graph


def _returned(out: Any) -> str:
    """What a forward returned, as a refusal names it: "a scalar loss", or its shape or type."""
    if isinstance(out, torch.Tensor):
        return "a scalar loss" if out.numel() == 1 and out.is_floating_point() else f"a tensor of shape {list(out.shape)}"
    return f"a {type(out).__name__}"


def check_loss(graph: Graph, what: str) -> None:
    """ConfigError in one line unless the captured forward (a whole module, not a pipeline stage) returned its
    loss: one floating-point number, what a step differentiates."""
    from plait.errors import ConfigError

    if graph.returned != "a scalar loss":
        raise ConfigError(f"{what}: its forward returned {graph.returned}, not a scalar loss; a module "
                          f"planned per operator returns its loss (a 0-d tensor) from forward(batch)")


class _Kept:
    """What autograd saves for the backward during the capture (saved_tensors_hooks: exactly the tensors each
    operator's backward needs, given which inputs require a gradient), by tensor and by storage."""

    def __init__(self) -> None:
        self.tensors: set[int] = set()
        self.storages: set[int] = set()
        self.alive: list[torch.Tensor] = []  # ids stay unique while the capture runs

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.tensors.add(id(t))
        self.storages.add(_storage(t))
        self.alive.append(t)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def mark(self, graph: Graph, recorder: "_Recorder") -> None:
        """Each call's `saved` flags (an output whose storage a saved tensor holds, counted at the first output
        made on that storage) and the graph's transient_bytes."""
        tensor_of = {recorder.refs[id(t)].value: t for t in recorder.keep if id(t) in recorder.refs}
        # a view of a parameter, a buffer or the batch (a weight's transpose that mm keeps) is not an activation
        counted = {_storage(tensor_of[v.id]) for v in graph.values.values()
                   if v.kind in ("param", "buffer", "input") and v.id in tensor_of}
        for call in graph.calls:
            flags = []
            for ref in call.outputs:
                t = tensor_of.get(ref.value)
                storage = _storage(t) if t is not None else None
                keep = storage in self.storages and storage not in counted and ref.is_float
                if keep:
                    counted.add(storage)
                flags.append(keep)
                if not keep and ref.is_float and (t is None or id(t) not in self.tensors):
                    graph.transient_bytes = max(graph.transient_bytes, float(ref.nbytes))
            call.saved = tuple(flags)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _input_hook(name: str, modules: list[str], graph: Graph, refs: dict[int, TensorRef]) -> Callable:
    def hook(module: nn.Module, args: Any) -> None:
        modules.append(name)
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if name and first is not None and id(first) in refs and name not in graph.module_inputs:
            graph.module_inputs[name] = refs[id(first)]
    return hook


def _output_hook(name: str, modules: list[str], graph: Graph, refs: dict[int, TensorRef]) -> Callable:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        modules.pop()
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if name and isinstance(first, torch.Tensor) and id(first) in refs:
            graph.module_outputs[name] = refs[id(first)]
    return hook
