"""Compute cost of one transformer layer, the embedding and the output layer, per micro-batch per device.

FLOPs count the GEMMs only (as Megatron's and Korthikanti's formulas do): per token a layer's
weight GEMMs take 2 FLOPs per weight, attention scores and values 4·s·q more (model FLOPs, what MFU
counts). Backward is twice forward for the weight GEMMs. The attention core runs as the model says
(ModelSpec.attention):

* "math": q·kᵀ and p·v over the whole s x s square, backward twice forward;
* "fused" (SDPA's flash / memory-efficient kernels): causal blocks above the diagonal are skipped (half
  the FLOPs), and the backward reruns q·kᵀ inside the kernel before its four gradient GEMMs: 5 GEMMs of
  the forward's 2, i.e. 2.5 times the forward (Dao 2023, FlashAttention-2, section 3.1.2).

The achieved rate of GEMMs of a model of hidden size h is

    rate(h) = peak · matmul · h / (h + matmul_half_dim)            (Efficiency, fitted)

(h, not h/t: fitting on the Megatron rows, the model's width explains the trend better than
the per-device slice, and it is the width `plait profile` measures on one device)
and the rest of a layer's work (norms, softmax, GeLU, residuals) costs `overhead` times its GEMM
time; ClusterSpec.host.layer_overhead_s adds a fixed host time per layer pass (forward 1x, backward
2x; 0 on the GPU presets, fitted by `plait tune` for CPU processes). What a layer keeps for backward
is plait.cost.activations'.

A device's share of a layer (`Slicing`) is cut by tensor parallelism (widths), context parallelism (the sequence:
each rank computes b·s/cp of the tokens, plait/execute/context.py) and expert parallelism (the experts):

* context parallelism runs the attention core as plait's ContextParallelAttention does, SDPA's fused kernels
  whatever ModelSpec.attention says: "all_gather" attends the local queries to the gathered keys through an
  explicit causal mask, which the kernels cannot skip blocks of (the whole s/cp x s rectangle: the model's
  attention FLOPs / cp, backward 2.5 x), "all_to_all" (Ulysses) attends heads/cp heads over the whole sequence
  with is_causal (half of it, as without CP). Their exchanges run as the executor issues them, exposed:
  functional collectives waited on at once, with nothing to overlap (the projections they need come first);
* layers with a sliding window shorter than the sequence compute the share of the square plait.cost.attention
  says their kernel does (band by band past about twice the window: ~2·s·W scores instead of s²), and rows packing
  documents kept apart (TrainSpec.document_len) each document's own causal square;
* mixture-of-experts layers compute each token's top-k experts and the router (the model FLOPs of the active
  parameters, Fedus et al. 2022), the busiest expert rank ModelSpec.router_imbalance times the mean under
  expert parallelism, and dispatch tokens with two all-to-alls forward and two backward (plait/execute/expert.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plait.cost.attention import context_window_share, window_share
from plait.cost.comm import Group, all_gather, all_reduce, all_to_all, reduce_scatter
from plait.cost.trainable import adapter_flops_per_token, backward_gemm_factor
from plait.spec.cluster import ClusterSpec
from plait.spec.model import ModelSpec

MACHINE_BALANCE = {"cuda": 150.0, "cpu": 4.0}
"""Peak FLOP/s per byte/s of memory bandwidth, for the memory-bound optimizer step (A100: 312e12 / 2.0e12
bytes/s ~ 150; a CPU core's fp32 peak against its share of DRAM bandwidth ~ 4). Public specs, not fitted."""

ADAM_BYTES_PER_PARAM = 30.0
"""Memory traffic of one mixed-precision Adam update: read+write fp32 master, m, v (24), read the 16-bit gradient,
write the 16-bit parameter (4), plus the norm for clipping (2)."""


def busiest_rank_load(model: ModelSpec, ep: int) -> float:
    """Slots the busiest of `ep` expert-parallel ranks receives in a pass, over the mean (ModelSpec.router_imbalance,
    at most all of the group's: ep). Dropless routing (plait.models.moe): no token is dropped, the all-to-alls and
    expert GEMMs wait for the busiest rank instead. 1 without expert parallelism: with every expert on one rank,
    the rank computes all its tokens' experts whatever their spread."""
    return 1.0 if ep <= 1 else min(model.router_imbalance, float(ep))


CP_ATTENTION_PASSES = {"all_gather": (1.0, 2.5), "all_to_all": (0.5, 1.25)}
"""Under context parallelism: (forward, backward) FLOPs of the attention core in units of its model FLOPs over the
rank's share (4·s·q per token, / cp). "all_gather": an explicit mask, so the fused kernel computes the whole s/cp x s
rectangle; "all_to_all": is_causal over the whole sequence, heads/cp of them (ATTENTION_PASSES' fused row)."""


@dataclass(frozen=True)
class Slicing:
    """How one device's share of a layer is cut: tensor parallelism (with or without sequence parallelism), context
    parallelism (`cp` ranks, each with b·s/cp tokens of every sequence, exchanging keys and values the `cp_kind`
    way) and expert parallelism (`ep` ranks holding different experts). The groups lie on the mesh as
    plait.cost.comm.axis_group says: cp at stride tp, ep at stride cp·tp."""

    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_kind: str = "all_gather"
    ep: int = 1

    def __post_init__(self) -> None:
        if self.cp == 1:  # the kind matters only with context parallelism: one key per share
            object.__setattr__(self, "cp_kind", "all_gather")
        if self.cp_kind not in CP_ATTENTION_PASSES:
            raise ValueError(f"cp_kind={self.cp_kind!r} is not one of {', '.join(CP_ATTENTION_PASSES)}")

    @property
    def sequence_parallel(self) -> bool:
        return self.sp and self.tp > 1

    def local_tokens(self, micro_batch: int, seq_len: int) -> float:
        """Tokens of a micro-batch this device computes (its context rank's share of every sequence)."""
        return micro_batch * seq_len / self.cp


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
    """Extra backward time per recompute mode (full: the forward again; selective: what plait.execute.recompute's
    policy reruns -- the attention core's forward on the math path, the unsaved GEMMs and the non-GEMM work on the
    fused path)."""
    gemm_fraction: float
    """Achieved fraction of peak of this layer's GEMMs."""
    cp_fwd: float = 0.0
    """Context parallelism's key/value exchange in the forward pass (all-gathers, or Ulysses' all-to-alls)."""
    cp_bwd: float = 0.0
    """... and in the backward pass (reduce-scatters of their gradients, or the reverse all-to-alls)."""
    ep_fwd: float = 0.0
    """Expert parallelism's token dispatch and return in the forward pass (all-to-alls)."""
    ep_bwd: float = 0.0
    """... and their reverse in the backward pass."""

    @property
    def comm_fwd(self) -> float:
        """Every collective of the forward pass (none of them overlapped with compute)."""
        return self.tp_fwd + self.cp_fwd + self.ep_fwd

    @property
    def comm_bwd(self) -> float:
        return self.tp_bwd + self.cp_bwd + self.ep_bwd

    @property
    def total(self) -> float:
        """Forward and backward of one micro-batch, collectives included, nothing recomputed."""
        return self.fwd + self.bwd + self.comm_fwd + self.comm_bwd


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
    if model.num_experts:  # the top-k experts each token passes through, and the router
        mlp_weights = model.experts_per_token * expert_weights(model) + h * model.num_experts
    else:
        mlp_weights = (3 if model.gated_mlp else 2) * h * f
    weights = h * (q + 2 * kv) + q * h + mlp_weights
    return 2.0 * tokens * weights, 4.0 * tokens * seq_len * q


def replicated_kv_weights(model: ModelSpec, tp: int) -> int:
    """Weights of a layer's key and value projections where tp exceeds the kv heads of a Hugging Face class: every
    tensor rank then holds and computes them whole, replicating the heads (plait.execute.tensor.KeyValueParallel);
    0 where tp splits them."""
    kv = model.num_kv_heads
    if not kv or tp <= kv or tp % kv or not model.source.startswith("hf:"):
        return 0
    return model.hidden_size * 2 * model.kv_size


def replicated_kv_flops(model: ModelSpec, tokens: float, tp: int) -> float:
    """Forward FLOPs of the replicated key and value projections (replicated_kv_weights) over `tokens` tokens."""
    return 2.0 * tokens * replicated_kv_weights(model, tp)


def replicated_block_weights(model: ModelSpec) -> float:
    """Parameters of the mean measured block that every tensor rank holds whole (BlockCost.replicated_params: a
    Hugging Face class's modules its plan leaves unplaced, run replicated); 0 for a closed-form model."""
    return sum(b.replicated_params for b in model.blocks) / len(model.blocks) if model.blocks else 0.0


def replicated_block_flops(model: ModelSpec, tokens: float, seq_len: int) -> float:
    """Forward FLOPs over `tokens` tokens of the mean measured block's modules every tensor rank computes whole
    (BlockCost.replicated_flops_per_token and replicated_attention_flops_per_token)."""
    if not model.blocks:
        return 0.0
    return tokens * sum(b.replicated_flops_per_token + seq_len * b.replicated_attention_flops_per_token
                        for b in model.blocks) / len(model.blocks)


def layer_expert_weights(model: ModelSpec) -> float:
    """Weights of one layer's routed experts: the closed form, or the mean measured block's (a Hugging Face class,
    whose dense layers hold none)."""
    if not model.num_experts:
        return 0.0
    if model.blocks:
        return sum(b.expert_params for b in model.blocks) / len(model.blocks)
    return model.num_experts * expert_weights(model)


def expert_weights(model: ModelSpec) -> int:
    """Weights of one expert (no biases: plait.models.moe.Experts)."""
    return (3 if model.gated_mlp else 2) * model.hidden_size * model.moe_ffn_hidden_size


def expert_flops(model: ModelSpec, tokens: float) -> float:
    """Forward FLOPs of the experts over `tokens` tokens (k experts each): the part of layer_flops that expert
    parallelism moves and the router's imbalance stretches."""
    if not model.num_experts:
        return 0.0
    if model.blocks:  # measured (a Hugging Face class's experts): the mean block's
        return tokens * sum(b.expert_flops_per_token for b in model.blocks) / len(model.blocks)
    return 2.0 * tokens * model.experts_per_token * expert_weights(model)


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
    """Model FLOPs of one training step (forward + backward, no recompute), as MFU counts them; a frozen base's
    backward has no weight gradients (plait.cost.trainable), so a LoRA step counts about 2/3 of a full one."""
    tokens = global_batch * seq_len
    dense, attn = layer_flops(model, tokens, seq_len)
    weights = 1.0 + backward_gemm_factor(model)  # 3 when every weight trains
    adapters = 3.0 * tokens * adapter_flops_per_token(model)
    return model.num_layers * (weights * dense + 3.0 * attn + adapters) + weights * head_flops(model, tokens)


ATTENTION_PASSES = {"math": (1.0, 2.0), "fused": (0.5, 1.25)}
"""(forward, backward) FLOPs the attention core executes, in units of its model FLOPs (4·s·q per token): the
math path computes the whole square; the fused kernels skip causal blocks above the diagonal (1/2) and their
backward reruns the scores (2.5 x the forward: FlashAttention-2's five GEMMs against two)."""


def gemm_dims(model: ModelSpec) -> list[tuple[int, int]]:
    """(in, out) features of a block's GEMMs in forward order: q, k, v, output, then the MLP's (gate, up, down or
    up, down) -- the order plait.execute.recompute's selective policy counts them in."""
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    f = model.ffn_hidden_size
    mlp = [(h, f), (h, f), (f, h)] if model.gated_mlp else [(h, f), (f, h)]
    return [(h, q), (h, kv), (h, kv), (q, h), *mlp]


def selective_recompute_flops(model: ModelSpec, tokens: int) -> float:
    """Forward GEMM FLOPs the fused path's selective policy reruns: every second GEMM (the 2nd, 4th, ...), whose
    outputs it did not keep. A measured block: those its measurement saw the policy leave (half its weight GEMMs
    where not measured)."""
    if model.blocks and all(b.selective_rerun_flops_per_token for b in model.blocks):
        return tokens * sum(b.selective_rerun_flops_per_token for b in model.blocks) / len(model.blocks)
    if model.blocks or model.num_experts:
        return 0.5 * layer_flops(model, tokens, 1)[0]
    return 2.0 * tokens * sum(i * o for i, o in gemm_dims(model)[1::2])


@lru_cache(maxsize=4096)
def layer_cost(model: ModelSpec, cluster: ClusterSpec, seq_len: int, micro_batch: int, tp: int, sp: bool,
               dtype_bytes: int = 2) -> LayerCost:
    """Time of one layer for one micro-batch on one device of a tensor group of `tp` (no context or expert
    parallelism: `sliced_layer_cost` of that Slicing)."""
    return sliced_layer_cost(model, cluster, seq_len, micro_batch, Slicing(tp=tp, sp=sp), dtype_bytes)


@lru_cache(maxsize=4096)
def sliced_layer_cost(model: ModelSpec, cluster: ClusterSpec, seq_len: int, micro_batch: int, cut: Slicing,
                      dtype_bytes: int = 2, document_len: int | None = None) -> LayerCost:
    """Time of one layer for one micro-batch on one device of the groups `cut` describes (cached, like `ends_cost`:
    the search prices many layouts of one slicing and micro-batch); `document_len`: TrainSpec.document_len."""
    tp, sp, cp = cut.tp, cut.sp, cut.cp
    tokens = cut.local_tokens(micro_batch, seq_len)
    dense, attn = layer_flops(model, tokens, seq_len)  # attention: the rank's queries against the whole sequence
    passes = ATTENTION_PASSES[model.attention] if cp == 1 else CP_ATTENTION_PASSES[cut.cp_kind]
    # sliding windows: the share of the square their kernels compute (plait.cost.attention)
    windows = window_share(model, seq_len, model.attention == "fused", document_len) if cp == 1 else \
        context_window_share(model, seq_len, cut.cp_kind, document_len)
    attn_fwd, attn_bwd = (attn * factor * windows for factor in passes)
    if cut.ep > 1:  # the busiest expert rank computes more than its share
        dense += (busiest_rank_load(model, cut.ep) - 1.0) * expert_flops(model, tokens)
    dense += (tp - 1) * replicated_kv_flops(model, tokens, tp)  # each rank's whole k, v projections (dense / tp below)
    dense += (tp - 1) * replicated_block_flops(model, tokens, seq_len)  # and the modules it runs whole
    fraction = gemm_fraction(cluster, model.hidden_size)
    rate = cluster.peak_flops * fraction
    rest = 1.0 + cluster.efficiency.overhead
    # and the fixed host time of the pass (ClusterSpec.host.layer_overhead_s, and tp_layer_overhead_s for
    # DTensor's dispatch under tensor parallelism): per micro-batch, not per token
    hosts = cluster.host
    host = hosts.layer_overhead_s + (hosts.tp_layer_overhead_s if tp > 1 else 0.0)
    adapters = tokens * adapter_flops_per_token(model)  # LoRA's (plait.cost.trainable), with the weights they adapt
    fwd_kernels = (dense + adapters + attn_fwd) / tp / rate * rest
    fwd = pass_time(cluster, fwd_kernels, host)
    # a frozen base runs no weight-gradient GEMMs; the adapters run both theirs
    bwd = pass_time(cluster, (backward_gemm_factor(model) * dense + 2.0 * adapters + attn_bwd) / tp / rate * rest,
                    2.0 * host)
    tp_pass = tp_collectives_per_pass(model, cluster, tokens, tp, sp, dtype_bytes)
    cp_fwd, cp_bwd = context_exchange(model, cluster, tokens, cut, dtype_bytes)
    ep_pass = expert_dispatch(model, cluster, tokens, cut, dtype_bytes)
    # a recomputed forward exchanges again: full reruns it all; the selective policy saves no all-gather or
    # all-to-all output (plait.execute.recompute), so the key/value exchange and the dispatch rerun too
    rerun = cp_fwd + ep_pass
    rerun_host = host + hosts.recompute_layer_overhead_s
    if model.attention == "math" and cp == 1:  # Korthikanti et al. 2022: the attention core's forward again
        selective = pass_time(cluster, attn_fwd / tp / rate * rest, 0.0)
    else:  # the GEMMs not kept, the non-GEMM work, the all-gathers under SP, and a layer pass of host time; the
        # per-op policy's host time on that rerun and on the forward (what the forward takes beyond `fwd`)
        gathers = 2 * all_gather(tokens * model.hidden_size * dtype_bytes, Group(tp, 1), cluster) if sp else 0.0
        policy = hosts.selective_layer_overhead_s
        kernels = (selective_recompute_flops(model, tokens) + cluster.efficiency.overhead * dense) / tp / rate
        selective = pass_time(cluster, kernels, rerun_host + policy) + gathers + rerun \
            + pass_time(cluster, fwd_kernels, host + policy) - fwd
    full = pass_time(cluster, fwd_kernels, rerun_host) + tp_pass + rerun
    return LayerCost(fwd=fwd, bwd=bwd, tp_fwd=tp_pass, tp_bwd=tp_pass, cp_fwd=cp_fwd, cp_bwd=cp_bwd, ep_fwd=ep_pass,
                     ep_bwd=ep_pass, recompute={"none": 0.0, "selective": selective, "full": full},
                     gemm_fraction=fraction)


def pass_time(cluster: ClusterSpec, kernels: float, host: float) -> float:
    """One layer pass of `kernels` seconds of device work launched by `host` seconds of host work. On a GPU the
    host launches ahead while kernels run: the pass takes the longer of the two (a small model's layers are
    host-bound, a large one's kernel-bound). CPU processes compute on the core that dispatches: the sum."""
    return kernels + host if cluster.device_type == "cpu" else max(kernels, host)


def context_exchange(model: ModelSpec, cluster: ClusterSpec, tokens: float, cut: Slicing, dtype_bytes: int
                     ) -> tuple[float, float]:
    """(forward, backward) seconds of context parallelism's exchange in one layer, as plait/execute/context.py runs
    it over the cp group (stride tp: plait.cost.comm.axis_group):

    * "all_gather": K and V all-gathered along the sequence (their kv heads of this tensor rank, the whole
      sequence's b·s tokens out), backward reduce-scatters their gradients (the autograd of the gather);
    * "all_to_all" (DeepSpeed-Ulysses, Jacobs et al. 2023): q, k, v (k and v repeated to the query heads first) and
      the output back, each this rank's b·s/cp tokens at the query width; the backward runs the four in reverse."""
    cp = cut.cp
    if cp == 1:
        return 0.0, 0.0
    group = Group(cp, cut.tp)
    if cut.cp_kind == "all_gather":
        gathered = tokens * cp * model.kv_size / cut.tp * dtype_bytes
        return (2 * all_gather(gathered, group, cluster), 2 * reduce_scatter(gathered, group, cluster))
    local = tokens * model.q_size / cut.tp * dtype_bytes
    swap = 4 * all_to_all(local, group, cluster)
    return swap, swap


def expert_dispatch(model: ModelSpec, cluster: ClusterSpec, tokens: float, cut: Slicing, dtype_bytes: int) -> float:
    """Seconds of one pass's token exchange in a mixture-of-experts layer under expert parallelism
    (plait/execute/expert.py; the backward runs the same in reverse): the counts, then every routed slot (b·s/cp·k
    tokens of width h; each tensor rank sends all of them) to its expert's rank and back, (ep-1)/ep of it leaving
    the rank (DeepSpeed-MoE, Rajbhandari et al. 2022), the busiest rank receiving busiest_rank_load times the mean.
    The group is the nearest data-parallel ranks (stride cp·tp)."""
    if not model.num_experts or cut.ep == 1:
        return 0.0
    group = Group(cut.ep, cut.cp * cut.tp)
    slots = tokens * model.experts_per_token * model.hidden_size * dtype_bytes * busiest_rank_load(model, cut.ep)
    counts = all_to_all(8.0 * model.num_experts, group, cluster)
    return counts + 2 * all_to_all(slots, group, cluster)


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
    loss_fwd: float = 0.0
    loss_bwd: float = 0.0
    """The loss beyond the head's GEMM (its elementwise work is in the head's `1 + efficiency.overhead`): under
    tensor parallelism, torch's `loss_parallel` (`loss_parallel_time`). It runs outside the stage's modules, in the
    training step's own code (plait.train.measure counts it as waiting)."""


LOSS_PARALLEL_ALL_REDUCES = 3
"""torch's loss_parallel (torch/distributed/tensor/parallel/loss.py) all-reduces three per-token fp32 statistics
over the tensor group in the forward, each of b·s values: the logits' max and sum of exponentials (the log-softmax
of a vocabulary slice) and the target's log-probability (the NLL, held by the one rank whose slice has it); its
backward is local."""


def loss_parallel_time(model: ModelSpec, cluster: ClusterSpec, tokens: float, tp: int) -> tuple[float, float]:
    """(forward, backward) seconds of the vocabulary-parallel cross-entropy per micro-batch under tensor
    parallelism: LOSS_PARALLEL_ALL_REDUCES all-reduces of the tokens' fp32 statistics, and the host time of its
    ops' DTensor dispatch, priced as one tensor-parallel layer pass of it (ClusterSpec.host.tp_layer_overhead_s:
    the same dispatch over a like handful of ops; on 2 gloo ranks it measured 5-11 ms a call, against 0.3-0.7 ms
    for the plain loss of one slice and 1-2 ms for the three all-reduces), half forward, half backward."""
    if tp <= 1:
        return 0.0, 0.0
    statistics = LOSS_PARALLEL_ALL_REDUCES * all_reduce(tokens * 4.0, Group(tp, 1), cluster)
    host = cluster.host.tp_layer_overhead_s / 2
    return statistics + host, host


@lru_cache(maxsize=4096)
def ends_cost(model: ModelSpec, cluster: ClusterSpec, seq_len: int, micro_batch: int, cut: Slicing,
              dtype_bytes: int = 2) -> EndsCost:
    """Vocabulary-parallel embedding and output layer with a parallel loss (Megatron's layout), on this context
    rank's tokens."""
    tp, sp = cut.tp, cut.sp
    tokens = cut.local_tokens(micro_batch, seq_len)
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
    loss_fwd, loss_bwd = loss_parallel_time(model, cluster, tokens, tp)
    return EndsCost(embed_fwd=embed, embed_bwd=embed, head_fwd=head, head_bwd=backward_gemm_factor(model) * head,
                    embed_tp=embed_tp, head_tp=head_tp, loss_fwd=loss_fwd, loss_bwd=loss_bwd)


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
    bandwidth = cluster.peak_flops / (cluster.efficiency.memory_balance or MACHINE_BALANCE[cluster.device_type])
    return ADAM_BYTES_PER_PARAM * params_updated / bandwidth
