"""What the generic Hugging Face adapter reads from a causal LM class, and how it runs the class's own code around
the decoder layers.

* `discover(model, config)`: the decoder layers (the ModuleList the class's ``base_model_pp_plan`` names, or the
  one ModuleList of identical blocks under the base model), the modules that run before them and after them (found
  by running the model's own forward on ``meta`` with the layers stood in for), tied parameters (Parameters two
  names share), and the parameters of norms;
* `around_layers(...)`: the model's own forward with its layers replaced by `LayerStub`s: it gives the hidden
  states the first layer receives (the embedding, as the class computes it: scaled, plus learned positions), the
  arguments the class passes each layer (rotary tables, masks, position ids), and the logits of given hidden states
  through what follows the layers (final norm, head, logit soft-capping or scaling) -- no family is written here;
* `reference_buffers(config)`: every buffer as the class's own ``__init__`` computes it, parameters left on meta:
  what `to_empty` turns into garbage (rotary tables, embedding scales) is copied back from it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from plait.errors import ConfigError
from plait.models.adapter import get_module, norm_parameters, set_module, tied_parameters


class _Stop(Exception):
    """Raised by the last LayerStub when only the layers' inputs are wanted (nothing after them runs)."""


class LayerStub(nn.Module):
    """Stands in for decoder layer `index`: records what the model passes it, and passes the hidden states on (or,
    at layer 0, hands over `inject`: hidden states computed elsewhere, e.g. by a previous pipeline stage)."""

    def __init__(self, index: int, calls: dict[int, tuple], stop_at: int | None, inject: torch.Tensor | None,
                 as_tuple: bool) -> None:
        super().__init__()
        self.index, self.calls, self.stop_at, self.inject, self.as_tuple = index, calls, stop_at, inject, as_tuple

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self.calls[self.index] = (hidden, args[1:], kwargs)
        if self.index == self.stop_at:
            raise _Stop
        if self.index == 0 and self.inject is not None:
            hidden = self.inject
        return (hidden,) if self.as_tuple else hidden


class ZeroStandIn(nn.Module):
    """Stands in for a module before the layers that a stage does not hold (an embedding): adds nothing."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros((), dtype=torch.get_default_dtype(), device=x.device)


@contextlib.contextmanager
def swapped(root: nn.Module, replacements: dict[str, nn.Module | None]) -> Iterator[None]:
    old = {path: get_module(root, path) for path in replacements}
    try:
        for path, module in replacements.items():
            set_module(root, path, module)
        yield
    finally:
        for path, module in old.items():
            set_module(root, path, module)


@contextlib.contextmanager
def no_masks_on_meta(root: nn.Module, on_meta: bool) -> Iterator[None]:
    """On meta, the class builds no mask: transformers reads the values of the position ids to find packed documents,
    which meta tensors have none of. Its mask function is set aside for the call (the layers then take SDPA's causal
    path: the same shapes and FLOPs, all that a run on meta measures)."""
    attention = getattr(getattr(root, "config", None), "_attn_implementation", None)
    if not on_meta or attention is None:
        yield
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    mapping = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    saved = mapping.pop(attention, None)
    try:
        yield
    finally:
        if saved is not None:
            mapping[attention] = saved


def causal_mask(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """A 4-D boolean causal mask [batch, 1, length, length], which transformers' mask builders hand on as it is."""
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return allowed.expand(batch, 1, length, length)


def around_layers(model_class: type, root: nn.Module, *, blocks_path: str, num_layers: int, pre: tuple[str, ...],
                  positions: torch.Tensor, tokens: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                  stop_at: int | None = None, as_tuple: bool = False,
                  causal_mask: bool = False) -> tuple[dict[int, tuple], Any]:
    """Run `model_class.forward` on `root` (the model, or a Stage holding its modules) with its layers stood in for.

    With `tokens`, the model embeds them itself; with `hidden` ([b, s, h]), its pre-layer modules add nothing and
    layer 0 hands `hidden` on. Returns ({layer index: (hidden in, extra args, kwargs)}, the model's output, or None
    when stopped at layer `stop_at`)."""
    calls: dict[int, tuple] = {}
    inject = hidden if tokens is None else None
    stubs = nn.ModuleList(LayerStub(i, calls, stop_at, inject, as_tuple) for i in range(num_layers))
    replacements: dict[str, nn.Module | None] = {blocks_path: stubs}
    if tokens is None:
        replacements.update({path: ZeroStandIn() for path in pre})
    inputs = {"input_ids": tokens} if tokens is not None else {"inputs_embeds": torch.zeros_like(hidden)}
    if causal_mask:  # a class whose layers read the mask themselves (sparse-attention indexers)
        inputs["attention_mask"] = globals()["causal_mask"]((tokens if tokens is not None else hidden).shape[0],
                                                            positions.shape[-1], positions.device)
    with swapped(root, replacements), no_masks_on_meta(root, positions.is_meta):
        try:
            position_ids = positions if positions.dim() == 2 else positions[None]  # [rows, s]: packed documents
            out = model_class.forward(root, **inputs, position_ids=position_ids, use_cache=False)
        except _Stop:
            out = None
    return calls, out


@dataclass(frozen=True)
class Structure:
    """A causal LM class's layout, as plait runs it (paths from the model's root)."""

    blocks_path: str
    pre: tuple[str, ...]
    post: tuple[str, ...]
    tied: tuple[tuple[str, str], ...]
    """(alias, canonical) parameter names sharing one Parameter."""
    norm_params: frozenset[str]
    """Parameters of norm modules (their initial values come from the class's own init)."""
    layer_returns_tuple: bool
    """Whether the model indexes [0] into what a layer returns (older classes) or takes it as the hidden states."""


def _blocks_of(model: nn.Module, config: Any) -> str:
    """The path of the decoder layers: the ModuleList the class's pipeline plan names, or the one ModuleList of
    identical blocks under the base model."""
    base = model.base_model
    prefix = "" if base is model else f"{model.base_model_prefix}."
    family = getattr(config, "model_type", type(model).__name__)
    pp_plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    named = [key for key in pp_plan if isinstance(get_module(base, key), nn.ModuleList)]
    if len(named) == 1:
        return prefix + named[0]
    lists = [name for name, child in base.named_children() if isinstance(child, nn.ModuleList) and len(child)
             and len({type(block) for block in child}) == 1]
    if len(lists) != 1:
        found = ", ".join(lists) or "none"
        raise ConfigError(f"Hugging Face model type {family!r}: its decoder layers are ambiguous (no "
                          f"base_model_pp_plan, and ModuleLists of identical blocks under the base model: {found}); "
                          f"plait needs exactly one [rule hf-one-layer-list]")
    return prefix + lists[0]


def untrained_parameters(model: nn.Module, structure: Structure) -> frozenset[str]:
    """Names of the parameters around the layers that get no gradient from a forward over token ids (found on meta:
    the model's forward with its layers stood in for, then autograd over logits)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad
             and not n.startswith(structure.blocks_path + ".")]
    params = [model.get_parameter(n) for n in names]
    if not params:
        return frozenset()
    num_layers = len(get_module(model, structure.blocks_path))
    _, out = around_layers(type(model), model, blocks_path=structure.blocks_path, num_layers=num_layers, pre=(),
                           positions=torch.arange(4, device="meta"),
                           tokens=torch.zeros(1, 4, dtype=torch.long, device="meta"),
                           as_tuple=structure.layer_returns_tuple)
    grads = torch.autograd.grad(out.logits.sum(), params, allow_unused=True)
    return frozenset(n for n, g in zip(names, grads) if g is None)


def discover(model: nn.Module, config: Any) -> Structure:
    """The Structure of `model` (built on meta), found by running its own forward with the layers stood in for."""
    blocks_path = _blocks_of(model, config)
    parent_path, _, _ = blocks_path.rpartition(".")
    owners = [(parent_path, get_module(model, parent_path) if parent_path else model)]
    if parent_path:
        owners.append(("", model))
    order: list[str] = []
    hooks = []
    for owner_path, owner in owners:
        for name, child in owner.named_children():
            path = f"{owner_path}.{name}" if owner_path else name
            if path == blocks_path or path == parent_path or not any(True for _ in child.parameters()):
                continue
            hooks.append(child.register_forward_pre_hook(lambda m, a, p=path: order.append(p)))
    num_layers = len(get_module(model, blocks_path))
    run = functools.partial(around_layers, type(model), model, blocks_path=blocks_path, num_layers=num_layers,
                            pre=(), positions=torch.arange(4, device="meta"),
                            tokens=torch.zeros(2, 4, dtype=torch.long, device="meta"))
    try:
        run(stop_at=0)  # the modules entered before layer 0 run before the layers
    finally:
        for hook in hooks:
            hook.remove()
    pre = tuple(dict.fromkeys(order))
    everything = [p for owner_path, owner in owners for name, child in owner.named_children()
                  if (p := f"{owner_path}.{name}" if owner_path else name) not in (blocks_path, parent_path)
                  and any(True for _ in child.parameters())]
    post = tuple(p for p in everything if p not in pre)
    # a class that indexes [0] into a layer's output hands layer 1 a tensor that lost its batch dim
    calls, _ = run(stop_at=min(1, num_layers - 1))
    first, second = calls.get(0), calls.get(1)
    as_tuple = bool(first and second and second[0].shape != first[0].shape)
    return Structure(blocks_path=blocks_path, pre=pre, post=post, tied=tied_parameters(model), norm_params=norm_parameters(model),
                     layer_returns_tuple=as_tuple)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules whose parameters land on meta while their buffers are computed for real (on the current
    device): the buffers as the class's own __init__ makes them, at the cost of the buffers only."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


_BUFFERS: dict[str, dict[str, torch.Tensor]] = {}


def reference_buffers(key: str, builder) -> dict[str, torch.Tensor]:
    """{buffer name: value} of the model `builder()` makes (parameters on meta, buffers on CPU), cached by `key`."""
    if key not in _BUFFERS:
        with parameters_on_meta():
            model = builder()
        _BUFFERS[key] = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    return _BUFFERS[key]
