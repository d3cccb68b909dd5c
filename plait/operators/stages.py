"""Pipeline stages of a module whose forward returns its loss (per-operator plans): the module's own forward, run
with the repeated blocks a stage does not hold stood in for, as plait.hf.structure runs a Hugging Face class's
forward around its layers.

* `find_layout(model, batch)`: the repeated blocks (the one ModuleList or ModuleDict of identical blocks: same class,
  same parameter shapes), and which parts outside them (modules with parameters, bare parameters of the blocks'
  ancestors) run before the first block and which after, found by running the forward on `meta`.
* `build_stage(model, layout, blocks, first, last)`: a copy of the module holding this stage's blocks and parts,
  under their single-process names. Its forward takes the batch (and, after the first stage, the hidden states the
  previous stage sent, first) and returns the hidden states entering the next stage's first block, or the loss on
  the last stage. Which blocks each stage holds is the plan's (Plan.stage_layers); a pipeline stage is then run by
  torch.distributed.pipelining like plait's other stages (plait.execute.pipeline).

Before the stage's first block, modules the stage does not hold return zeros of the shape they returned on meta
(batch dim from the batch), bare parameters are zeros; the block before the stage's first hands the received
hidden states on instead of what reached it. After the stage's last block, the next block's stand-in stops the
forward. The code around the blocks (rotary tables, masks) runs on every stage, as the module wrote it.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from plait.torch_internals import DisableTorchFunction, tree_flatten, tree_map

from plait.errors import ConfigError
from plait.models.adapter import get_module, set_module
from plait.operators import batch as batches
from plait.operators.capture import forward_on_meta


class _Stop(Exception):
    def __init__(self, hidden: Any) -> None:
        super().__init__()
        self.hidden = hidden


@dataclass(frozen=True)
class TiedParameter:
    """One parameter several parts hold (names in part order: before the blocks, the blocks, after them)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StageLayout:
    """Where a module's repeated blocks are and what runs around them (find_layout)."""

    blocks_path: str
    num_blocks: int
    pre: tuple[str, ...]
    """Modules with parameters, and bare parameters, used before the first block."""
    post: tuple[str, ...]
    """The same, used after the last block (or not at all)."""
    returns_tuple: bool
    """Whether a block returns a tuple whose first item is the hidden states."""
    pre_outputs: dict[str, Any] = field(default_factory=dict, compare=False)
    """Pre module -> what it returned on meta (shapes for the stand-ins)."""
    tied: tuple[TiedParameter, ...] = field(default=(), compare=False)
    """Parameters held by several parts (the stages holding them sum their gradients every step)."""


def find_blocks(model: nn.Module, name: str = "the model") -> str:
    """The path of the one ModuleList / ModuleDict of two or more identical blocks (outermost); ConfigError naming
    what would work when there is none, or several."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) >= 2:
            blocks = _blocks(module)
            shapes = {(type(b), tuple((n, tuple(p.shape)) for n, p in b.named_parameters())) for b in blocks}
            if len(shapes) == 1 and any(True for _ in blocks[0].parameters()):
                found.append(path)
    outer = [p for p in found if not any(p.startswith(o + ".") for o in found if o != p)]
    if not outer:
        raise ConfigError(f"{name} has no repeated blocks (an nn.ModuleList or nn.ModuleDict of two or more identical "
                          f"modules), which pipeline stages cut between; use pp=1, or hold the blocks in a ModuleList")
    if len(outer) > 1:
        raise ConfigError(f"{name} has several lists of repeated blocks ({', '.join(outer)}); pipeline stages need "
                          f"one; use pp=1")
    return outer[0]


def _blocks(container: nn.Module) -> list[nn.Module]:
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def _parts(model: nn.Module, blocks_path: str) -> tuple[list[str], list[str]]:
    """(modules, bare parameters) outside the blocks that hold parameters: the subtrees off the path from the root to
    the blocks, and the parameters the blocks' ancestors hold themselves."""
    names = blocks_path.split(".")
    ancestors = [".".join(names[:i]) for i in range(len(names))]
    modules, params = [], []
    for owner in ancestors:
        module = get_module(model, owner) if owner else model
        for name, child in module.named_children():
            path = f"{owner}.{name}" if owner else name
            if path != blocks_path and path not in ancestors and child is not None and \
                    any(True for _ in child.parameters()):
                modules.append(path)
        params += [f"{owner}.{name}" if owner else name for name, _ in module.named_parameters(recurse=False)]
    return modules, params


class _Uses(TorchFunctionMode):
    """Records which of `params` (id -> name) torch-level calls read."""

    def __init__(self, params: dict[int, str]) -> None:
        super().__init__()
        self.params, self.used = params, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for a in tree_flatten((args, kwargs or {}))[0]:
            if id(a) in self.params:
                self.used.add(self.params[id(a)])
        return func(*args, **(kwargs or {}))


def find_layout(model: nn.Module, batch: tuple[torch.Tensor, ...], name: str = "the model") -> StageLayout:
    """The StageLayout of `model` (on meta) on `batch` (on meta): its forward run up to the first block."""
    blocks_path = find_blocks(model, name)
    container = get_module(model, blocks_path)
    first = _blocks(container)[0]
    modules, bare = _parts(model, blocks_path)
    entered: list[str] = []
    outputs: dict[str, Any] = {}
    tuple_out: list[bool] = []

    def stop(module, args, kwargs):
        with torch.no_grad():
            tuple_out.append(isinstance(module.forward(*args, **kwargs), tuple))  # not module(): its hook
        raise _Stop(None)

    hooks = [first.register_forward_pre_hook(stop, with_kwargs=True)]
    for path in modules:
        module = get_module(model, path)
        hooks.append(module.register_forward_pre_hook(lambda m, a, p=path: entered.append(p)))
        hooks.append(module.register_forward_hook(lambda m, a, out, p=path: outputs.setdefault(p, out)))
    uses = _Uses({id(model.get_parameter(p)): p for p in bare})
    try:
        with uses, forward_on_meta():
            batches.call(model, batch)
    except _Stop:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    if not tuple_out:
        raise ConfigError(f"{name}'s forward never runs its repeated blocks ({blocks_path}); pipeline stages need "
                          f"it to; use pp=1")
    pre = tuple(dict.fromkeys(entered)) + tuple(p for p in bare if p in uses.used)
    post = tuple(p for p in (*modules, *bare) if p not in pre)
    return StageLayout(blocks_path, len(container), pre, post, tuple_out[0],
                       {p: outputs[p] for p in pre if p in outputs}, _ties_across_parts(model, blocks_path, pre, post))


def _ties_across_parts(model: nn.Module, blocks_path: str, pre: tuple[str, ...], post: tuple[str, ...]
                       ) -> tuple[TiedParameter, ...]:
    """Parameters held by more than one part that may sit on different stages (an output layer tied to the
    embedding, blocks sharing weights): each stage trains its own copy, and the executor sums their gradients
    across the stages every step (plait.execute.module_model.TiedAcrossStages), so the copies stay one parameter."""
    parts = {path: "before the blocks" for path in pre} | {path: "after the blocks" for path in post}
    container = get_module(model, blocks_path)
    keys = list(container.keys()) if isinstance(container, nn.ModuleDict) else range(len(container))
    parts |= {f"{blocks_path}.{key}": f"block {i}" for i, key in enumerate(keys)}
    holders: dict[int, dict[str, str]] = {}
    params: dict[int, nn.Parameter] = {}
    for path, part in parts.items():
        owner_path, _, leaf = path.rpartition(".")
        owner = get_module(model, owner_path) if owner_path else model
        if leaf in owner._parameters:  # a bare parameter
            held = [(path, owner._parameters[leaf])]
        else:
            held = [(f"{path}.{n}", p) for n, p in get_module(model, path).named_parameters(remove_duplicate=False)]
        for param_name, param in held:
            holders.setdefault(id(param), {}).setdefault(part, param_name)
            params[id(param)] = param
    return tuple(TiedParameter(tuple(found.values()), tuple(params[key].shape))
                 for key, found in holders.items() if len(found) > 1)


@dataclass
class _Run:
    """What one call of a stage's forward hands its stand-ins."""

    hidden: Any = None
    like: torch.Tensor | None = None
    """A batch tensor: the stand-ins' device and batch size."""


class _Skipped(nn.Module):
    """Stands in for block `index`, which another stage holds: stops the forward (the block after the stage's
    last), hands the received hidden states on (the block before the stage's first), or passes its input on."""

    def __init__(self, index: int, stop: bool, inject: bool, returns_tuple: bool, run: _Run) -> None:
        super().__init__()
        self.index, self.stop, self.inject, self.returns_tuple = index, stop, inject, returns_tuple
        self.run = run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        if self.stop:
            raise _Stop(hidden)
        if self.inject:
            hidden = self.run.hidden
        return (hidden,) if self.returns_tuple else hidden


class _ZerosLike(nn.Module):
    """Stands in for a module before the blocks that this stage does not hold: zeros shaped as its output on meta
    (`output`, tensors or a tuple of them), in the received hidden states' floating dtype (what it returns is never
    used past the stage's first block)."""

    def __init__(self, output: Any, run: _Run) -> None:
        super().__init__()
        self.output, self.run = output, run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        like, hidden = self.run.like, self.run.hidden

        def zeros(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            return torch.zeros((like.shape[0], *t.shape[1:]), device=like.device,
                               dtype=hidden.dtype if t.is_floating_point() else t.dtype)

        with DisableTorchFunction():  # not a call of the module's: planned reads and capture skip it
            return tree_map(zeros, self.output)


def build_stage(model: nn.Module, layout: StageLayout, blocks: range, *, first: bool, last: bool) -> nn.Module:
    """A copy of `model` holding `blocks` (global indices), its pre parts if `first` and post parts if `last`; its
    forward as the module docstring says. The model itself is left as it was."""
    if first and last:
        return model
    if len(blocks) == 0:
        raise ConfigError(f"a pipeline stage of a per-operator plan must hold a block; blocks {blocks} is empty")
    container = get_module(model, layout.blocks_path)
    all_blocks = _blocks(container)
    keys = list(container.keys()) if isinstance(container, nn.ModuleDict) else None
    set_module(model, layout.blocks_path, type(container)())
    try:
        stage = copy.deepcopy(model)
    finally:
        set_module(model, layout.blocks_path, container)
    run = _Run()
    held = [copy.deepcopy(b) if i in blocks else
            _Skipped(i, stop=i == blocks.stop, inject=i == blocks.start - 1, returns_tuple=layout.returns_tuple, run=run)
            for i, b in enumerate(all_blocks)]
    set_module(stage, layout.blocks_path, nn.ModuleDict(dict(zip(keys, held))) if keys else nn.ModuleList(held))
    for path in (() if first else layout.pre) + (() if last else layout.post):
        owner_path, _, leaf = path.rpartition(".")
        owner = get_module(stage, owner_path) if owner_path else stage
        if leaf in owner._parameters:  # a bare parameter: zeros before the blocks, absent after
            param = owner._parameters.pop(leaf)
            setattr(owner, leaf, torch.zeros_like(param) if path in layout.pre else None)
        elif path in layout.pre:
            set_module(stage, path, _ZerosLike(layout.pre_outputs[path], run))
        else:
            set_module(stage, path, None)
    stage.forward = functools.partial(_stage_forward, stage.forward, run, 0 if first else 1)
    stage.pipeline_blocks = blocks
    return stage


def _stage_forward(forward, run: _Run, num_received: int, *args: Any, **kwargs: Any) -> Any:
    """args: the received hidden states (after the first stage), then the batch; or the batch as keyword arguments
    "0", "1", ... (torch.distributed.pipelining hands a non-first stage its batch so)."""
    received = args[:num_received]
    batch = args[num_received:] or tuple(kwargs[k] for k in sorted(kwargs, key=int))
    run.hidden, run.like = (received[0] if received else None), batch[0]
    try:
        return forward(*batch)
    except _Stop as stop:
        return stop.hidden
    finally:
        run.hidden = run.like = None
