"""Where a Hugging Face block's tensors are split over the tensor ranks, read from one forward of it on meta: which
modules a class's tensor-parallel plan leaves unplaced can run replicated and stay exact.

Under a class's plan, the tensors between a column-wise projection's output and a row-wise projection's input are
split over the tensor ranks (the *sharded region*: heads, MLP width); everything else in a block is whole on every
rank (the input, after a row-wise sum, after a gathered column-wise projection). The region is found in autograd's
graph of one forward on meta: every node reached walking back from a row-wise input, stopping at column-wise
outputs. A module whose parameters the plan places nowhere is then

* ``replicate``: its input and its output both lie outside the region (an MLA ``q_a_proj`` feeding a column-wise
  ``q_b_proj``; a linear-attention block between gathered projections). Every rank computes it whole on the same
  input; the column-wise projections after it all-reduce their input gradients, so its gradient is whole too;
* ``sharded_input``: its input is exactly a column-wise projection's output (an activation with learned
  parameters after ``up_proj``: Apertus' xIELU). Its input is declared split along the last dim and its
  parameters replicated: DTensor computes it exactly and sums their gradients over the ranks;
* left unplaced otherwise (its output mixes into the region outside a column-wise projection, like an MLA key's
  rotary part, or its input is split some other way): legality's ``tp-places-parameters`` refuses tp.

Under sequence parallelism a module sees the whole sequence only inside a parent that gathers it (one with a
column-wise child: plait.hf.adapter.HFAdapter.tp_plan's "gather_input") and whose output goes back to sequence
slices through a row-wise child. A module outside such a parent (an attention or linear-attention layer the plan
leaves whole or only partly placed: DeepSeek-V3's MLA, Qwen3-Next's gated delta net) is run by its *root*, the
block's child holding it, as ``replicate_module``: the root's parameters (its whole subtree's) whole on every rank,
whatever the class's plan says inside it, and the root run on the whole sequence. That is exact when

* the root reads the block's hidden states ([b, s, h]: the sequence slices under SP, gathered first) and returns
  [b, s, ...] (sliced back to the rank's part of the sequence under SP), and
* its input and output lie outside the sharded region (it does not feed a column-wise output's split directly).

Every rank then computes the same output from the same whole input, and receives the same whole output gradient
(the residual stream's gradient is whole and identical on every rank: row-wise outputs are summed, column-wise
inputs' gradients all-reduced, and under SP the slice's backward all-gathers): its parameters' gradients are
identical on every rank with no reduction, and its input gradient is whole (under SP the gather's backward keeps
the rank's slice of it). A root holding a class's experts is not replicated (expert parallelism splits them).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from plait.models.adapter import is_norm_module

ROW_SINKS = ("rowwise",)
"""Styles whose input is split over the tensor ranks (their output is summed whole)."""
UNDERSTOOD = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce",
              "mla_kv_a_proj", "moe_block")
"""The styles whose boundaries the walk knows ("moe_block": a MoE block, whole in and whole out, whose inside
plait.hf.experts places); a block whose plan holds another proves nothing."""
REPLICATE_MODULE = "replicate_module"
"""The style of a block's child run whole on every tensor rank, its class's placements inside it dropped."""


def whole_module(block: nn.Module, entry: str) -> nn.Module | None:
    """The module of `block` a replicate_module entry names ("path", or "path:Class": only where the module at path
    is of that class, as in a hybrid's linear-attention layers), or None where this layer runs it otherwise."""
    path, _, owner = entry.partition(":")
    try:
        module = block.get_submodule(path)
    except AttributeError:
        return None
    return module if not owner or type(module).__name__ == owner else None


def _node(value: Any):
    """autograd's node of the first tensor in `value` (a tensor, or a tuple / list starting with one)."""
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    return value.grad_fn if isinstance(value, torch.Tensor) else None


def _shape(value: Any) -> tuple | None:
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def hidden_input(args: tuple, kwargs: dict) -> tuple[str | int, Any]:
    """(where, value) of a module call's hidden-state input: its first positional argument, else `hidden_states=`,
    else its first keyword argument (where: an index into args, or a keyword)."""
    if args:
        return 0, args[0]
    key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs), None)
    return key, kwargs.get(key) if key is not None else None


def module_flow(block: nn.Module, run: Callable[[nn.Module], Any]) -> dict[str, tuple]:
    """{module path: (node of its input, node of its output, shape of its input, shape of its output)} of one forward
    `run(block)` (on meta); the block itself under ""."""
    seen: dict[str, tuple] = {}

    def hook(path: str):
        def record(module, args, kwargs, output):
            first = hidden_input(args, kwargs)[1]
            seen.setdefault(path, (_node(first), _node(output), _shape(first), _shape(output)))
        return record

    hooks = [module.register_forward_hook(hook(path), with_kwargs=True) for path, module in block.named_modules()]
    try:
        run(block)
    finally:
        for handle in hooks:
            handle.remove()
    return seen


def sharded_region(flow: dict[str, tuple], styles: dict[str, str]) -> set:
    """The autograd nodes between column-wise outputs and row-wise inputs (see the module docstring). The walk
    stops at every placed module's output: its style owns what lies behind it."""
    stops = {flow[p][1] for p in styles if p in flow and flow[p][1] is not None}
    stack = [flow[p][0] for p, s in styles.items() if s in ROW_SINKS and p in flow and flow[p][0] is not None]
    region: set = set()
    while stack:
        node = stack.pop()
        if node is None or node in region:
            continue
        region.add(node)
        if node not in stops:
            stack.extend(next_node for next_node, _ in node.next_functions)
    return region


def _split_sources(node, flow: dict[str, tuple], styles: dict[str, str]) -> list[str]:
    """The column-wise modules (split over the tensor ranks) `node` is computed from before any other placed
    module's output (walking back through autograd's graph)."""
    stops = {flow[p][1]: p for p in styles if p in flow and flow[p][1] is not None}
    stack, seen, found = [node], set(), []
    while stack:
        current = stack.pop()
        if current is None or current in seen:
            continue
        seen.add(current)
        if current in stops:
            if styles[stops[current]] == "colwise":
                found.append(stops[current])
            continue
        stack.extend(next_node for next_node, _ in current.next_functions)
    return found


def _nested_norm_style(block: nn.Module, path: str, flow: dict[str, tuple], styles: dict[str, str]) -> str | None:
    """A nested norm the plan leaves unmarked, by what it reads: None (whole projections: left as it is); "head_norm"
    where it normalizes each head of a column-wise output (a per-head q_norm the class's plan forgot: Sarvam-MoE's,
    GLM-4-MoE's; its gradient summed over the tensor ranks, as Qwen3's marked ones are); "unplaced" where it
    normalizes a column-wise output's whole width, of which each rank holds a slice."""
    sources = _split_sources(flow[path][0], flow, styles)
    if not sources:
        return None
    weight = getattr(block.get_submodule(path), "weight", None)
    widths = {getattr(block.get_submodule(source), "out_features", None) for source in sources}
    if isinstance(weight, torch.Tensor) and weight.dim() == 1 and None not in widths \
            and all(width > weight.numel() and width % weight.numel() == 0 for width in widths):
        return "head_norm"
    return "unplaced"


def _gathered_parents(flow: dict[str, tuple], styles: dict[str, str]) -> set[str]:
    """Parents that, in this block, gather their input under sequence parallelism (a column-wise child) and hand
    their output back split (a row-wise child): inside one, a module sees the whole sequence and what it adds
    reaches the residual through the row-wise sum. A parent with no row-wise child in this block (a hybrid's
    linear-attention layer under a pattern its attention layers fill) would hand the residual a whole sequence."""
    def parents(kinds: tuple[str, ...]) -> set[str]:
        return {p.rsplit(".", 1)[0] for p, s in styles.items() if "." in p and p in flow and s.startswith(kinds)}

    return parents(("colwise",)) & parents(("rowwise",))


def unplaced_styles(block: nn.Module, styles: dict[str, str], run: Callable[[nn.Module], Any],
                    unplaced: str) -> dict[str, str]:
    """{path: style} for each module of `block` holding parameters the plan `styles` ({block-relative path: style})
    places nowhere: "replicate", "sharded_input", or `unplaced` (see the module docstring)."""
    placed = list(styles)
    unmarked = [(path, module) for path, module in block.named_modules()
                if path and any(True for _ in module.parameters(recurse=False))
                and not any(path == p or path.startswith(p + ".") for p in placed)]
    candidates = [path for path, module in unmarked if not is_norm_module(module)]
    norms = [path for path, module in unmarked if is_norm_module(module) and "." in path]
    if not candidates and not norms:
        return {}
    if any(style not in UNDERSTOOD for style in styles.values()):
        return {path: unplaced for path in candidates}
    try:
        flow = module_flow(block, run)
    except Exception:  # a block that does not run on meta: nothing is proven
        return {path: unplaced for path in candidates}
    region = sharded_region(flow, styles)
    # a norm nested in the block is taken to read whole projections (plait.hf.spec.unplaced_modules) unless
    # it reads a column-wise output (_nested_norm_style)
    out = {}
    for path in norms:
        style = _nested_norm_style(block, path, flow, styles) if path in flow else None
        if style is not None:
            out[path] = unplaced if style == "unplaced" else style
    column_outputs = {flow[p][1] for p, s in styles.items() if s == "colwise" and p in flow}
    gathered = _gathered_parents(flow, styles)
    for path in candidates:
        entry, exit_ = flow.get(path, (None, None))[:2]
        inside_gather = any(path.startswith(parent + ".") for parent in gathered)
        if not inside_gather:
            root = path.split(".", 1)[0]
            out[root] = REPLICATE_MODULE if _replicable(block, root, flow, region, gathered) else unplaced
        elif path not in flow:
            out[path] = unplaced
        elif entry not in region and exit_ not in region:
            out[path] = "replicate"
        elif entry in column_outputs and entry is not None:
            out[path] = "sharded_input"
        else:
            out[path] = unplaced
    roots = [path for path, style in out.items() if style == REPLICATE_MODULE]
    return {path: style for path, style in out.items()  # a replicated root runs what is inside it
            if not any(path.startswith(root + ".") for root in roots)}


def _replicable(block: nn.Module, root: str, flow: dict[str, tuple], region: set, gathered: set[str]) -> bool:
    """Whether the block's child `root` can run whole on every tensor rank (REPLICATE_MODULE; the module docstring)."""
    from plait.hf.experts import class_experts

    if root in gathered or root not in flow or "" not in flow or class_experts(block.get_submodule(root)):
        return False
    entry, exit_, in_shape, out_shape = flow[root]
    block_shape = flow[""][2]
    return (entry not in region and exit_ not in region and in_shape == block_shape and out_shape is not None
            and len(out_shape) >= 3 and out_shape[:2] == block_shape[:2])
