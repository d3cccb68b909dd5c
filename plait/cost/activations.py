"""What one transformer block keeps for its backward pass, tensor by tensor, as plait's executor runs it.

Korthikanti et al. 2022 (Table 2) count a 2021 Megatron layer: 34·s·b·h bytes plus the 5·a·s²·b of the
unfused attention's scores, with dropout masks everywhere. plait's executor differs in ways that change
the count, so the list below follows its code (plait.models.reference; transformers' Llama and GPT-2
blocks keep the same tensors) and is checked against the tensors autograd really saves
(tests/unit/test_activations.py) and against PyTorch's memory tracker on whole plans
(benchmarks/memory_accuracy.py):

* attention is SDPA's fused kernel by default (ModelSpec.attention = "fused"): it keeps q, k, v, its output
  and the logsumexp (fp32, one per head and token), no s x s matrix; grouped-query keys and values are kept
  at their kv-head width (enable_gqa). The "math" path keeps the softmax probabilities (a·s per token),
  and keys and values repeated to every query head;
* no dropout (plait trains without it): no masks;
* the norms: LayerNorm keeps its input and two fp32 statistics; plait's RMSNorm (like transformers') keeps
  its fp32 input, the normalized tensor and one fp32 statistic; from a 16-bit input transformers' keeps its
  fp32 upcast, plait's reference model only that input (it recomputes its fp32 internals in backward, as fused
  kernels do: dtype classes "fp32 over residual" and "fp32 over compute", 4 bytes where that class is fp32,
  else 0); the norm's output is kept by the
  linear layers it feeds. Under sequence parallelism that output is all-gathered first, and the linear
  keeps the gathered copy: two whole b·s·h tensors per layer (Megatron keeps the shard and gathers again in
  backward, which Korthikanti's 34/t assumes);
* the MLP: GeLU keeps its input and output (2f per token), SwiGLU/GeGLU gate, activation, up and product (4f);
  a mixture-of-experts MLP (plait.models.moe) keeps the router's fp32 probabilities and top-k weights, the
  slots' indices, the routed tokens (k·h), each expert's inner activations (k times the dense MLP's) and the
  experts' outputs with their weights (2·k·h); under expert parallelism the busiest rank receives
  busiest_rank_load times the mean of the routed tokens (ModelSpec.router_imbalance);
* context parallelism (plait/execute/context.py; every per-token tensor above is this rank's b·s/cp tokens):
  "all_gather" keeps the gathered keys and values of the whole sequence, repeated to the query heads (q·cp per
  local token each), and the causal mask the fused kernel takes (s/cp x s, in the compute dtype, per layer and
  micro-batch); "all_to_all" keeps the kernel's q, k, v and output at the query width over heads/cp of the whole
  sequence (q per local token each), the output swapped back for the output projection, and the two sequence
  permutations (int64, s each). Both run SDPA's fused kernels, whatever ModelSpec.attention says.

Recompute modes: "full" keeps the block's input; "selective" keeps what plait.execute.recompute's policy
saves: on the fused path the block input, the outputs of the fused attention kernel and of every second
GEMM in forward order, and those of the reduce-scatters (all-reduces) that end the attention and the MLP
under tensor parallelism; on the math path everything but the probabilities (the attention core is
checkpointed).

Widths are elements per token of one micro-batch; each tensor has a dtype class and a split:

* dtype "compute" (the 16-bit compute dtype, or 4 bytes in fp32 runs), "residual" (the residual stream's:
  fp32 where 16-bit runs autocast over fp32 parameters, plait's DDP path; the compute dtype under
  fully_shard's mixed precision), "fp32", "index" (int64 token ids);
* split "tp" (divided by the tensor degree: heads, the MLP's inner width), "sp" (divided by it under
  sequence parallelism only), "whole" (never: gathered inputs, row-parallel partial sums), "tp-seq"
  (the math path's probabilities: `width` per head and position, heads divided by the tensor degree).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plait.cost.attention import window_share
from plait.cost.compute import busiest_rank_load
from plait.spec.model import SEQ_PROBES, ModelSpec

FP32_BYTES = 4
INDEX_BYTES = 8


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of the dtype classes of one plan (see the module docstring)."""

    compute: int
    residual: int

    def bytes(self, kind: str) -> int:
        return {"compute": self.compute, "residual": self.residual, "fp32": FP32_BYTES, "index": INDEX_BYTES,
                # an RMSNorm's fp32 internals: kept where its input is fp32, recomputed from a 16-bit input
                "fp32 over residual": FP32_BYTES if self.residual >= FP32_BYTES else 0,
                "fp32 over compute": FP32_BYTES if self.compute >= FP32_BYTES else 0}[kind]


@dataclass(frozen=True)
class Saved:
    """One tensor a block keeps for backward: `width` elements per token."""

    name: str
    width: float
    dtype: str
    split: str


def recomputes_upcast(model: ModelSpec) -> bool:
    """Whether the model's RMSNorm keeps a 16-bit input alone and recomputes its fp32 upcast in backward: plait's
    reference model does (plait.models.reference.RMSNorm); a Hugging Face or user module keeps the upcast."""
    return model.source == "plait"


def _norm(model: ModelSpec, where: str) -> list[Saved]:
    """What a norm over the hidden size keeps, and its output kept by the linear layers it feeds."""
    h = model.hidden_size
    if model.norm == "layernorm":
        kept = [Saved(f"{where} input", h, "residual", "sp"), Saved(f"{where} mean, rstd", 2, "fp32", "sp")]
    else:
        kept = [Saved(f"{where} input", h, "residual", "sp"), Saved(f"{where} normalized", h, "fp32 over residual", "sp"),
                Saved(f"{where} rstd", 1, "fp32 over residual", "sp")]
        if not recomputes_upcast(model):  # transformers' RMSNorm keeps its fp32 upcast whatever the input
            kept = [Saved(f"{where} input (fp32)", h, "fp32", "sp"), Saved(f"{where} normalized", h, "residual", "sp"),
                    Saved(f"{where} rstd", 1, "fp32", "sp")]
    return kept + [Saved(f"{where} output (linear input, gathered under SP)", h, "compute", "whole")]


def _attention(model: ModelSpec, math: bool, cp: int = 1, cp_kind: str = "all_gather") -> list[Saved]:
    """The attention core's inputs and what the kernel keeps; `math`: SDPA's unfused path (never under context
    parallelism)."""
    q, kv, a = model.q_size, model.kv_size, model.num_heads
    kept = []
    if model.qk_norm:  # Qwen3: an RMSNorm over head_dim on q and k
        if recomputes_upcast(model):
            kept += [Saved("q/k norm input", q + kv, "compute", "tp"),
                     Saved("q/k normalized", q + kv, "fp32 over compute", "tp"),
                     Saved("q/k norm rstd", a + model.num_kv_heads, "fp32 over compute", "tp")]
        else:
            kept += [Saved("q/k norm input (fp32)", q + kv, "fp32", "tp"), Saved("q/k normalized", q + kv, "compute", "tp"),
                     Saved("q/k norm rstd", a + model.num_kv_heads, "fp32", "tp")]
    if cp > 1:  # gathered keys of the whole sequence, or keys swapped for heads: at the query width either way
        keys = q * cp if cp_kind == "all_gather" else q
    else:
        keys = q if math and kv != q else kv  # the math path repeats grouped keys and values to every query head
    kept += [Saved("q", q, "compute", "tp"), Saved("k", keys, "compute", "tp"), Saved("v", keys, "compute", "tp"),
             Saved("attention output", q, "compute", "tp")]
    if math:
        kept.append(Saved("softmax probabilities", a, "compute", "tp-seq"))  # a·s per token (see `_width`)
    else:
        kept.append(Saved("logsumexp", a, "fp32", "tp"))
    if cp > 1 and cp_kind == "all_to_all":
        kept.append(Saved("attention output swapped back", q, "compute", "tp"))
    return kept


def _mlp(model: ModelSpec, ep: int = 1) -> list[Saved]:
    if model.num_experts:  # each token's k slots keep the dense MLP's tensors; the router its probabilities
        k, h = model.experts_per_token, model.hidden_size
        busiest = busiest_rank_load(model, ep)
        inner = (4 if model.gated_mlp else 2) * k * model.moe_ffn_hidden_size
        return [Saved("router probabilities", model.num_experts, "fp32", "whole"),
                Saved("top-k weights and their sum", k + 1, "fp32", "whole"),
                Saved("chosen experts, slot order, slot tokens", 3 * k, "index", "whole"),
                Saved("routed tokens", busiest * k * h, "compute", "whole"),
                Saved("expert inner activations", busiest * inner, "compute", "tp"),
                Saved("slot weights", k, "compute", "whole"),
                Saved("expert outputs, weighted", 2 * k * h, "compute", "whole")]
    f = model.ffn_hidden_size
    if model.gated_mlp:
        return [Saved(name, f, "compute", "tp") for name in ("gate", "activation", "up", "gate x up")]
    return [Saved("up projection", f, "compute", "tp"), Saved("activation", f, "compute", "tp")]


def block_gemms(model: ModelSpec) -> list[Saved]:
    """The GEMM outputs of one block in forward order (q, k, v, o, up/gate..., down): what the selective policy
    counts. A row-parallel GEMM's output is its local partial sum, whole."""
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    f = model.ffn_hidden_size
    mlp = ([Saved("gate GEMM", f, "compute", "tp"), Saved("up GEMM", f, "compute", "tp")] if model.gated_mlp
           else [Saved("up GEMM", f, "compute", "tp")])
    return [Saved("q GEMM", q, "compute", "tp"), Saved("k GEMM", kv, "compute", "tp"),
            Saved("v GEMM", kv, "compute", "tp"), Saved("out GEMM (partial sum)", h, "compute", "whole"),
            *mlp, Saved("down GEMM (partial sum)", h, "compute", "whole")]


def saved_tensors(model: ModelSpec, mode: str, tp: int = 1, sp: bool = False, cp: int = 1,
                  cp_kind: str = "all_gather", ep: int = 1) -> tuple[Saved, ...]:
    """Every tensor one block keeps for backward under recompute `mode`, per token of this rank (see the module
    docstring)."""
    math = model.attention == "math" and cp == 1
    block_input = Saved("block input", model.hidden_size, "residual", "sp")
    if mode == "full":
        return (block_input,)
    if mode == "selective" and not math:
        kept = [block_input] + block_gemms(model)[0::2]  # the 1st, 3rd, ... GEMM
        kept += [s for s in _attention(model, math) if s.name in ("attention output", "logsumexp")]
        if tp > 1:  # the reduce-scatters (all-reduces without SP) closing the attention and the MLP
            kept += [Saved("collective output", model.hidden_size, "compute", "sp" if sp else "whole")] * 2
        return tuple(kept)
    kept = (_norm(model, "attention norm") + _attention(model, math, cp, cp_kind) + _norm(model, "MLP norm")
            + _mlp(model, ep))
    if mode == "selective":  # math path: the checkpointed core keeps its inputs, not its probabilities
        kept = [s for s in kept if s.name != "softmax probabilities"]
        kv = model.kv_size
        kept = [Saved(s.name, kv, s.dtype, s.split) if s.name in ("k", "v") else s for s in kept]
    return tuple(kept)


def _width(saved: Saved, seq_len: int, tp: int, sp: bool, windows: float = 1.0) -> float:
    if saved.split == "tp-seq":  # probabilities: a·s per token, heads split by tp (a sliding window's share of it)
        return saved.width * seq_len * windows / tp
    divisor = {"tp": tp, "sp": tp if sp else 1, "whole": 1}[saved.split]
    return saved.width / divisor


@lru_cache(maxsize=65536)
def activation_bytes(model: ModelSpec, micro_batch: int, seq_len: int, tp: int, sp: bool, mode: str,
                     dtypes: Dtypes, cp: int = 1, cp_kind: str = "all_gather", ep: int = 1) -> float:
    """Bytes one block keeps for backward, per device, for one micro-batch of `micro_batch` sequences (this context
    rank's b·s/cp tokens of them). A model measured on meta (ModelSpec.blocks) keeps its measured bytes:
    `measured_bytes_per_token`."""
    tokens = micro_batch * seq_len / cp
    sequence = context_sequence_bytes(seq_len, tp, cp, cp_kind, dtypes) if mode == "none" else 0.0
    if model.blocks and mode != "full":
        return tokens * measured_bytes_per_token(model, seq_len, tp, sp, mode, dtypes, cp, cp_kind, ep) + sequence
    return tokens * _closed_per_token(model, seq_len, tp, sp, mode, dtypes, cp, cp_kind, ep) + sequence


def _closed_per_token(model: ModelSpec, seq_len: int, tp: int, sp: bool, mode: str, dtypes: Dtypes, cp: int = 1,
                      cp_kind: str = "all_gather", ep: int = 1) -> float:
    """Bytes per token of this rank the transformer layer of `model`'s shape keeps (`saved_tensors`)."""
    kept = saved_tensors(model, mode, tp, sp, cp, cp_kind, ep)
    windows = window_share(model, seq_len, fused=False)  # a window computed band by band keeps its band only
    return sum(_width(s, seq_len, tp, sp, windows) * dtypes.bytes(s.dtype) for s in kept)


def measured_bytes_per_token(model: ModelSpec, seq_len: int, tp: int, sp: bool, mode: str, dtypes: Dtypes,
                             cp: int = 1, cp_kind: str = "all_gather", ep: int = 1) -> float:
    """Bytes per token of this rank the mean measured block keeps (plait.models.saved_bytes measured them whole, on
    one rank, on the fused path): without recompute, the measurement of the plan's precision; under selective
    recompute, the block input and what the policy saved. Split over tp, sp and cp as the transformer layer of the
    same shape splits its own (the share of its bytes one rank keeps); the math path adds the probabilities (and
    repeated keys and values) the fused measurement did not keep. A block measured before these fields existed
    (0) keeps its fp32 bytes scaled as that layer's are."""
    layer = model_like_blocks(model).replace(attention="fused")
    blocks = model.blocks

    def mean(field: str) -> float:
        return sum(getattr(b, field) for b in blocks) / len(blocks)

    def share(kind: str) -> float:  # this rank's part of the layer's bytes (measured whole: one rank, balanced)
        return (_closed_per_token(layer, seq_len, tp, sp, kind, dtypes, cp, cp_kind, ep)
                / _closed_per_token(layer, seq_len, 1, False, kind, dtypes, 1, cp_kind, 1))

    if mode == "selective" and mean("selective_elements_per_token") > 0 and (model.attention == "fused" or cp > 1):
        whole = (model.hidden_size * dtypes.residual + mean("selective_elements_per_token") * dtypes.compute
                 + mean("selective_fp32_elements_per_token") * FP32_BYTES)
        return whole * share("selective")
    whole = _measured_whole(model, layer, seq_len, dtypes, mean)
    if whole is None:  # not measured in this precision: the fp32 bytes as the layer's scale
        return mean("activation_bytes_per_token") * (
            _closed_per_token(model_like_blocks(model), seq_len, tp, sp, mode, dtypes, cp, cp_kind, ep)
            / _closed_per_token(layer, seq_len, 1, False, "none", Dtypes(FP32_BYTES, FP32_BYTES)))
    math = 0.0
    if model.attention == "math" and cp == 1 and mean("activation_bytes_per_token_position") == 0:
        unfused = model_like_blocks(model)
        math = (_closed_per_token(unfused, seq_len, tp, sp, mode, dtypes)
                - _closed_per_token(layer, seq_len, tp, sp, mode, dtypes))
    return whole * share("none") + math


def _measured_whole(model: ModelSpec, layer: ModelSpec, seq_len: int, dtypes: Dtypes, mean) -> float | None:
    """The mean block's bytes per token without recompute on one rank in the plan's precision, at `seq_len` (with the
    part per position its measurement found growing: an unfused attention's); None where that precision was not
    measured."""
    if dtypes.compute >= FP32_BYTES:
        field = "activation_bytes_per_token"
    elif dtypes.residual >= FP32_BYTES:
        field = "autocast_activation_bytes_per_token"
    else:
        field = "half_activation_bytes_per_token"
    linear = mean(field)
    if not linear:
        return None
    return linear + (seq_len - SEQ_PROBES[0]) * mean(field + "_position")


def context_sequence_bytes(seq_len: int, tp: int, cp: int, cp_kind: str, dtypes: Dtypes) -> float:
    """What context parallelism keeps per layer and micro-batch whatever the batch size: the causal mask of the
    "all_gather" kind (this rank's s/cp positions against all s, one for every sequence and head), or the
    "all_to_all" kind's two permutations of the sequence (plait/execute/context.py)."""
    if cp == 1:
        return 0.0
    if cp_kind == "all_gather":
        return seq_len / cp * seq_len * dtypes.compute
    return 2 * seq_len * INDEX_BYTES


def model_like_blocks(model: ModelSpec) -> ModelSpec:
    """A transformer layer of the measured model's shape (its blocks' costs dropped): what the split rules of
    measured blocks follow."""
    return model.replace(blocks=(), pre_params=None, post_params=None)


def stage_input_is_kept(model: ModelSpec, mode: str, dtypes: Dtypes) -> bool:
    """Whether a block keeps its input tensor itself (rather than a copy): then a pipeline stage's received
    activation, which torch.distributed.pipelining keeps in a buffer of its own, is that same tensor."""
    if mode == "full" or (mode == "selective" and model.attention == "fused"):
        return True
    return model.norm == "layernorm" or dtypes.residual == FP32_BYTES or recomputes_upcast(model)


def head_saved_bytes(model: ModelSpec, tokens: int, tp: int, sp: bool, dtypes: Dtypes) -> float:
    """What the last stage keeps for backward per micro-batch: the final norm, the output layer's (gathered)
    input, and the loss's fp32 log-softmax over this rank's vocabulary slice (the logits themselves are freed
    once upcast)."""
    per_token = sum(_width(s, 0, tp, sp) * dtypes.bytes(s.dtype) for s in _norm(model, "final norm"))
    return tokens * (per_token + FP32_BYTES * model.vocab_size / tp)


def loss_backward_bytes(model: ModelSpec, tokens: int, tp: int) -> float:
    """Temporaries at the start of the backward pass: the loss's gradient over the log-softmax and the
    log-softmax's gradient over the logits, fp32, over this rank's vocabulary slice."""
    return tokens * 2 * FP32_BYTES * model.vocab_size / tp


def layer_backward_bytes(model: ModelSpec, seq_len: int, tokens: float, tp: int, sp: bool, dtypes: Dtypes,
                         cp: int = 1, cp_kind: str = "all_gather", ep: int = 1) -> float:
    """Temporaries of one block's backward (`tokens`: this rank's): the gradient flowing in and out along the
    residual stream, and the gradients of the MLP's inner activations; on the math path also the gradients with
    respect to the softmax's output and input (two a·s-wide tensors per token); under "all_gather" context
    parallelism the gradients of the gathered keys and values before they are reduce-scattered."""
    h = model.hidden_size / (tp if sp else 1)
    if model.num_experts:
        f = model.experts_per_token * model.moe_ffn_hidden_size * busiest_rank_load(model, ep)
    else:
        f = model.ffn_hidden_size
    inner = (2 if model.gated_mlp else 1) * f / tp
    scores = 2 * probabilities_bytes(model, seq_len, tokens, tp, dtypes, cp) / tokens
    gathered = 2 * model.q_size * cp / tp if cp > 1 and cp_kind == "all_gather" else 0.0
    return tokens * (2 * h * dtypes.residual + (inner + gathered) * dtypes.compute + scores)


def probabilities_bytes(model: ModelSpec, seq_len: int, tokens: float, tp: int, dtypes: Dtypes, cp: int = 1) -> float:
    """The math path's softmax probabilities of one block and micro-batch (0 on the fused path, and under context
    parallelism, whose attention runs the fused kernels)."""
    if model.attention != "math" or cp > 1:
        return 0.0
    windows = window_share(model, seq_len, fused=False)  # a window computed band by band keeps its band only
    return tokens * model.num_heads / tp * seq_len * dtypes.compute * windows
