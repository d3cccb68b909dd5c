"""A tensor-parallel plan for a Hugging Face class that declares none (StableLM's), read from its layers.

A decoder layer whose projections are plain ``nn.Linear`` layers, grouped in modules of their own (an attention, an
MLP), splits as Megatron splits one: in each group the projections the layer's hidden states go into are
column-wise (q, k, v; gate and up), and the last one called, which writes back into the hidden width, is row-wise
(o; down). The groups and their order come from one forward of the first layer on meta. Only plain projections
qualify: each column-wise one as wide as the row-wise input (the MLP's width, all heads), or as the key-value heads
of an attention; a fused q|k|v or gate|up projection (Persimmon, Bloom, GPT-BigCode) does not, nor projections
sitting in the layer itself (BioGPT's fc1 and fc2), nor a mixture of experts, nor an attention holding one module
per head (StableLM's qk_layernorm: a rank would apply head 0's norm to its first head, whichever that is).

The plan is then proven on meta: a copy of the layer with every projection narrowed to one tensor rank's share and
its attention's head counts divided (`divide_head_counts`, which the executor applies to the real layers too) must
run and return the layer's output shape. What it cannot prove is refused before any rank starts, naming why
(plait.legality's tp-needs-class-plan); what it proves is then checked by plait.hf.flow like any class plan,
and `plait check` compares it with one process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
"""Attributes an attention module may read its (query) head count from in its forward (StableLM's `view`)."""
KV_HEAD_COUNTS = ("num_key_value_heads", "num_kv_heads")
DERIVED_STYLES = ("plait:colwise", "plait:rowwise")
"""The styles of a derived plan in ModelSpec.tp_plan (plait.legality.PLAIT_STYLE + "colwise" / "rowwise")."""


@dataclass(frozen=True)
class Heads:
    """An attention's head counts and width (of a ModelSpec, or of its fields)."""

    heads: int
    kv: int
    head_dim: int

    @classmethod
    def of(cls, spec: Any) -> "Heads":
        get = spec.get if isinstance(spec, dict) else lambda key: getattr(spec, key)
        heads = int(get("num_heads"))
        return cls(heads, int(get("num_kv_heads") or heads), int(get("head_dim") or get("hidden_size") // heads))


def derived_tensor_plan(adapter: Any, heads: Heads) -> tuple[dict[str, str], str | None]:
    """({"layers.*.self_attn.q_proj": "plait:colwise", ...}, None) for a class whose layers split as the module
    docstring says, else ({}, why not)."""
    from plait.legality import PLAIT_STYLE
    from plait.hf.experts import class_experts
    from plait.hf.spec import block_caller

    blocks = adapter.meta_model.get_submodule(adapter.blocks_path)
    block, leaf = blocks[0], adapter.blocks_path.rsplit(".", 1)[-1]
    if class_experts(block):
        return {}, "its layers hold a mixture of experts"
    call = block_caller(adapter)(0)
    hidden = int(adapter.hf_config().hidden_size)
    try:
        order = _linear_call_order(block, lambda b: call(b, torch.zeros(1, 8, hidden, device="meta")))
    except Exception as e:  # a layer that does not run on meta proves nothing
        return {}, f"its layer does not run on meta ({type(e).__name__})"
    styles, why = _group_styles(block, order, heads, hidden)
    if why:
        return {}, why
    missing = [path for path in styles for other in blocks if _get(other, path) is None]
    if missing:
        return {}, f"its layers differ ({missing[0]} is not in every one)"
    why = _runs_narrowed(block, styles, heads, call, hidden)
    if why:
        return {}, why
    return {f"{leaf}.*.{path}": PLAIT_STYLE + style for path, style in styles.items()}, None


def _get(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _linear_call_order(block: nn.Module, run) -> list[str]:
    """The block's nn.Linear modules in the order one forward calls them (each once)."""
    order: list[str] = []
    hooks = [module.register_forward_hook(lambda *_, path=path: order.append(path) if path not in order else None)
             for path, module in block.named_modules() if isinstance(module, nn.Linear)]
    try:
        with torch.no_grad():
            run(block)
    finally:
        for handle in hooks:
            handle.remove()
    return order


def _group_styles(block: nn.Module, order: list[str], heads: Heads, hidden: int
                  ) -> tuple[dict[str, str], str | None]:
    """{path: "colwise" | "rowwise"} of each group of projections (the Linear children of one module), in call
    order, or why a group is not plain."""
    groups: dict[str, list[str]] = {}
    for path in order:
        groups.setdefault(path.rpartition(".")[0], []).append(path)
    if not groups:
        return {}, "its layers hold no linear projections"
    styles: dict[str, str] = {}
    for parent, paths in groups.items():
        if not parent:
            return {}, (f"its projections {', '.join(paths)} sit in the decoder layer itself, not in a module of "
                        f"their own")
        *into, out = [block.get_submodule(p) for p in paths]
        attention = hasattr(block.get_submodule(parent), "is_causal")
        widths = {out.in_features} | ({heads.kv * heads.head_dim} if attention else set())
        plain = into and out.out_features == hidden and all(
            m.in_features == hidden and m.out_features in widths for m in into)
        if not plain:
            shapes = ", ".join(f"{p.rpartition('.')[2]} {m.in_features}->{m.out_features}"
                               for p, m in zip(paths, [*into, out]))
            return {}, (f"{parent}'s projections ({shapes}) are not plain ones split column-wise in and row-wise "
                        f"out (a fused q|k|v or gate|up projection, say)")
        per_head = [f"{parent}.{p}" for p, m in block.get_submodule(parent).named_modules()
                    if isinstance(m, nn.ModuleList) and len(m) in (heads.heads, heads.kv)] if attention else []
        if per_head:
            return {}, (f"{per_head[0]} holds one module per head (StableLM's qk_layernorm), which a rank holding "
                        f"some heads would pair with the wrong ones")
        styles.update({p: "colwise" for p in paths[:-1]} | {paths[-1]: "rowwise"})
    return styles, None


def divide_head_counts(block: nn.Module, heads: Heads, tp: int) -> None:
    """Each attention module of a layer split by a derived plan holds heads / tp query heads and max(1, kv / tp)
    key-value heads (a kv head is replicated where tp exceeds them): the head counts its forward reads say so."""
    local_heads, local_kv = heads.heads // tp, max(1, heads.kv // tp)
    for module in block.modules():
        if not hasattr(module, "is_causal"):
            continue
        for name in HEAD_COUNTS:
            if getattr(module, name, None) == heads.heads:
                setattr(module, name, local_heads)
        for name in KV_HEAD_COUNTS:
            if getattr(module, name, None) == heads.kv:
                setattr(module, name, local_kv)
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = local_heads // local_kv


def _runs_narrowed(block: nn.Module, styles: dict[str, str], heads: Heads, call, hidden: int) -> str | None:
    """None when a copy of `block` holding one rank's share of each projection (and the head counts to match) runs
    to the block's output shape under the smallest tp that divides the heads; else why not."""
    kv, head_dim = heads.kv, heads.head_dim
    tp = next((d for d in range(2, heads.heads + 1) if heads.heads % d == 0), None)
    if tp is None:
        return "its attention has a single head"
    narrow = copy.deepcopy(block)
    for path, style in styles.items():
        linear = narrow.get_submodule(path)
        if style == "rowwise":
            _resize(linear, linear.out_features, linear.in_features // tp)
        elif linear.out_features == kv * head_dim and kv < heads.heads:
            _resize(linear, max(1, kv // tp) * head_dim, linear.in_features)
        else:
            _resize(linear, linear.out_features // tp, linear.in_features)
    divide_head_counts(narrow, heads, tp)
    try:
        with torch.no_grad():
            out = call(narrow, torch.zeros(1, 8, hidden, device="meta"))
    except Exception as e:
        return f"a layer holding one tensor rank's share of its projections does not run ({type(e).__name__}: " \
               f"{str(e).splitlines()[0][:120] if str(e) else ''})"
    out = out[0] if isinstance(out, tuple) else out
    if tuple(out.shape) != (1, 8, hidden):
        return f"a layer holding one tensor rank's share of its projections returns shape {list(out.shape)}"
    return None


def _resize(linear: nn.Linear, out_features: int, in_features: int) -> None:
    linear.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"))
    if linear.bias is not None and linear.bias.shape[0] != out_features:
        linear.bias = nn.Parameter(torch.empty(out_features, device="meta"))
    linear.in_features, linear.out_features = in_features, out_features
