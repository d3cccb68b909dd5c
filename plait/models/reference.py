"""plait's reference decoder: any ModelSpec's features (plait.spec.model) in one small torchtitan-style module.

* ``gpt`` features: LayerNorm, GeLU MLP, learned positions, biases everywhere (GPT-2 / Megatron);
* ``llama`` features: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, no biases;
* and their mixes (GeGLU, biases on q/k/v only, a norm over head_dim on q and k, head_dim decoupled
  from hidden / heads), so a Hugging Face config's shape can run on plait's own code too.

The layout suits the executor: ``layers`` is keyed by the global layer index (a pipeline stage keeps
the single-process names), ``wq/wk/wv/wo`` and ``w1/w2/w3`` are separate linears (tensor-parallel plans
are dicts from module name to style), and attention reads its local head count from the projection's
width (the same code runs on one device and on a tensor-parallel shard).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from plait.spec import ModelSpec


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 for stability.

    On a 16-bit input the fp32 upcast would be kept for backward (two bytes more per element than the input),
    so there the norm keeps its input alone and recomputes the rest in backward (torch.utils.checkpoint: the
    same ops, so the same numerics), as fused RMSNorm kernels do (torchtitan's Triton one, which its published
    Llama 2 runs used; torch's CUDA rms_norm). fp32 and float64 inputs run unchanged."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype.itemsize < 4 and torch.is_grad_enabled():
            return checkpoint(self._norm, x, use_reentrant=False)
        return to_compute_dtype(self._norm(x))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(_at_least_fp32(x.dtype))
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm, its output in the compute dtype under autocast (`to_compute_dtype`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return to_compute_dtype(super().forward(x))


def to_compute_dtype(y: torch.Tensor) -> torch.Tensor:
    """A norm's output under autocast (16-bit compute over fp32 parameters: one replica, DDP) is fp32; each linear
    that reads it would cast its own 16-bit copy and keep it for backward (q, k and v: three copies of one tensor,
    found on a GPU: 6 bytes per hidden unit per token per layer more than one copy). Cast once here instead: the
    values each linear computes with are the same, one copy is kept. Outside autocast: unchanged."""
    device = y.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):  # not on meta
        dtype = torch.get_autocast_dtype(device)
        if y.dtype.is_floating_point and y.dtype.itemsize > dtype.itemsize:
            return y.to(dtype)
    return y


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs; float64 stays float64 (plait check runs float64 end to end)."""
    return torch.promote_types(dtype, torch.float32)


def make_norm(spec: ModelSpec, dim: int | None = None) -> nn.Module:
    dim = dim or spec.hidden_size
    if spec.norm == "rmsnorm":
        return RMSNorm(dim, spec.norm_eps)
    return LayerNorm(dim, eps=spec.norm_eps)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim/2] of RoPE (Su et al. 2021) at `positions` (global indices, so that a
    sequence-parallel or context-parallel slice rotates as the whole sequence would)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x [batch, seq, heads, head_dim] by the angles of `rope`."""
    cos, sin = (t[None, :, None, :] for t in rope)
    pairs = x.to(_at_least_fp32(x.dtype)).unflatten(-1, (-1, 2))  # [b, s, heads, head_dim/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class AttentionCore(nn.Module):
    """softmax(q·kᵀ/√d)·v, causal, over [batch, heads, seq, head_dim]: no parameters. A module of its own so
    that selective recompute can checkpoint exactly this where it is the math path (plait/execute/recompute.py),
    and context parallelism can swap how it sees the other ranks' keys and values.

    `math` runs SDPA's MATH backend (ModelSpec.attention = "math": the s x s probabilities are kept for
    backward); otherwise SDPA picks its fused kernel. Grouped-query attention goes to the kernel as it is
    (enable_gqa), so keys and values are kept at their kv-head width, as transformers' SDPA path does."""

    def __init__(self, math: bool = False) -> None:
        super().__init__()
        self.math = math

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]  # each kv head serves a group of q heads
        if self.math:
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # [b, heads, s, hd]


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
        qkv_bias = spec.bias in ("all", "qkv")
        self.head_dim = spec.head_dim
        self.wq = nn.Linear(h, q, bias=qkv_bias)
        self.wk = nn.Linear(h, kv, bias=qkv_bias)
        self.wv = nn.Linear(h, kv, bias=qkv_bias)
        self.wo = nn.Linear(q, h, bias=spec.has_bias)
        self.q_norm = make_norm(spec, spec.head_dim) if spec.qk_norm else None
        self.k_norm = make_norm(spec, spec.head_dim) if spec.qk_norm else None
        self.core = AttentionCore(math=spec.attention == "math")

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        # -1 heads: the local head count under tensor parallelism (projections are column-sharded)
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # [b, s, heads, hd]
        k = self.wk(x).view(batch, seq, -1, self.head_dim)  # [b, s, kv_heads, hd]
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hd]
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """GeLU MLP (w2(gelu(w1 x))), or gated: w2(act(w1 x) * w3 x) with SiLU (SwiGLU) or GeLU (GeGLU)."""

    def __init__(self, spec: ModelSpec, ffn: int | None = None) -> None:
        super().__init__()
        h, f, bias = spec.hidden_size, ffn or spec.ffn_hidden_size, spec.has_bias
        self.kind = spec.mlp
        self.w1 = nn.Linear(h, f, bias=bias)
        self.w2 = nn.Linear(f, h, bias=bias)
        self.w3 = nn.Linear(h, f, bias=bias) if spec.gated_mlp else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.kind == "geglu":
            return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward(norm(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attention_norm = make_norm(spec)
        self.attention = Attention(spec)
        self.ffn_norm = make_norm(spec)
        self.feed_forward = make_mlp(spec)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


def make_mlp(spec: ModelSpec) -> nn.Module:
    if spec.num_experts:
        from plait.models.moe import MoE

        return MoE(spec)
    return FeedForward(spec)


class Transformer(nn.Module):
    """tokens [b, s] -> logits [b, s, V]: embedding (+ learned positions), blocks, final norm, output layer."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.tok_embeddings = nn.Embedding(spec.vocab_size, h)
        self.pos_embeddings = nn.Embedding(spec.max_seq_len, h) if spec.positions == "learned" else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec) for i in range(spec.num_layers)})
        self.norm = make_norm(spec)
        self.output = nn.Linear(h, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(positions[None])  # [b, s, h] + [1, s, h]
        rope = rope_tables(positions, self.spec.head_dim, self.spec.rope_theta) if self.spec.positions == "rope" else None
        for layer in self.layers.values():
            h = layer(h, rope)
        return self.output(self.norm(h))
