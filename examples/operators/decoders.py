"""Decoders planned operator by operator (README, "Any module"): plait's reference Llama and a Hugging Face
LlamaForCausalLM, each wrapped so that forward(tokens, labels) returns the loss. The automatic solution should be
Megatron's pattern (q/k/v and the MLP's gate and up projections split by columns, the attention's and MLP's out
projections by rows) or one the cost model prices no higher.

    llama() / hf_llama() -> the module; tokens(batch_size, generator) -> (tokens, labels).
    megatron_pins("llama" | "hf_llama") -> Megatron's pattern as pins (semi-automatic mode), to compare or run.
    llama_8b() -> Llama 3 8B's shape (32 layers, hidden 4096, 32 heads, 8 key/value heads), for planning on meta.

Wide enough (hidden 256, 8 heads, 4 key/value heads: tp2 and tp4 split every projection evenly) that splitting
beats replicating on local-cpu's links, small enough to run on a few CPU ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 32, 256, 8, 4, 512, 2


def _spec(**changes):
    from plait.spec.model import ModelSpec

    fields = dict(name="auto-llama", arch="llama", num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS,
                  num_kv_heads=KV_HEADS, ffn_hidden_size=FFN, vocab_size=VOCAB, max_seq_len=SEQ, norm_eps=1e-5,
                  rope_theta=10000.0)
    return ModelSpec(**{**fields, **changes})


class WithLoss(nn.Module):
    """A language model (tokens -> logits) whose forward takes the labels too and returns the next-token loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(tokens).flatten(0, 1), labels.flatten())


class HFWithLoss(WithLoss):
    """A transformers causal LM: its causal mask given as a 4-D additive mask, so transformers takes it as it is
    (building one itself inspects the positions' values, which a capture on meta does not have)."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        future = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(1)
        mask = torch.zeros(seq, seq, device=tokens.device).masked_fill(future, float("-inf"))[None, None]
        logits = self.model(input_ids=tokens, attention_mask=mask.to(self.model.dtype)).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def llama() -> nn.Module:
    from plait.models.reference import Transformer

    return WithLoss(Transformer(_spec()))


def llama_8b() -> nn.Module:
    """Llama 3 8B's shape (plait's preset llama3-8b) on plait's reference code."""
    from plait.models.reference import Transformer
    from plait.spec.models import MODEL_PRESETS

    return WithLoss(Transformer(MODEL_PRESETS["llama3-8b"]))


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
                         bos_token_id=0, eos_token_id=1, attn_implementation="sdpa", use_cache=False)
    return HFWithLoss(LlamaForCausalLM(config))


def tokens(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def tokens_8k(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 3 8B's batch: sequences of 8192 tokens (only planned: the capture is on meta)."""
    ids = torch.randint(0, 128256, (batch_size, 8192), generator=generator)
    return ids, ids


MEGATRON = {
    "llama": ("model.layers", ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
              ("attention.wo", "feed_forward.w2")),
    "hf_llama": ("model.model.layers", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                                        "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj")),
}


def megatron_pins(model: str, layers: int = LAYERS) -> dict[str, str]:
    """Columns into attention and the MLP (weight rows split, outputs split on the last dim), rows out of them."""
    prefix, columns, rows = MEGATRON[model]
    pins = {}
    for layer in range(layers):
        for name in columns:
            pins[f"{prefix}.{layer}.{name}.weight"] = "S0"
            pins[f"{prefix}.{layer}.{name}"] = "S2"
        for name in rows:
            pins[f"{prefix}.{layer}.{name}.weight"] = "S1"
    return pins
