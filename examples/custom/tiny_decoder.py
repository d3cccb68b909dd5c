"""A small decoder that is not a transformers class, to show plait running a user's own module.

    plait plan --model module:tiny_decoder:build --cluster local-cpu --devices 2 --global-batch 8 --seq-len 64
    plait train examples/custom.toml

(with examples/custom on PYTHONPATH; the config sets it up). The contract plait needs (plait.models.factory):
`blocks` (an nn.ModuleList of blocks called as block(hidden)), `embed(tokens)`, `head(hidden)`, and for
tensor parallelism the head counts plus a tp_plan in the config. Its blocks differ on purpose: every
other block has a wider MLP, so the planner must price and split unequal blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, LAYERS, MAX_SEQ = 256, 64, 4, 6, 256


class Block(nn.Module):
    def __init__(self, wide: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = SelfAttention()
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.mlp = MLP(8 * HIDDEN if wide else 2 * HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, HIDDEN // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads (local under tp), s, head_dim]
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, inner: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, inner), nn.Linear(inner, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TinyDecoder(nn.Module):
    num_heads = num_kv_heads = HEADS
    ffn_hidden_size = 2 * HIDDEN  # tensor parallelism must divide every MLP's width (128 and 512)
    max_seq_len = MAX_SEQ

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(MAX_SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block(wide=i % 2 == 1) for i in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(positions[None])  # [b, s, h] + [1, s, h]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def build() -> TinyDecoder:
    return TinyDecoder()


TP_PLAN = {
    "blocks.*.ln1": "norm", "blocks.*.attn": "gather_input",
    "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
    "blocks.*.attn.out": "rowwise",
    "blocks.*.ln2": "norm", "blocks.*.mlp": "gather_input", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise",
    "tokens": "embedding", "positions": "position_embedding", "ln_f": "final_norm", "lm_head": "output",
}
