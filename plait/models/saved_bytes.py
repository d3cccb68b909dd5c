"""What a block keeps for backward, measured on `meta` as the run keeps it.

A block run on meta under `torch.autograd.graph.saved_tensors_hooks` shows every tensor autograd saves; three
things stand between that list and the bytes a training run holds, and this module removes them:

* **what is no activation**: the weights themselves, their views (a linear saves its weight transposed) and what is
  made from weights alone (a weight cast to 16 bits, a token's top-k experts' weights gathered): the carrier holds
  those (plait.cost.memory), not the block; nor what the model computes once for all its layers and hands each one
  (rotary tables, a mask). A dispatch mode follows every storage the block's forward makes and whether only weights
  went into it (`_Provenance`);
* **views counted twice**: q, k and v each save a view of the one normalized input; bytes are counted per storage;
* **the attention path**: on meta, SDPA dispatches to its math backend, which keeps the s x s probabilities, where
  the run on a GPU takes a fused kernel, and the run on CPU too (`_scaled_dot_product_flash_attention_for_cpu`:
  checked on torch 2.13 in tests/unit/test_class_activations.py). `_RunPath` sends SDPA on meta to that fused kernel,
  whose meta function saves what the run's does: q, k, v at their own head counts, the output and the fp32
  logsumexp. A class whose attention is its own eager code (soft-capped scores) keeps its probabilities in the run
  too, and is measured so (their bytes grow with the sequence: `SavedBytes.per_token_position`).

Precision: a block is measured in fp32, in 16 bits (parameters and residual stream in bf16: fully_shard's mixed
precision), and under autocast (16-bit matmuls over fp32 parameters and residual stream: one replica, DDP), which
`_RunPath` emulates on meta (autocast has no meta kernels): every matmul-like call casts its fp32 inputs to bf16, a
fresh copy per call as autocast makes for activations, so a norm's fp32 output read by q, k and v is kept three
times, as on an H200 (tests/unit/test_activations.py).

Selective recompute (plait.execute.recompute's policy on the fused path) keeps the block input, the outputs of
every second GEMM and those of the fused attention kernel: `_Provenance` records them in forward order, split into
compute-dtype elements and the kernel's fp32 logsumexp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from plait.torch_internals import TorchDispatchMode, c10d_functional, op, storage_id, tree_leaves, tree_map


def _ops(namespace, *names: str) -> frozenset:
    return frozenset(getattr(namespace, name).default for name in names if hasattr(namespace, name))


SELECTIVE_GEMMS = _ops(torch.ops.aten, "mm", "addmm")
"""The GEMMs of a block's linear layers (biased ones are addmm); selective recompute saves every second one's
output (plait.execute.recompute)."""
FUSED_ATTENTION = _ops(torch.ops.aten, "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                       "_scaled_dot_product_cudnn_attention")
"""SDPA's fused kernels: their output and logsumexp are what they keep (the scores are never materialized)."""
SELECTIVE_ALWAYS_SAVED = FUSED_ATTENTION | _ops(c10d_functional(), "reduce_scatter_tensor", "all_reduce")
"""Ops whose outputs selective recompute always saves: fused attention (rerunning it would cost its whole forward)
and the collectives whose rerun would communicate again."""

PRECISIONS = ("fp32", "16bit", "autocast")
"""The three ways a block runs (module docstring), as `measure` names them."""
HALF = torch.bfloat16

# Matmul-like functions autocast runs in 16 bits (torch's CUDA and CPU lists, the calls transformers' classes make)
_AUTOCAST_CALLS = frozenset({F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
                             torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm,
                             torch.baddbmm, torch.Tensor.baddbmm, torch.einsum, F.scaled_dot_product_attention,
                             F.conv1d, F.conv2d})


@dataclass(frozen=True)
class SavedBytes:
    """One block's kept bytes per token, measured on meta."""

    none: dict[str, float]
    """Without recompute, per precision (PRECISIONS), at the shorter probe length."""
    per_token_position: dict[str, float]
    """Bytes per token and position of the sequence, per precision, where they keep growing (0 where attention is
    fused)."""
    selective_elements: float
    """Compute-dtype elements per token selective recompute keeps besides the block input (GEMM and attention
    outputs)."""
    selective_fp32_elements: float
    """fp32 elements per token it keeps (the fused attention's logsumexp)."""
    selective_rerun_flops: float
    """Forward FLOPs per token of the GEMMs it does not keep (every second one), which its backward runs again."""


def _key(t: torch.Tensor) -> int:
    """One storage, however viewed (on meta too)."""
    return storage_id(t)


class _Provenance(TorchDispatchMode):
    """Sorts the storages a forward makes into activations and weight-made ones, and records the outputs
    selective recompute keeps."""

    def __init__(self, weights: set[int], inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.weights, self.created = set(weights), {_key(t) for t in inputs}
        self.alive: list[torch.Tensor] = []  # kept referenced: a freed storage's address could come back
        self.gemms = 0
        self.started = False  # set when the block's own forward begins: what its caller computed is no activation
        self.selective: dict[int, tuple[float, float]] = {}  # storage -> (compute elements, fp32 elements)
        self.rerun_flops = 0.0  # of the GEMMs selective recompute does not keep: its backward runs them again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.started:
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        seen = {_key(t) for t in inputs}
        floats = [t for t in inputs if t.is_floating_point()]
        from_weights = bool(floats) and all(_key(t) in self.weights for t in floats)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in outputs:
            if _key(t) not in seen:  # an alias keeps what its input is
                self.alive.append(t)
                (self.weights if from_weights else self.created).add(_key(t))
        # transformers' experts measured in their batched form (plait.hf.spec.experts_batched): a bmm against
        # gathered expert weights stands for the run's loop of one linear per expert, whose GEMMs the policy counts
        batched_experts = func is torch.ops.aten.bmm.default and any(_key(t) in self.weights for t in floats)
        self._selective(func, outputs, floats, batched_experts)
        return out

    def _selective(self, func, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                   batched_experts: bool = False) -> None:
        if func in SELECTIVE_GEMMS or batched_experts:
            self.gemms += 1
            if self.gemms % 2 == 1 and _key(outputs[0]) in self.created:
                self.selective[_key(outputs[0])] = (float(outputs[0].numel()), 0.0)
            elif self.gemms % 2 == 0:  # 2 x output elements x the inner dimension
                self.rerun_flops += 2.0 * outputs[0].numel() * inputs[-1].shape[-2]
        elif func in FUSED_ATTENTION:  # the output, and the logsumexp in fp32
            self.selective[_key(outputs[0])] = (float(outputs[0].numel()), 0.0)
            if len(outputs) > 1 and outputs[1].dtype == torch.float32:
                self.selective[_key(outputs[1])] = (0.0, float(outputs[1].numel()))


class _RunPath(TorchFunctionMode):
    """SDPA on meta through the fused kernel the run takes; under `autocast`, matmul-like calls in 16 bits."""

    def __init__(self, fused: bool, autocast: bool) -> None:
        super().__init__()
        self.fused, self.autocast = fused, autocast

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.autocast and func in _AUTOCAST_CALLS:
            args, kwargs = tree_map(_to_half, (args, kwargs))
        if self.fused and func is F.scaled_dot_product_attention:
            return _fused_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _to_half(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return value.to(HALF)
    return value


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """SDPA as its fused CPU kernel runs it (keys and values at their own head count: GQA without repeating)."""
    if query.device.type != "meta" or (not enable_gqa and key.shape[-3] != query.shape[-3]):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.requires_grad:  # a learned bias: the kernel that differentiates it
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
        out, *_ = op("efficient_attention")(
            query, key, value, attn_mask.expand(*query.shape[:-1], key.shape[-2]), True, dropout_p, is_causal,
            scale=scale)
        return out
    out, _ = op("cpu_flash_attention")(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out


BlockCall = Callable[[nn.Module, torch.Tensor], Any]


def _kept_bytes(block: nn.Module, hidden: int, seq: int, call: BlockCall | None, precision: str,
                fused: bool) -> tuple[float, float, float, float]:
    """(bytes kept without recompute, selective's compute elements, its fp32 elements, the FLOPs it reruns) over
    `seq` tokens."""
    dtype = HALF if precision == "16bit" else torch.float32
    x = torch.zeros(1, seq, hidden, device="meta", dtype=dtype, requires_grad=True)
    weights = {_key(t) for t in [*block.parameters(), *block.buffers()]}
    provenance = _Provenance(weights, (x,))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if _key(t) in provenance.created:
            saved[_key(t)] = t.untyped_storage().nbytes()
        return t

    start = block.register_forward_pre_hook(lambda *_: setattr(provenance, "started", True))
    try:
        with _RunPath(fused, precision == "autocast"), provenance, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x) if call is None else call(block, x)
    finally:
        start.remove()
    kept = list(provenance.selective.values())  # saved whether or not autograd would keep them
    return float(sum(saved.values())), sum(c for c, _ in kept), sum(f for _, f in kept), provenance.rerun_flops


def measure(block: nn.Module, hidden: int, probes: tuple[int, int], call: BlockCall | None = None,
            fused: bool = True) -> SavedBytes:
    """The block's kept bytes on meta (module docstring): per token at the first of `probes`, and per token and
    position where they grow with the sequence, read off the longer lengths: `probes`' second and twice it. A
    block whose bytes per token grow and then stop (a scan computed chunk by chunk keeps a chunk's square, whatever
    the sequence) is priced flat at its longest length; one whose bytes keep growing (the class's own eager
    attention, its s x s scores) grows on."""
    s1, s2 = probes
    s3 = 2 * s2
    _, sel, sel32, rerun = _kept_bytes(block, hidden, s1, call, "fp32", fused)
    none, position = {}, {}
    for precision in PRECISIONS:
        try:
            tail = [_in_precision(block, precision, lambda p=precision, s=s: _kept_bytes(
                block, hidden, s, call, p, fused)[0] / s) for s in (s2, s3)]
        except RuntimeError:  # a class that mixes dtypes its own way (a buffer kept in fp32): priced from fp32
            if precision == "fp32":
                raise
            none[precision], position[precision] = 0.0, 0.0
            continue
        position[precision] = max(0.0, (tail[1] - tail[0]) / (s3 - s2))
        none[precision] = tail[1] - (s3 - s1) * position[precision]  # the line through the longest length, at s1
    return SavedBytes(none=none, per_token_position=position, selective_elements=sel / s1,
                      selective_fp32_elements=sel32 / s1, selective_rerun_flops=rerun / s1)


def _in_precision(block: nn.Module, precision: str, run: Callable[[], float]) -> float:
    """`run()` with the block's floating-point parameters in 16 bits for "16bit" (what fully_shard's mixed precision
    casts; buffers stay), then back."""
    if precision != "16bit":
        return run()
    params = [p for p in block.parameters() if p.is_floating_point()]
    dtypes = [p.dtype for p in params]
    for p in params:
        p.data = p.data.to(HALF)
    try:
        return run()
    finally:
        for p, dtype in zip(params, dtypes):
            p.data = p.data.to(dtype)
