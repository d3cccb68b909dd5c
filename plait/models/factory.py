"""A user's own model: ModelSpec.source = "module:<package.module:factory>".

The factory is called with no arguments and returns an `nn.Module` shaped like a decoder:

    class MyModel(nn.Module):
        blocks: nn.ModuleList                  # the repeated blocks, each called as block(hidden) -> hidden
        def embed(self, tokens): ...           # tokens [b, s] -> hidden [b, s, h]
        def head(self, hidden): ...            # hidden -> logits [b, s, V]
        def forward(self, tokens):             # the single-process model: head(blocks(embed(tokens)))
        # optional, for tensor parallelism (semi-automatic mode: you say how a block shards, plait decides
        # the rest): num_heads, num_kv_heads, ffn_hidden_size; and max_seq_len if positions are learned.

Which modules run before and after the blocks is found by calling `embed` and `head` on `meta`; an output
layer whose weight is the embedding's Parameter is a tied pair. The tensor-parallel plan is data, in the
config or the plan (ModelSpec.tp_plan): HF-style patterns, "blocks.*.attn.q": "colwise", and the root's
"embed": "embedding", "head": "output" (plait.models.adapter.STYLES lists the styles). The planner's
ModelSpec is measured from the module on `meta` (plait.models.measure): per-block FLOPs, parameters and
activation bytes, so blocks of unequal cost are priced and split as they are.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch import nn

from plait.errors import ConfigError
from plait.models.adapter import ModelAdapter, StageContext, TensorPlan, norm_parameters, register, tied_parameters
from plait.torch_internals import DisableTorchFunction


def load_factory(source: str):
    """The callable `package.module:factory` of a "module:..." source, with errors that say what to fix."""
    target = source.removeprefix("module:")
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"model {source!r} must look like 'module:package.module:factory'")
    try:
        # as Python imports it: a caller's torch.device("meta") (or any torch function mode) must not reach the
        # module's top level, whose tensors (a fixed projection, a mask) are real and stay where the file puts them
        with DisableTorchFunction():
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"model {source!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"model {source!r}: {module_name} has no callable {attr!r}")
    return factory


def import_roots(*sources: str) -> tuple[str, ...]:
    """The folders the modules of `sources` ("package.module:function", imported already) were imported from: the
    folder holding each top-level package or module, left out when it is inside Python's own installation
    (site-packages: importable anywhere). A plan records them (OperatorSharding.import_paths) so that `plait check`
    and `plait train` import the same files from any working directory."""
    import os
    import sys

    installed = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    roots: list[str] = []
    for source in sources:
        top = source.removeprefix("module:").partition(":")[0].split(".")[0]
        module = sys.modules.get(top)
        where = getattr(module, "__file__", None)
        if not where:
            continue
        folder = os.path.dirname(os.path.realpath(where))
        if os.path.basename(where).startswith("__init__."):  # a package: the folder above it
            folder = os.path.dirname(folder)
        if not any(folder == p or folder.startswith(p + os.sep) for p in installed) and folder not in roots:
            roots.append(folder)
    return tuple(roots)


def use_import_roots(roots: tuple[str, ...]) -> None:
    """The folders a plan recorded (import_roots), importable here and in the ranks; a folder that is not on this
    machine is left out (PYTHONPATH may hold the module there)."""
    import os

    from plait.inputs import add_import_folder

    for folder in roots:
        if os.path.isdir(folder):
            add_import_folder(folder)


def build_factory_module(source: str, device: str | torch.device = "meta") -> nn.Module:
    """The module `source`'s factory returns, its parameters and buffers made on `device` (only the factory call
    runs under torch.device(device): the file itself is imported as Python imports it, see load_factory)."""
    factory = load_factory(source)
    with torch.device(device):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {source!r}: the factory returned {type(model).__name__}, not an nn.Module")
    from plait.models.embedding_bags import pool_embedding_bags

    return pool_embedding_bags(model)  # bags as a lookup and a pooling, which DTensor and fused tables run


def build_user_model(source: str, device: str | torch.device = "meta") -> nn.Module:
    model = build_factory_module(source, device)
    missing = [name for name in ("embed", "head") if not callable(getattr(model, name, None))]
    if missing or _blocks_path(model) is None:
        raise ConfigError(f"model {source!r}: a module:factory model needs `blocks` (an nn.ModuleList), `embed(tokens)` "
                          f"and `head(hidden)`; missing {', '.join(missing) or 'blocks'}")
    return model


def _blocks_path(model: nn.Module) -> str | None:
    blocks = getattr(model, "blocks", None)
    return "blocks" if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)) else None


@functools.lru_cache(maxsize=32)
def _structure(source: str) -> tuple[type, tuple[str, ...], tuple[str, ...], tuple[tuple[str, str], ...],
                                     frozenset[str]]:
    """(class, pre modules, post modules, tied pairs, norm parameters) of a factory model, found by running embed
    and head on meta."""
    model = build_user_model(source)
    children = [name for name in model._modules if name != "blocks"]
    touched: dict[str, set[str]] = {"embed": set(), "head": set()}
    current = ["embed"]
    hooks = [model._modules[name].register_forward_pre_hook(lambda m, a, n=name: touched[current[0]].add(n))
             for name in children if model._modules[name] is not None]
    try:
        hidden = model.embed(torch.zeros(1, 4, dtype=torch.long, device="meta"))
        current[0] = "head"
        model.head(hidden)
    finally:
        for hook in hooks:
            hook.remove()
    return (type(model), tuple(sorted(touched["embed"])), tuple(sorted(touched["head"] - touched["embed"])),
            tied_parameters(model), norm_parameters(model))


class FactoryAdapter(ModelAdapter):
    blocks_path = "blocks"

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.user_class, self.pre, self.post, tied, self.norm_names = _structure(spec.source)
        self.tied = dict(tied)

    def build(self, device: str | torch.device = "meta") -> nn.Module:
        return build_user_model(self.spec.source, device)

    # The user's own embed and head, run on the Stage, which holds the model's modules and attributes under
    # their names.
    def embed(self, stage: nn.Module, tokens: torch.Tensor, ctx: StageContext) -> torch.Tensor:
        return self.user_class.embed(stage, tokens)

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return self.user_class.head(stage, hidden)

    def is_norm(self, name: str) -> bool:
        return name in self.norm_names

    def run_block(self, block: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        return block(hidden)

    def tp_plan(self) -> TensorPlan:
        plan = dict(self.spec.tp_plan)
        if not plan:
            raise ConfigError(f"{self.spec.name}: tensor parallelism needs a tp_plan for this module:factory model "
                              f"([model] tp_plan in the config: 'blocks.*.attn.q' = 'colwise', ...); use tp=1")
        block = {k.removeprefix("blocks.*."): v for k, v in plan.items() if k.startswith("blocks.*.")}
        root = {k: v for k, v in plan.items() if not k.startswith("blocks.*.")}
        return TensorPlan(block=block, root=root)

    def selective(self, block: nn.Module, wrap) -> int:
        """No attention core is known in a user's block: selective recompute checkpoints the modules the plan
        marks "gather_input" (attention and MLP) when a tp_plan is given, else the whole block's first child."""
        targets = [k.removeprefix("blocks.*.") for k, v in self.spec.tp_plan.items()
                   if k.startswith("blocks.*.") and v == "gather_input"]
        names = targets[:1] or [next(iter(block._modules))]
        for name in names:
            setattr(block, name, wrap(getattr(block, name)))
        return len(names)


register("module", FactoryAdapter)


def factory_spec(source: str, **overrides: Any):
    """The ModelSpec of a "module:..." model, measured on meta (plait.models.measure)."""
    from plait.models.measure import measure_spec

    return measure_spec(source, **overrides)
