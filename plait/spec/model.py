"""ModelSpec: what the planner and the executor need to know about a decoder-only transformer.

No weights: shapes only. Two block styles cover the presets and the reference models:

* ``arch="gpt"``: LayerNorm, plain GeLU MLP (ffn = 4h by default), learned positions,
  biases in every linear layer (GPT-2/GPT-3/Megatron).
* ``arch="llama"``: RMSNorm, RoPE, gated SwiGLU MLP, grouped-query attention, no biases.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from plait.spec._dict import from_dict, to_dict

Arch = Literal["gpt", "llama"]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str = "custom"
    """A label for tables and checkpoints."""
    arch: Arch = "gpt"
    """Block style: "gpt" (LayerNorm, GeLU, learned positions, biases) or "llama" (RMSNorm, RoPE, SwiGLU)."""
    num_layers: int
    """Transformer blocks."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention (query) heads a."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means num_heads (plain multi-head)."""
    ffn_hidden_size: int | None = None
    """MLP inner width; None means 4h for gpt, and Llama's rule (2/3·4h rounded up to 256) for llama."""
    vocab_size: int
    """Vocabulary V."""
    max_seq_len: int = 2048
    """Longest sequence (size of the learned position table for gpt)."""
    tied_embeddings: bool = False
    """Share the input embedding with the output layer."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", _default_ffn(self.arch, self.hidden_size))
        if self.num_kv_heads <= 0 or self.ffn_hidden_size <= 0:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} and ffn_hidden_size={self.ffn_hidden_size} must be positive")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                f"pick heads among the divisors of {self.hidden_size}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"arch={self.arch!r} is not one of 'gpt', 'llama'")

    # ---- shapes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection: kv_heads · head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def gated_mlp(self) -> bool:
        return self.arch == "llama"

    @property
    def has_bias(self) -> bool:
        return self.arch == "gpt"

    # ---- parameter counts (exactly those of plait.models) ------------------------
    @property
    def attention_params(self) -> int:
        h, kv = self.hidden_size, self.kv_size
        weights = h * h + 2 * h * kv + h * h  # q, k, v, out
        return weights + ((h + 2 * kv + h) if self.has_bias else 0)

    @property
    def mlp_params(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        if self.gated_mlp:
            return 3 * h * f  # gate, up, down
        return 2 * h * f + (f + h if self.has_bias else 0)

    @property
    def norm_params(self) -> int:
        """Parameters of one normalization layer (LayerNorm has a bias, RMSNorm not)."""
        return 2 * self.hidden_size if self.arch == "gpt" else self.hidden_size

    @property
    def params_per_layer(self) -> int:
        return self.attention_params + self.mlp_params + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Token embedding (plus the learned position table for gpt)."""
        positions = self.max_seq_len * self.hidden_size if self.arch == "gpt" else 0
        return self.vocab_size * self.hidden_size + positions

    @property
    def head_params(self) -> int:
        """Final norm and, unless tied, the output projection."""
        out = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.norm_params + out

    @property
    def num_params(self) -> int:
        return self.num_layers * self.params_per_layer + self.embedding_params + self.head_params

    # ---- (de)serialization -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelSpec":
        return from_dict(cls, data, "model")

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


def _default_ffn(arch: str, hidden: int) -> int:
    if arch == "llama":
        ffn = int(2 * 4 * hidden / 3)
        return 256 * ((ffn + 255) // 256)
    return 4 * hidden
