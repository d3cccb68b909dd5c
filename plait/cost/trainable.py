"""Which parameters train, as the cost model prices them: every one, or the LoRA adapters on a frozen base
(ModelSpec.lora, plait.spec.lora). The one place the cost model asks; memory, the optimizer step, data-parallel
gradient traffic and the backward's FLOPs read it.

What a frozen base changes (plait/execute/lora.py runs it):

* memory: the base keeps its parameters (as the carrier holds them: DDP's fp32 copy, fully_shard's shards and
  gathered units) but no gradient, no AdamW moments and no DDP bucket; the adapters keep all of those. The embedding,
  the final norm and the output layer are frozen whole (plait adapts linear layers inside the blocks);
* the optimizer step and the gradient reductions cover the adapters only; fully_shard still gathers the base;
* the backward runs no weight-gradient GEMM for a frozen weight (autograd skips a gradient nobody needs): a layer's
  backward is its input-gradient GEMMs, as many FLOPs as its forward, plus the adapters' weight gradients; the
  output layer's likewise;
* activations: autograd keeps no input for a frozen linear without an adapter (a frozen `down_proj`'s ffn-wide
  input), nor the normalized input of a frozen norm weight; an adapter's A keeps its projection's input. What a
  block keeps is full fine-tuning's scaled by the share measured on meta (Lora.activation_share,
  plait.models.lora.activation_share) where the block keeps everything (no recompute, or the math path's
  selective); full recompute keeps the block input, and the fused path's selective policy the same GEMM outputs,
  either way.
"""

from __future__ import annotations

from plait.spec.model import ModelSpec


def full(model: ModelSpec) -> bool:
    """Whether every parameter trains (no LoRA)."""
    return model.lora is None


def adapter_layer_params(model: ModelSpec, tp: int) -> float:
    """The LoRA adapters of one layer on one device of a tensor group of `tp`: the parts tensor parallelism keeps
    whole (Lora.whole_params) on every rank, the rest split (0 without LoRA)."""
    lora = model.lora
    if lora is None:
        return 0.0
    return lora.whole_params + (lora.adapter_params - lora.whole_params) / tp


def trained(model: ModelSpec, held: float, adapters: float = 0.0) -> float:
    """Of `held` parameters, those with gradients and optimizer states: all, or under LoRA the `adapters` among
    them (0 for the embedding, the head and the experts)."""
    return held if model.lora is None else adapters


def trained_layer_params(model: ModelSpec, tp: int, held: float) -> float:
    """Of one layer's `held` parameters on a device, those that train."""
    return trained(model, held, adapter_layer_params(model, tp))


def adapter_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs of one layer's adapters per token: A·x and B·(A·x), 2 per parameter (0 without LoRA)."""
    return 0.0 if model.lora is None else 2.0 * model.lora.adapter_params


def backward_gemm_factor(model: ModelSpec) -> float:
    """A layer's backward FLOPs of its weight GEMMs, in units of their forward: 2 (input and weight gradients), or 1
    under LoRA (input gradients only: its weights are frozen; the adapters' own are priced with their FLOPs)."""
    return 2.0 if model.lora is None else 1.0


def kept_activations(model: ModelSpec, mode: str, nbytes: float) -> float:
    """`nbytes` of a block's activations under recompute `mode` (plait.cost.activations), as a frozen base keeps
    them (module docstring)."""
    if model.lora is None or not (mode == "none" or (mode == "selective" and model.attention == "math")):
        return nbytes
    return nbytes * model.lora.activation_share
