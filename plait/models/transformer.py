"""Reference decoder-only transformers built from a ModelSpec, torchtitan-style.

Two block styles (see plait.spec.model):

* ``gpt``: LayerNorm, GeLU MLP, learned positions, biases everywhere (GPT-2 / Megatron).
* ``llama``: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, no biases.

The layout is chosen for the executor:

* ``layers`` is an ``nn.ModuleDict`` keyed by the *global* layer index, so a pipeline
  stage can drop the layers it does not own and keep the single-process names (and so
  state dicts of stages merge back into the full model's).
* Separate ``wq/wk/wv/wo`` and ``w1/w2/(w3)`` linears, so tensor-parallel plans are a
  dict from module name to ``ParallelStyle``.
* ``forward`` tolerates a missing ``tok_embeddings``/``pos_embeddings``/``norm``/``output``
  (set to None on the middle stages of a pipeline): it then takes and returns hidden
  states instead of tokens / logits.
* Attention infers its local head count from the projection's width, so the same code
  runs on one device and on a tensor-parallel shard.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from plait.spec import ModelSpec


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 for stability."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class PositionEmbedding(nn.Module):
    """Learned absolute positions (GPT-2). Takes the token ids only to read the sequence length,
    and returns the [seq, hidden] table rows, which broadcast over the batch."""

    def __init__(self, max_seq_len: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_seq_len, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[: tokens.shape[1]]  # [seq, hidden]


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Apply RoPE (Su et al. 2021) to x: [batch, seq, heads, head_dim], rotating pairs (2i, 2i+1).

    Computed from the sequence length on each call rather than kept in a buffer, so pipeline
    stages and meta-device models need no extra state; the cost is negligible next to the matmuls."""
    seq, head_dim = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)  # [seq, head_dim/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    pairs = x.float().unflatten(-1, (-1, 2))  # [b, s, heads, head_dim/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class AttentionCore(nn.Module):
    """softmax(q·kᵀ/√d)·v, causal, over [batch, heads, seq, head_dim]: no parameters. A module of its own so
    that selective recompute can checkpoint exactly this (plait/execute/recompute.py)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group of q heads
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, hd]


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, kv, bias = spec.hidden_size, spec.kv_size, spec.has_bias
        self.head_dim = spec.head_dim
        self.rope_theta = spec.rope_theta if spec.arch == "llama" else None
        self.wq = nn.Linear(h, h, bias=bias)
        self.wk = nn.Linear(h, kv, bias=bias)
        self.wv = nn.Linear(h, kv, bias=bias)
        self.wo = nn.Linear(h, h, bias=bias)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        # -1 heads: the local head count under tensor parallelism (projections are column-sharded)
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # [b, s, heads, hd]
        k = self.wk(x).view(batch, seq, -1, self.head_dim)  # [b, s, kv_heads, hd]
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.rope_theta is not None:
            q, k = rotary(q, self.rope_theta), rotary(k, self.rope_theta)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hd]
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """GeLU MLP (gpt) or SwiGLU (llama: w2(silu(w1 x) * w3 x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f, bias = spec.hidden_size, spec.ffn_hidden_size, spec.has_bias
        self.w1 = nn.Linear(h, f, bias=bias)
        self.w2 = nn.Linear(f, h, bias=bias)
        self.w3 = nn.Linear(h, f, bias=False) if spec.gated_mlp else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.arch == "llama":
        return RMSNorm(spec.hidden_size, spec.norm_eps)
    return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward(norm(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attention_norm = make_norm(spec)
        self.attention = Attention(spec)
        self.ffn_norm = make_norm(spec)
        self.feed_forward = FeedForward(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.tok_embeddings: nn.Module | None = nn.Embedding(spec.vocab_size, h)
        self.pos_embeddings: nn.Module | None = (
            PositionEmbedding(spec.max_seq_len, h) if spec.arch == "gpt" else None
        )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec) for i in range(spec.num_layers)})
        self.norm: nn.Module | None = make_norm(spec)
        self.output: nn.Module | None = nn.Linear(h, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, V]; on a pipeline stage, hidden states in and/or out."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(tokens)  # [b, s, h] + [s, h]
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed` (see `initial_tensor`): identical for a full model and
        for any pipeline stage or device, because each tensor depends only on (seed, name, shape)."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(initial_tensor(self.spec, name, tuple(param.shape), seed))


def initial_tensor(spec: ModelSpec, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial value of parameter `name` (a full, unsharded fp32 CPU tensor).

    GPT-2's scheme: normal(0, 0.02) for weights, the residual projections (wo, w2) scaled by
    1/sqrt(2·layers), zeros for biases, ones for norm weights. Each tensor has its own
    generator seeded from (seed, name), so any subset of the model can be built alone."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name:
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(_name_seed(seed, name))
    std = 0.02
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        std /= math.sqrt(2 * spec.num_layers)
    return torch.randn(shape, generator=generator) * std


def _name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, name); Python's hash() is salted per process, so not that."""
    value = (seed * 1_000_003) & (2**63 - 1)
    for char in name.encode():
        value = (value * 131 + char) % (2**61 - 1)
    return value


def build_model(spec: ModelSpec, *, device: str | torch.device = "meta", seed: int | None = None) -> Transformer:
    """A Transformer for `spec` on `device` ("meta" builds shapes only, for planning and for
    parallelizing before materializing). With `seed`, weights are initialized."""
    with torch.device(device):
        model = Transformer(spec)
    if seed is not None:
        model.init_weights(seed)
    return model


def initial_state_dict(spec: ModelSpec, seed: int, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Full initial tensors for `names` (default: every parameter), without building the model's weights."""
    meta = build_model(spec, device="meta")
    shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
    wanted = shapes.keys() if names is None else names
    return {name: initial_tensor(spec, name, shapes[name], seed) for name in wanted}
