"""Compute cost of one transformer layer, the embedding and the output layer, per micro-batch per device.

FLOPs count the GEMMs only (as Megatron's and Korthikanti's formulas do): per token a layer's
weight GEMMs take 2 FLOPs per weight, attention scores and values 4·s·h more. Backward is
twice forward. The achieved rate of GEMMs of a model of hidden size h is

    rate(h) = peak · matmul · h / (h + matmul_half_dim)            (Efficiency, fitted)

(h, not h/t: fitting on the Megatron rows, the model's width explains the trend better than
the per-device slice, and it is the width `plait profile` measures on one device)
and the rest of a layer's work (norms, softmax, dropout, GeLU, residuals) costs `overhead`
times its GEMM time; `layer_overhead_s` adds a fixed host time per layer pass (forward 1x,
backward 2x; 0 on the GPU presets, fitted by `plait tune` for CPU processes). Activation
bytes follow Korthikanti et al. 2022, Table 2, generalized to grouped-query attention and
SwiGLU MLPs (see `activation_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plait.cost.comm import Group, all_gather, all_reduce, reduce_scatter
from plait.spec.cluster import ClusterSpec
from plait.spec.model import ModelSpec

MACHINE_BALANCE = {"cuda": 150.0, "cpu": 4.0}
"""Peak FLOP/s per byte/s of memory bandwidth, for the memory-bound optimizer step (A100: 312e12 / 2.0e12
bytes/s ~ 150; a CPU core's fp32 peak against its share of DRAM bandwidth ~ 4). Public specs, not fitted."""

ADAM_BYTES_PER_PARAM = 30.0
"""Memory traffic of one mixed-precision Adam update: read+write fp32 master, m, v (24), read the 16-bit gradient,
write the 16-bit parameter (4), plus the norm for clipping (2)."""


@dataclass(frozen=True)
class LayerCost:
    """One transformer layer, one micro-batch, one device: seconds and bytes."""

    fwd: float
    """Forward compute (GEMMs and the rest)."""
    bwd: float
    """Backward compute, without recomputation."""
    tp_fwd: float
    """Tensor-parallel collectives of the forward pass."""
    tp_bwd: float
    """Tensor-parallel collectives of the backward pass."""
    recompute: dict[str, float]
    """Extra backward time per recompute mode (full: the forward again; selective: the attention core's forward)."""
    activations: dict[str, float]
    """Activation bytes kept per recompute mode until the backward pass."""
    gemm_fraction: float
    """Achieved fraction of peak of this layer's GEMMs."""


def gemm_fraction(cluster: ClusterSpec, width: float) -> float:
    """Achieved fraction of peak of the GEMMs of a model `width` (its hidden size) wide."""
    eff = cluster.efficiency
    if eff.matmul_half_dim <= 0:
        return eff.matmul
    return eff.matmul * width / (width + eff.matmul_half_dim)


def layer_flops(model: ModelSpec, tokens: int, seq_len: int) -> tuple[float, float]:
    """Forward FLOPs of one layer over `tokens` tokens: (weight GEMMs, attention scores+values), whole layer.
    For a model measured on meta (ModelSpec.blocks), the mean block's (block_loads weighs each block)."""
    if model.blocks:
        n = len(model.blocks)
        return (tokens * sum(b.flops_per_token for b in model.blocks) / n,
                tokens * seq_len * sum(b.attention_flops_per_token for b in model.blocks) / n)
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn_hidden_size
    mlp_weights = (3 if model.gated_mlp else 2) * h * f
    weights = h * (q + 2 * kv) + q * h + mlp_weights
    return 2.0 * tokens * weights, 4.0 * tokens * seq_len * q


@dataclass(frozen=True)
class BlockWeights:
    """Each block's cost relative to the mean block, where blocks differ (a model measured on meta): forward time
    (FLOPs at the sequence length), parameters and activation bytes."""

    time: tuple[float, ...]
    params: tuple[float, ...]
    activations: tuple[float, ...]


@lru_cache(maxsize=256)
def block_weights(model: ModelSpec, seq_len: int) -> BlockWeights | None:
    """None when every block costs the same (the cost model then counts layers)."""
    if not model.blocks:
        return None
    flops = [b.flops_per_token + seq_len * b.attention_flops_per_token for b in model.blocks]
    params = [float(b.params) for b in model.blocks]
    acts = [b.activation_bytes_per_token for b in model.blocks]
    if len(set(flops)) == len(set(params)) == len(set(acts)) == 1:
        return None

    def relative(values: list[float]) -> tuple[float, ...]:
        mean = sum(values) / len(values)
        return tuple(v / mean if mean > 0 else 1.0 for v in values)

    return BlockWeights(relative(flops), relative(params), relative(acts))


def block_loads(model: ModelSpec, seq_len: int, layers: tuple[int, ...]) -> list[tuple[float, float, float]]:
    """Per virtual stage holding `layers[k]` consecutive blocks: (time, parameter, activation) load in units of
    the mean block -- the block count itself when blocks are alike."""
    weights = block_weights(model, seq_len)
    if weights is None:
        return [(float(n), float(n), float(n)) for n in layers]
    out, start = [], 0
    for n in layers:
        out.append((sum(weights.time[start:start + n]), sum(weights.params[start:start + n]),
                    sum(weights.activations[start:start + n])))
        start += n
    return out


def head_flops(model: ModelSpec, tokens: int) -> float:
    """Forward FLOPs of the output projection (logits)."""
    return 2.0 * tokens * model.hidden_size * model.vocab_size


def model_flops_per_step(model: ModelSpec, global_batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step (forward + backward, no recompute), as MFU counts them."""
    tokens = global_batch * seq_len
    dense, attn = layer_flops(model, tokens, seq_len)
    return 3.0 * (model.num_layers * (dense + attn) + head_flops(model, tokens))


@lru_cache(maxsize=65536)
def activation_bytes(model: ModelSpec, micro_batch: int, seq_len: int, tp: int, sp: bool, mode: str,
                     dtype_bytes: int = 2) -> float:
    """Bytes one layer keeps for backward, per device (Korthikanti et al. 2022, Table 2, generalized).

    Legend: s seq, b micro-batch, h hidden, kv key/value width, f ffn, a heads, t tensor degree.
    * not split by tensor parallelism (split by t under sequence parallelism): the two norm inputs 4sbh,
      the QKV and MLP inputs 2sbh each, two 1-byte dropout masks 2sbh: 10sbh;
    * split by t: Q 2sbh, K and V 4sb·kv, the attention-output input 2sbh, the MLP inner activations
      4sbf (GeLU: its input and output) or 6sbf (SwiGLU: gate, up and their product): 24sbh for GPT;
    * split by t, dropped by selective recompute: softmax output, dropout mask and output 5as²b;
    * full recompute keeps the layer input only: 2sbh (split by t under sequence parallelism).
    """
    s, b, h, a = seq_len, micro_batch, model.hidden_size, model.num_heads
    sbh = s * b * h
    scale = dtype_bytes / 2.0
    split = tp if sp else 1
    if mode == "full":
        return scale * 2.0 * sbh / split
    if model.blocks:
        # measured on meta in fp32 (the mean block): the part Korthikanti's table splits over tp (24 of 34 sbh)
        # is split, the rest only under sequence parallelism; fused attention keeps no scores to drop
        measured = s * b * sum(x.activation_bytes_per_token for x in model.blocks) / len(model.blocks)
        return dtype_bytes / 4.0 * measured * (10.0 / 34 / split + 24.0 / 34 / tp)
    inner = (6 if model.gated_mlp else 4) * s * b * model.ffn_hidden_size
    sbq = s * b * model.q_size
    sharded = 2 * sbq + 4 * s * b * model.kv_size + 2 * sbq + inner
    total = 10.0 * sbh / split + sharded / tp
    if mode == "none":
        total += 5.0 * a * s * s * b / tp
    return scale * total


@lru_cache(maxsize=4096)
def layer_cost(model: ModelSpec, cluster: ClusterSpec, seq_len: int, micro_batch: int, tp: int, sp: bool,
               dtype_bytes: int = 2) -> LayerCost:
    """Time and activation memory of one layer for one micro-batch on one device of a tensor group of `tp`."""
    tokens = micro_batch * seq_len
    dense, attn = layer_flops(model, tokens, seq_len)
    fraction = gemm_fraction(cluster, model.hidden_size)
    rate = cluster.peak_flops * fraction
    rest = 1.0 + cluster.efficiency.overhead
    # plus the fixed host time of the pass (Efficiency.layer_overhead_s, and tp_layer_overhead_s for
    # DTensor's dispatch under tensor parallelism): per micro-batch, not per token
    host = cluster.efficiency.layer_overhead_s + (cluster.efficiency.tp_layer_overhead_s if tp > 1 else 0.0)
    fwd = (dense + attn) / tp / rate * rest + host
    tp_pass = tp_collectives_per_pass(model, cluster, tokens, tp, sp, dtype_bytes)
    modes = ("none", "selective", "full")
    return LayerCost(
        fwd=fwd,
        bwd=2.0 * fwd,
        tp_fwd=tp_pass,
        tp_bwd=tp_pass,
        # Full recompute reruns the layer; selective reruns the attention core (Korthikanti et al. 2022).
        recompute={"none": 0.0, "selective": attn / tp / rate * rest, "full": fwd + tp_pass},
        activations={m: activation_bytes(model, micro_batch, seq_len, tp, sp, m, dtype_bytes) for m in modes},
        gemm_fraction=fraction,
    )


def tp_collectives_per_pass(model: ModelSpec, cluster: ClusterSpec, tokens: int, tp: int, sp: bool,
                            dtype_bytes: int) -> float:
    """Two all-reduces of the layer's b·s·h activations per pass (Megatron's g/f), or under sequence
    parallelism two all-gathers and two reduce-scatters of the same total volume."""
    if tp <= 1:
        return 0.0
    nbytes = tokens * model.hidden_size * dtype_bytes
    group = Group(tp, 1)
    if sp:
        return 2 * all_gather(nbytes, group, cluster) + 2 * reduce_scatter(nbytes, group, cluster)
    return 2 * all_reduce(nbytes, group, cluster)


@dataclass(frozen=True)
class EndsCost:
    """The embedding (first stage) and the final norm + output layer + loss (last stage), per micro-batch."""

    embed_fwd: float
    embed_bwd: float
    head_fwd: float
    head_bwd: float
    embed_tp: float
    head_tp: float


@lru_cache(maxsize=4096)
def ends_cost(model: ModelSpec, cluster: ClusterSpec, seq_len: int, micro_batch: int, tp: int, sp: bool,
              dtype_bytes: int = 2) -> EndsCost:
    """Vocabulary-parallel embedding and output layer with a parallel loss (Megatron's layout)."""
    tokens = micro_batch * seq_len
    rate = cluster.peak_flops * gemm_fraction(cluster, model.hidden_size)
    rest = 1.0 + cluster.efficiency.overhead
    head = head_flops(model, tokens) / tp / rate * rest
    # The embedding is a gather: memory-bound, priced like the non-GEMM part of a tiny GEMM.
    embed = cluster.efficiency.overhead * tokens * model.hidden_size * 2.0 / rate
    nbytes = tokens * model.hidden_size * dtype_bytes
    group = Group(tp, 1)
    if sp:
        embed_tp = reduce_scatter(nbytes, group, cluster)
        head_tp = all_gather(nbytes, group, cluster) + reduce_scatter(nbytes, group, cluster)
    else:
        embed_tp = all_reduce(nbytes, group, cluster)
        head_tp = all_reduce(nbytes, group, cluster)
    return EndsCost(embed_fwd=embed, embed_bwd=embed, head_fwd=head, head_bwd=2.0 * head,
                    embed_tp=embed_tp, head_tp=head_tp)


def layer_tensors(model: ModelSpec) -> int:
    """Parameter tensors of one block: a GPT layer has 16 (two norms with biases; q, k, v, output and two MLP
    weights, each with a bias), a Llama layer 9."""
    if model.blocks:
        return round(sum(b.tensors for b in model.blocks) / len(model.blocks))
    norm = 2 if model.norm == "layernorm" else 1
    biases = {"all": 4, "qkv": 3, "none": 0}[model.bias] + ((3 if model.gated_mlp else 2) if model.has_bias else 0)
    return 2 * norm + 4 + (3 if model.gated_mlp else 2) + biases + (2 if model.qk_norm else 0)


def param_tensors(model: ModelSpec, layers: int, first: bool, last: bool) -> int:
    """Parameter tensors of a pipeline rank holding `layers` blocks; the first stage adds the embeddings, the
    last the final norm and the output layer."""
    norm = 2 if model.norm == "layernorm" else 1
    count = layers * layer_tensors(model)
    if first:
        count += 2 if model.positions == "learned" else 1
    if last:
        count += norm + (0 if model.tied_embeddings and first else 1)
    return count


def optimizer_time(cluster: ClusterSpec, params_updated: float) -> float:
    """Adam step over the parameters this device updates (memory-bound)."""
    bandwidth = cluster.peak_flops / MACHINE_BALANCE[cluster.device_type]
    return ADAM_BYTES_PER_PARAM * params_updated / bandwidth
