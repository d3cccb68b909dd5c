"""Measure a model on `meta` for the planner: what each block costs, without any weights or compute.

* FLOPs: torch.utils.flop_counter.FlopCounterMode over one block's forward at two sequence lengths, which
  splits them into a part per token (weight GEMMs) and a part per token and position (attention);
* activation bytes: the tensors autograd saves for backward during the block's forward, as the run keeps them
  (plait.models.saved_bytes: fused attention, weights left out, per storage), per token, in fp32, 16 bits and
  under autocast, and what selective recompute keeps;
* parameters: counted per block, and for what runs before and after the blocks.

`measure_spec(source)` turns a "module:package.module:factory" model into a ModelSpec whose `blocks` hold
these measurements, so the cost model prices each block as it is (they need not be alike).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from plait.torch_internals import TorchDispatchMode, tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from plait.errors import ConfigError
from plait.models import saved_bytes
from plait.spec.model import SEQ_PROBES, BlockCost, ModelSpec



BlockCall = Callable[[nn.Module, torch.Tensor], Any]
"""How a block is called on hidden states [1, s, h] (with whatever else its model passes it)."""


NO_WORK = frozenset({"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "slice", "select",
                     "unsqueeze", "squeeze", "as_strided", "detach", "alias", "split", "split_with_sizes", "unbind",
                     "chunk", "narrow", "lift_fresh", "empty", "empty_like", "new_empty", "_to_copy", "clone",
                     "contiguous", "zeros", "zeros_like", "ones", "ones_like", "full", "arange", "new_zeros",
                     "new_ones", "index_select", "embedding", "copy_", "fill_", "zero_", "cat", "stack"})
"""Aten ops that move or make tensors without arithmetic worth pricing."""


class _Unpriced(TorchDispatchMode):
    """Elements written by aten ops that FlopCounterMode has no formula for and that do arithmetic (elementwise
    maths, reductions, a scan's cumulative sums): the work a FLOP count leaves out."""

    def __init__(self, priced) -> None:
        super().__init__()
        self.priced, self.elements = priced, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.overloadpacket not in self.priced and name.removesuffix("_") not in NO_WORK and name not in NO_WORK:
            self.elements += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _forward_cost(block: nn.Module, hidden: int, seq: int, call: BlockCall | None = None,
                  replicated: tuple[nn.Module, ...] = ()) -> tuple[float, float, float]:
    """(forward FLOPs, elements written by unpriced ops, FLOPs inside the `replicated` modules) of one block over one
    sequence of `seq` tokens, on meta."""
    x = torch.zeros(1, seq, hidden, device="meta", requires_grad=True)
    counter = FlopCounterMode(display=False)
    unpriced = _Unpriced(counter.flop_registry)
    inside = [0.0]  # FLOPs counted while a replicated module ran: the total's difference across its forward
    hooks = [h for module in replicated for h in (
        module.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] - counter.get_total_flops())),
        module.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] + counter.get_total_flops())))]
    try:
        with counter, unpriced:
            block(x) if call is None else call(block, x)
    finally:
        for hook in hooks:
            hook.remove()
    return float(counter.get_total_flops()), float(unpriced.elements), inside[0]


def _per_token(f1: float, f2: float) -> tuple[float, float]:
    """(FLOPs per token, per token and position) from the counts at the two SEQ_PROBES lengths."""
    s1, s2 = SEQ_PROBES
    per_position = max(0.0, (f2 / s2 - f1 / s1) / (s2 - s1))  # attention: FLOPs per token grow with s
    return max(0.0, f1 / s1 - per_position * s1), per_position


def measure_block(block: nn.Module, hidden: int, call: BlockCall | None = None,
                  replicated: tuple[str, ...] = ()) -> BlockCost:
    """`block` measured on meta; `replicated`: paths of its modules that tensor parallelism runs whole on every rank
    (their parameters and FLOPs are also counted apart: BlockCost.replicated_*)."""
    whole = tuple(m for path in replicated if (m := _submodule(block, path)) is not None)
    (f1, u1, r1), (f2, _, r2) = (_forward_cost(block, hidden, s, call, whole) for s in SEQ_PROBES)
    per_token, per_position = _per_token(f1, f2)
    replicated_token, replicated_position = _per_token(r1, r2)
    kept = saved_bytes.measure(block, hidden, SEQ_PROBES, call)
    return BlockCost(params=sum(p.numel() for p in block.parameters()), flops_per_token=per_token,
                     attention_flops_per_token=per_position, activation_bytes_per_token=kept.none["fp32"],
                     activation_bytes_per_token_position=kept.per_token_position["fp32"],
                     half_activation_bytes_per_token=kept.none["16bit"],
                     half_activation_bytes_per_token_position=kept.per_token_position["16bit"],
                     autocast_activation_bytes_per_token=kept.none["autocast"],
                     autocast_activation_bytes_per_token_position=kept.per_token_position["autocast"],
                     selective_elements_per_token=kept.selective_elements,
                     selective_fp32_elements_per_token=kept.selective_fp32_elements,
                     selective_rerun_flops_per_token=kept.selective_rerun_flops,
                     tensors=sum(1 for _ in block.parameters()), unpriced_elements_per_token=u1 / SEQ_PROBES[0],
                     replicated_params=sum(p.numel() for m in whole for p in m.parameters()),
                     replicated_flops_per_token=min(replicated_token, per_token),
                     replicated_attention_flops_per_token=min(replicated_position, per_position))


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


UNPRICED_FLAG = 0.1
"""A block whose unpriced elements per token exceed this share of its FLOPs runs work the FLOP count misses: a
transformer layer writes ~2% (norms, activations, softmax), Mamba's scan in torch's elementwise steps ~21%,
Kimi's delta attention ~32% (tiny configs, measured with benchmarks/hf_families.py's shrinking)."""


def unpriced_blocks(model: ModelSpec, seq_len: int) -> list[tuple[int, float]]:
    """(block index, unpriced elements / FLOPs) of the measured blocks over UNPRICED_FLAG at `seq_len`: priced by
    their FLOPs only, their time is a lower bound (`plait plan` says so)."""
    out = []
    for index, block in enumerate(model.blocks):
        flops = block.flops_per_token + seq_len * block.attention_flops_per_token
        share = block.unpriced_elements_per_token / flops if flops else float(block.unpriced_elements_per_token > 0)
        if share > UNPRICED_FLAG:
            out.append((index, share))
    return out


def unpriced_note(model: ModelSpec, seq_len: int) -> str | None:
    """One line naming the blocks `unpriced_blocks` finds, or None."""
    found = unpriced_blocks(model, seq_len)
    if not found:
        return None
    worst = max(share for _, share in found)
    indices = [index for index, _ in found]
    shown = ", ".join(map(str, indices[:8])) + (f" and {len(indices) - 8} more" if len(indices) > 8 else "")
    return (f"{len(indices)} of {model.name}'s {len(model.blocks)} blocks ({shown}) run elementwise work with no FLOP "
            f"formula (a scan: up to {worst:.0%} of their FLOPs in elements written); they are priced by their FLOPs "
            f"only, so their time is a lower bound")


def measure_spec(source: str, **overrides: Any) -> ModelSpec:
    """The ModelSpec of a module:factory model, every block measured on meta."""
    from plait.models.factory import _structure, build_user_model

    model = build_user_model(source)
    _, pre, post, tied, _ = _structure(source)
    blocks = list(model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks)
    if not blocks:
        raise ConfigError(f"model {source!r} has no blocks")
    hidden_states = model.embed(torch.zeros(1, 4, dtype=torch.long, device="meta"))
    hidden = hidden_states.shape[-1]
    vocab = model.head(hidden_states).shape[-1]
    costs = tuple(measure_block(block, hidden) for block in blocks)
    aliases = {alias for alias, _ in tied}

    def params_of(names: tuple[str, ...]) -> int:
        return sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False)
                   if n.split(".")[0] in names and n not in aliases)

    attrs = {key: getattr(model, key) for key in ("num_heads", "num_kv_heads", "ffn_hidden_size", "max_seq_len")
             if isinstance(getattr(model, key, None), int)}
    name = source.removeprefix("module:").split(":")[0].rsplit(".", 1)[-1]
    plan = getattr(model, "tp_plan", None)
    fields = dict(name=name, source=source, arch="llama", num_layers=len(blocks), hidden_size=hidden,
                  num_heads=attrs.get("num_heads", 1), num_kv_heads=attrs.get("num_kv_heads"),
                  ffn_hidden_size=attrs.get("ffn_hidden_size", 4 * hidden), vocab_size=vocab,
                  head_dim=hidden // attrs.get("num_heads", 1) if hidden % attrs.get("num_heads", 1) == 0 else 1,
                  max_seq_len=attrs.get("max_seq_len", 1 << 20),
                  positions="learned" if "max_seq_len" in attrs else "rope",
                  tied_embeddings=bool(tied), blocks=costs, pre_params=params_of(pre), post_params=params_of(post),
                  tp_plan=dict(plan) if isinstance(plan, dict) else {})
    fields.update(overrides)
    return ModelSpec(**fields)
